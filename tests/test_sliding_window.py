"""Models whose layers all attend within one sliding window (Mistral 7B v0.1, Phi-3 mini, StarCoder2) keep
only the window's KV blocks of a sequence: the blocks behind it go back to the pool (block_manager.py), so
sequences longer than the whole pool run, token for token as HF's."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import hf_greedy, hybrid_tables, make_tiny_model, random_pool_history, random_prompts
from inflight import LLM, SamplingParams
from inflight.block_manager import BlockManager
from inflight.hybrid_blocks import HybridBlockManager
from inflight.sequence import Sequence

WINDOW = 48  # the tiny Mistral's (conftest.TINY_FAMILIES)
BLOCK = 8
# The fewest blocks that hold a sequence's window and the block its next token may start.
FEWEST_BLOCKS = -(-(WINDOW - 1) // BLOCK) + 2
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def window_checked(llm: LLM) -> LLM:
    """`llm`, each of whose steps asserts, as scheduled, that every sequence in it holds the blocks of every
    key its new tokens see (none given back too early, which the outputs show only once a block is reused)."""
    schedule = llm.scheduler.schedule

    def checked():
        batch = schedule()
        for seq in batch.seqs:
            first = max(0, seq.num_computed_tokens - WINDOW + 1) // BLOCK
            assert seq.num_released_blocks <= first, f"a block in the window of position {seq.num_computed_tokens}"
            assert all(llm.block_manager.blocks[b].ref_count > 0 for b in seq.block_table[first:])
        return batch

    llm.scheduler.schedule = checked
    return llm


@pytest.mark.parametrize("caching", [False, True], ids=["no-caching", "prefix-caching"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["steps", "async"])
@pytest.mark.parametrize("budget", [40, 512])
def test_sequences_longer_than_the_pool_equal_hf(tiny_models, hf_reference, budget, async_scheduling, caching):
    """A pool of the fewest blocks that hold one window (64 tokens) runs prompts of up to 400 tokens and
    their outputs, in chunks shorter and longer than the window, several sequences at once (with chunks of
    40, preempting each other) and, under prefix caching, the same prompts again from what the cache still
    holds."""
    model = tiny_models["mistral"]
    llm = window_checked(LLM(model, device="cpu", dtype="float32", block_size=BLOCK, num_kv_blocks=FEWEST_BLOCKS,
                             max_num_seqs=4, max_num_batched_tokens=budget, enable_prefix_caching=caching,
                             async_scheduling=async_scheduling))
    assert llm.block_manager.sliding_window == WINDOW
    assert llm.max_model_len == 1024, "the model's own limit, not the pool's 64 tokens"
    prompts = random_prompts(6, 1, 400, vocab=512, seed=19)
    if caching:
        prompts += prompts[:3]
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY)):
        assert out.token_ids == hf_reference(model, prompt, GREEDY.max_tokens), f"prompt of {len(prompt)} tokens"
    assert budget > 40 or llm.stats()["num_preemptions"] > 0
    llm.block_manager.check_all_free()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["steps", "async"])
def test_penalties_count_the_tokens_behind_the_window(tiny_models, async_scheduling):
    """Penalties count every token of a sequence, those whose blocks went back to the pool too (the
    device's record of them went with the blocks: their rows are laid out on the host): HF's outputs
    under the same penalties, prompts of up to 300 tokens in a pool of one window."""
    model = tiny_models["mistral"]
    llm = window_checked(LLM(model, device="cpu", dtype="float32", block_size=BLOCK, num_kv_blocks=FEWEST_BLOCKS,
                             max_num_seqs=4, max_num_batched_tokens=40, async_scheduling=async_scheduling))
    prompts = random_prompts(4, 100, 300, vocab=512, seed=37)
    penalties = [dict(repetition_penalty=0.3), dict(repetition_penalty=0.5, frequency_penalty=-1.0),
                 dict(presence_penalty=-2.0), dict(repetition_penalty=0.3)]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, **p) for p in penalties]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    for prompt, p, out in zip(prompts, penalties, llm.generate(prompts, params)):
        assert out.token_ids == hf_greedy(hf, prompt, 24, **p), f"prompt of {len(prompt)} tokens, {p}"
    llm.block_manager.check_all_free()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["steps", "async"])
def test_speculative_decoding_takes_back_drafts_within_the_window(tiny_models, hf_reference, async_scheduling):
    """n-gram drafts computed and then rejected take back the sequence's computed tokens: blocks are given
    back only after the drafts are judged, never by a count that then goes back."""
    model = tiny_models["mistral"]
    llm = window_checked(LLM(model, device="cpu", dtype="float32", block_size=BLOCK, num_kv_blocks=FEWEST_BLOCKS + 2,
                             max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=False,
                             async_scheduling=async_scheduling, speculative_config={"num_speculative_tokens": 4}))
    pieces = random_prompts(4, 5, 9, vocab=512, seed=31)
    prompts = [piece * (150 // len(piece)) for piece in pieces]  # repeated: the n-gram proposer drafts
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY)):
        assert out.token_ids == hf_reference(model, prompt, GREEDY.max_tokens), f"prompt of {len(prompt)} tokens"
    assert llm.num_draft_tokens > llm.num_accepted_draft_tokens > 0, "drafts were meant to be kept and rejected"
    llm.block_manager.check_all_free()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_sequences_longer_than_the_pool_on_a_gpu(tiny_models, hf_reference):
    """The same on the GPU's path: the Triton kernels (whose first tile may start before the window, on a
    block given back: masked), decode steps replaying CUDA graphs, async scheduling."""
    model = tiny_models["mistral"]
    llm = window_checked(LLM(model, device="cuda", dtype="float32", block_size=BLOCK, num_kv_blocks=FEWEST_BLOCKS,
                             max_num_seqs=4, max_num_batched_tokens=64))
    prompts = random_prompts(6, 1, 400, vocab=512, seed=19)
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY)):
        assert out.token_ids == hf_reference(model, prompt, GREEDY.max_tokens), f"prompt of {len(prompt)} tokens"
    assert llm.runner.graphs.replays > 0 and llm.num_pipelined_steps > 0
    llm.block_manager.check_all_free()


def test_cached_blocks_behind_the_window_serve_the_same_prompt_again(tiny_models, hf_reference):
    """Blocks given back behind the window keep their contents in the prefix cache: the same long prompt
    later reuses them, under async scheduling too (where a step's blocks are offered to the cache after
    the next step is scheduled: one given back before that could be another sequence's by then)."""
    model = tiny_models["mistral"]
    llm = LLM(model, device="cpu", dtype="float32", block_size=BLOCK, num_kv_blocks=128, max_num_seqs=4,
              max_num_batched_tokens=128, enable_prefix_caching=True, async_scheduling=True)
    prompt, other = random_prompts(2, 300, 300, vocab=512, seed=23)
    expected = hf_reference(model, prompt, GREEDY.max_tokens)
    assert [out.token_ids for out in llm.generate([prompt, other], GREEDY)][0] == expected
    before = llm.stats()["prefix_cache_hit_tokens"]
    assert llm.generate([prompt], GREEDY)[0].token_ids == expected
    assert llm.stats()["prefix_cache_hit_tokens"] - before >= 256, "the prompt's blocks were meant to be reused"
    llm.block_manager.check_all_free()


def test_a_finished_prompt_keeps_its_first_blocks_longest(tiny_models, hf_reference):
    """A finished sequence's blocks leave the prefix cache tail first, those given back behind the window
    included (they went to the cache first): other prompts' demand for blocks then evicts the end of a
    long prompt, and the prompt again still finds its beginning."""
    model = tiny_models["mistral"]
    llm = LLM(model, device="cpu", dtype="float32", block_size=BLOCK, num_kv_blocks=64, max_num_seqs=4,
              max_num_batched_tokens=64, enable_prefix_caching=True)
    prompt, other = random_prompts(2, 300, 300, vocab=512, seed=37)
    once = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([prompt], once)  # 38 blocks cached, 26 never used
    llm.generate([other], once)  # 38 more: the 26 unused ones, then 12 of the cache's
    before = llm.stats()["prefix_cache_hit_tokens"]
    assert llm.generate([prompt], GREEDY)[0].token_ids == hf_reference(model, prompt, GREEDY.max_tokens)
    assert llm.stats()["prefix_cache_hit_tokens"] - before == (38 - 12) * BLOCK
    llm.block_manager.check_all_free()


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_n_completions_and_beams_share_blocks_behind_the_window(tiny_models, more_tiny_models, family):
    """Completions forked from one prompt share its blocks, those given back behind the window
    included (Gemma 2: its windowed layer's, in tables of their own): each returns only what it holds, and
    the pool ends whole."""
    model = tiny_models[family] if family in tiny_models else more_tiny_models(family)
    llm = LLM(model, device="cpu", dtype="float32", block_size=BLOCK, num_kv_blocks=32 if family == "mistral" else 64,
              max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=True)
    prompt = random_prompts(1, 200, 200, vocab=512, seed=29)[0]
    alone = llm.generate([prompt], GREEDY)[0].token_ids
    out = llm.generate([prompt], SamplingParams(n=3, max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    assert [c.token_ids for c in out.outputs] == [alone] * 3
    beams = llm.generate([prompt], SamplingParams(beam_width=2, n=2, max_tokens=24, ignore_eos=True))[0]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=2,
                               num_return_sequences=2, max_new_tokens=24, eos_token_id=None, pad_token_id=0)
    assert [c.token_ids for c in beams.outputs] == expected[:, len(prompt):].tolist()
    llm.block_manager.check_all_free()


def test_models_with_full_attention_layers_keep_every_block(more_tiny_models, tiny_models):
    """Gemma 2 and 3 alternate windowed and full layers: the full ones read every key, so their blocks bound
    a sequence (the pool less what the windowed layers hold of one: below); Llama has no window."""
    for model in (more_tiny_models("gemma2"), more_tiny_models("gemma3_text"), tiny_models["llama"]):
        hybrid = model != tiny_models["llama"]
        llm = LLM(model, device="cpu", dtype="float32", block_size=BLOCK, num_kv_blocks=FEWEST_BLOCKS * (1 + hybrid))
        assert (llm.block_manager.full if hybrid else llm.block_manager).sliding_window is None
        assert llm.max_model_len == FEWEST_BLOCKS * BLOCK
    with pytest.raises(ValueError, match="exceeds the KV pool's 64 tokens"):
        LLM(tiny_models["llama"], device="cpu", block_size=BLOCK, num_kv_blocks=FEWEST_BLOCKS, max_model_len=65)
    # one block fewer than a window needs: the pool bounds a sequence again
    llm = LLM(tiny_models["mistral"], device="cpu", block_size=BLOCK, num_kv_blocks=FEWEST_BLOCKS - 1)
    assert llm.max_model_len == (FEWEST_BLOCKS - 1) * BLOCK


def test_blocks_go_back_once_every_token_is_behind_the_window():
    """The next token at position p sees keys p - 47 .. p: a block goes back once its last key is before
    p - 47, never earlier; preemption and a finish return the rest, each block once."""
    manager = BlockManager(num_blocks=20, block_size=BLOCK, enable_prefix_caching=False, sliding_window=WINDOW)
    seq = Sequence("a", list(range(3, 103)), GREEDY, detokenizer=None)
    assert manager.allocate(seq, 100)
    for computed, given_back in [(0, 0), (54, 0), (55, 1), (62, 1), (63, 2), (100, 6)]:
        seq.num_computed_tokens = computed
        manager.release_behind_window(seq)
        assert seq.num_released_blocks == given_back, f"{computed} tokens computed"
        assert manager.num_free_blocks == 20 - 13 + given_back
        first_seen = computed - WINDOW + 1
        assert all((i + 1) * BLOCK - 1 < first_seen for i in range(given_back))
    manager.free(seq)
    manager.check_all_free()
    assert seq.num_released_blocks == 0 and not seq.block_table


# -- models that alternate windowed and full layers: block tables for each kind (hybrid_blocks.py) ----------
HYBRID_FAMILIES = ["gemma2", "gemma3_text", "gpt_oss"]  # tiny ones: layer 0 windowed, layer 1 full


def hybrid_checked(llm: LLM) -> LLM:
    """`llm`, each of whose steps asserts, as scheduled, that every sequence in it holds the blocks of every
    key its new tokens see in its windowed layers' table, and every block of its full layers' table (which
    gives none back)."""
    schedule, pool, window = llm.scheduler.schedule, llm.block_manager, llm.runner.hybrid_window

    def checked():
        batch = schedule()
        for seq in batch.seqs:
            first = max(0, seq.num_computed_tokens - window + 1) // BLOCK
            assert seq.num_released_blocks == 0 and all(pool.blocks[b].ref_count > 0 for b in seq.block_table)
            for group in seq.windows:
                assert group.num_released_blocks <= first, f"a block in the window of {seq.num_computed_tokens}"
                assert all(pool.blocks[b].ref_count > 0 for b in group.block_table[first:])
                assert len(group.block_table) == len(seq.block_table)
        return batch

    llm.scheduler.schedule = checked
    return llm


@pytest.mark.parametrize("mode", ["steps", "async-prefix-caching"])
@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_hybrid_models_keep_the_window_alone_in_tables_of_its_own(more_tiny_models, hf_eager_reference, family,
                                                                  mode):
    """Gemma 2 and 3 and gpt-oss: a pool of 60 blocks, each a block of one layer of each kind, runs prompts of
    up to 300 tokens and their outputs (324 tokens: 41 blocks of the full layer, 7 or 8 of the windowed one
    at once), preempting each other, token for token as HF's eager attention; under prefix caching the same
    prompts again, from what the pool still holds."""
    model = more_tiny_models(family)
    caching = mode == "async-prefix-caching"
    llm = hybrid_checked(LLM(model, device="cpu", dtype="float32", block_size=BLOCK, num_kv_blocks=60,
                             max_num_seqs=4, max_num_batched_tokens=40, enable_prefix_caching=caching,
                             async_scheduling=caching))
    assert llm.runner.window_groups == 1 and llm.runner.layer_groups == [1, 0]
    assert llm.runner.kv_cache.shape[0] == 1, "a block holds one layer of each kind"
    prompts = random_prompts(6, 1, 300, vocab=512, seed=19)
    if caching:
        prompts += prompts[:3]
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY)):
        assert out.token_ids == hf_eager_reference(model, prompt, GREEDY.max_tokens), f"prompt of {len(prompt)}"
    stats = llm.stats()
    assert stats["num_preemptions"] > 0, "the pool was meant to be short"
    if caching:
        assert stats["prefix_cache_hit_tokens"] > 0
    llm.block_manager.check_all_free()


def gemma_3_pattern_of_seven_layers(folder) -> str:
    """A tiny Gemma 3 of 7 layers, 3 and 6 full, the others windowed."""
    sliding, full = "sliding_attention", "full_attention"
    types = [sliding, sliding, sliding, full, sliding, sliding, full]
    return str(make_tiny_model("gemma3_text", folder, num_hidden_layers=7, layer_types=types))


def test_gemma_3_layers_five_windowed_to_one_full_make_groups_of_tables(tmp_path, hf_eager_reference):
    """Gemma 3's kind of pattern over 7 layers (layers 3 and 6 full): groups of two layers, the full ones and
    three of the five windowed (the last one's second slot unused), each with its own tables over one pool of
    blocks of two layers; under preemption and prefix caching, token for token as HF's eager attention."""
    model = gemma_3_pattern_of_seven_layers(tmp_path / "gemma3")
    llm = hybrid_checked(LLM(model, device="cpu", dtype="float32", block_size=BLOCK, num_kv_blocks=90, max_num_seqs=4,
                             max_num_batched_tokens=40, async_scheduling=True))
    assert llm.runner.window_groups == 3 and llm.runner.layer_groups == [1, 1, 2, 0, 2, 3, 0]
    assert llm.runner.kv_cache.shape[0] == 2 and llm.max_model_len == (90 - 3 * 8) * BLOCK
    prompts = random_prompts(5, 1, 300, vocab=512, seed=53)
    prompts += prompts[:2]
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY)):
        assert out.token_ids == hf_eager_reference(model, prompt, GREEDY.max_tokens), f"prompt of {len(prompt)}"
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    llm.block_manager.check_all_free()


def test_a_step_plans_each_table_and_window_once(tmp_path, monkeypatch):
    """On a CPU, the attention plans a step's reads once for each block table and window its layers use: Gemma
    3's 7 layers of groups 1, 1, 2, 0, 2, 3, 0 make four plans a step (the layers switching tables made six)."""
    from inflight.ops import torch_ops

    model = gemma_3_pattern_of_seven_layers(tmp_path / "gemma3")
    llm = LLM(model, device="cpu", dtype="float32", block_size=BLOCK, num_kv_blocks=90, max_num_seqs=4)
    llm.add_request("a", random_prompts(1, 60, 60, vocab=512, seed=3)[0], GREEDY)
    made, make = [], torch_ops._make_plan
    monkeypatch.setattr(torch_ops, "_make_plan", lambda *args: made.append(args) or make(*args))
    for step in range(3):  # the prompt, then two decodes
        made.clear()
        llm.step()
        assert len(made) == 4, (step, len(made))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_hybrid_models_on_a_gpu(more_tiny_models, hf_eager_reference, family):
    """The same on the GPU's path: the Triton kernels over each group's tables, steps replaying CUDA graphs
    that read them from their own buffers, async scheduling; under preemption."""
    model = more_tiny_models(family)
    llm = hybrid_checked(LLM(model, device="cuda", dtype="float32", block_size=BLOCK, num_kv_blocks=60,
                             max_num_seqs=4, max_num_batched_tokens=40))
    prompts = random_prompts(6, 1, 300, vocab=512, seed=19)
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY)):
        assert out.token_ids == hf_eager_reference(model, prompt, GREEDY.max_tokens), f"prompt of {len(prompt)}"
    assert llm.stats()["num_preemptions"] > 0 and llm.num_pipelined_steps > 0
    assert llm.runner.graphs is None or llm.runner.graphs.replays > 0
    llm.block_manager.check_all_free()


def test_hybrid_tables_hold_more_of_each_sequence_in_the_same_memory(more_tiny_models, hf_eager_reference):
    """The tiny Gemma 2 (one windowed layer, one full) in the memory of 64 blocks of both layers: 127 blocks of
    one layer, of which a sequence of 324 tokens holds 41 for its full layer and 8 for its windowed one, so
    that more run at once; with hybrid_kv_cache false, 64 blocks of both layers as before."""
    model = more_tiny_models("gemma2")
    settings = dict(device="cpu", dtype="float32", block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=40,
                    enable_prefix_caching=False)
    both_layers = BLOCK * (2 * 2 * 2 * 256 * 4 + 8)  # keys and values of 2 layers, 2 heads of 256, and the token ids
    prompts = random_prompts(4, 300, 300, vocab=512, seed=41)
    runs = {}
    for hybrid in (True, False):
        llm = LLM(model, kv_cache_memory=64 * both_layers, hybrid_kv_cache=hybrid, **settings)
        peak, schedule = [0], llm.scheduler.schedule

        def counted():
            batch = schedule()
            peak[0] = max(peak[0], len(batch.seqs))
            return batch

        llm.scheduler.schedule = counted
        outs = [out.token_ids for out in llm.generate(prompts, GREEDY)]
        llm.block_manager.check_all_free()
        runs[hybrid] = (llm.runner.num_blocks, llm.max_model_len, peak[0], outs)
    assert runs[True][:2] == (127, (127 - 8) * BLOCK) and runs[False][:2] == (64, 64 * BLOCK)
    assert runs[True][2] > runs[False][2], "more sequences were meant to run at once"
    assert runs[True][3] == runs[False][3]
    assert runs[True][3][0] == hf_eager_reference(model, prompts[0], GREEDY.max_tokens)


def test_the_pool_bounds_a_sequence_less_its_windowed_blocks(more_tiny_models):
    """A sequence holds as many blocks of the tiny Gemma 2's windowed layer as of its full one up to 8 (a
    window of 48 in blocks of 8, and two), then 8: a pool of 40 holds 32 blocks of the full layer, one of 12
    six; a pool of one block holds no sequence, and says why."""
    model = more_tiny_models("gemma2")
    for blocks, longest in ((40, 32 * BLOCK), (12, 6 * BLOCK)):
        assert LLM(model, device="cpu", block_size=BLOCK, num_kv_blocks=blocks).max_model_len == longest
    with pytest.raises(ValueError, match="the KV pool's 1 blocks hold no sequence, which takes a block in each of the "
                                         "model's 2 groups of layers"):
        LLM(model, device="cpu", block_size=BLOCK, num_kv_blocks=1)


def run_computed(pool: HybridBlockManager, request_id: str, tokens: list[int]) -> Sequence:
    """A sequence of `tokens`, its prefix found in the cache, the rest given blocks and counted computed."""
    seq = Sequence(request_id, tokens, GREEDY, detokenizer=None)
    hit = pool.match_prefix(seq)
    assert pool.allocate(seq, len(tokens) - hit)
    seq.num_computed_tokens = len(tokens)
    pool.cache_full_blocks(seq)
    pool.release_behind_window(seq)
    return seq


def test_a_prefix_is_reused_while_the_windowed_tables_hold_its_end():
    """A prompt's blocks are found again while the pool holds its full layers' blocks and its windowed
    layers' blocks within the window of the prefix's end, those behind it long handed to another sequence."""
    pool = HybridBlockManager(num_blocks=38, block_size=BLOCK, enable_prefix_caching=True, sliding_window=WINDOW,
                              window_groups=1)
    prompt = list(range(3, 103))  # 12 full blocks and 4 tokens: the next token after 96 sees blocks 6 on
    first = run_computed(pool, "a", prompt)  # 13 blocks a table, 6 of the windowed ones given back
    assert first.windows[0].num_released_blocks == 6 and pool.num_free_blocks == 38 - 26 + 6
    other = run_computed(pool, "b", list(range(200, 272)))  # 9 + 9: the 12 unused blocks, then the 6 given back
    pool.free(first)
    again = Sequence("c", prompt, GREEDY, detokenizer=None)
    assert pool.match_prefix(again) == 96 and len(again.windows[0].block_table) == len(again.block_table) == 12
    assert again.windows[0].num_released_blocks == 6
    pool.free(again)
    pool.free(other)
    pool.check_all_free()


def test_the_windowed_tables_find_only_blocks_of_the_same_tokens():
    """A full layers' block handed to other tokens is registered again: the windowed blocks of its former
    tokens no longer answer for it (they are found by its registration too), and the new tokens find the
    windowed blocks they filled. (A pool of 14: the second prompt's full blocks are some of the first's,
    while one of the first's windowed blocks stays cached.)"""
    pool = HybridBlockManager(num_blocks=14, block_size=BLOCK, enable_prefix_caching=True, sliding_window=WINDOW,
                              window_groups=1)
    pool.free(run_computed(pool, "a", list(range(3, 52))))
    second = list(range(300, 325))
    seq = run_computed(pool, "b", second)
    filled = list(seq.windows[0].block_table)
    pool.free(seq)
    again = Sequence("c", second, GREEDY, detokenizer=None)
    assert pool.match_prefix(again) == 24 and list(again.windows[0].block_table) == filled[:3]
    pool.free(again)
    pool.check_all_free()


@pytest.mark.parametrize("seed", range(0, 100, 25))
def test_random_histories_leave_every_table_on_its_own_tokens(seed):
    """Random histories of the hybrid tables (block sizes 2-8, windows 2-40, one to three windowed groups,
    pools of 8-80): sequences sharing prefixes arriving, found in the cache, computed in random chunks,
    forked and copied on write, preempted, finished. A model of what each block holds (each group's KV of
    the tokens up to the block's end, as written) checks every block a sequence's tables name, past what a
    windowed group gave back, after every match and step; every block back at the end. 25 histories a
    case, 400 events each."""
    for history in range(seed, seed + 25):
        run_random_history(history)


def run_random_history(seed: int) -> None:
    rng = random.Random(seed)
    bs, window, groups = rng.choice([2, 4, 8]), rng.randint(2, 40), rng.randint(1, 3)
    pool = HybridBlockManager(rng.randint(4 * (groups + 1), 80), bs, True, window, groups)
    random_pool_history(pool, rng, hybrid_tables, label=seed)
