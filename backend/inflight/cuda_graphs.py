"""CUDA graphs of decode steps.

A decode step through transformers' modules is about forty kernel launches a layer, each issued by
Python: on a GPU the host, not the GPU, sets the step's pace. At start-up each bucket of batch sizes
(1, 2, 4, 8, then every 16 up to max_num_seqs) is captured once: the forward through the model's own
modules with our attention, to the float32 logits of every row. A decode step then loads its inputs
into the runner's InputBuffers, padded to the next bucket, and replays that bucket's graph.

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

from .input_buffers import InputBuffers, StepInputs, StepTensors, empty_step

logger = logging.getLogger(__name__)


def bucket_sizes(max_seqs: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then every 16, and max_seqs itself."""
    return sorted({n for n in (1, 2, 4, 8) if n < max_seqs} | set(range(16, max_seqs, 16)) | {max_seqs})


class DecodeGraphs:
    def __init__(self, forward: Callable[[StepTensors], torch.Tensor], buffers: InputBuffers, max_seqs: int,
                 lora: bool = False):
        self._forward = forward  # step tensors -> float32 logits, one row per token
        self._buffers = buffers
        self.sizes = bucket_sizes(max_seqs)
        # With LoRA adapters, each bucket twice: steps with an adapter, and steps of the base model alone,
        # which then pay nothing for the adapters (lora.py).
        self._variants = (False, True) if lora else (False,)
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0  # decode steps run by a graph

    @torch.inference_mode()
    def capture(self) -> None:
        started = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            for lora in self._variants:
                tensors = self._buffers.load(empty_step(lora), pad_seqs=size)
                self._forward(tensors)  # compiles this bucket's kernels outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward(tensors)
                self._graphs[size, lora] = (graph, logits)
        torch.cuda.synchronize()
        logger.info("CUDA graphs: %d decode batch sizes (1 to %d)%s captured in %.1f s, %.0f MiB",
                    len(self.sizes), self.sizes[-1], ", with and without LoRA," if len(self._variants) > 1 else "",
                    time.perf_counter() - started, (free_before - torch.cuda.mem_get_info()[0]) / 2**20)

    def covers(self, inputs: StepInputs) -> bool:
        """A decode step of at most the largest bucket, sampling every row in order, of real tokens only
        (a prompt's virtual last token comes as a vector: prompt_embeds.py)."""
        seqs = len(inputs.seq_lens)
        return (bool(self._graphs) and 0 < seqs <= self.sizes[-1] and inputs.is_decode and inputs.embeds is None
                and bool((inputs.logits_at == np.arange(seqs)).all()))

    def graph(self, size: int, lora: bool = False) -> torch.cuda.CUDAGraph:
        """The graph captured for decode steps of `size` sequences (a bucket's size)."""
        return self._graphs[size, lora][0]

    def replay(self, inputs: StepInputs, sampled: torch.Tensor | None = None) -> torch.Tensor:
        """The step's logits [sequences, vocab]: a view of the graph's output, valid until its next replay."""
        seqs = len(inputs.seq_lens)
        size = self.sizes[bisect.bisect_left(self.sizes, seqs)]
        graph, logits = self._graphs[size, inputs.lora_ids is not None]
        self._buffers.load(inputs, pad_seqs=size, sampled=sampled)
        graph.replay()
        self.replays += 1
        return logits[:seqs]
