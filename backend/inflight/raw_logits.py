"""TensorRT-LLM's context and generation logits: the model's raw logits (float32, before any sampling
parameter touches them) at every prompt position, and for each generated token the logits it was drawn
from. Context logits come from the rows that prompt logprobs read (positions 0 to P-2) and from the
row of the first sampled token (position P-1, whose logits are also the first generated token's);
under beam search, each hypothesis's generated tokens' rows come along its beams (beam_search.py);
rows are copied to the host without waiting for the device, read with the step's other copies, and
handed out as numpy arrays (a torch tensor sent to the Triton model's process would go through torch's
shared-memory file descriptors, which processes not started by torch.multiprocessing cannot open).
"""

import numpy as np
import torch

from .sampling_params import SamplingParams
from .sequence import Sequence

# What one request's logits may hold (float32): a prompt of 8,192 tokens over a 32,000-token vocabulary
# is 1 GiB. A request that could hold more is refused when it is added.
MAX_LOGITS_BYTES = 1 << 30


def check_size(params: SamplingParams, num_prompt_tokens: int, vocab_size: int) -> None:
    """ValueError when the logits a request asks for could exceed MAX_LOGITS_BYTES."""
    row = 4 * vocab_size
    completions, which = (params.beam_width, "beam_width") if params.beam_search else (params.n, "n")
    for wanted, rows, what in ((params.return_context_logits, num_prompt_tokens, "its prompt's"),
                               (params.return_generation_logits, completions * params.max_tokens,
                                f"{which} x max_tokens generated tokens'")):
        if wanted and rows * row > MAX_LOGITS_BYTES:
            raise ValueError(f"the logits of {what} {rows} positions would take {rows * row / 2**20:.0f} MiB, "
                             f"more than the {MAX_LOGITS_BYTES >> 20} MiB a request may hold")


def to_host(rows: torch.Tensor) -> torch.Tensor:
    """A float32 copy of `rows` on the host, made without waiting for the device. A copy on a CPU too: the
    rows may view an output that the next step rewrites in place (a CUDA graph's, as the tests' graphs on
    a CPU do) before this step's are read."""
    if rows.device.type == "cpu":
        return rows.to(torch.float32, copy=True)
    return rows.float().to("cpu", non_blocking=True)


def own_row(row: torch.Tensor) -> np.ndarray:
    """A row of a step's host tensor as an array of its own (a view would keep the whole tensor)."""
    return row.numpy().copy()


def wants_sampled_row(seq: Sequence) -> bool:
    """Whether the row `seq` samples from now is kept: a generated token's logits, or the last prompt
    position's (its first token)."""
    p = seq.params
    return p.return_generation_logits or (p.return_context_logits and seq.index == 0 and not seq.output_token_ids
                                          and not seq.num_pending)


def record_sampled(seq: Sequence, row: torch.Tensor) -> None:
    """The row a token of `seq` was sampled from, its value now known."""
    row = own_row(row)
    record_prompts_last(seq, row)
    if seq.params.return_generation_logits:
        seq.generation_logits.append(row)


def record_prompts_last(seq: Sequence, row: np.ndarray) -> None:
    """`row`, the first token's logits, as the context logits' last (prompt position P-1) where asked."""
    if seq.params.return_context_logits and seq.index == 0 and len(seq.context_logits) == seq.num_prompt_tokens - 1:
        seq.context_logits.append(row)
