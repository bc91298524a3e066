"""The prefix cache's host tier (kv_offload_memory, kv_offload.py): blocks the pool hands out kept in host
memory and copied back for a prefix that finds them, greedy and logits as without it, every block and slot
back."""

import mmap
import random

import numpy as np
import pytest
import torch

from conftest import hybrid_tables, random_pool_history, random_prompts
from inflight import LLM, SamplingParams, faults
from inflight.block_manager import BlockManager
from inflight.hybrid_blocks import HybridBlockManager
from inflight.config import EngineConfig
from inflight import kv_offload
from inflight.kv_offload import FROM_HOST, TO_HOST
from inflight.sequence import Sequence

BLOCK = 16
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


# -- the block manager's bookkeeping, against a model of what each block and slot holds -------------------
@pytest.mark.parametrize("seed, weak_hashes", [(0, False), (25, False), (50, False), (75, True), (100, True)])
def test_random_histories_find_every_prefix_block_holding_its_tokens(seed, weak_hashes, monkeypatch):
    """Random histories (block sizes 2-8, pools of 4-40 blocks, host tiers of 1-60 slots, two adapters):
    sequences sharing prefixes arriving, found in the pool and the host tier, computed in random chunks,
    forked and copied on write, preempted, finished. A model of each block's and slot's contents (the
    adapter and the tokens whose KV it holds), moved by the pending copies in their order, checks every
    block a sequence's table names after every match and step; every block back at the end, and prefixes
    found in the host tier in every case. 25 histories a case, 400 events each. `weak_hashes`: three
    hashes in all, so that blocks of the same tokens after other prefixes collide (told apart by their
    parents' registrations) as do others."""
    if weak_hashes:
        monkeypatch.setattr(BlockManager, "hash_block", staticmethod(lambda parent, tokens: hash((parent, tokens)) % 3))
    loaded = 0
    for history in range(seed, seed + 25):
        loaded += run_random_history(history)
    assert loaded > 0


def run_random_history(seed: int) -> int:
    rng = random.Random(seed)
    pool = BlockManager(rng.randint(4, 40), rng.choice([2, 4, 8]), True, host_slots=rng.randint(1, 60))
    random_pool_history(pool, rng, lambda seq: [(seq.lora_id, seq.block_table, 0)], label=seed, adapters=(0, 0, 1),
                        vocab=4, longest_prefix=40)
    assert pool.host.num_used_slots <= pool.host.num_slots
    return pool.host.loaded


@pytest.mark.parametrize("seed", [200, 225])
def test_random_histories_of_hybrid_tables_with_a_host_tier(seed):
    """The same histories over a hybrid model's tables (hybrid_blocks.py: windows 2-40, one to three windowed
    groups, pools of 8-80): the full layers' blocks and each windowed group's go to the host tier and back
    under their keys, a prefix found as far as the full layers' blocks reach and the windows' blocks within
    the window of its end, in the pool or the host tier; blocks brought back in every case."""
    loaded = 0
    for history in range(seed, seed + 25):
        rng = random.Random(history)
        bs, window, groups = rng.choice([2, 4, 8]), rng.randint(2, 40), rng.randint(1, 3)
        pool = HybridBlockManager(rng.randint(4 * (groups + 1), 80), bs, True, window, groups,
                                  host_slots=rng.randint(1, 60))
        random_pool_history(pool, rng, hybrid_tables, label=history, adapters=(0, 0, 1), vocab=4, longest_prefix=40)
        loaded += pool.host.loaded
    assert loaded > 0


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 3 * 4096 + 7, 1 << 22])
def test_pinned_host_memory_begins_on_a_page(nbytes):
    """What a GPU's host tier pins: exactly the bytes asked for, from a page's start (the driver pins pages)."""
    buffer = kv_offload.page_aligned(nbytes)
    assert buffer.nbytes == nbytes and buffer.data_ptr() % mmap.PAGESIZE == 0
    buffer.fill_(7)  # (all of it writable)
    assert int(buffer.sum()) == 7 * nbytes


def test_a_prefix_runs_on_from_the_pool_into_the_host_tier():
    """A prompt's first blocks still cached in the pool and the rest in the host tier: found whole, the
    host's copied back into free blocks, one copy each, and cached in the pool again (found there next)."""
    pool = BlockManager(6, 4, True, host_slots=8)
    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)

    def compute(tokens) -> Sequence:
        seq = Sequence(str(tokens), tokens, params, detokenizer=None)
        pool.match_prefix(seq)
        pool.allocate(seq, seq.num_uncomputed_tokens)
        seq.num_computed_tokens = seq.num_tokens
        pool.cache_full_blocks(seq)
        pool.free(seq)
        return seq

    prompt = list(range(17))  # 4 full blocks and a token
    compute(prompt)
    pool.take_pending_copies()
    compute([100 + t for t in range(13)])  # 4 blocks: 2 never cached, then the prompt's tail (freed first)
    stored = pool.take_pending_copies()
    assert [c.kind for c in stored] == [TO_HOST] * 2 and pool.host.num_used_slots == 2
    again = Sequence("again", prompt, params, detokenizer=None)
    assert pool.match_prefix(again) == 16
    loads = pool.take_pending_copies()
    assert sorted(c.kind for c in loads).count(FROM_HOST) == 2 and pool.host.loaded == 2
    assert {c.destination for c in loads if c.kind == FROM_HOST} == set(again.block_table[2:4])
    pool.free(again)
    assert pool.match_prefix(Sequence("third", prompt, params, detokenizer=None)) == 16
    assert not any(c.kind == FROM_HOST for c in pool.take_pending_copies())


def test_a_hybrid_prefix_comes_back_with_its_windowed_blocks():
    """A hybrid model's prompt whose blocks all went to the host tier (full layers' and windowed group's) is
    found whole again: its full blocks and its windowed blocks within the window of its end copied back."""
    pool = HybridBlockManager(12, 4, True, sliding_window=8, window_groups=1, host_slots=32)
    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)

    def compute(tokens) -> Sequence:
        seq = Sequence(str(tokens), tokens, params, detokenizer=None)
        pool.match_prefix(seq)
        assert pool.allocate(seq, seq.num_uncomputed_tokens)
        seq.num_computed_tokens = seq.num_tokens
        pool.cache_full_blocks(seq)
        pool.free(seq)
        return seq

    prompt = list(range(21))  # 5 full blocks and a token: the window of 8 reaches back into block 3
    compute(prompt)
    compute([100 + t for t in range(23)])  # 6 blocks in each group: every cached block of the prompt handed out
    pool.take_pending_copies()
    again = Sequence("again", prompt, params, detokenizer=None)
    assert pool.match_prefix(again) == 20
    loads = [c for c in pool.take_pending_copies() if c.kind == FROM_HOST]
    assert len(loads) == 5 + 2  # (the full layers' 5, the windowed group's blocks 3 and 4)
    assert again.windows[0].num_released_blocks == 3
    pool.free(again)
    pool.check_all_free()


# -- the engine ------------------------------------------------------------------------------------------
def waves(seed: int) -> list[list[int]]:
    """Three prefixes of 70-90 tokens, each with three tails, sent prefix after prefix and then again: a
    pool of 14 blocks holds about one prefix's requests, so the second round finds the first's blocks in
    the host tier only."""
    rng = random.Random(seed)
    prefixes = random_prompts(3, 70, 90, vocab=512, seed=seed)
    rounds = [[prefix + [rng.randrange(512) for _ in range(rng.randint(1, 20))] for _ in range(3)]
              for prefix in prefixes]
    return [prompt for wave in rounds + rounds for prompt in wave]


@pytest.mark.parametrize("family, async_scheduling, draft_model", [
    ("llama", False, False), ("llama", True, False), ("mistral", False, False), ("llama", False, True),
    ("gemma3_text", False, False), ("gemma2", True, False)])
def test_greedy_outputs_equal_the_engine_without_a_host_tier(tiny_models, more_tiny_models, family, async_scheduling,
                                                             draft_model, monkeypatch):
    """Chunked prefill, preemption (14 blocks for 3 requests of ~110 tokens) and a host tier smaller than
    what the pool hands out (30 blocks: the oldest forgotten): outputs equal those without prefix caching
    (Mistral: every layer within a sliding window, blocks behind it given back; Gemma 2 and 3: windowed
    layers beside full ones, their blocks in tables of their own, twice the pool), blocks found in the host
    tier and copied back, every block free at the end. `draft_model`: speculative decoding with a draft
    model (the model itself), whose pool makes the copies on the device alone (it computes cached blocks
    again). The copies are staged three blocks at a time, so that a copy of more goes in parts."""
    monkeypatch.setattr(kv_offload, "STAGED_BLOCKS", 3)
    model = tiny_models[family] if family in tiny_models else more_tiny_models(family)
    prompts = waves(seed=7)
    hybrid = family.startswith("gemma")
    settings = dict(block_size=BLOCK, num_kv_blocks=28 if hybrid else 14, max_num_seqs=3, max_num_batched_tokens=48,
                    async_scheduling=async_scheduling)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLM(model, enable_prefix_caching=False, **settings)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    speculative = {"model": model, "num_speculative_tokens": 3} if draft_model else None
    llm = LLM(model, kv_offload_memory=30 * plain.runner.bytes_per_block, speculative_config=speculative, **settings)
    assert llm.block_manager.host.num_slots == 30 and bool(llm.runner.window_groups) == hybrid
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    stats = llm.stats()
    assert stats["kv_offload_loaded_blocks_total"] > 0 and stats["kv_offload_stored_blocks_total"] > 30
    assert 0 < stats["kv_offload_blocks_used"] <= stats["kv_offload_blocks_total"] == 30
    assert stats["num_preemptions"] > 0 or family != "llama"  # (the others' windowed layers hold a window)
    assert not draft_model or stats["spec_decode_accepted_tokens_total"] > 0
    llm.block_manager.check_all_free()


def test_a_prefix_brought_back_from_the_host_gives_the_same_logits_bit_for_bit(tiny_models):
    """Sent again after other prompts took every block of the pool, a request finds its prompt in the host
    tier: its raw logits under a repetition penalty (which reads the prompt's token ids the host tier kept
    beside its KV: token_history.py) equal the first time's bit for bit, as its seeded draws do."""
    llm = LLM(tiny_models["llama"], block_size=BLOCK, num_kv_blocks=12, kv_offload_memory=1 << 24)
    prompt = random_prompts(1, 3 * BLOCK + 5, 3 * BLOCK + 5, vocab=512, seed=11)[0]
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=5, ignore_eos=True, repetition_penalty=1.5,
                            return_generation_logits=True)
    first = llm.generate([prompt], params)[0]
    llm.generate(random_prompts(2, 5 * BLOCK, 5 * BLOCK, vocab=512, seed=12), GREEDY)  # (one after the other)
    assert llm.stats()["kv_offload_stored_blocks_total"] >= 3
    again = llm.generate([prompt], params)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 3 * BLOCK
    assert llm.stats()["kv_offload_loaded_blocks_total"] == 3
    assert np.array_equal(first.outputs[0].generation_logits, again.outputs[0].generation_logits)
    assert again.token_ids == first.token_ids
    llm.block_manager.check_all_free()


def test_a_failed_step_leaves_no_block_its_copies_were_to_fill(tiny_models):
    """A step that fails before its copies are made (here the forward, injected) would leave the pool caching
    the blocks it was to bring back from the host tier, and the host tier the blocks it was to store, holding
    whatever they held before: those are forgotten, so the prompt sent again after the failure is computed
    again, its output as the first time's."""
    llm = LLM(tiny_models["llama"], block_size=BLOCK, num_kv_blocks=12, kv_offload_memory=1 << 24)
    prompt = random_prompts(1, 4 * BLOCK + 5, 4 * BLOCK + 5, vocab=512, seed=21)[0]
    first = llm.generate([prompt], GREEDY)[0]
    others = random_prompts(2, 5 * BLOCK, 5 * BLOCK, vocab=512, seed=22)
    before = [o.token_ids for o in llm.generate(others, GREEDY)]  # (the prompt's blocks to the host)
    stored = llm.stats()["kv_offload_stored_blocks_total"]
    faults.inject(llm, f"forward@{llm.num_steps + 1}")
    failed = llm.generate([prompt], GREEDY)[0]
    assert failed.outputs[0].finish_reason == "error"
    stats = llm.stats()  # (the failed step's loads displaced the others' blocks: to the host, never copied)
    assert stats["kv_offload_loaded_blocks_total"] == 4 and stats["kv_offload_stored_blocks_total"] > stored
    assert llm.generate([prompt], GREEDY)[0].token_ids == first.token_ids
    assert [o.token_ids for o in llm.generate(others[::-1], GREEDY)] == before[::-1]
    llm.block_manager.check_all_free()


def test_settings_refused_with_a_reason(tiny_models):
    model = tiny_models["llama"]
    for value in (-1, True, 1.5, "1G"):
        with pytest.raises(ValueError, match="kv_offload_memory must be a number of bytes"):
            EngineConfig(model=model, kv_offload_memory=value)
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        EngineConfig(model=model, kv_offload_memory=1 << 20, enable_prefix_caching=False)
    assert EngineConfig(model=model, kv_offload_memory=0).kv_offload_memory == 0  # (none)
    with pytest.raises(ValueError, match="holds no KV block of"):
        LLM(model, num_kv_blocks=8, kv_offload_memory=100)
    llm = LLM(model, num_kv_blocks=16, kv_offload_memory=1 << 20)
    assert llm.block_manager.host.num_slots == (1 << 20) // llm.runner.bytes_per_block


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_beside_cuda_graphs_and_async_scheduling(tiny_models):
    """On a GPU the host tier is pinned memory, its copies asynchronous on the step's stream (nothing waits
    for the device): with CUDA graphs and async scheduling (steps launched before the one before is read),
    greedy output equals the engine's without prefix caching, and blocks are brought back."""
    model = tiny_models["llama"]
    prompts = waves(seed=5)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    settings = dict(device="cuda", dtype="bfloat16", block_size=BLOCK, num_kv_blocks=14, max_num_seqs=3,
                    max_num_batched_tokens=48)
    expected = [o.token_ids for o in LLM(model, enable_prefix_caching=False, **settings).generate(prompts, params)]
    llm = LLM(model, kv_offload_memory=1 << 24, **settings)
    assert llm.config.async_scheduling and llm.runner.host_kv.kv.is_pinned()
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.stats()["kv_offload_loaded_blocks_total"] > 0 and llm.runner.graphs.replays > 0
    llm.block_manager.check_all_free()
