"""Quantized copies of a checkpoint, for the tests and benchmarks (the engine loads them: quantization.py).

Each format as its checkpoints on the Hub are laid out, written from a float checkpoint's weights with a
scale from each group's largest value (no calibration: what the layout and the loaders do is the point):

- "fp8": transformers' fine-grained FP8 (Qwen3's and DeepSeek's FP8 checkpoints): FP8 weights, a float32
  scale (`weight_scale_inv`) for each 128 x 128 block; every projection a whole number of blocks;
- "fp8-dynamic": compressed-tensors' FP8-dynamic (llm-compressor's FP8_DYNAMIC scheme): FP8 weights with a
  scale a row, inputs rounded to FP8 a token at a time as the layers run;
- "w4a16": compressed-tensors' W4A16: 4-bit integers with a scale for each `group` of a row, packed into
  int32s ("pack-quantized").

compressed-tensors' layouts are written by its own compressors. The output head stays as it was.
"""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FORMATS = ("fp8", "fp8-dynamic", "w4a16")
FP8_BLOCK = 128
FP8_MAX = 448.0  # float8_e4m3fn's largest value
FP8_WEIGHTS = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
FP8_INPUTS = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}


def compressed_tensors_config(*schemes: dict, layout: str) -> dict:
    """A compressed-tensors quantization_config: a group a scheme, over every Linear but the output head,
    stored in `layout` (compressed-tensors' format)."""
    return {"quant_method": "compressed-tensors", "format": layout, "quantization_status": "compressed",
            "ignore": ["lm_head"], "config_groups": {f"group_{i}": {"targets": ["Linear"], **scheme}
                                                     for i, scheme in enumerate(schemes)}}


def int4_scheme(group: int) -> dict:
    return {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": group, "symmetric": True}}


def fp8_dynamic_scheme() -> dict:
    return {"weights": FP8_WEIGHTS, "input_activations": FP8_INPUTS}


def quantized_copy(base: str | Path, out: str | Path, fmt: str, group: int = 128) -> str:
    """`base`'s checkpoint with each decoder projection quantized in format `fmt` (FORMATS), saved to `out`."""
    base, out = Path(base), Path(out)
    if fmt == "fp8":
        quantize, config = _blockwise_fp8, {"quant_method": "fp8", "activation_scheme": "dynamic",
                                            "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    elif fmt == "fp8-dynamic":
        quantize = _compressor("float-quantized", fp8_dynamic_scheme(),
                               lambda w: w.abs().amax(dim=1, keepdim=True) / FP8_MAX)
        config = compressed_tensors_config(fp8_dynamic_scheme(), layout="float-quantized")
    elif fmt == "w4a16":  # (symmetric 4 bits: -8 to 7)
        quantize = _compressor("pack-quantized", int4_scheme(group),
                               lambda w: w.reshape(w.shape[0], -1, group).abs().amax(dim=-1) / 7)
        config = compressed_tensors_config(int4_scheme(group), layout="pack-quantized")
    else:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    shutil.copytree(base, out, ignore=shutil.ignore_patterns("model.safetensors"))
    tensors = {}
    for name, tensor in load_file(base / "model.safetensors").items():
        if name.endswith("_proj.weight"):
            tensors.update({f"{name.removesuffix('weight')}{key}": value
                            for key, value in quantize(tensor.float()).items()})
        else:
            tensors[name] = tensor
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    settings = json.loads((out / "config.json").read_text())
    settings["quantization_config"] = config
    (out / "config.json").write_text(json.dumps(settings, indent=1))
    return str(out)


def _blockwise_fp8(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    rows, cols = weight.shape
    blocks = weight.reshape(rows // FP8_BLOCK, FP8_BLOCK, cols // FP8_BLOCK, FP8_BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
    quantized = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(rows, cols)
    return {"weight": quantized, "weight_scale_inv": scale}


def _compressor(layout: str, scheme: dict, scale_of):
    """A weight's tensors in compressed-tensors' `layout`, by its compressor, under `scheme`, with the
    scales `scale_of(weight)`."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    compressor = BaseCompressor.get_value_from_registry(layout)
    parsed = QuantizationScheme(targets=["Linear"], **scheme)
    return lambda weight: compressor.compress({"weight": weight, "weight_scale": scale_of(weight)}, parsed)
