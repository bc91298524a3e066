"""The memory the largest step takes beside the weights and the KV cache, measured on a GPU at start-up.

A step's activations (each layer's inputs and outputs, the MLP's widest, the logits and what sampling
makes of them) come from torch's caching allocator while it runs, so the KV pool, when it is sized from
the free memory (kv_cache_memory_fraction), must leave room for them: sized from the free memory alone,
a pool could leave the first step of max_num_batched_tokens tokens, or the first to sample max_num_seqs
rows with every filter, to fail in the middle of serving on a GPU with little memory to spare. So before
the pool is allocated, one step that large runs over a pool of one block, writing no KV, then the
sampler's widest path and the logprobs over its logits; the pool's budget is the share of the free memory
less that step's peak (vLLM's profile run measures the same).

The share's remainder holds what the step does not: the CUDA graphs' own memory pool (captured later:
their activations, of up to cuda_graph_max_tokens tokens), the CUDA context and cuBLAS' workspaces.
Prompt logprobs of a whole chunk (a row of logits for each of its tokens) are not in the measured step.
"""

import types
from collections.abc import Callable

import numpy as np
import torch

from .input_buffers import InputBuffers, StepTensors, empty_prefill
from .logprobs import MAX_LOGPROBS, measure as measure_logprobs
from .sampler import draw, filter_probs
from .sampling_params import SamplingParams

# The sampler's widest path: every filter at once (top-k's and top-p's cuts, min-p's masked copy).
WIDEST_SAMPLING = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05)


def largest_step(max_tokens: int, max_seqs: int, block_size: int, device: torch.device) -> StepTensors:
    """A step of `max_tokens` prompt tokens of one sequence that writes no KV and reads only block 0 (a
    pool of one block will do), with logits at its last tokens: as many rows as a step samples at most.
    Its tokens are all at position 0, which any model's position table has (the memory is the same)."""
    inputs = empty_prefill(max_tokens, block_size)
    inputs.positions[:] = 0
    rows = min(max_seqs, max_tokens)
    inputs.logits_at = np.arange(max_tokens - rows, max_tokens, dtype=np.int64)
    return InputBuffers(max_tokens, 1, inputs.block_tables.shape[1], device).load(inputs)


@torch.inference_mode()
def run_largest_step(forward: Callable[[StepTensors], torch.Tensor], step: StepTensors) -> torch.Tensor:
    """The step's forward, then each of its rows sampled through every filter with its logprobs measured;
    returns the tokens drawn."""
    logits = forward(step)
    rows = [types.SimpleNamespace(params=WIDEST_SAMPLING)] * len(logits)
    tokens = draw(filter_probs(logits, rows), None, logits.max(dim=-1).indices)
    measure_logprobs(logits, tokens, MAX_LOGPROBS)
    return tokens


def peak_bytes(run: Callable[[], object], device: torch.device) -> int:
    """The most memory torch's allocator held on `device` while `run` ran, above what it held before."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before
