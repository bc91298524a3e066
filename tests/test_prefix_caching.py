"""Automatic prefix caching: same greedy outputs with and without it, real reuse, no leaks."""

import time

import numpy as np
import pytest

from conftest import random_prompts
from inflight import LLM, SamplingParams
from inflight.block_manager import BlockManager

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
BLOCK = 16


def shared_prefix_prompts(prefix_len: int, count: int, seed: int) -> list[list[int]]:
    prefix = random_prompts(1, prefix_len, prefix_len, vocab=512, seed=seed)[0]
    tails = random_prompts(count, 1, 20, vocab=512, seed=seed + 1)
    return [prefix + tail for tail in tails]


def run(model, prompts, caching: bool, **settings):
    settings = {"num_kv_blocks": 256, "max_num_seqs": 8, "max_num_batched_tokens": 64, **settings}
    llm = LLM(model, block_size=BLOCK, enable_prefix_caching=caching, **settings)
    outs = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    return llm, outs


def assert_no_leak(llm):
    bm = llm.block_manager
    bm.check_all_free()
    assert all(b.ref_count == 0 for b in bm.blocks.values())


@pytest.mark.parametrize("prefix_len", [5, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK, 3 * BLOCK + 7, 100])
def test_same_outputs_with_and_without_caching(tiny_models, prefix_len):
    model = tiny_models["llama"]
    prompts = shared_prefix_prompts(prefix_len, 6, seed=prefix_len)
    # Run twice in a row so that the second wave finds the first wave's blocks.
    prompts = prompts + prompts[::-1]
    _, expected = run(model, prompts, caching=False)
    llm, got = run(model, prompts, caching=True)
    assert got == expected
    stats = llm.stats()
    full_blocks = (prefix_len + 1 - 1) // BLOCK  # blocks of the shared prefix that are full
    if full_blocks:
        assert stats["prefix_cache_hit_tokens"] >= full_blocks * BLOCK
    assert_no_leak(llm)


def test_identical_prompts_reuse_all_but_the_last_token(tiny_models):
    model = tiny_models["qwen3"]
    prompt = random_prompts(1, 4 * BLOCK, 4 * BLOCK, vocab=512, seed=3)[0]  # exactly 4 blocks
    llm = LLM(model, block_size=BLOCK, num_kv_blocks=64, enable_prefix_caching=True)
    first = llm.generate([prompt], GREEDY)[0].token_ids
    before = llm.stats()["prefix_cache_hit_tokens"]
    second = llm.generate([prompt], GREEDY)[0].token_ids
    assert second == first
    # The last block holds the last prompt token, which is recomputed to sample from: 3 blocks hit.
    assert llm.stats()["prefix_cache_hit_tokens"] - before == 3 * BLOCK
    assert_no_leak(llm)


@pytest.mark.parametrize("prompt_len", [3 * BLOCK - 1, 3 * BLOCK, 3 * BLOCK + 1, 3 * BLOCK + 2])
def test_a_request_sent_again_gets_its_logits_bit_for_bit(tiny_models, prompt_len):
    """Sent again, a request finds its prompt in the prefix cache but for the last tokens (one alone when
    the prompt is 3 blocks and a token): its raw logits equal the first time's bit for bit (CPU, float32),
    as its seeded draws then do. The rest of a prompt goes through the prefill path however short, and
    the prefill kernel's sums do not depend on the rows computed beside them; before, they were a few 1e-7
    apart, enough for a seeded draw from a flat distribution to take another token."""
    llm = LLM(tiny_models["llama"], block_size=BLOCK, num_kv_blocks=64, enable_prefix_caching=True)
    prompt = random_prompts(1, prompt_len, prompt_len, vocab=512, seed=prompt_len)[0]
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=5, ignore_eos=True, return_generation_logits=True)
    first, again = (llm.generate([prompt], params)[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == (prompt_len - 1) // BLOCK * BLOCK
    assert np.array_equal(first.outputs[0].generation_logits, again.outputs[0].generation_logits)
    assert again.token_ids == first.token_ids
    assert_no_leak(llm)


def test_each_request_reports_what_the_cache_held_and_when_it_passed_each_stage(tiny_models):
    """RequestOutput.metrics: the prompt tokens and blocks found in the prefix cache at admission (none
    the first time), the blocks held at the end, and its times in order; for n completions, in the
    request's output once."""
    llm = LLM(tiny_models["llama"], block_size=BLOCK, num_kv_blocks=64, enable_prefix_caching=True)
    prompt = random_prompts(1, 70, 70, vocab=512, seed=4)[0]  # 4 full blocks and 6 tokens
    started = time.time_ns()
    outs = [llm.generate([prompt], GREEDY)[0] for _ in range(2)] + [
        llm.generate([prompt], SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=1, ignore_eos=True))[0]]
    for out, reused in zip(outs, (0, 4, 4)):
        m = out.metrics
        assert (out.num_cached_tokens, m.kv_reused_blocks) == (reused * BLOCK, reused)
        assert (m.kv_total_blocks, m.kv_new_blocks) == (6, 6 - reused)  # KV of 70 + 11 tokens (not the last one)
        times = [m.arrival_time_ns, m.first_scheduled_time_ns, m.first_token_time_ns, m.last_token_time_ns]
        assert started <= times[0] and times == sorted(times) and times[-1] <= time.time_ns()
    assert_no_leak(llm)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["steps", "async"])
def test_a_prompts_blocks_are_cached_chunk_by_chunk(tiny_models, async_scheduling):
    """A long prompt's full blocks go into the cache as its chunks are computed (in steps where another
    sequence decodes, too), not when it ends: the same prompt arriving while it is still being computed
    finds the blocks done by then."""
    llm = LLM(tiny_models["llama"], block_size=BLOCK, num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=4,
              async_scheduling=async_scheduling)
    llm.add_request("decoding", [5, 6, 7], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    llm.step()
    prompt = random_prompts(1, 100, 100, vocab=512, seed=6)[0]
    llm.add_request("first", prompt, GREEDY)
    for _ in range(3):  # 31 tokens a step beside the decode
        llm.step()
    first = next(seq for seq in llm.scheduler.running if seq.request_id == "first")
    assert first.num_computed_tokens == 93 and not first.output_token_ids
    llm.add_request("second", prompt, GREEDY)
    cached = {}
    while llm.has_unfinished():
        cached.update((d.request_id, d.metrics.num_cached_tokens) for d in llm.step() if d.metrics)
    assert cached == {"decoding": 0, "first": 0, "second": 80}  # (5 blocks of 16 were full)
    assert_no_leak(llm)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["steps", "async"])
def test_the_next_turn_finds_the_blocks_the_answer_filled(tiny_models, async_scheduling):
    """A conversation's next turn (its prompt the last one, the answer and a new message) finds every
    block the answer filled, the last one filled in the step that ended it among them."""
    llm = LLM(tiny_models["llama"], block_size=BLOCK, num_kv_blocks=64, async_scheduling=async_scheduling)
    prompt = random_prompts(1, 20, 20, vocab=512, seed=8)[0]
    answer = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0].token_ids
    # 20 + 39 tokens computed (the last answer token never was): 3 full blocks
    turn = prompt + answer + random_prompts(1, 5, 5, vocab=512, seed=9)[0]
    llm.add_request("next", turn, GREEDY)
    cached = None
    while llm.has_unfinished():
        cached = next((d.metrics.num_cached_tokens for d in llm.step() if d.metrics), cached)
    assert cached == 3 * BLOCK
    assert_no_leak(llm)


def test_a_beam_searchs_blocks_are_cached(tiny_models):
    """A beam search's prompt and its beams' full blocks go into the prefix cache as any sequence's do:
    the same prompt again finds the prompt's blocks, and the best beam's text after it more."""
    llm = LLM(tiny_models["llama"], block_size=BLOCK, num_kv_blocks=64)
    prompt = random_prompts(1, 70, 70, vocab=512, seed=8)[0]  # 4 full blocks and 6 tokens
    best = llm.generate([prompt], SamplingParams(beam_width=2, max_tokens=30, ignore_eos=True))[0].token_ids
    assert llm.generate([prompt], GREEDY)[0].num_cached_tokens == 4 * BLOCK
    assert llm.generate([prompt + best], GREEDY)[0].num_cached_tokens == 6 * BLOCK  # (of 100 tokens)
    assert_no_leak(llm)


def test_evicted_prefix_is_recomputed(tiny_models):
    model = tiny_models["mistral"]
    first_wave = shared_prefix_prompts(3 * BLOCK, 2, seed=21)
    flood = random_prompts(6, 100, 140, vocab=512, seed=22)  # fills the small pool with other blocks
    prompts_and_order = [first_wave, flood, first_wave]
    settings = dict(num_kv_blocks=24, max_num_seqs=4, max_num_batched_tokens=64)
    llm = LLM(model, block_size=BLOCK, enable_prefix_caching=True, **settings)
    reference = LLM(model, block_size=BLOCK, enable_prefix_caching=False, **settings)
    for prompts in prompts_and_order:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == \
               [o.token_ids for o in reference.generate(prompts, GREEDY)]
    assert_no_leak(llm)


def test_a_finished_prompts_tail_is_evicted_before_its_prefix(tiny_models):
    """A finished sequence's blocks go back tail first, so that when the pool runs short the blocks a
    later prompt could share least (the tail) are taken first and its prefix stays cached."""
    llm = LLM(tiny_models["llama"], block_size=BLOCK, num_kv_blocks=8, enable_prefix_caching=True)
    first = random_prompts(1, 4 * BLOCK, 4 * BLOCK, vocab=512, seed=31)[0]  # 4 full blocks, cached at its end
    once = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([first], once)
    llm.generate(random_prompts(1, 5 * BLOCK - 10, 5 * BLOCK - 10, vocab=512, seed=32)[:1], once)  # 5 blocks: 1 evicted
    before = llm.stats()["prefix_cache_hit_tokens"]
    llm.generate([first[:3 * BLOCK] + [7, 8, 9]], once)
    assert llm.stats()["prefix_cache_hit_tokens"] - before == 3 * BLOCK  # the first 3 blocks still there
    assert_no_leak(llm)


def test_caching_with_chunked_prefill_and_preemption(tiny_models):
    model = tiny_models["qwen2"]
    prompts = shared_prefix_prompts(70, 12, seed=31)
    settings = dict(num_kv_blocks=14, max_num_seqs=12, max_num_batched_tokens=40)
    _, expected = run(model, prompts, caching=False, **settings)
    llm, got = run(model, prompts, caching=True, **settings)
    assert got == expected
    assert llm.stats()["num_preemptions"] > 0
    assert llm.stats()["prefix_cache_hit_tokens"] > 0
    assert_no_leak(llm)


def test_hash_collisions_never_share_wrong_blocks(tiny_models, monkeypatch):
    """With every block hashing alike, matching must fall back on comparing token ids."""
    model = tiny_models["llama"]
    prompts = random_prompts(8, 40, 90, vocab=512, seed=41)
    _, expected = run(model, prompts, caching=False)
    monkeypatch.setattr(BlockManager, "hash_block", staticmethod(lambda parent, tokens: 7))
    llm, got = run(model, prompts + prompts[:2], caching=True)
    assert got == expected + expected[:2]
    assert_no_leak(llm)


def test_default_model_shared_system_prompt(default_model):
    system = "You are a helpful assistant who answers questions about astronomy briefly and precisely. " * 4
    prompts = [system + q for q in ("What is a comet?", "Why is Mars red?", "How far is the Moon?")]
    results = {}
    for caching in (False, True):
        llm = LLM(default_model, num_kv_blocks=128, enable_prefix_caching=caching)
        results[caching] = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        results[caching] += [o.token_ids for o in llm.generate(prompts, GREEDY)]
        if caching:
            assert llm.stats()["prefix_cache_hit_tokens"] > 0
            assert_no_leak(llm)
    assert results[True] == results[False]
