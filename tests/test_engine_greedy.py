"""Greedy outputs equal HF transformers' `generate` token for token, whatever the batching does."""

import dataclasses
import warnings

import numpy as np
import pytest
import torch

from conftest import MORE_FAMILIES, hf_greedy, make_tiny_model, random_prompts
from inflight import LLM, SamplingParams

MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

# Engine settings that change how the same work is cut into steps.
SCHEDULES = {
    "roomy": dict(num_kv_blocks=512, max_num_seqs=64, max_num_batched_tokens=512),
    "chunked-prefill": dict(num_kv_blocks=512, max_num_seqs=16, max_num_batched_tokens=37),
    "preemption": dict(num_kv_blocks=40, max_num_seqs=16, max_num_batched_tokens=128),
    "one-at-a-time": dict(num_kv_blocks=512, max_num_seqs=1, max_num_batched_tokens=512),
}
# Models whose layers all share a sliding window (48 tokens here) hold a sequence's last blocks only: under
# "preemption" their pool of 7 blocks (112 tokens) is a third of the longest sequence (344 tokens).
SHARED_WINDOW_FAMILIES = {"mistral", "starcoder2"}


def schedule_settings(schedule: str, family: str) -> dict:
    settings = SCHEDULES[schedule]
    if schedule == "preemption" and family in SHARED_WINDOW_FAMILIES:
        settings = dict(settings, num_kv_blocks=7)
    return settings

# On a GPU machine the engine's greedy tests also run there (float32, CUDA graphs for decode steps,
# async scheduling); on the CPU with steps one at a time and with async scheduling.
DEVICES = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
MODES = {"cpu": dict(device="cpu", async_scheduling=False), "cpu-async": dict(device="cpu", async_scheduling=True)}
if torch.cuda.is_available():
    MODES["cuda"] = dict(device="cuda")


def run_and_compare(model_dir, prompts, hf_reference, **settings):
    llm = LLM(model_dir, block_size=16, enable_prefix_caching=False, **settings)
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out.finish_reason == "length"
        assert out.token_ids == hf_reference(model_dir, prompt, MAX_TOKENS), f"prompt of {len(prompt)} tokens"
    llm.block_manager.check_all_free()
    return llm


FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]
# Every family under every schedule, pipelined (the GPU's way) and, for Llama and Mistral (sliding window),
# one step at a time too: the family changes the model, the mode the engine's loop.
GREEDY_CASES = [(family, schedule, mode) for mode in MODES for schedule in SCHEDULES for family in FAMILIES
                if mode != "cpu" or family in ("llama", "mistral")]


@pytest.mark.parametrize("family, schedule, mode", GREEDY_CASES, ids=["-".join(case) for case in GREEDY_CASES])
def test_tiny_models_match_hf(tiny_models, hf_reference, family, schedule, mode):
    prompts = random_prompts(16, 1, 320, vocab=512, seed=7)
    llm = run_and_compare(tiny_models[family], prompts, hf_reference, dtype="float32", **MODES[mode],
                          **schedule_settings(schedule, family))
    if mode == "cuda":
        assert llm.runner.graphs.replays > 0, "decode steps were meant to replay CUDA graphs"
    if llm.config.async_scheduling:
        assert llm.num_pipelined_steps > llm.num_steps // 2, "steps were meant to overlap"
    if schedule == "preemption":
        assert llm.stats()["num_preemptions"] > 0, "the pool was meant to be too small to hold every sequence"


@pytest.mark.slow
def test_default_model_matches_hf(default_model, hf_reference):
    prompts = random_prompts(8, 1, 300, vocab=49152, seed=3)
    # chunked prefill and a pool small enough to preempt, on real weights
    llm = run_and_compare(default_model, prompts, hf_reference, num_kv_blocks=32, max_num_seqs=16,
                          max_num_batched_tokens=96)
    assert llm.stats()["num_preemptions"] > 0


NARROW_KV_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "fp8_e5m2": torch.float8_e5m2,
                    "fp8_e4m3": torch.float8_e4m3fn}


@pytest.mark.parametrize("kv_cache_dtype", NARROW_KV_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_narrow_kv_cache_matches_hf_over_rounded_keys_and_values(tiny_models, device, kv_cache_dtype):
    """A float32 model with a 16-bit or fp8 KV cache (`kv_cache_dtype`): greedy output equals HF `generate`
    in float32 whose attention sees its keys and values rounded to that dtype (what the cache holds), with
    chunked prefill and preemption; the pool holds the 2- or 1-byte blocks its memory pays for. On a CPU the
    bfloat16 cache is read by the C kernels, the float16 and fp8 ones gathered for torch; on a GPU, by the
    Triton kernels, whose matmuls then take the cache's dtype, or bfloat16 over fp8 (the reference rounds
    the queries too)."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cache_dtype = NARROW_KV_DTYPES[kv_cache_dtype]
    if device == "cuda" and cache_dtype == torch.float8_e4m3fn and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("this GPU does not convert fp8 e4m3")
    query_dtype = torch.bfloat16 if cache_dtype.itemsize == 1 else cache_dtype

    def rounded_kv_attention(module, query, key, value, *args, **kwargs):
        if device == "cuda":
            query = query.to(query_dtype).float()
        return sdpa_attention_forward(module, query, key.to(cache_dtype).float(), value.to(cache_dtype).float(),
                                      *args, **kwargs)

    name = f"sdpa_kv_{kv_cache_dtype}_{device}"
    AttentionInterface.register(name, rounded_kv_attention)
    model_dir = tiny_models["llama"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=name).eval()
    prompts = random_prompts(8, 1, 200, vocab=512, seed=11)
    expected = [hf_greedy(model, prompt, MAX_TOKENS) for prompt in prompts]
    # 40 blocks of 16 tokens, each 2 layers x K/V x 2 KV heads x 16 dims x 2 or 1 bytes, and its id's 8 bytes
    memory = 40 * 16 * (2 * 2 * 2 * 16 * cache_dtype.itemsize + 8)
    llm = LLM(model_dir, dtype="float32", kv_cache_dtype=kv_cache_dtype, kv_cache_memory=memory, block_size=16,
              max_num_seqs=16, max_num_batched_tokens=128, enable_prefix_caching=False, **MODES[device])
    assert llm.runner.kv_cache.dtype == cache_dtype and llm.runner.num_blocks == 40
    outs = llm.generate(prompts, GREEDY)
    assert [out.token_ids for out in outs] == expected
    assert llm.stats()["num_preemptions"] > 0, "the pool was meant to be too small to hold every sequence"
    llm.block_manager.check_all_free()


def test_kv_cache_dtype_is_checked():
    from inflight.config import EngineConfig
    from inflight.model_runner import kv_cache_dtype

    assert EngineConfig("m", device="cpu").kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="kv_cache_dtype must be float32, float16, bfloat16, fp8, fp8_e4m3, "
                                         "fp8_e5m2 or auto, got 'int8'"):
        EngineConfig("m", device="cpu", kv_cache_dtype="int8")
    assert kv_cache_dtype("fp8", torch.bfloat16, "cuda", (9, 0)) == torch.float8_e4m3fn
    assert kv_cache_dtype("fp8_e5m2", torch.float32, "cuda", (8, 0)) == torch.float8_e5m2
    assert kv_cache_dtype("fp8_e4m3", torch.float32, "cpu") == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="needs a GPU of compute capability 8.9 or more .* this one's is 8.0: "
                                         "fp8_e5m2 works there"):
        kv_cache_dtype("fp8", torch.bfloat16, "cuda", (8, 0))
    assert kv_cache_dtype("auto", torch.bfloat16, "cuda") == torch.bfloat16
    assert kv_cache_dtype("float16", torch.bfloat16, "cuda") == torch.float16
    assert kv_cache_dtype("bfloat16", torch.float32, "cuda") == torch.bfloat16
    # A wider cache than the model's: on a CPU the C kernels compute in float32 anyway; on a GPU refused.
    assert kv_cache_dtype("float32", torch.bfloat16, "cpu") == torch.float32
    with pytest.raises(ValueError, match="kv_cache_dtype float32 is wider than the model's bfloat16"):
        kv_cache_dtype("float32", torch.bfloat16, "cuda")


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_matches_hf(tiny_models, hf_reference, device):
    """torch_compile: the model compiled around our attention (a graph break), dynamic shapes, chunked
    prefill and decodes of several batch sizes (on a GPU, captured in CUDA graphs too)."""
    from torch._dynamo.utils import counters

    graphs_before = counters["stats"]["unique_graphs"]
    prompts = random_prompts(6, 1, 90, vocab=512, seed=13)
    run_and_compare(tiny_models["llama"], prompts, hf_reference, device=device, dtype="float32",
                    torch_compile=True, num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=64)
    assert counters["stats"]["unique_graphs"] > graphs_before, "the model was meant to run compiled"



def test_torch_compile_compiles_every_step_shape_at_start_up(tiny_models):
    """Under torch_compile no request waits for a compile: start-up compiles a step of each shape class
    (compile_warmup.py)."""
    llm = LLM(tiny_models["llama"], device="cpu", dtype="float32", torch_compile=True, num_kv_blocks=64,
              max_num_seqs=4, max_num_batched_tokens=32, enable_prefix_caching=False)
    assert_nothing_compiles_after_start_up(llm)


def assert_nothing_compiles_after_start_up(llm):
    """A lone one-token prompt and lone decodes, prompt chunks that sample nothing, mixed steps sampling
    several rows and prompt logprobs all run what start-up compiled."""
    from torch._dynamo.utils import counters

    compiled = counters["stats"]["unique_graphs"]
    assert compiled > 0, "the model was meant to run compiled"
    prompts = random_prompts(5, 2, 100, vocab=512, seed=5)
    llm.generate([[7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    llm.generate([prompts[1]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    llm.generate(prompts, GREEDY)
    llm.generate([prompts[0]], SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert llm.num_steps > 0
    assert counters["stats"]["unique_graphs"] == compiled, "a step compiled a graph after start-up"
    llm.block_manager.check_all_free()


# Chunked prefill and preemption, pipelined; on a GPU machine on the GPU too (CUDA graphs where they capture).
MORE_CASES = [(mode, schedule) for mode in MODES if mode != "cpu" for schedule in ("chunked-prefill", "preemption")]


@pytest.mark.parametrize("mode, schedule", MORE_CASES, ids=["-".join(case) for case in MORE_CASES])
@pytest.mark.parametrize("family", MORE_FAMILIES)
def test_more_model_types_match_hf(more_tiny_models, hf_eager_reference, family, mode, schedule):
    """Other model types transformers has, each run by its own modeling code with our attention: greedy
    equal to HF's eager attention; Gemma 2's softcap and gpt-oss's sinks taken by the kernels, Llama 4's
    chunked attention over contexts up to its chunk."""
    prompts = random_prompts(16, 1, 320, vocab=512, seed=7)
    llm = run_and_compare(more_tiny_models(family), prompts, hf_eager_reference, dtype="float32", **MODES[mode],
                          **schedule_settings(schedule, family))
    if mode == "cuda" and llm.runner.graphs is None:  # allowed (model_runner._capture_graphs), and worth knowing
        warnings.warn(f"{family}: CUDA graphs were not captured, decode steps ran eagerly")


LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [1.0 + 2.0 * i for i in range(8)]}


@pytest.mark.parametrize("kind", ["longrope", "dynamic"])
def test_rotary_frequencies_are_chosen_once_from_max_model_len(tmp_path, kind):
    """transformers' longrope (Phi-3's 128K models) and dynamic NTK rotary embeddings choose their
    frequencies at each forward from its largest position: in an engine's step, any sequence's. The engine
    chooses them once from max_model_len (model_support.fix_rotary_frequencies): a short request's logits
    the same bit for bit alone and beside a long one (CPU, float32); longrope's short factors up to
    original_max_position_embeddings (32 here; HF's for a sequence that short), its long ones beyond (HF's
    for a longer one), each against HF's forward over the whole sequence; NTK's for max_model_len."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    path = str(make_tiny_model("phi3", tmp_path, rope_scaling=LONGROPE, max_position_embeddings=256,
                               original_max_position_embeddings=32) if kind == "longrope" else
               make_tiny_model("llama", tmp_path, rope_scaling={"rope_type": "dynamic", "factor": 2.0},
                               max_position_embeddings=32))
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    params = dataclasses.replace(GREEDY, max_tokens=20, return_generation_logits=True)
    short, long = random_prompts(1, 8, 8, 512, seed=1)[0], random_prompts(1, 60, 60, 512, seed=2)[0]

    def hf_logits(prompt, out):
        with torch.no_grad():
            return reference(torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1:].numpy()

    for max_model_len in (32, 128):
        alone = LLM(path, max_model_len=max_model_len).generate([short], params)[0]
        llm = LLM(path, max_model_len=max_model_len)
        beside = llm.generate([short, long] if max_model_len > 32 else [short, short[:5]], params)
        assert np.array_equal(beside[0].outputs[0].generation_logits, alone.outputs[0].generation_logits)
        rotary = llm.runner.model.model.rotary_emb
        if kind == "dynamic":
            expected = ROPE_INIT_FUNCTIONS["dynamic"](reference.config, seq_len=max_model_len)[0] \
                if max_model_len > 32 else rotary.original_inv_freq
            assert torch.equal(rotary.inv_freq, expected)
        elif max_model_len == 32:
            np.testing.assert_allclose(alone.outputs[0].generation_logits, hf_logits(short, alone), atol=1e-4,
                                       rtol=1e-4)
        else:
            np.testing.assert_allclose(beside[1].outputs[0].generation_logits, hf_logits(long, beside[1]), atol=1e-4,
                                       rtol=1e-4)
