"""Prompt logprobs (and TensorRT-LLM's context logits, which come from the same rows): a prompt chunk's
logits at position p predict prompt token p + 1. A step picks the positions its chunks predict
(`positions`), measures them on the device as it launches (`measure`), and records them on the
sequences once its copies to the host are done (`record`), under async scheduling a step later."""

from dataclasses import dataclass
from typing import Callable

import torch

from . import raw_logits
from .input_buffers import to_device
from .logprobs import MeasuredLogprobs, entries, measure as measure_logprobs
from .sequence import Sequence


@dataclass(slots=True)
class PromptPosition:
    seq: Sequence
    row: int  # the position's row in the step's flat batch
    target: int  # the index of the prompt token it predicts


@dataclass
class MeasuredPrompts:
    """What a step measured at its prompt positions, copied to the host without waiting."""

    positions: list[PromptPosition]
    tokens: list[int]  # the prompt token each position predicts
    wanting: list[int]  # the positions (indexes into `positions`) of sequences that asked for logprobs
    logprobs: MeasuredLogprobs | None  # of the positions `wanting`, in order
    context: torch.Tensor | None  # every position's raw row, when a sequence asked for context logits


def positions(seq: Sequence, n: int, start: int) -> list[PromptPosition]:
    """The positions of a chunk of `n` tokens (at row `start` of the batch) that predict prompt tokens
    not measured yet, counted as measured from here on (a recomputed chunk is not measured twice)."""
    first = seq.num_computed_tokens
    targets = range(max(first, seq.num_prompt_logprobs_measured) + 1, min(first + n, seq.num_prompt_tokens - 1) + 1)
    if targets:
        seq.num_prompt_logprobs_measured = targets[-1]
    return [PromptPosition(seq, start + target - 1 - first, target) for target in targets]


def measure(logits: torch.Tensor, positions: list[PromptPosition]) -> MeasuredPrompts | None:
    """`logits`: the rows of `positions`, in order (extra rows after them are ignored)."""
    if not positions:
        return None
    logits = logits[:len(positions)]
    tokens = [p.seq.prompt_token_ids[p.target] for p in positions]
    wanting = [i for i, p in enumerate(positions) if p.seq.params.prompt_logprobs is not None]
    measured = None
    if wanting:
        rows = logits if len(wanting) == len(positions) else logits[to_device(wanting, logits.device)]
        k = max(positions[i].seq.params.prompt_logprobs for i in wanting)
        measured = measure_logprobs(rows, to_device([tokens[i] for i in wanting], logits.device), k).to_host()
    context = raw_logits.to_host(logits) if any(p.seq.params.return_context_logits for p in positions) else None
    return MeasuredPrompts(positions, tokens, wanting, measured, context)


def record(measured: MeasuredPrompts, decode: Callable[[int], str]) -> None:
    """Each sequence's prompt logprobs and context logits, where it asked for them (read from the host
    copies: after the step's copy event)."""
    wanting = measured.wanting
    logprobs = entries(measured.logprobs, [measured.tokens[i] for i in wanting],
                       [measured.positions[i].seq.params.prompt_logprobs for i in wanting], decode) if wanting else []
    by_position = dict(zip(wanting, logprobs))
    for i, p in enumerate(measured.positions):
        seq = p.seq
        if seq.is_finished:
            continue
        if seq.params.return_context_logits:
            seq.context_logits.append(raw_logits.own_row(measured.context[i]))
        if i not in by_position:
            continue
        if not seq.prompt_logprobs:
            seq.prompt_logprobs.append(None)  # the first prompt token has nothing before it
        assert len(seq.prompt_logprobs) == p.target
        seq.prompt_logprobs.append(by_position[i])
