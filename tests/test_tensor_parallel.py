"""Tensor parallelism on CPU (gloo): token-exact against one rank, clear start-up errors, and a worker
that dies mid-run ending every request with an error, with no process left behind."""

import os
import signal
import time

import numpy as np
import psutil
import pytest
import torch

from conftest import make_tiny_model, random_prompts
from inflight import LLM, LoRATask, SamplingParams
from inflight.engine import EngineDeadError
from test_kv_offload import waves

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(),
                       reason="transformers builds the tensor-parallel mesh on the GPU where there is one; "
                              "these tests shard over CPU processes"),
]

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def run_to_the_end(llm: LLM, prompts, params) -> list[list[int]]:
    outputs = llm.generate(prompts, params)
    assert llm.block_manager.num_used_blocks == 0, "KV blocks were not freed"
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_three_ranks_match_one_across_chunks_preemption_prefix_caching_and_forks(default_model):
    shared = "You are a helpful assistant. Answer briefly and precisely. Question: "
    prompts = [shared + q for q in ("What is the capital of Japan?", "Why is the sky blue?",
                                    "Name three primary colors.", "What does a compiler do?")]
    prompts += ["In 1969, the first humans landed on", "def fibonacci(n):"]
    # 16 tokens each: three ranks on two cores take ~0.6 s a step (each all-reduce waits for a rank the
    # scheduler has set aside), and this is enough for a preemption (its recompute hitting the cache).
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    params = [greedy] * 5 + [SamplingParams(n=2, max_tokens=16, temperature=0.0, ignore_eos=True)]
    # A small pool and budget: prompts are prefilled in chunks, sequences are preempted and recomputed,
    # the prefix cache is hit, and the n=2 request copies its last prompt block on write.
    settings = dict(num_kv_blocks=8, max_num_seqs=4, max_num_batched_tokens=16, num_threads=1)
    expected = run_to_the_end(LLM(default_model, **settings), prompts, params)
    before = children()
    llm = LLM(default_model, tensor_parallel_size=3, **settings)
    try:
        assert len(llm.runner.worker_pids) == 2 and set(llm.runner.worker_pids) <= children()
        assert llm.runner.num_kv_heads == 1  # 3 KV heads over 3 ranks
        assert run_to_the_end(llm, prompts, params) == expected
        stats = llm.stats()
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
        assert llm.runner.step_messages == llm.num_steps  # one message per step
    finally:
        llm.close()
    assert children() <= before, "a worker outlived close()"


@pytest.mark.parametrize("ranks, fused, drafts, kv_cache_dtype",
                         [(2, False, False, "auto"), (4, False, False, "auto"), (2, True, True, "bfloat16")])
def test_tiny_checkpoint_sharded_over_two_and_four_ranks(tmp_path, ranks, fused, drafts, kv_cache_dtype):
    """fused: each rank with fused layers (on by default on GPUs), inside transformers' sharded modules.
    The last prompt is a beam search (its beams fork and copy blocks on every rank). drafts: the ranks
    judge n-gram drafts (speculative decoding), against one rank without them. The second prompt holds
    virtual tokens of a p-tuning table (every rank embeds them: the step's message carries their rows).
    kv_cache_dtype: every rank's cache in that dtype, as one rank's."""
    model = str(make_tiny_model("llama", tmp_path / "tiny", num_attention_heads=8, num_key_value_heads=4))
    prompts = random_prompts(6, 3, 40, 512, seed=ranks)
    table = torch.randn(5, 64, generator=torch.Generator().manual_seed(ranks)) * 0.2
    prompts[1] = {"prompt_token_ids": prompts[1][:2] + list(range(512, 517)) + prompts[1][2:],
                  "prompt_embedding_table": table}
    params = [GREEDY] * 5 + [SamplingParams(beam_width=3, n=2, max_tokens=24, ignore_eos=True)]
    settings = dict(num_kv_blocks=24, max_num_seqs=4, max_num_batched_tokens=32, num_threads=1,
                    kv_cache_dtype=kv_cache_dtype)
    expected = run_to_the_end(LLM(model, **settings), prompts, params)
    speculative = {"num_speculative_tokens": 3, "prompt_lookup_min": 1} if drafts else None
    llm = LLM(model, tensor_parallel_size=ranks, fused_layers=fused, speculative_config=speculative, **settings)
    try:
        assert run_to_the_end(llm, prompts, params) == expected
        assert not drafts or llm.stats()["spec_decode_draft_tokens_total"] > 0
        assert llm.runner.kv_cache.dtype == (torch.bfloat16 if kv_cache_dtype == "bfloat16" else torch.float32)
    finally:
        llm.close()


def test_a_host_tier_on_two_ranks(tmp_path):
    """kv_offload_memory (split over the ranks): each rank stores and loads its own KV heads of each block,
    the copies in the step's message; output equal to one rank's with the same tier, blocks brought back."""
    model = str(make_tiny_model("llama", tmp_path / "tiny", num_attention_heads=8, num_key_value_heads=4))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    settings = dict(num_kv_blocks=14, max_num_seqs=3, max_num_batched_tokens=48, num_threads=1)
    one = LLM(model, kv_offload_memory=1 << 22, **settings)
    expected = run_to_the_end(one, waves(seed=3), [params] * 18)
    llm = LLM(model, tensor_parallel_size=2, kv_offload_memory=1 << 22, **settings)
    try:
        assert llm.block_manager.host.num_slots == (1 << 21) // llm.runner.bytes_per_block  # (a rank's share)
        assert run_to_the_end(llm, waves(seed=3), [params] * 18) == expected
        assert llm.stats()["kv_offload_loaded_blocks_total"] == one.stats()["kv_offload_loaded_blocks_total"] > 0
    finally:
        llm.close()


def test_a_draft_model_beside_two_ranks(tmp_path):
    """The model sharded over two ranks, its draft model whole on rank 0 (its KV pool under the same block
    ids, every rank's pool as small as rank 0's, which leaves the draft model room): one rank's outputs; the
    model whole as its own draft model, its drafts kept (all but a rounding's few)."""
    model = str(make_tiny_model("llama", tmp_path / "tiny", num_attention_heads=8, num_key_value_heads=4))
    prompts = random_prompts(5, 3, 40, 512, seed=7)
    settings = dict(max_num_seqs=4, max_num_batched_tokens=32, num_threads=1, kv_cache_memory=1 << 20)
    expected = run_to_the_end(LLM(model, **settings), prompts, GREEDY)
    llm = LLM(model, tensor_parallel_size=2, speculative_config={"model": model, "num_speculative_tokens": 3},
              **settings)
    try:
        assert run_to_the_end(llm, prompts, GREEDY) == expected
        stats = llm.stats()
        assert stats["spec_decode_accepted_tokens_total"] >= 0.95 * stats["spec_decode_draft_tokens_total"] > 0
        rank0 = llm.runner.runner
        assert llm.draft_model.runner.num_blocks == rank0.num_blocks == (
            (1 << 20) // (rank0.bytes_per_block + llm.draft_model.runner.bytes_per_block))
    finally:
        llm.close()


def test_lora_adapters_sharded_over_two_ranks(tmp_path):
    """LoRA adapters of q and v (column-parallel) and of k, o, gate and down (o and down row-parallel: each
    rank's shrunk product summed over the ranks) with the base model in one batch: the outputs of one rank,
    which equal peft's (test_lora.py), and unlike the base model's; the same sent as LoRA tasks."""
    from lora_adapters import make_lora_adapters, trtllm_lora_tensors

    model = str(make_tiny_model("llama", tmp_path / "tiny", num_attention_heads=8, num_key_value_heads=4))
    adapters = make_lora_adapters(model, tmp_path / "lora")
    prompts = random_prompts(4, 3, 40, 512, seed=7)
    names = [None, "alpha", "beta"]
    cases = [(p, name) for name in names for p in prompts]
    settings = dict(num_kv_blocks=48, max_num_seqs=8, max_num_batched_tokens=32, num_threads=1, lora_modules=adapters)

    def outputs(llm: LLM) -> list[list[int]]:
        outs = llm.generate([p for p, _ in cases], GREEDY, lora_name=[name for _, name in cases])
        assert llm.block_manager.num_used_blocks == 0
        return [o.outputs[0].token_ids for o in outs]

    expected = outputs(LLM(model, **settings))
    for name in ("alpha", "beta"):
        changed = sum(expected[names.index(name) * 4 + k] != expected[k] for k in range(4))
        assert changed >= 3, f"adapter {name} changed only {changed} of 4 outputs"
    llm = LLM(model, tensor_parallel_size=2, **settings)
    try:
        assert outputs(llm) == expected
    finally:
        llm.close()
    # Sent with requests as TensorRT-LLM's LoRA tasks into one slot: alpha's loaded, then beta's in its
    # place (each rank loads its share from the step's message).
    settings = dict(settings, lora_modules=None, lora_task_slots=1)
    llm = LLM(model, tensor_parallel_size=2, **settings)
    try:
        for k, name in enumerate(("alpha", "beta"), start=1):
            task = LoRATask(k, *trtllm_lora_tensors(adapters[name], np.float32))
            outs = llm.generate(prompts + prompts, GREEDY, lora_task=[task] * 4 + [None] * 4)
            assert [o.outputs[0].token_ids for o in outs] == expected[names.index(name) * 4:][:4] + expected[:4]
        assert llm.stats()["lora_task_loads"] == 2
    finally:
        llm.close()


@pytest.mark.parametrize("model_type", ["llava", "gemma3", "paligemma2"])
def test_a_vision_language_model_sharded_over_two_ranks(tmp_path, model_type):
    """A tiny LLaVA's (Gemma 3's, PaliGemma 2's) language model sharded over two ranks (the images' vectors
    made on rank 0 travel as rows of the step's message; Gemma 3's images' and PaliGemma's prompts' spans of
    tokens that see each other with them): prompts of one and two images and of text alone (not PaliGemma's,
    which takes none), as one rank."""
    from test_images import make_tiny_vlm, pictures, placeholder, with_images  # (skips where Pillow is missing)

    model = make_tiny_vlm(model_type, tmp_path / model_type)
    a, b = pictures(2)
    image = placeholder(model_type)
    prompts = [with_images(f"{image} hello", [a]), with_images(f"two: {image} {image}", [a, b])]
    prompts += [] if model_type == "paligemma2" else ["text alone"]
    settings = dict(num_kv_blocks=64, num_threads=1, max_num_batched_tokens=48 if model_type == "paligemma2" else 32,
                    max_num_seqs=4)
    expected = run_to_the_end(LLM(model, **settings), prompts, GREEDY)
    llm = LLM(model, tensor_parallel_size=2, **settings)
    try:
        assert llm.runner.num_kv_heads == 1  # (of the model's 2: the language model is sharded)
        assert run_to_the_end(llm, prompts, GREEDY) == expected
    finally:
        llm.close()


def test_chunked_attention_beyond_a_chunk_sharded_over_two_ranks(tmp_path):
    """A tiny Llama 4 (chunks of 16) over contexts of up to 100 tokens, sharded over two ranks (each step's
    chunk view in its message): as one rank."""
    model = str(make_tiny_model("llama4_text", tmp_path / "llama4", attention_chunk_size=16, num_hidden_layers=4))
    prompts = random_prompts(4, 5, 70, 512, seed=5)
    settings = dict(max_model_len=128, num_kv_blocks=64, num_threads=1, max_num_batched_tokens=32, max_num_seqs=4)
    expected = run_to_the_end(LLM(model, **settings), prompts, GREEDY)
    llm = LLM(model, tensor_parallel_size=2, **settings)
    try:
        assert llm.runner.num_kv_heads == 1 and llm.runner.chunk_view == 16
        assert run_to_the_end(llm, prompts, GREEDY) == expected
    finally:
        llm.close()


@pytest.mark.parametrize("family", ["gemma2", "gpt2", "mistral"])
def test_other_model_types_sharded_or_refused(tmp_path, family):
    """Gemma 2 (its softcap in every rank's kernels), sharded by transformers' plan, equals one rank, its
    windowed layer's blocks in tables of their own (the step's message carries them) given back behind its
    window of 48: sequences of up to 224 tokens in a pool of 24 blocks of 16; GPT-2, which transformers has
    no plan to shard, would hold every head on each rank: refused at start-up with the reason, no worker left
    behind. Mistral, its blocks given back behind its window of 48 (rank 0's tables, every rank's caches):
    sequences of up to 224 tokens in a pool of 192, as one rank."""
    model = str(make_tiny_model(family, tmp_path / family, num_attention_heads=8, num_key_value_heads=4))
    prompts = random_prompts(4, 100, 200, 512, seed=5) if family != "gpt2" else random_prompts(4, 3, 40, 512, seed=5)
    settings = dict(num_kv_blocks=12 if family == "mistral" else 24, max_num_seqs=4, max_num_batched_tokens=32,
                    num_threads=1)
    expected = run_to_the_end(LLM(model, **settings), prompts, [GREEDY] * 4)
    before = children()
    if family == "gpt2":
        # (from rank 0 itself, or from another rank through the start-up's RuntimeError: whichever is first)
        with pytest.raises((ValueError, RuntimeError), match="plan for it does not shard its attention heads"):
            LLM(model, tensor_parallel_size=2, **settings)
        deadline = time.monotonic() + 10
        while children() - before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert children() <= before, "a worker outlived the refusal"
        return
    llm = LLM(model, tensor_parallel_size=2, **settings)
    try:
        assert run_to_the_end(llm, prompts, [GREEDY] * 4) == expected
    finally:
        llm.close()


def test_clear_errors_at_start_up(default_model, tmp_path):
    with pytest.raises(ValueError, match="tensor_parallel_size 2 must divide the model's 9 attention heads and 3 KV"):
        LLM(default_model, tensor_parallel_size=2, num_kv_blocks=8)
    with pytest.raises(ValueError, match="tensor parallelism runs on this machine's cpu, not on device 'cuda'"):
        LLM(default_model, tensor_parallel_size=3, device="cuda", num_kv_blocks=8)
    with pytest.raises(ValueError, match="gpu_device_ids must list 3 distinct GPU indices"):
        LLM(default_model, tensor_parallel_size=3, device="cuda", gpu_device_ids=[0, 0, 1])
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM(default_model, tensor_parallel_size=0)
    # A worker that cannot start: its interpreter exits at once.
    before = children()
    os.environ["INFLIGHT_PYTHON"] = "/bin/false"
    try:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) exited with code 1"):
            LLM(default_model, tensor_parallel_size=3, num_kv_blocks=8)
        assert time.monotonic() - started < 30
    finally:
        del os.environ["INFLIGHT_PYTHON"]
    assert not torch.distributed.is_initialized()
    assert children() <= before, "a worker outlived the failed start-up"


def test_a_worker_killed_mid_run_ends_every_request_with_an_error(default_model):
    before = children()
    llm = LLM(default_model, tensor_parallel_size=3, num_kv_blocks=64, num_threads=1)
    try:
        for i in range(4):
            llm.add_request(f"r{i}", f"Story number {i}: once upon a time", SamplingParams(max_tokens=200,
                                                                                        ignore_eos=True))
        for _ in range(3):
            llm.step()
        victim = llm.runner.worker_pids[1]
        os.kill(victim, signal.SIGKILL)
        started = time.monotonic()
        finals = {}
        while llm.has_unfinished():
            for delta in llm.step():
                if delta.finished:
                    finals[delta.request_id] = delta
            assert time.monotonic() - started < 30, "the engine hung after a worker died"
        assert sorted(finals) == [f"r{i}" for i in range(4)]
        assert all(d.finish_reason == "error" and f"rank 2 (pid {victim})" in d.error for d in finals.values())
        assert llm.dead_reason is not None and llm.block_manager.num_used_blocks == 0
        with pytest.raises(EngineDeadError):
            llm.add_request("late", "hello")
    finally:
        llm.close()
    assert children() <= before, "a worker outlived close()"
