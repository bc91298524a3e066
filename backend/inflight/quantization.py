"""Quantized checkpoints, loaded by transformers' own quantizers.

A checkpoint whose config.json carries a `quantization_config` (block-wise FP8 as Qwen3's and DeepSeek's
FP8 checkpoints are, llm-compressor's compressed-tensors FP8 / INT8 / INT4, GPTQ, AWQ, bitsandbytes,
torchao, ...) loads through the quantizer transformers picks for its `quant_method`, and its layers compute
as transformers' do; attention, the KV cache and the schedule are the engine's as for any model. Left to
decide here is how a format loads on the device the engine runs on, where transformers' defaults would
not run or would run slowly:

- "fp8" (transformers' fine-grained FP8): on a GPU of compute capability 8.9 on the weights stay FP8 and
  transformers' FP8Linear layers run its Triton kernels; elsewhere (a CPU, an A100) they are dequantized as
  they load (`dequantize`: transformers would keep them FP8 for an engine on the CPU of a machine with a GPU).
- "compressed-tensors": on such a GPU, when every scheme of the checkpoint quantizes weights to FP8, the
  layers run row-wise FP8 matmuls (`use_optimized_inference`: vLLM's FP8-dynamic checkpoints). Otherwise
  the weights are dequantized as they load (`dequantize`) rather than at the model's first forward pass
  (compressed-tensors' default, where a layer called alone before it fails). The layers keep
  compressed-tensors' forward where it rounds their inputs to the scheme's grid (W8A8, FP8-dynamic), as
  transformers' model does, so output equals HF's; the engine's CPU packing and GPU merging leave such
  layers alone (their forward is not nn.Linear's). Layers whose scheme rounds weights alone get nn.Linear's
  forward back, and their parameters leave compressed-tensors' offload cache (`unwrap`).

The `quantization` setting ("fp8", vLLM's name) quantizes an unquantized checkpoint as it loads, in
transformers' fine-grained FP8 (blocks of 128 x 128, each with its scale): on a GPU of compute capability
8.9 on only, where the layers then run as an FP8 checkpoint's do; elsewhere it is refused.

A format whose library is missing fails at start-up with transformers' own message, naming the package.
Under tensor parallelism transformers' plan shards the quantized weights with their scales (block-wise FP8:
each rank's rows a whole number of the checkpoint's blocks); compressed-tensors is refused there.
"""

import logging

import torch

from .model_support import kv_heads_and_head_dim

logger = logging.getLogger(__name__)

FP8_CAPABILITY = (8, 9)  # FP8 matmuls: Ada, Hopper and later
FP8_BLOCK = 128  # the `quantization` setting's FP8 blocks: rows and columns a scale (DeepSeek's and Qwen3's)
# Methods whose transformers quantizer does not shard under a tensor-parallel plan (compressed-tensors'
# decompression fails on the sharded layers in transformers 5.18): refused there.
NOT_SHARDED = ("compressed-tensors",)


def settings(full_config) -> dict:
    """config.json's quantization_config ({} for a checkpoint that has none)."""
    quantization = getattr(full_config, "quantization_config", None) or {}
    return quantization if isinstance(quantization, dict) else quantization.to_dict()


def quant_method(full_config) -> str | None:
    """The checkpoint's quantization method (quantization_config's quant_method), or None."""
    return settings(full_config).get("quant_method")


def loading_options(full_config, device: torch.device, requested: str | None = None) -> dict:
    """from_pretrained's arguments for the checkpoint's quantization on `device`, or for quantizing it as
    `requested` (the engine's `quantization` setting); none for other checkpoints."""
    method = quant_method(full_config)
    has_fp8 = device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_CAPABILITY
    if requested is not None and method is None:
        uneven = {name: size for name, size in _projection_sizes(full_config).items() if size % FP8_BLOCK}
        if uneven:
            name, size = next(iter(uneven.items()))
            raise ValueError(f"quantization {requested} quantizes weights in blocks of {FP8_BLOCK} x {FP8_BLOCK}; "
                             f"the model's {name}: {size}, not a multiple of {FP8_BLOCK}")
        if not has_fp8:
            raise ValueError(f"quantization {requested}: FP8 weights need a GPU of compute capability 8.9 or "
                             f"more (Ada, Hopper), not {_named(device)}")
        from transformers import FineGrainedFP8Config

        return {"quantization_config": FineGrainedFP8Config(weight_block_size=(FP8_BLOCK, FP8_BLOCK))}
    if requested is not None and method != requested:
        raise ValueError(f"quantization {requested}: the checkpoint is already quantized ({method})")
    if method == "fp8" and not has_fp8:  # (transformers would keep FP8 for a CPU engine on a GPU's machine)
        from transformers import FineGrainedFP8Config

        return {"quantization_config": FineGrainedFP8Config(
            dequantize=True, modules_to_not_convert=settings(full_config).get("modules_to_not_convert"))}
    if method != "compressed-tensors":
        return {}
    from transformers import CompressedTensorsConfig

    fp8_matmuls = has_fp8 and _every_scheme_fp8(settings(full_config))
    return {"quantization_config": CompressedTensorsConfig(use_optimized_inference=fp8_matmuls,
                                                           dequantize=not fp8_matmuls)}


def check_tensor_parallel(full_config, ranks: int, requested: str | None = None) -> None:
    """A ValueError, before any rank starts, for a quantized checkpoint tensor parallelism cannot shard:
    a method transformers does not shard, or FP8 blocks (the checkpoint's, or those `requested` makes) that a
    rank's share of a projection would cut."""
    method = quant_method(full_config)
    if method in NOT_SHARDED:
        raise ValueError(f"tensor parallelism over a {method} checkpoint: transformers' quantizer for it does not "
                         "shard the weights (transformers 5.18); run it with tensor_parallel_size 1")
    if method == "fp8":
        block = (settings(full_config).get("weight_block_size") or [None])[0]
    else:
        block = FP8_BLOCK if method is None and requested == "fp8" else None
    if block is None:
        return
    for name, size in _projection_sizes(full_config).items():
        if name != "hidden size" and size // ranks % block:  # (the hidden size is not split)
            raise ValueError(f"tensor_parallel_size {ranks} splits the model's {name} ({size}) into {size // ranks} "
                             f"a rank, not a whole number of the FP8 blocks of {block}: transformers cannot shard "
                             "their scales so; run it with fewer ranks")


def unwrap(model: torch.nn.Module, full_config) -> None:
    """A compressed-tensors checkpoint's model, loaded, made plain where that changes no result: its layers'
    parameters back in dicts (compressed-tensors keeps them in an offload cache, which would keep them on
    the CPU through `.to(device)`), and a layer whose scheme rounds its weights alone (W4A16, W8A16), which
    are dequantized on their grid already, back to nn.Linear's forward (rounding them again each call gives
    the same values): packed on a CPU, merged on a GPU, as any layer."""
    if quant_method(full_config) != "compressed-tensors":
        return
    from compressed_tensors.offload import remove_dispatch

    remove_dispatch(model, onload_tensors=True)  # (which leaves each module its class's forward, bound)
    for module in model.modules():
        forward = vars(module).get("forward")
        if forward is None:
            continue
        scheme = getattr(module, "quantization_scheme", None)
        weights_alone = (scheme is not None and module.weight.is_floating_point()
                         and scheme.input_activations is None and scheme.output_activations is None)
        if weights_alone or getattr(forward, "__func__", None) is type(module).forward:
            del module.forward


def _projection_sizes(full_config) -> dict[str, int]:
    """The sizes of the decoder's projections: their rows, and the hidden size (the columns of most)."""
    hf_config = getattr(full_config, "text_config", full_config)
    kv_heads, head_dim = kv_heads_and_head_dim(hf_config)
    return {"query rows": hf_config.num_attention_heads * head_dim, "key and value rows": kv_heads * head_dim,
            "MLP rows": getattr(hf_config, "intermediate_size", None) or 0, "hidden size": hf_config.hidden_size}


def _named(device: torch.device) -> str:
    if device.type != "cuda":
        return f"a {device.type.upper()}"
    return f"{torch.cuda.get_device_name(device)} ({'.'.join(map(str, torch.cuda.get_device_capability(device)))})"


def _every_scheme_fp8(quantization: dict) -> bool:
    groups = quantization.get("config_groups") or {}
    return bool(groups) and all((group.get("weights") or {}).get("type") == "float"
                                and (group.get("weights") or {}).get("num_bits") == 8 for group in groups.values())


def describe(model: torch.nn.Module, method: str | None) -> None:
    """Log how the quantized checkpoint's linear layers will compute."""
    if method is None:
        return
    kinds: dict[str, int] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, torch.nn.Linear) or type(module).__name__.endswith("Linear"):
            kind = f"{type(module).__name__} ({weight.dtype if weight is not None else 'no weight'})"
            kinds[kind] = kinds.get(kind, 0) + 1
    logger.info("quantized checkpoint (%s): %s", method, ", ".join(f"{n} x {kind}" for kind, n in kinds.items()))
