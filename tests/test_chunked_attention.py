"""Chunked attention beyond one chunk (Llama 4's: a token sees the keys of its own chunk up to itself): a
tiny Llama 4 with chunks of 16 tokens, three chunked layers and a full one, over contexts of up to 128 tokens,
its greedy output equal to HF's token for token; the scheduler keeps a sequence's tokens of a step within
one chunk (drafts included), and the chunked layers read each sequence from its chunk's start
(input_buffers.chunk_view)."""

import dataclasses

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import graphs_on_a_cpu, hf_greedy, make_tiny_model, random_prompts
from inflight import LLM, SamplingParams
from inflight.input_buffers import StepInputs, chunk_tables, chunk_view

CHUNK = 16
GREEDY = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llama4(tmp_path_factory) -> str:
    return str(make_tiny_model("llama4_text", tmp_path_factory.mktemp("llama4"), attention_chunk_size=CHUNK,
                               num_hidden_layers=4))


@pytest.fixture(scope="module")
def reference(tiny_llama4):
    return AutoModelForCausalLM.from_pretrained(tiny_llama4, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def tiny_llama4_scaled(tmp_path_factory) -> str:
    """Its layer without rotary embedding (the fourth) scales queries from position 3 on, by up to 2.6 at 100."""
    return str(make_tiny_model("llama4_text", tmp_path_factory.mktemp("llama4-scaled"), attention_chunk_size=CHUNK,
                               num_hidden_layers=4, floor_scale=4, attn_scale=0.5))


def within_chunks(llm: LLM) -> list[tuple[int, int, list[int]]]:
    """Record every step's (first position, tokens, blocks each group of chunked layers holds) of each
    sequence, and check its tokens lie within one chunk and those groups still hold that chunk's blocks."""
    schedule, steps = llm.scheduler.schedule, []

    def checked():
        batch = schedule()
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            assert start // CHUNK == (start + n - 1) // CHUNK, (start, n)
            assert all(g.num_released_blocks <= start // CHUNK * CHUNK // llm.block_manager.block_size
                       for g in seq.windows), "a block of the chunk given back"
            steps.append((start, n, [len(g.block_table) - g.num_released_blocks for g in seq.windows]))
        return batch

    llm.scheduler.schedule = checked
    return steps


@pytest.mark.parametrize("settings", [
    {},  # the CPU's defaults: chunks of up to 512 tokens, cut at the attention chunks' ends
    dict(max_num_batched_tokens=12, max_num_seqs=4, num_kv_blocks=28, block_size=8),  # chunks of 12, preempted
    dict(max_num_batched_tokens=12, max_num_seqs=4, async_scheduling=True),  # the next step scheduled early
], ids=["whole-prompts", "chunked-preempted", "async"])
def test_contexts_beyond_a_chunk_equal_hf(tiny_llama4, reference, settings):
    """Prompts of 5 to 70 tokens and 30 more, each across several chunks: HF's output; the same prompts
    again, found in the prefix cache, the same; prompt chunks cut at the chunks' ends."""
    prompts = random_prompts(6, 5, 70, 512, seed=3)
    expected = [hf_greedy(reference, p, 30) for p in prompts]
    llm = LLM(tiny_llama4, max_model_len=128, **settings)
    steps = within_chunks(llm)
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert llm.stats()["prefix_cache_hit_tokens"] > 0
    assert any(n > 1 and (start + n) % CHUNK == 0 for start, n, _ in steps)  # (a prompt chunk cut at a chunk's end)
    if "num_kv_blocks" in settings:
        assert llm.stats()["num_preemptions"] > 0
    llm.block_manager.check_all_free()


def test_drafts_stay_within_a_chunk(tiny_llama4, reference):
    """Under n-gram speculative decoding, a decode's drafts end with its chunk: every output HF's."""
    prompts = [[7, 8, 9, 10, 11] * 5, [20, 21, 22] * 9, list(range(30, 42)) * 3]
    expected = [hf_greedy(reference, p, 40) for p in prompts]
    llm = LLM(tiny_llama4, max_model_len=128, speculative_config={
        "method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    steps = within_chunks(llm)
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.stats()["spec_decode_draft_tokens_total"] > 0
    assert any(n > 1 and (start + n) % CHUNK == 0 for start, n, _ in steps)  # (drafts cut at a chunk's end)
    llm.block_manager.check_all_free()


def test_queries_scaled_by_position_equal_hf(tiny_llama4_scaled):
    """Llama 4's layers without rotary embedding scale their queries by log1p(floor((position + 1) /
    floor_scale)) * attn_scale + 1, which transformers computes from the step's row indices when no cache
    is passed: the engine scales them in attention by the tokens' positions (model_support.py). Prompts
    chunked and preempted: each token HF's greedy choice after the same tokens, the logits HF's forward
    over the whole sequence gives (floor_scale 4 here, 8,192 in Llama 4's checkpoints: their contexts past
    8K)."""
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama4_scaled, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    prompts = random_prompts(5, 5, 70, 512, seed=4)
    llm = LLM(tiny_llama4_scaled, max_model_len=128, max_num_batched_tokens=12, max_num_seqs=4, num_kv_blocks=28,
              block_size=8)
    outs = llm.generate(prompts, dataclasses.replace(GREEDY, return_generation_logits=True))
    assert llm.stats()["num_preemptions"] > 0
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1:]
        assert out.token_ids == logits.argmax(-1).tolist()
        np.testing.assert_allclose(out.outputs[0].generation_logits, logits.numpy(), atol=1e-4, rtol=1e-4)
    assert llm.runner.query_scaling[1][:3].tolist() == pytest.approx([1, 1 + 0.5 * np.log(2), 1 + 0.5 * np.log(3)])
    llm.block_manager.check_all_free()


def test_chunked_layers_keep_their_chunk_alone(tiny_llama4, reference):
    """Under the hybrid KV cache (the default), the chunked layers keep a sequence's blocks in tables of their
    own (three groups, hybrid_blocks.py) and give back those a chunk behind a step's first token: a sequence of
    up to 100 tokens holds up to 13 blocks of 8 for the full layer, at most 5 in each chunked group (a chunk
    behind and the step's own; never one of its own chunk: within_chunks); outputs HF's. Without it, one
    table for every layer, the same outputs."""
    prompts = random_prompts(4, 40, 70, 512, seed=6)
    expected = [hf_greedy(reference, p, 30) for p in prompts]
    for hybrid in (True, False):
        llm = LLM(tiny_llama4, max_model_len=128, block_size=8, num_kv_blocks=64, hybrid_kv_cache=hybrid)
        steps = within_chunks(llm)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
        if hybrid:
            assert llm.runner.window_groups == 3 and llm.runner.layer_groups == [1, 2, 3, 0]
            assert 3 <= max(max(held) for _, _, held in steps) <= 2 * CHUNK // 8 + 1
            assert max(start + n for start, n, _ in steps) > 90
        else:
            assert llm.runner.window_groups == 0 and all(held == [] for _, _, held in steps)
        llm.block_manager.check_all_free()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_steps_through_the_graphs_a_gpu_replays(tiny_llama4, reference, async_scheduling):
    """Every step a CUDA graph covers run through its padded layout and persistent buffers (graphs_on_a_cpu:
    decode steps, steps verifying n-gram drafts, steps with prompt chunks), the chunk view's lengths and
    first blocks among them: HF's outputs. (A graph fixes the chunk tables' width: a chunk and a verify
    step's padding.)"""
    prompts = [[7, 8, 9, 10, 11] * 5, [20, 21, 22] * 9] + random_prompts(3, 5, 70, 512, seed=5)
    expected = [hf_greedy(reference, p, 40) for p in prompts]
    llm = LLM(tiny_llama4, max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4, block_size=8,
              async_scheduling=async_scheduling, speculative_config={
                  "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    graphs = graphs_on_a_cpu(llm)
    assert llm.runner.buffers.chunk_width == 3  # (blocks of 8: a chunk's 16 tokens and a verify step's 3 of padding)
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert graphs.verify_replays > 0 and graphs.ragged_replays > 0
    assert graphs.replays > graphs.verify_replays + graphs.ragged_replays  # (decode steps too)
    llm.block_manager.check_all_free()


def test_the_chunk_view_of_a_step():
    """Sequences at 3, 20 and 40 computed tokens (chunks of 16, blocks of 4): the chunked layers see lengths
    from their chunk's start and block tables from that chunk's first block, which the device takes from
    the step's tables (and a group's), the columns past a row's end repeating its last."""
    tables = np.arange(1, 13)[None, :] + 100 * np.arange(3)[:, None]  # [3, 12]: row r holds 100r + 1 ...
    starts, counts = np.array([3, 20, 40]), np.array([2, 1, 5])
    inputs = StepInputs(np.zeros(8, np.int64), np.zeros(8, np.int64), np.zeros(8, np.int64),
                        np.concatenate([[0], np.cumsum(counts)]), starts + counts, tables, np.zeros(3, np.int64))
    chunk_view(inputs, starts, 4, CHUNK)
    assert inputs.chunk_seq_lens.tolist() == [5, 5, 13] and inputs.chunk_first_blocks.tolist() == [0, 4, 8]
    first = torch.as_tensor(inputs.chunk_first_blocks)
    assert chunk_tables(torch.as_tensor(tables), first, 4).tolist() == [[1, 2, 3, 4], [105, 106, 107, 108],
                                                                        [209, 210, 211, 212]]
    assert chunk_tables(torch.as_tensor(tables + 1000), first, 5)[2].tolist() == [1209, 1210, 1211, 1212, 1212]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_contexts_beyond_a_chunk_on_a_gpu(tiny_llama4, reference):
    """On a GPU (float32, the Triton kernels, CUDA graphs that take the chunk tables from the step's): HF's
    outputs."""
    prompts = random_prompts(4, 5, 70, 512, seed=4)
    llm = LLM(tiny_llama4, device="cuda", dtype="float32", max_model_len=128, num_kv_blocks=64)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == [
        hf_greedy(reference, p, 30) for p in prompts]
    assert llm.runner.graphs.replays > llm.runner.graphs.ragged_replays > 0
    llm.block_manager.check_all_free()
