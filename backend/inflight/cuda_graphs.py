"""CUDA graphs of engine steps: decode steps, steps that verify speculative drafts, and steps with
prompt chunks of up to cuda_graph_max_tokens tokens.

A step through transformers' modules is about forty kernel launches a layer, each issued by Python: on
a GPU the host, not the GPU, sets the pace of any step that is not thousands of tokens. At start-up a
graph of each shape below is captured once: the forward through the model's own modules with our
attention, to float32 logits. A step then loads its inputs into the runner's InputBuffers, padded to
its graph's shape, and replays the graph.

- Decode steps, one token a sequence: a graph for each bucket of batch sizes (1, 2, 4, 8, then every 16
  up to max_num_seqs), padded with sequences of one token; every row's logits.
- Under speculative decoding, steps that judge drafts (each decoding sequence's last token and its
  drafts: up to num_speculative_tokens + 1 tokens, the verify length): the same buckets, each sequence
  given the verify length (`uniform_step`). A sequence with fewer tokens is padded after its last one
  with tokens that write no KV and whose logits nobody reads; its own tokens attend exactly as they
  would alone, since a token sees only the keys before it. The Triton attention splits their contexts
  as a decode batch's (triton_ops.verify_steps_split).
- Any other step (prompt chunks, with or without decodes beside them), of up to cuda_graph_max_tokens
  tokens: a graph for each bucket of token counts (16, 32, 64, 128, 256, then every 256), over max_num_seqs
  sequences (`ragged_step`): the padding tokens belong to no sequence and the padding sequences have no
  tokens, so the attention kernel leaves both alone; the logits of as many rows as the bucket's tokens or
  sequences allow (the fewer), at the step's logits_at. In these graphs the attention launches a step's
  decodes in prefill tiles (how many decodes lead the batch changes from step to step; eager steps launch
  them apart).

Everything that varies between steps is read from those device buffers: token ids, positions, cache
slots, sequence offsets and lengths, block tables, the rows whose logits are kept (and, under chunked
attention beyond one chunk, each sequence's length from its chunk's start and that chunk's first block,
from which the graph takes the chunked layers' block tables: input_buffers.chunk_tables). A graph fixes
only its shape: the launch grids, the split count of split-KV decode (triton_ops.decode_splits takes the
bucket's size, never a context length) and the block-table row width (the buffers' max_blocks, and
chunk_width). All graphs share one memory pool, captured the most tokens first so that the smaller ones
reuse its memory, and write their logits into one output tensor (a step's are read, by the sampler's
kernels queued after its replay, before the next replay writes its own; a tensor each took over a GB of
a 1.2B model's memory).
"""

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .input_buffers import InputBuffers, StepInputs, StepTensors, WindowInputs, empty_step, to_device

logger = logging.getLogger(__name__)


def bucket_sizes(max_seqs: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then every 16, and max_seqs itself."""
    return sorted({n for n in (1, 2, 4, 8) if n < max_seqs} | set(range(16, max_seqs, 16)) | {max_seqs})


def token_buckets(max_tokens: int) -> list[int]:
    """The token counts captured for steps with prompt chunks: 16, 32, 64, 128, 256, then every 256, and
    max_tokens itself (none for 0)."""
    if max_tokens <= 0:
        return []
    return sorted({n for n in (16, 32, 64, 128) if n < max_tokens} | set(range(256, max_tokens, 256)) | {max_tokens})


@dataclass(frozen=True)
class GraphShape:
    """What one graph computes: `tokens` over `seqs` sequences, each of `query_len` tokens (0: any), and the
    logits of `logits` rows at logits_at (None: of every token)."""

    tokens: int
    seqs: int
    query_len: int
    logits: int | None
    lora: bool = False


def uniform_step(inputs: StepInputs, seqs: int, query_len: int) -> tuple[StepInputs, np.ndarray]:
    """`inputs` (sequences of at most `query_len` tokens each) laid out as `seqs` sequences of exactly
    `query_len`, and the row of each of its logits_at in that layout. A sequence's padding tokens follow
    its last real one: they repeat its position, write no KV (slot -1) and count in its length, so that
    its real tokens keep their place in the causal order (a token's context is the length less the query);
    the padding sequences after the real ones are `query_len` tokens over block 0."""
    real = len(inputs.seq_lens)
    counts = np.diff(inputs.cu_seqlens)
    owner = np.repeat(np.arange(real), counts)
    rows = owner * query_len + np.arange(len(inputs.input_ids)) - inputs.cu_seqlens[owner]  # each token's row
    tokens = seqs * query_len
    input_ids = np.zeros(tokens, dtype=np.int64)
    input_ids[rows] = inputs.input_ids
    positions = np.zeros(tokens, dtype=np.int64)
    positions[:real * query_len] = np.repeat(inputs.positions[inputs.cu_seqlens[1:] - 1], query_len)
    positions[rows] = inputs.positions
    seq_lens = np.full(seqs, query_len, dtype=np.int64)
    seq_lens[:real] = inputs.seq_lens - counts + query_len

    def laid_out(slot_mapping: np.ndarray, block_tables: np.ndarray) -> WindowInputs:
        """Cache slots and block tables in the padded layout (the step's own, or a hybrid model's group's)."""
        slots = np.full(tokens, -1, dtype=np.int64)
        slots[rows] = slot_mapping
        tables = np.zeros((seqs, block_tables.shape[1]), dtype=np.int64)
        tables[:real] = block_tables
        return WindowInputs(slots, tables)

    own = laid_out(inputs.slot_mapping, inputs.block_tables)
    lora_ids = None
    if inputs.lora_ids is not None:
        lora_ids = np.zeros(tokens, dtype=np.int64)
        lora_ids[rows] = inputs.lora_ids
    padded = StepInputs(input_ids, positions, own.slot_mapping, np.arange(seqs + 1, dtype=np.int64) * query_len,
                        seq_lens, own.block_tables, np.zeros(0, dtype=np.int64), pending_at=rows[inputs.pending_at],
                        pending_rows=inputs.pending_rows, lora_ids=lora_ids,
                        windows=[laid_out(window.slot_mapping, window.block_tables) for window in inputs.windows])
    if inputs.chunk_seq_lens is not None:  # (a chunk view's lengths padded as the lengths are)
        padded.chunk_seq_lens = np.full(seqs, query_len, dtype=np.int64)
        padded.chunk_seq_lens[:real] = inputs.chunk_seq_lens - counts + query_len
        padded.chunk_first_blocks = np.zeros(seqs, dtype=np.int64)
        padded.chunk_first_blocks[:real] = inputs.chunk_first_blocks
    return padded, rows[inputs.logits_at]


def ragged_step(inputs: StepInputs, shape: GraphShape) -> StepInputs:
    """`inputs` padded to a graph of `shape` (query_len 0): its tokens keep their places, the padding
    tokens after them write no KV and belong to no sequence, the padding sequences after its own have no
    tokens (their block-table rows are not read, so not written), and the logits rows past its own are
    the first token's, unread."""
    tokens, real = len(inputs.input_ids), len(inputs.seq_lens)

    def padded(values: np.ndarray, length: int, fill: int) -> np.ndarray:
        out = np.full(length, fill, dtype=np.int64)
        out[:len(values)] = values
        return out

    chunked = inputs.chunk_seq_lens is not None
    return StepInputs(padded(inputs.input_ids, shape.tokens, 0), padded(inputs.positions, shape.tokens, 0),
                      padded(inputs.slot_mapping, shape.tokens, -1), padded(inputs.cu_seqlens, shape.seqs + 1, tokens),
                      padded(inputs.seq_lens, shape.seqs, 0), inputs.block_tables[:real],
                      padded(inputs.logits_at, shape.logits, 0), pending_at=inputs.pending_at,
                      pending_rows=inputs.pending_rows,
                      lora_ids=None if inputs.lora_ids is None else padded(inputs.lora_ids, shape.tokens, 0),
                      windows=[WindowInputs(padded(window.slot_mapping, shape.tokens, -1), window.block_tables[:real])
                               for window in inputs.windows],
                      chunk_seq_lens=padded(inputs.chunk_seq_lens, shape.seqs, 0) if chunked else None,
                      chunk_first_blocks=padded(inputs.chunk_first_blocks, shape.seqs, 0) if chunked else None)


class StepGraphs:
    def __init__(self, forward: Callable[[StepTensors], torch.Tensor], buffers: InputBuffers, max_seqs: int,
                 lora: bool = False, verify_len: int = 1, verify_seqs: int = 0, max_tokens: int = 0):
        """`verify_len`: tokens a sequence in a step that verifies drafts (num_speculative_tokens + 1; 1:
        no drafts), captured for batches of up to `verify_seqs` sequences; `max_tokens`: the most tokens of
        a step with prompt chunks that a graph runs (0: none does)."""
        # step tensors (, out=) -> float32 logits, a row per token or per logits_at (written into `out`)
        self._forward = forward
        self._buffers = buffers
        self.sizes = bucket_sizes(max_seqs)
        self.verify_len = verify_len
        self.verify_sizes = bucket_sizes(verify_seqs) if verify_len > 1 and verify_seqs > 0 else []
        # (A bucket of exactly max_seqs tokens would launch the attention's decode kernel, which takes every
        # sequence for one token: left out, its steps go to the next bucket.)
        self.token_buckets = [n for n in token_buckets(min(max_tokens, buffers.max_tokens)) if n != max_seqs]
        self._max_seqs = max_seqs
        # With LoRA adapters, each shape twice: steps with an adapter, and steps of the base model alone,
        # which then pay nothing for the adapters (lora.py).
        self._variants = (False, True) if lora else (False,)
        self._graphs: dict[GraphShape, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0  # steps run by a graph
        self.verify_replays = 0  # of which verifying drafts
        self.ragged_replays = 0  # of which with prompt chunks

    def shapes(self) -> list[GraphShape]:
        """The graphs to capture, the most tokens first (all share one memory pool)."""
        uniform = [(size, 1) for size in self.sizes] + [(size, self.verify_len) for size in self.verify_sizes]
        shapes = [GraphShape(size * length, size, length, None, lora) for size, length in uniform
                  for lora in self._variants]
        shapes += [GraphShape(tokens, self._max_seqs, 0, min(tokens, self._max_seqs), lora)
                   for tokens in self.token_buckets for lora in self._variants]
        return sorted(shapes, key=lambda shape: -shape.tokens)

    def step_tensors(self, shape: GraphShape, padding: bool = False) -> StepTensors:
        """The device views a graph of `shape` reads (new view objects each call); `padding`: with a step of
        padding alone loaded first (it writes no KV), to capture."""
        if padding:
            self._buffers.load(self._padded(empty_step(shape.lora), shape)[0])
        tensors = self._buffers.views(shape.tokens, shape.seqs, self._buffers.max_blocks, shape.logits, shape.lora,
                                      shape.seqs if shape.query_len == 1 else 0)
        if shape.query_len > 1:  # (the attention then splits their contexts: triton_ops.verify_steps_split)
            tensors.query_len = shape.query_len
        return tensors

    @torch.inference_mode()
    def capture(self) -> None:
        started = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()
        output = None
        for shape in self.shapes():
            tensors = self.step_tensors(shape, padding=True)
            logits = self._forward(tensors)  # compiles this shape's kernels outside the capture
            if output is None:  # (the most rows any graph keeps, by the vocabulary)
                rows = max(s.tokens if s.logits is None else s.logits for s in self.shapes())
                output = torch.empty(rows, logits.shape[1], dtype=torch.float32, device=logits.device)
            del logits
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(tensors, out=output[:shape.tokens if shape.logits is None else shape.logits])
            self._graphs[shape] = (graph, logits)
        torch.cuda.synchronize()
        kinds = [f"{len(self.sizes)} decode batch sizes (1 to {self.sizes[-1]})"]
        if self.verify_sizes:
            kinds.append(f"{len(self.verify_sizes)} of steps verifying drafts ({self.verify_len} tokens a sequence, "
                         f"1 to {self.verify_sizes[-1]} sequences)")
        if self.token_buckets:
            kinds.append(f"{len(self.token_buckets)} of steps with prompt chunks ({self.token_buckets[0]} to "
                         f"{self.token_buckets[-1]} tokens)")
        logger.info("CUDA graphs: %s%s captured in %.1f s, %.0f MiB", ", ".join(kinds),
                    ", with and without LoRA," if len(self._variants) > 1 else "", time.perf_counter() - started,
                    (free_before - torch.cuda.mem_get_info()[0]) / 2**20)

    def covers(self, inputs: StepInputs) -> bool:
        return self._shape(inputs) is not None

    def _shape(self, inputs: StepInputs) -> GraphShape | None:
        """The shape of the graph that runs the step, if one does: a decode step of at most the largest
        bucket, sampling every row in order; a step of at most the largest verify bucket whose sequences
        have no more tokens than the verify length (any logits); else a step of at most the largest token
        bucket and as many logits rows as its bucket keeps. Never a step with virtual prompt tokens (a
        prompt's last token may come as a vector: prompt_embeds.py)."""
        seqs = len(inputs.seq_lens)
        if not self._graphs or seqs == 0 or inputs.embeds is not None:
            return None
        lora = inputs.lora_ids is not None
        if seqs <= self.sizes[-1] and inputs.is_decode and bool((inputs.logits_at == np.arange(seqs)).all()):
            size = self.sizes[bisect.bisect_left(self.sizes, seqs)]
            return GraphShape(size, size, 1, None, lora)
        if self.verify_sizes and seqs <= self.verify_sizes[-1] \
                and int(np.diff(inputs.cu_seqlens).max()) <= self.verify_len:
            size = self.verify_sizes[bisect.bisect_left(self.verify_sizes, seqs)]
            return GraphShape(size * self.verify_len, size, self.verify_len, None, lora)
        tokens, logits = len(inputs.input_ids), len(inputs.logits_at)
        for bucket in self.token_buckets[bisect.bisect_left(self.token_buckets, tokens):]:
            if min(bucket, self._max_seqs) >= logits:
                return GraphShape(bucket, self._max_seqs, 0, min(bucket, self._max_seqs), lora)
        return None

    @staticmethod
    def _padded(inputs: StepInputs, shape: GraphShape) -> tuple[StepInputs, np.ndarray | None]:
        """The step laid out for a graph of `shape`, and the graph's logits rows of its logits_at, where
        they are not the first ones in order."""
        if shape.query_len == 0:
            return ragged_step(inputs, shape), None
        return uniform_step(inputs, shape.seqs, shape.query_len)

    def graph(self, size: int, lora: bool = False) -> torch.cuda.CUDAGraph:
        """The graph captured for decode steps of `size` sequences (a bucket's size)."""
        return self._graphs[GraphShape(size, size, 1, None, lora)][0]

    def replay(self, inputs: StepInputs, sampled: torch.Tensor | None = None) -> torch.Tensor | None:
        """The step's logits [len(logits_at), vocab] from its graph, None where no graph covers it: unless
        its sequences were padded to the verify length, a view of the graphs' output, valid until the next
        replay."""
        shape = self._shape(inputs)
        if shape is None:
            return None
        graph, logits = self._graphs[shape]
        self.replays += 1
        if shape.query_len == 1:
            self._buffers.load(inputs, pad_seqs=shape.seqs, sampled=sampled)
            graph.replay()
            return logits[:len(inputs.seq_lens)]
        padded, rows = self._padded(inputs, shape)
        self._buffers.load(padded, sampled=sampled)
        graph.replay()
        if rows is None:
            self.ragged_replays += 1
            return logits[:len(inputs.logits_at)]
        self.verify_replays += 1
        return logits[to_device(rows, logits.device)]
