"""Quantized checkpoints (quantization.py): a tiny Llama written in three formats' layouts, block-wise FP8
(transformers' "fp8": FP8 weights, a float32 scale for each 128 x 128 block), compressed-tensors' FP8-dynamic
(FP8 weights with a scale a row, inputs rounded to FP8 a token at a time) and its W4A16 (4-bit weights, a
scale for each 128 of a row, packed), run by the engine greedy equal to HF transformers loading the same
checkpoint, token for token; the `quantization` setting; tensor parallelism."""

import functools
import importlib.util

import pytest
import torch

from conftest import hf_greedy, make_tiny_model, random_prompts
from inflight import LLM, SamplingParams, quantization
from quantized_checkpoints import FORMATS, compressed_tensors_config, fp8_dynamic_scheme, int4_scheme, quantized_copy


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("quantized")
    # Every projection a whole number of 128 x 128 blocks (heads of 64: 4 query, 2 KV)
    base = make_tiny_model("llama", root / "base", hidden_size=256, intermediate_size=512)
    # (compressed-tensors' formats where its package is: requirements.txt has it, a GPU machine may not)
    formats = [fmt for fmt in FORMATS if fmt == "fp8" or importlib.util.find_spec("compressed_tensors")]
    return {"base": str(base), **{fmt: quantized_copy(base, root / fmt, fmt) for fmt in formats}}


@pytest.mark.parametrize("method", FORMATS)
def test_greedy_equals_hf_loading_the_same_checkpoint(checkpoints, method):
    from transformers import AutoConfig, AutoModelForCausalLM

    if method not in checkpoints:
        pytest.skip("compressed-tensors is not installed")
    # (the engine's options for a CPU: on a machine with a GPU transformers would keep FP8 weights)
    options = quantization.loading_options(AutoConfig.from_pretrained(checkpoints[method]), torch.device("cpu"))
    hf = AutoModelForCausalLM.from_pretrained(checkpoints[method], dtype=torch.float32, **options).eval()
    base = AutoModelForCausalLM.from_pretrained(checkpoints["base"], dtype=torch.float32).eval()
    prompts = random_prompts(6, 5, 60, 512, seed=3)
    expected = [hf_greedy(hf, p, 16) for p in prompts]
    # The quantization is not lost on the way: the unquantized weights answer otherwise.
    assert expected != [hf_greedy(base, p, 16) for p in prompts]
    # Prompts in chunks of 24 and a pool of 12 blocks of 8: chunked prefill and preemption.
    llm = LLM(checkpoints[method], num_kv_blocks=12, block_size=8, max_num_batched_tokens=24, max_num_seqs=4)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.stats()["num_preemptions"] > 0 and llm.block_manager.num_used_blocks == 0
    q_proj = llm.runner.model.model.layers[0].self_attn.q_proj
    assert type(q_proj._parameters) is dict  # (out of compressed-tensors' offload cache)
    # Packed for oneDNN, as nn.Linear layers are, unless the scheme rounds the layer's inputs first; the
    # output head (not quantized) too
    assert isinstance(q_proj.forward, functools.partial) == (method != "fp8-dynamic")
    assert isinstance(llm.runner.model.lm_head.forward, functools.partial)
    if method == "fp8-dynamic":
        assert q_proj.quantization_scheme.input_activations is not None


def test_checkpoints_load_for_the_device(monkeypatch):
    """compressed-tensors: FP8 matmuls on a GPU that has them when every scheme is FP8, dequantized weights
    otherwise; block-wise FP8 likewise."""
    from transformers import PretrainedConfig

    def options(device: str, *schemes):
        config = PretrainedConfig(quantization_config=compressed_tensors_config(*schemes, layout="float-quantized"))
        chosen = quantization.loading_options(config, torch.device(device))["quantization_config"]
        return chosen.use_optimized_inference, chosen.dequantize

    fp8, int4 = fp8_dynamic_scheme(), int4_scheme(128)
    assert options("cpu", fp8) == (False, True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert options("cuda", fp8) == (True, False)
    assert options("cuda", fp8, int4) == (False, True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert options("cuda", fp8) == (False, True)
    # Block-wise FP8: kept on a GPU that computes in FP8, dequantized elsewhere (the checkpoint's layers left
    # unquantized kept so); other checkpoints load as transformers has them load.
    blockwise = PretrainedConfig(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128],
                                                      "modules_to_not_convert": ["lm_head", "model.layers.0.mlp"]})
    for device in ("cpu", "cuda"):  # (a CPU, then a GPU of compute capability 8.0)
        chosen = quantization.loading_options(blockwise, torch.device(device))["quantization_config"]
        assert chosen.dequantize and chosen.modules_to_not_convert == ["lm_head", "model.layers.0.mlp"]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert quantization.loading_options(blockwise, torch.device("cuda")) == {}
    assert quantization.loading_options(PretrainedConfig(), torch.device("cpu")) == {}


def test_the_quantization_setting(checkpoints, default_model, monkeypatch):
    """quantization "fp8" quantizes an unquantized checkpoint on a GPU that computes in FP8, and is refused
    elsewhere, for sizes its blocks do not divide, over a checkpoint quantized otherwise, or as another name."""
    from transformers import AutoConfig

    with pytest.raises(ValueError, match="quantization must be fp8 or null"):
        LLM(checkpoints["base"], quantization="int4")
    with pytest.raises(ValueError, match=r"quantization fp8 quantizes weights in blocks of 128 x 128; the model's "
                                         "query rows: 576, not a multiple of 128"):
        LLM(default_model, quantization="fp8")
    with pytest.raises(ValueError, match="quantization fp8: FP8 weights need a GPU of compute capability 8.9 or "
                                         "more .Ada, Hopper., not a CPU"):
        LLM(checkpoints["base"], quantization="fp8")
    with pytest.raises(ValueError, match=r"the checkpoint is already quantized \(compressed-tensors\)"):
        LLM(checkpoints["fp8-dynamic"], quantization="fp8")
    assert LLM(checkpoints["fp8"], quantization="fp8", num_kv_blocks=8).generate(
        [[5, 6, 7]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    chosen = quantization.loading_options(AutoConfig.from_pretrained(checkpoints["base"]), torch.device("cuda"),
                                          "fp8")["quantization_config"]
    assert chosen.quant_method == "fp8" and tuple(chosen.weight_block_size) == (128, 128)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="tensor parallelism here shards over CPU processes")
def test_tensor_parallel_fp8_as_one_rank_and_what_it_cannot_shard_refused(checkpoints, tmp_path):
    # Twice the heads: each rank's key and value rows a whole FP8 block (128 of 256)
    base = make_tiny_model("llama", tmp_path / "base", hidden_size=512, intermediate_size=1024,
                           num_attention_heads=8, num_key_value_heads=4)
    fp8 = quantized_copy(base, tmp_path / "fp8", "fp8")
    prompts = random_prompts(3, 5, 40, 512, seed=4)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    one = [o.outputs[0].token_ids for o in LLM(fp8, num_kv_blocks=32).generate(prompts, greedy)]
    llm = LLM(fp8, num_kv_blocks=32, tensor_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == one
    finally:
        llm.close()
    # Refused before any rank starts: the key and value projections' 128 rows would give each rank half a block
    with pytest.raises(ValueError, match=r"splits the model's key and value rows \(128\) into 64 a rank, not a "
                                         "whole number of the FP8 blocks of 128"):
        LLM(checkpoints["fp8"], tensor_parallel_size=2)
    # (the blocks the quantization setting would make: refused before the device could be)
    with pytest.raises(ValueError, match="splits the model's key and value rows"):
        LLM(checkpoints["base"], tensor_parallel_size=2, quantization="fp8")
    with pytest.raises(ValueError, match="compressed-tensors checkpoint: transformers' quantizer for it does not"):
        LLM(checkpoints["fp8-dynamic"], tensor_parallel_size=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("method", [*FORMATS, "base"])
def test_on_a_gpu_beside_cuda_graphs(checkpoints, method):
    """On a GPU of compute capability 8.9 on the weights stay FP8 (transformers' FP8Linear; compressed-tensors'
    row-wise FP8 matmuls; the unquantized checkpoint quantized by the `quantization` setting; W4A16's
    dequantized, its layers plain, on the GPU), CUDA graphs replay the decode steps, and greedy output equals
    HF's on the GPU with the same options."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if method not in checkpoints:
        pytest.skip("compressed-tensors is not installed (it travels in .whl-grammar/)")
    fp8_matmuls = torch.cuda.get_device_capability() >= quantization.FP8_CAPABILITY
    requested = "fp8" if method == "base" else None
    if requested and not fp8_matmuls:
        pytest.skip("quantization fp8 needs a GPU of compute capability 8.9 or more")
    config = AutoConfig.from_pretrained(checkpoints[method])
    options = quantization.loading_options(config, torch.device("cuda"), requested)
    hf = AutoModelForCausalLM.from_pretrained(checkpoints[method], dtype=torch.bfloat16, **options)
    quantization.unwrap(hf, config)  # (its parameters out of compressed-tensors' CPU cache, same values)
    hf = hf.to("cuda").eval()
    prompts = random_prompts(6, 5, 60, 512, seed=3)
    expected = [hf_greedy(hf, p, 16) for p in prompts]
    llm = LLM(checkpoints[method], device="cuda", dtype="bfloat16", num_kv_blocks=64, block_size=16,
              quantization=requested)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.runner.graphs.replays > 0
    weight = llm.runner.model.model.layers[0].self_attn.q_proj.weight
    assert (weight.dtype == torch.float8_e4m3fn) == (fp8_matmuls and method != "w4a16")
