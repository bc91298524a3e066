"""Compiling the model for every shape class of a step at start-up, under `torch_compile`.

The model is compiled with dynamic shapes, so one graph serves any number of tokens, but torch.compile
still specializes sizes 0 and 1 (its zero-one specialization): a step of one token, or one that asks
for the logits of no position, one position or several, is a graph of its own, and the first step of
a class would compile it in the middle of a request (seconds). A step's class is its token count (1 or
more) and what logits it asks for: every token's (a padded decode batch: `logits_to_keep=0`) or those
at 0, 1 or several positions; the sequence count and the attention metadata do not count (our
attention is a graph break, so they never enter a graph). One step of each class, writing no KV,
compiles them all.
"""

from collections.abc import Callable

import torch

from .input_buffers import InputBuffers, StepInputs, StepTensors, empty_prefill, empty_step


def shape_class_steps(max_tokens: int, max_seqs: int, block_size: int) -> list[tuple[StepInputs, int | None]]:
    """One step of each shape class these limits allow, with its `pad_seqs` for InputBuffers.load."""
    tokens = min(16, max_tokens)
    steps = [(empty_prefill(n, block_size, sampled=sampled), None) for n in sorted({1, tokens})
             for sampled in (True, False)]
    if tokens >= 2 and max_seqs >= 2:  # several sampled positions
        steps.append((empty_prefill(tokens - tokens % 2, block_size, seqs=2), None))
    steps += [(empty_step(), rows) for rows in sorted({1, min(2, max_seqs)})]  # every token's logits
    return steps


@torch.inference_mode()
def compile_shape_classes(forward: Callable[[StepTensors], torch.Tensor], buffers: InputBuffers, max_tokens: int,
                          max_seqs: int, block_size: int) -> None:
    """Run one step of each shape class through `forward` (the compiled model's)."""
    for inputs, pad_seqs in shape_class_steps(max_tokens, max_seqs, block_size):
        forward(buffers.load(inputs, pad_seqs=pad_seqs))
