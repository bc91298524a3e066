"""CUDA graphs of decode steps, and of steps that verify speculative drafts.

A decode step through transformers' modules is about forty kernel launches a layer, each issued by
Python: on a GPU the host, not the GPU, sets the step's pace. At start-up each bucket of batch sizes
(1, 2, 4, 8, then every 16 up to max_num_seqs) is captured once: the forward through the model's own
modules with our attention, to the float32 logits of every row. A decode step then loads its inputs
into the runner's InputBuffers, padded to the next bucket, and replays that bucket's graph.

Under speculative decoding a step that judges drafts computes each decoding sequence's last token and
its drafts, up to num_speculative_tokens + 1 tokens a sequence (the verify length). Its buckets are
captured too, each sequence given the verify length (`uniform_step`): a sequence with fewer tokens (fewer
drafts, or none) is padded after its last one with tokens that write no KV and whose logits nobody reads;
its real tokens attend exactly as they would alone, since a token sees only the keys before it. Without
these graphs every step with drafts ran eagerly, its host time many times a decode step's.

Everything that varies between steps is read from those device buffers: token ids, positions, cache
slots, sequence lengths, block tables. A graph fixes only its bucket's shape: the launch grids, the
split count of split-KV decode (triton_ops.decode_splits takes the bucket's size, never a context
length) and the block-table row width (the buffers' max_blocks). All graphs share one memory pool,
captured largest first so that the smaller ones reuse its memory.
"""

import bisect
import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from .input_buffers import InputBuffers, StepInputs, StepTensors, empty_step, to_device

logger = logging.getLogger(__name__)


def bucket_sizes(max_seqs: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then every 16, and max_seqs itself."""
    return sorted({n for n in (1, 2, 4, 8) if n < max_seqs} | set(range(16, max_seqs, 16)) | {max_seqs})


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
    slots = np.full(tokens, -1, dtype=np.int64)
    slots[rows] = inputs.slot_mapping
    seq_lens = np.full(seqs, query_len, dtype=np.int64)
    seq_lens[:real] = inputs.seq_lens - counts + query_len
    tables = np.zeros((seqs, inputs.block_tables.shape[1]), dtype=np.int64)
    tables[:real] = inputs.block_tables
    lora_ids = None
    if inputs.lora_ids is not None:
        lora_ids = np.zeros(tokens, dtype=np.int64)
        lora_ids[rows] = inputs.lora_ids
    padded = StepInputs(input_ids, positions, slots, np.arange(seqs + 1, dtype=np.int64) * query_len, seq_lens,
                        tables, np.zeros(0, dtype=np.int64), pending_at=rows[inputs.pending_at],
                        pending_rows=inputs.pending_rows, lora_ids=lora_ids)
    return padded, rows[inputs.logits_at]


class DecodeGraphs:
    def __init__(self, forward: Callable[[StepTensors], torch.Tensor], buffers: InputBuffers, max_seqs: int,
                 lora: bool = False, verify_len: int = 1, verify_seqs: int = 0):
        """`verify_len`: tokens a sequence in a step that verifies drafts (num_speculative_tokens + 1; 1:
        no drafts), captured for batches of up to `verify_seqs` sequences."""
        self._forward = forward  # step tensors -> float32 logits, one row per token
        self._buffers = buffers
        self.sizes = bucket_sizes(max_seqs)
        self.verify_len = verify_len
        self.verify_sizes = bucket_sizes(verify_seqs) if verify_len > 1 and verify_seqs > 0 else []
        # With LoRA adapters, each bucket twice: steps with an adapter, and steps of the base model alone,
        # which then pay nothing for the adapters (lora.py).
        self._variants = (False, True) if lora else (False,)
        # (query length, batch size, LoRA) -> the graph and its logits
        self._graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0  # steps run by a graph
        self.verify_replays = 0  # of which verifying drafts

    def keys(self) -> list[tuple[int, int, bool]]:
        """The graphs to capture, the most tokens first (all share one memory pool)."""
        shapes = [(1, size) for size in self.sizes] + [(self.verify_len, size) for size in self.verify_sizes]
        return [(length, size, lora) for length, size in sorted(shapes, key=lambda s: -s[0] * s[1])
                for lora in self._variants]

    def step_tensors(self, key: tuple[int, int, bool], padding: bool = False) -> StepTensors:
        """The device views a graph of `key` reads, for every row's logits (new view objects each call);
        `padding`: with a step of padding alone loaded first (it writes no KV), to capture."""
        length, size, lora = key
        if padding:
            self._buffers.load(uniform_step(empty_step(lora), size, length)[0])
        return self._buffers.views(length * size, size, self._buffers.max_blocks, None, lora,
                                   size if length == 1 else 0)

    @torch.inference_mode()
    def capture(self) -> None:
        started = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()
        for key in self.keys():
            tensors = self.step_tensors(key, padding=True)
            self._forward(tensors)  # compiles this bucket's kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(tensors)
            self._graphs[key] = (graph, logits)
        torch.cuda.synchronize()
        verify = (f" and {len(self.verify_sizes)} of steps verifying drafts ({self.verify_len} tokens a sequence, "
                  f"1 to {self.verify_sizes[-1]} sequences)" if self.verify_sizes else "")
        logger.info("CUDA graphs: %d decode batch sizes (1 to %d)%s%s captured in %.1f s, %.0f MiB",
                    len(self.sizes), self.sizes[-1], verify,
                    ", with and without LoRA," if len(self._variants) > 1 else "",
                    time.perf_counter() - started, (free_before - torch.cuda.mem_get_info()[0]) / 2**20)

    def covers(self, inputs: StepInputs) -> bool:
        return self._query_len(inputs) is not None

    def _query_len(self, inputs: StepInputs) -> int | None:
        """The query length of the graphs that can run the step, if any: 1 for a decode step of at most the
        largest bucket, sampling every row in order; the verify length for a step of at most the largest
        verify bucket whose sequences have no more tokens than that (any logits). Never a step with
        virtual prompt tokens (a prompt's last token may come as a vector: prompt_embeds.py)."""
        seqs = len(inputs.seq_lens)
        if not self._graphs or seqs == 0 or inputs.embeds is not None:
            return None
        if seqs <= self.sizes[-1] and inputs.is_decode and bool((inputs.logits_at == np.arange(seqs)).all()):
            return 1
        if self.verify_sizes and seqs <= self.verify_sizes[-1] \
                and int(np.diff(inputs.cu_seqlens).max()) <= self.verify_len:
            return self.verify_len
        return None

    def graph(self, size: int, lora: bool = False, query_len: int = 1) -> torch.cuda.CUDAGraph:
        """The graph captured for steps of `size` sequences (a bucket's size) of `query_len` tokens each."""
        return self._graphs[query_len, size, lora][0]

    def replay(self, inputs: StepInputs, sampled: torch.Tensor | None = None) -> torch.Tensor:
        """The step's logits [len(logits_at), vocab]: a decode step's a view of the graph's output, valid
        until its next replay."""
        length = self._query_len(inputs)
        seqs = len(inputs.seq_lens)
        sizes = self.sizes if length == 1 else self.verify_sizes
        size = sizes[bisect.bisect_left(sizes, seqs)]
        graph, logits = self._graphs[length, size, inputs.lora_ids is not None]
        self.replays += 1
        if length == 1:
            self._buffers.load(inputs, pad_seqs=size, sampled=sampled)
            graph.replay()
            return logits[:seqs]
        padded, rows = uniform_step(inputs, size, length)
        self._buffers.load(padded, sampled=sampled)
        graph.replay()
        self.verify_replays += 1
        return logits[to_device(rows, logits.device)]
