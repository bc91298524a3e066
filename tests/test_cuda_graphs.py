"""The GPU path's host side: step inputs built without per-token Python, persistent input buffers, the
padding a captured decode graph reads, the graphs' batch-size buckets; on a GPU, graphs against eager."""

import dataclasses

import numpy as np
import pytest
import torch

from conftest import graphs_on_a_cpu, random_prompts
from inflight import LLM, SamplingParams
from inflight.cuda_graphs import bucket_sizes
from inflight.input_buffers import BlockTableRows, InputBuffers, StepInputs
from inflight.sequence import BlockTable

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def test_bucket_sizes():
    assert bucket_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert bucket_sizes(5) == [1, 2, 4, 5]
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(40) == [1, 2, 4, 8, 16, 32, 40]


def reference_inputs(batch, block_size, logits_at) -> StepInputs:
    """The step's inputs token by token, the plain way."""
    ids, positions, slots, cu, lens = [], [], [], [0], []
    for seq, n in zip(batch.seqs, batch.num_tokens):
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            ids.append(seq.token_ids[p])
            positions.append(p)
            slots.append(seq.block_table[p // block_size] * block_size + p % block_size)
        cu.append(cu[-1] + n)
        lens.append(seq.num_computed_tokens + n)
    width = max(len(s.block_table) for s in batch.seqs)
    tables = [list(s.block_table) + [0] * (width - len(s.block_table)) for s in batch.seqs]
    return StepInputs(*(np.asarray(x, dtype=np.int64) for x in (ids, positions, slots, cu, lens, tables, logits_at)))


def test_step_inputs_equal_a_token_by_token_build(tiny_models):
    """Every step of a run with chunked prefill, decodes and preemption: the numpy build equals the
    plain one, field by field; and the decodes that lead a step (launched apart from its prefill chunks by
    the Triton attention) are counted."""
    llm = LLM(tiny_models["llama"], num_kv_blocks=24, max_num_seqs=6, max_num_batched_tokens=40,
              enable_prefix_caching=False)
    built = llm.runner.prepare
    checked, mixed = [], []

    def prepare(batch, logits_at, block_copies=None):
        inputs = built(batch, logits_at, block_copies)
        expected = reference_inputs(batch, llm.runner.block_size, logits_at)
        for name in ("input_ids", "positions", "slot_mapping", "cu_seqlens", "seq_lens", "block_tables", "logits_at"):
            np.testing.assert_array_equal(getattr(inputs, name), getattr(expected, name), err_msg=name)
        checked.append(inputs.is_decode)
        leading = next((i for i, n in enumerate(batch.num_tokens) if n != 1), len(batch.num_tokens))
        assert inputs.num_decodes == leading
        mixed.append(0 < leading < len(batch.num_tokens))
        return inputs

    llm.runner.prepare = prepare
    llm.generate(random_prompts(10, 1, 90, vocab=512, seed=5), GREEDY)
    assert True in checked and False in checked, "the run was meant to have decode and prefill steps"
    assert any(mixed), "the run was meant to have steps of decodes then prefill chunks"
    assert llm.stats()["num_preemptions"] > 0
    llm.block_manager.check_all_free()


def test_block_table_reads_and_writes_as_a_list():
    """A sequence's block table keeps its ids in an array (copied into a step's inputs with one memcpy a
    row) and behaves as the list it replaced, past its first growth too."""
    table, mirror = BlockTable(), []
    for block_id in range(40):
        table.append(block_id * 7)
        mirror.append(block_id * 7)
    table[3] = mirror[3] = 999
    table[-1] = mirror[-1] = 5
    assert len(table) == 40 and list(table) == mirror and table[:] == mirror and table[5:9] == mirror[5:9]
    assert table[-2] == mirror[-2] and isinstance(table[0], int) and all(isinstance(i, int) for i in table)
    np.testing.assert_array_equal(table.ids, mirror)
    copy = table.copy()
    copy.append(1)
    copy[0] = 2
    assert list(table) == mirror and len(copy) == 41
    with pytest.raises(IndexError):
        table[40]
    with pytest.raises(IndexError):
        table[40] = 1
    table.clear()
    assert not table and list(table) == [] and len(BlockTable([3, 4])) == 2


def test_block_table_rows_follow_every_change():
    """The step's block-table matrix, kept from step to step, equals one built afresh after each kind of
    change: a block taken, one replaced (copy-on-write), a table cleared (preempted) and grown again,
    another table in a row, fewer or more rows, a longer table than the matrix holds."""
    rows = BlockTableRows()

    def check(tables):
        width = max(len(t) for t in tables)
        fresh = np.array([list(t) + [0] * (width - len(t)) for t in tables], dtype=np.int64)
        np.testing.assert_array_equal(rows.of(tables), fresh)

    a, b, c = BlockTable([1, 2, 3]), BlockTable([4]), BlockTable([5, 6])
    check([a, b, c])
    b.append(7)
    check([a, b, c])
    a[1] = 9
    check([a, b, c])
    a.clear()
    check([a, b, c])
    a.append(8)
    check([a, b, c])
    check([c, a, b])  # each row another table's, shorter ones too
    check([b])
    check([b, BlockTable(range(100, 200)), a, c, *map(BlockTable, [[i] for i in range(20)])])  # it grows
    check([a, c])


def decode_step(seq_lens: list[int], tables: list[list[int]]) -> StepInputs:
    n = len(seq_lens)
    ints = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    return StepInputs(ints(range(100, 100 + n)), ints(seq_lens) - 1, ints([t[0] * 16 for t in tables]),
                      ints(range(n + 1)), ints(seq_lens), ints(tables), ints(range(n)))


def test_padded_decode_step_reads_harmless_rows():
    buffers = InputBuffers(max_tokens=32, max_seqs=8, max_blocks=4, device=torch.device("cpu"))
    step = decode_step([5, 17, 3], [[7, 0], [2, 9], [4, 0]])
    exact = buffers.load(step)
    assert exact.input_ids.tolist() == [100, 101, 102] and exact.block_tables.tolist() == [[7, 0], [2, 9], [4, 0]]
    assert exact.logits_at.tolist() == [0, 1, 2]
    padded = buffers.load(decode_step([5], [[3]]), pad_seqs=4)
    assert padded.input_ids.tolist() == [100, 0, 0, 0]
    assert padded.slot_mapping.tolist() == [48, -1, -1, -1]  # padding writes no KV
    assert padded.cu_seqlens.tolist() == [0, 1, 2, 3, 4]
    assert padded.seq_lens.tolist() == [5, 1, 1, 1]  # one key each: its own row's first block
    assert padded.block_tables.shape == (4, 4) and padded.block_tables[:, 0].tolist() == [3, 0, 0, 0]
    assert padded.logits_at is None  # a graph computes every row's logits
    assert exact.num_decodes == 3 and padded.num_decodes == 4
    # Under async scheduling a row's token is still on the device: it comes from the last step's tokens.
    step = decode_step([5, 9, 7], [[3], [4], [5]])
    step.input_ids[[0, 2]] = -1
    step.pending_at, step.pending_rows = np.array([0, 2]), np.array([1, 0])
    padded = buffers.load(step, pad_seqs=4, sampled=torch.tensor([41, 42, 43]))
    assert padded.input_ids.tolist() == [42, 101, 41, 0] and padded.seq_lens.tolist() == [5, 9, 7, 1]
    with pytest.raises(ValueError, match="exceeds the input buffers"):
        buffers.load(decode_step([5] * 9, [[1]] * 9))
    with pytest.raises(ValueError, match="exceeds the input buffers"):
        buffers.load(decode_step([5], [[1, 2, 3, 4, 5]]))


def test_staged_buffers_carry_the_tables_packed_to_the_step_width():
    """A GPU's buffers (host and device apart; here both on the CPU): a step's block tables cross packed to
    its width (its rows times its longest table, not times the rows' capacity) and are spread into the rows
    the kernels read; a padded decode step's padding rows read block 0; a later, narrower step's rows are
    right where it reads them."""
    buffers = InputBuffers(max_tokens=32, max_seqs=8, max_blocks=6, device=torch.device("cpu"), staged=True)
    assert buffers.device is not buffers.host and buffers.device_tables.shape == (8, 6)
    staged = buffers._field(buffers.device, "block_tables")
    staged.fill_(-5)  # (what the device holds beyond what a step sends stays as it was)
    wide = buffers.load(decode_step([5, 40, 3], [[7, 0, 0], [2, 9, 8], [4, 0, 0]]))
    assert wide.block_tables.tolist() == [[7, 0, 0], [2, 9, 8], [4, 0, 0]]
    assert staged[:9].tolist() == [7, 0, 0, 2, 9, 8, 4, 0, 0] and staged[9:].eq(-5).all()
    padded = buffers.load(decode_step([5, 17], [[3, 0], [1, 6]]), pad_seqs=4)
    assert padded.block_tables[:, :2].tolist() == [[3, 0], [1, 6], [0, 0], [0, 0]]
    assert staged[:8].tolist() == [3, 0, 1, 6, 0, 0, 0, 0]
    assert buffers.device_tables[1, :3].tolist() == [1, 6, 8]  # (past the step's width: not sent, not read)
    narrow = buffers.load(decode_step([9], [[5]]))
    assert narrow.block_tables.tolist() == [[5]] and buffers.device_tables[0, :2].tolist() == [5, 0]
    assert narrow.input_ids.tolist() == [100] and narrow.seq_lens.tolist() == [9]


def test_which_graph_runs_a_step():
    """What a captured graph can run (StepGraphs.covers, decided on the host): a decode step of at most
    the largest bucket's sequences, each sampling its own row in order; under speculative decoding a step
    of sequences of at most the verify length (their logits anywhere); with cuda_graph_max_tokens, a step
    of any kind up to the largest token bucket whose logits rows its bucket keeps. Never a step with
    virtual prompt tokens, nor anything before capture."""
    from inflight.cuda_graphs import GraphShape, StepGraphs, token_buckets

    buffers = InputBuffers(max_tokens=32, max_seqs=8, max_blocks=4, device=torch.device("cpu"))
    graphs = StepGraphs(lambda step: None, buffers, max_seqs=6, max_tokens=0)
    plain = decode_step([5, 17, 3], [[7, 0], [2, 9], [4, 0]])
    assert not graphs.covers(plain)  # nothing captured yet
    graphs._graphs = {shape: None for shape in graphs.shapes()}  # (what capture() fills, on a GPU)
    assert graphs.shapes() == [GraphShape(n, n, 1, None) for n in (6, 4, 2, 1)]  # the most tokens first
    assert graphs._shape(plain) == GraphShape(4, 4, 1, None) and graphs.covers(decode_step([5] * 6, [[1]] * 6))
    assert not graphs.covers(decode_step([5] * 7, [[1]] * 7))  # beyond the largest bucket
    reordered = decode_step([5, 17, 3], [[7, 0], [2, 9], [4, 0]])
    reordered.logits_at = np.array([0, 2, 1])
    fewer = decode_step([5, 17, 3], [[7, 0], [2, 9], [4, 0]])
    fewer.logits_at = np.array([0, 1])  # (a prompt chunk's end that samples nothing)
    prefill = StepInputs(np.arange(4), np.arange(4), np.arange(4), np.array([0, 4]), np.array([4]),
                         np.array([[1]]), np.array([3]))
    virtual = decode_step([5, 17, 3], [[7, 0], [2, 9], [4, 0]])
    virtual.embeds_at, virtual.embeds = np.array([1]), torch.zeros(1, 8)
    assert not any(graphs.covers(step) for step in (reordered, fewer, prefill, virtual))
    # Under speculative decoding, graphs of 3 tokens a sequence, up to 4 sequences.
    verifying = StepGraphs(lambda step: None, buffers, max_seqs=6, verify_len=3, verify_seqs=4, max_tokens=0)
    verifying._graphs = {shape: None for shape in verifying.shapes()}
    assert [(s.tokens, s.seqs, s.query_len) for s in verifying.shapes()] == \
        [(12, 4, 3), (6, 6, 1), (6, 2, 3), (4, 4, 1), (3, 1, 3), (2, 2, 1), (1, 1, 1)]
    chunks = StepInputs(np.arange(6), np.arange(6), np.arange(6), np.array([0, 3, 4, 6]), np.array([9, 5, 8]),
                        np.array([[1], [2], [3]]), np.array([2, 3, 4, 5]))
    assert all(verifying._shape(step) == GraphShape(12, 4, 3, None) for step in (reordered, fewer, chunks))
    assert verifying._shape(plain).query_len == 1
    wide = decode_step([5] * 5, [[1]] * 5)
    wide.logits_at = np.array([1, 0, 2, 3, 4])
    virtual_chunks = StepInputs(np.arange(6), np.arange(6), np.arange(6), np.array([0, 3, 4, 6]), np.array([9, 5, 8]),
                                np.array([[1], [2], [3]]), np.array([2, 3, 5]), embeds_at=np.array([0]),
                                embeds=torch.zeros(1, 8))
    assert not any(verifying.covers(step) for step in (prefill, wide, virtual_chunks))  # 4 tokens; 5 sequences
    # Steps with prompt chunks: buckets of tokens over max_seqs sequences, as many logits rows as both allow.
    assert token_buckets(2048) == [16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert token_buckets(300) == [16, 32, 64, 128, 256, 300] and token_buckets(0) == []
    ragged = StepGraphs(lambda step: None, buffers, max_seqs=6, max_tokens=32)
    ragged._graphs = {shape: None for shape in ragged.shapes()}
    assert [s for s in ragged.shapes() if s.query_len == 0] == [GraphShape(32, 6, 0, 6), GraphShape(16, 6, 0, 6)]
    assert ragged._shape(prefill) == GraphShape(16, 6, 0, 6) and ragged._shape(plain).query_len == 1
    assert all(ragged._shape(step) == GraphShape(16, 6, 0, 6) for step in (reordered, fewer, chunks))
    long_chunk = StepInputs(np.arange(20), np.arange(20), np.arange(20), np.array([0, 1, 20]), np.array([9, 19]),
                            np.array([[1], [2]]), np.arange(7))  # 7 logits rows (prompt logprobs, say)
    assert not ragged.covers(long_chunk)  # more logits rows than a bucket keeps
    long_chunk.logits_at = np.array([0, 19])
    assert ragged._shape(long_chunk) == GraphShape(32, 6, 0, 6)
    assert not ragged.covers(virtual)
    # (no bucket of exactly max_seqs tokens: the attention would take it for a decode batch)
    assert StepGraphs(lambda step: None, buffers, max_seqs=16, max_tokens=32).token_buckets == [32]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["one-at-a-time", "pipelined"])
def test_steps_with_prompt_chunks_replay_graphs_of_their_token_bucket(tiny_models, hf_reference, async_scheduling):
    """On a GPU a step with prompt chunks (alone, or after decodes) of up to cuda_graph_max_tokens tokens
    replays the graph of its token bucket over max_num_seqs sequences (cuda_graphs.ragged_step). Run here
    with the graphs' replays as eager forwards over the same buffers, under chunked prefill, preemption and
    the prefix cache: every output is HF's, the steps of chunks and decodes together were replayed with
    padding tokens and sequences, and a step wanting more logits rows than its bucket keeps (prompt
    logprobs) ran eagerly, with the prompt logprobs of the engine without graphs."""
    model = tiny_models["llama"]
    prompts = random_prompts(10, 1, 90, vocab=512, seed=13)
    settings = dict(num_kv_blocks=28, max_num_seqs=6, max_num_batched_tokens=48, async_scheduling=async_scheduling)
    llm = LLM(model, **settings)
    graphs = graphs_on_a_cpu(llm)
    assert graphs.token_buckets == [16, 32, 48] and graphs.sizes == [1, 2, 4, 6]
    replay, replayed = graphs.replay, []

    def recording_replay(inputs, sampled=None):
        shape = graphs._shape(inputs)
        if shape is not None:
            replayed.append((shape, np.diff(inputs.cu_seqlens).tolist()))
        return replay(inputs, sampled)

    graphs.replay = recording_replay
    for round_ in range(2):  # (the second finds the prompts' blocks in the prefix cache)
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == [hf_reference(model, p, GREEDY.max_tokens) for p in prompts], round_
    ragged = [(shape, counts) for shape, counts in replayed if shape.query_len == 0]
    assert graphs.ragged_replays == len(ragged) > 0
    assert any(1 in counts and max(counts) > 1 for _, counts in ragged), "decodes beside a chunk were meant to replay"
    assert any(sum(counts) < shape.tokens for shape, counts in ragged)
    assert len({shape.tokens for shape, _ in ragged}) > 1, "steps were meant to replay several buckets"
    stats = llm.stats()
    print(stats)
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    llm.block_manager.check_all_free()
    logprobs = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    replays, ragged_replays = graphs.replays, graphs.ragged_replays
    (out,) = llm.generate([prompts[1]], logprobs)
    (expected,) = LLM(model, **settings).generate([prompts[1]], logprobs)
    assert out.token_ids == expected.token_ids and graphs.replays > replays  # (its decodes)
    assert graphs.ragged_replays == ragged_replays  # (its chunks want a row a token)
    assert [{k: (v.rank, round(v.logprob, 4)) for k, v in entry.items()} if entry else entry
            for entry in out.prompt_logprobs] == \
        [{k: (v.rank, round(v.logprob, 4)) for k, v in entry.items()} if entry else entry
         for entry in expected.prompt_logprobs]


def test_ragged_step_pads_tokens_and_sequences_that_attention_leaves_alone():
    """A step with prompt chunks laid out for a graph of 16 tokens over 5 sequences: its tokens keep their
    places, the padding tokens after them write no KV and belong to no sequence (the offsets end at its
    last token), the padding sequences have no tokens, and its logits rows come first."""
    from inflight.cuda_graphs import GraphShape, ragged_step

    ints = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    step = StepInputs(ints([5, 6, 7, 8, 9]), ints([3, 0, 1, 2, 3]), ints([19, 32, 33, 34, 35]), ints([0, 1, 5]),
                      ints([4, 4]), ints([[1], [2]]), ints([0, 4]), pending_at=ints([0]), pending_rows=ints([2]))
    padded = ragged_step(step, GraphShape(16, 5, 0, 5))
    assert padded.input_ids.tolist() == [5, 6, 7, 8, 9] + [0] * 11
    assert padded.positions.tolist() == [3, 0, 1, 2, 3] + [0] * 11
    assert padded.slot_mapping.tolist() == [19, 32, 33, 34, 35] + [-1] * 11
    assert padded.cu_seqlens.tolist() == [0, 1, 5, 5, 5, 5] and padded.seq_lens.tolist() == [4, 4, 0, 0, 0]
    assert padded.block_tables.tolist() == [[1], [2]] and padded.logits_at.tolist() == [0, 4, 0, 0, 0]
    assert padded.pending_at.tolist() == [0] and padded.lora_ids is None
    buffers = InputBuffers(max_tokens=16, max_seqs=5, max_blocks=4, device=torch.device("cpu"))
    buffers.tables(buffers.host)[:] = 7  # (a row not written keeps what it held)
    loaded = buffers.load(padded, sampled=torch.tensor([40, 41, 42]))
    assert loaded.input_ids.tolist()[:5] == [42, 6, 7, 8, 9]
    assert buffers.tables(buffers.host)[:, 0].tolist() == [1, 2, 7, 7, 7]


def test_uniform_step_pads_each_sequence_to_the_verify_length():
    """A step that verifies drafts, laid out for a graph of 4 sequences of 3 tokens: each sequence's tokens
    keep their order and context (its length less its query), its padding tokens follow them (the last
    position again, no KV written, their logits unread), padding sequences after; a token in flight and
    each logits row land where their token went."""
    from inflight.cuda_graphs import uniform_step

    ints = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    # three sequences: 2 tokens at positions 7-8, 1 at 4, 3 at 10-12 (the second's token in flight)
    step = StepInputs(ints([11, 12, -1, 31, 32, 33]), ints([7, 8, 4, 10, 11, 12]), ints([23, 24, 52, 90, 91, 92]),
                      ints([0, 2, 3, 6]), ints([9, 5, 13]), ints([[1, 2], [3, 0], [5, 6]]), ints([1, 0, 3, 4, 5]),
                      pending_at=ints([2]), pending_rows=ints([7]), lora_ids=ints([1, 1, 0, 2, 2, 2]))
    padded, rows = uniform_step(step, seqs=4, query_len=3)
    assert padded.input_ids.tolist() == [11, 12, 0, -1, 0, 0, 31, 32, 33, 0, 0, 0]
    assert padded.positions.tolist() == [7, 8, 8, 4, 4, 4, 10, 11, 12, 0, 0, 0]
    assert padded.slot_mapping.tolist() == [23, 24, -1, 52, -1, -1, 90, 91, 92, -1, -1, -1]
    assert padded.cu_seqlens.tolist() == [0, 3, 6, 9, 12]
    assert padded.seq_lens.tolist() == [10, 7, 13, 3]  # contexts 7, 4, 10 (and 0) as before
    assert (padded.seq_lens - np.diff(padded.cu_seqlens)).tolist()[:3] == \
        (step.seq_lens - np.diff(step.cu_seqlens)).tolist()
    assert padded.block_tables.tolist() == [[1, 2], [3, 0], [5, 6], [0, 0]]
    assert padded.lora_ids.tolist() == [1, 1, 0, 0, 0, 0, 2, 2, 2, 0, 0, 0]
    assert padded.pending_at.tolist() == [3] and padded.pending_rows.tolist() == [7]
    assert rows.tolist() == [1, 0, 6, 7, 8]
    buffers = InputBuffers(max_tokens=16, max_seqs=4, max_blocks=4, device=torch.device("cpu"))
    loaded = buffers.load(padded, sampled=torch.arange(100, 110))
    assert loaded.input_ids.tolist()[:6] == [11, 12, 0, 107, 0, 0]  # the token in flight, from the device


def test_auto_device_and_dtype(tiny_models):
    llm = LLM(tiny_models["llama"], num_kv_blocks=8)  # the tests' "auto" is the CPU (conftest)
    assert (llm.config.device, llm.runner.dtype) == ("cpu", torch.float32)
    assert (llm.config.max_num_seqs, llm.config.max_num_batched_tokens) == (64, 512)


@pytest.mark.parametrize("value", [-1, 1.5, True, "2048"])
def test_cuda_graph_max_tokens_is_checked(value):
    from inflight.config import EngineConfig

    with pytest.raises(ValueError, match="cuda_graph_max_tokens must be an integer of at least 0"):
        EngineConfig("m", device="cpu", cuda_graph_max_tokens=value)
    assert EngineConfig("m", device="cpu", cuda_graph_max_tokens=0).cuda_graph_max_tokens == 0


def test_batch_limits_default_per_device():
    """Unset, the batch limits suit the device: a GPU's step costs about the same for 64 or 256 decodes."""
    from inflight.config import EngineConfig

    gpu = EngineConfig("m", device="cuda:1")
    assert (gpu.max_num_seqs, gpu.max_num_batched_tokens) == (256, 8192)
    assert EngineConfig("m", device="cpu", max_num_seqs=1000).max_num_batched_tokens == 1000
    set_budget = EngineConfig("m", device="cuda", max_num_batched_tokens=300)
    assert (set_budget.max_num_seqs, set_budget.max_num_batched_tokens) == (256, 300)
    with pytest.raises(ValueError, match="at least max_num_seqs"):
        EngineConfig("m", device="cuda", max_num_batched_tokens=100)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_graphs_equal_eager_in_bfloat16(tiny_models, family):
    """bfloat16 on the GPU: decode steps replayed from graphs (padded to their bucket) give the tokens
    of eager steps, for batch sizes that hit several buckets and a bucket's exact size."""
    prompts = random_prompts(21, 1, 200, vocab=512, seed=9)
    settings = dict(device="cuda", dtype="bfloat16", num_kv_blocks=512, max_num_seqs=24, max_num_batched_tokens=512)
    graphed = LLM(tiny_models[family], **settings)
    assert graphed.runner.dtype == torch.bfloat16
    outs = graphed.generate(prompts, GREEDY)
    assert graphed.runner.graphs.replays > 0
    graphed.block_manager.check_all_free()
    eager = LLM(tiny_models[family], cuda_graphs=False, **settings)
    assert eager.runner.graphs is None
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager.generate(prompts, GREEDY)]


@needs_cuda
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["one-at-a-time", "pipelined"])
def test_graphs_of_steps_with_prompt_chunks_equal_eager_on_a_gpu(tiny_models, async_scheduling):
    """float32 on the GPU: steps with prompt chunks (alone and beside decodes, chunked, preempted) replayed
    from graphs of their token buckets give the tokens of eager steps; max_num_seqs 16 leaves out the
    bucket of 16 tokens (the attention would take it for a decode batch)."""
    prompts = random_prompts(24, 1, 150, vocab=512, seed=21)
    settings = dict(device="cuda", dtype="float32", num_kv_blocks=48, max_num_seqs=16, max_num_batched_tokens=64,
                    async_scheduling=async_scheduling)
    graphed = LLM(tiny_models["llama"], **settings)
    assert graphed.runner.graphs.token_buckets == [32, 64]
    outs = graphed.generate(prompts, GREEDY)
    assert graphed.runner.graphs.ragged_replays > 0 and graphed.stats()["num_preemptions"] > 0
    graphed.block_manager.check_all_free()
    eager = LLM(tiny_models["llama"], cuda_graphs=False, **settings)
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager.generate(prompts, GREEDY)]


@needs_cuda
def test_auto_is_the_gpu_in_bfloat16(tiny_models, monkeypatch):
    import inflight.config

    monkeypatch.setattr(inflight.config, "auto_device", lambda: "cuda")
    llm = LLM(tiny_models["llama"], num_kv_blocks=8, max_num_seqs=4, max_num_batched_tokens=64)
    assert (llm.config.device, llm.runner.dtype, llm.runner.graphs is not None) == ("cuda", torch.bfloat16, True)


@pytest.mark.parametrize("failing", ["all", "with prompt chunks"])
def test_a_model_that_cannot_be_captured_runs_eagerly(tiny_models, monkeypatch, caplog, failing):
    """Where capturing fails (modeling code that waits for the GPU in its forward pass, as some mixtures of
    experts route tokens), the engine starts with eager steps and says why, rather than not at all; where
    only the graphs of steps with prompt chunks fail, it keeps the others. Here on a CPU, with a capture
    that fails as CUDA's does."""
    from inflight import cuda_graphs, model_runner

    class FailingGraphs(cuda_graphs.StepGraphs):
        def capture(self):
            if failing == "all" or self.token_buckets:
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(model_runner.ModelRunner, "_use_cuda_graphs", lambda self: True)
    monkeypatch.setattr(model_runner, "StepGraphs", FailingGraphs)
    with caplog.at_level("WARNING", logger="inflight.model_runner"):
        llm = LLM(tiny_models["llama"], device="cpu", dtype="float32", num_kv_blocks=32)
    if failing == "all":
        assert llm.runner.graphs is None
        assert "its steps run eagerly: CUDA error: operation not permitted" in caplog.text
    else:
        assert llm.runner.graphs.sizes and not llm.runner.graphs.token_buckets
        assert "prompt chunks could not be captured for model type llama, so those steps run eagerly" in caplog.text
        llm.runner.graphs = None  # (nothing captured on a CPU to replay)
    out = llm.generate([[5, 6, 7]], GREEDY)[0]
    assert len(out.token_ids) == GREEDY.max_tokens


# -- the KV pool's room for the largest step (step_memory.py) ------------------------------------------
@pytest.mark.parametrize("max_seqs", [8, 100], ids=["rows-of-max_num_seqs", "rows-of-every-token"])
def test_the_largest_step_writes_no_kv_and_samples_as_many_rows_as_a_step_can(tiny_models, max_seqs):
    """The step run before the pool is sized: max_num_batched_tokens tokens over block 0 that leave the
    pool and the token history as they were, their last min(max_num_seqs, tokens) rows sampled through
    every filter to tokens of the vocabulary."""
    from inflight.step_memory import largest_step, run_largest_step

    llm = LLM(tiny_models["llama"], device="cpu", dtype="float32", num_kv_blocks=4, max_num_batched_tokens=64)
    runner = llm.runner
    runner.kv_cache.uniform_()
    runner.token_history._blocks.random_(3, 512)
    pool, history = runner._kv_bytes.clone(), runner.token_history._blocks.clone()
    tokens = run_largest_step(runner._forward, largest_step(64, max_seqs, runner.block_size, runner.device))
    assert tokens.shape == (min(max_seqs, 64),)
    assert 0 <= int(tokens.min()) and int(tokens.max()) < runner.hf_config.vocab_size
    assert torch.equal(runner._kv_bytes, pool) and torch.equal(runner.token_history._blocks, history)


def test_a_gpus_pool_leaves_room_for_the_largest_step(tiny_models, monkeypatch):
    """On a GPU the pool's budget is its share of the free memory less the largest step's peak, and a share
    too small for that step is refused naming the limits to lower. (The GPU's memory calls faked here.)"""
    llm = LLM(tiny_models["llama"], device="cpu", dtype="float32", num_kv_blocks=4)
    runner = llm.runner
    free, step = 1000 * runner.bytes_per_block, 300 * runner.bytes_per_block + 5
    runner.config = dataclasses.replace(runner.config, num_kv_blocks=None, kv_cache_memory_fraction=0.5)
    runner.device = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, 2 * free))
    monkeypatch.setattr(runner, "_largest_step_bytes", lambda: step)
    assert runner._pool_size() == 199  # (500 blocks' bytes less 300 blocks' and 5 bytes)
    step = 600 * runner.bytes_per_block
    with pytest.raises(ValueError, match="max_num_batched_tokens.*max_num_seqs.*lower those limits or raise"):
        runner._pool_size()


@needs_cuda
def test_the_largest_steps_memory_is_measured_and_fits_beside_the_pool_on_a_gpu(tiny_models):
    """bfloat16 on the GPU, the pool sized from the free memory: the largest step's peak holds at least its
    float32 logits and probabilities, and a request of that step's size sampling through every filter,
    with logprobs, runs beside the pool."""
    from inflight.step_memory import WIDEST_SAMPLING

    llm = LLM(tiny_models["llama"], device="cuda", dtype="bfloat16", kv_cache_memory_fraction=0.05,
              max_num_seqs=16, max_num_batched_tokens=256)
    runner = llm.runner
    assert runner._largest_step_bytes() >= 2 * 16 * runner.hf_config.vocab_size * 4
    params = dataclasses.replace(WIDEST_SAMPLING, max_tokens=4, logprobs=5, ignore_eos=True)
    [out] = llm.generate([random_prompts(1, 256, 256, vocab=512)[0]], params)
    assert len(out.token_ids) == 4
    llm.block_manager.check_all_free()


@pytest.mark.parametrize("speculative", [False, True], ids=["decodes-and-chunks", "verifying-drafts"])
def test_hybrid_models_replay_graphs_with_their_windowed_layers_tables(more_tiny_models, hf_eager_reference,
                                                                       speculative):
    """Gemma 2's windowed layer reads block tables of its own (hybrid_blocks.py): a graph's replay reads its
    cache slots and tables from buffers of their own, padded as the step's own (decodes, steps with prompt
    chunks, steps verifying n-gram drafts), under the prefix cache and, drafts aside, preemption; every
    output is HF's."""
    model = more_tiny_models("gemma2")
    llm = LLM(model, block_size=8, num_kv_blocks=200 if speculative else 60, max_num_seqs=4,
              max_num_batched_tokens=48, speculative_config={"num_speculative_tokens": 3} if speculative else None)
    graphs = graphs_on_a_cpu(llm)
    assert llm.runner.buffers.window_groups == 1
    pieces = random_prompts(6, 5, 9, vocab=512, seed=43)
    prompts = [piece * (120 // len(piece)) for piece in pieces] if speculative else random_prompts(6, 1, 300, 512, 43)
    for round_ in range(2):  # (the second finds the prompts' blocks in the prefix cache)
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == [hf_eager_reference(model, p, GREEDY.max_tokens) for p in prompts]
    assert graphs.ragged_replays > 0 and graphs.replays > graphs.ragged_replays + graphs.verify_replays
    assert graphs.verify_replays > 0 if speculative else graphs.verify_replays == 0
    stats = llm.stats()
    assert stats["prefix_cache_hit_tokens"] > 0 and (speculative or stats["num_preemptions"] > 0)
    llm.block_manager.check_all_free()
