"""Compiling the Triton attention kernels at start-up, not in the first requests.

Triton compiles a kernel the first time it is launched with a new set of compile-time constants, and
the attention kernel takes seconds to compile. The engine launches a few such sets: one for steps with
prefill chunks, and one per split count for decode steps (triton_ops.decode_splits: the count depends
on the batch size), each in every attention layer's variant (sliding window or not). Counts that vary
from step to step are not specialized (triton_ops), so one forward pass of each kind compiles them all.
Captured CUDA graphs cover decode steps, but eager decodes (graphs off, or steps that graphs do not
cover) would still compile their split counts in a request. Triton keeps what it compiled on disk,
so a second start with the same kernels takes a fraction of the time.
"""

import logging
import time
from collections.abc import Callable

import torch

from .input_buffers import InputBuffers, StepTensors, empty_prefill, empty_step

logger = logging.getLogger(__name__)


def decode_batch_per_split_count(max_seqs: int, num_kv_heads: int, num_sms: int) -> dict[int, int]:
    """The smallest decode batch size that launches each split count the engine can choose."""
    from .ops.triton_ops import decode_splits

    batches: dict[int, int] = {}
    for seqs in range(1, max_seqs + 1):
        batches.setdefault(decode_splits(seqs, num_kv_heads, num_sms), seqs)
    return batches


@torch.inference_mode()
def compile_attention_kernels(forward: Callable[[StepTensors], torch.Tensor], buffers: InputBuffers, max_seqs: int,
                              max_tokens: int, num_kv_heads: int, block_size: int, num_sms: int) -> None:
    """Run one prefill step and one decode step per split count through `forward`; they write no KV."""
    started = time.perf_counter()
    forward(buffers.load(empty_prefill(min(16, max_tokens), block_size)))
    batches = decode_batch_per_split_count(max_seqs, num_kv_heads, num_sms)
    for seqs in batches.values():
        logits = forward(buffers.load(empty_step(), pad_seqs=seqs))
    logits.cpu()  # waits for the GPU
    logger.info("Triton attention kernels ready for prefill and %d decode split counts (%s) in %.1f s",
                len(batches), ", ".join(map(str, sorted(batches))), time.perf_counter() - started)
