"""What the engine hands out: per-step deltas for streaming, and whole results for generate()."""

import operator
import time
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


@dataclass
class Logprob:
    logprob: float  # log probability under the model's distribution (before temperature, penalties, filters)
    rank: int  # 1 for the most likely token
    decoded_token: str


# One entry per token: the sampled (or prompt) token and the k most likely, by token id.
TokenLogprobs = dict[int, Logprob]


@dataclass
class RequestMetrics:
    """When a request reached each stage, in nanoseconds since the epoch (time.time_ns, so that another
    process can compare them with its own clock), and what the prefix cache held of its prompt:
    TensorRT-LLM's per-request perf metrics, vLLM's num_cached_tokens."""

    arrival_time_ns: int  # added to the engine
    first_scheduled_time_ns: int | None = None  # first admitted to a step
    first_token_time_ns: int | None = None  # its first generated token known
    last_token_time_ns: int | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when first admitted
    kv_reused_blocks: int = 0  # the KV blocks holding them
    kv_total_blocks: int = 0  # the most KV blocks its (first) completion held
    num_draft_tokens: int = 0  # speculative decoding: drafts its (first) completion's steps judged ...
    num_accepted_draft_tokens: int = 0  # ... and kept

    @property
    def kv_new_blocks(self) -> int:
        return self.kv_total_blocks - self.kv_reused_blocks

    def token_known(self, now_ns: int | None = None) -> None:
        """A generated token's value is known now (`now_ns`: time.time_ns(), read by the caller)."""
        self.last_token_time_ns = time.time_ns() if now_ns is None else now_ns
        if self.first_token_time_ns is None:
            self.first_token_time_ns = self.last_token_time_ns


@dataclass(slots=True)  # (one a sequence a step)
class RequestDelta:
    """What one step added to one completion of a request. The concatenation of a completion's deltas
    is its output."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool  # the request is finished: every one of its completions
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" once this completion is finished
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None = None  # why the engine ended the request, when finish_reason is "error"
    # With an error: "invalid" (the request was refused: bad input) or "unavailable" (the engine has
    # stopped); None: the engine failed while serving it.
    error_kind: str | None = None
    new_logprobs: list[TokenLogprobs] | None = None  # one per new token, when logprobs were asked for
    cumulative_logprob: float | None = None  # over every token so far, when logprobs were asked for
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # in the first delta, when asked for
    index: int = 0  # which completion (of n)
    metrics: RequestMetrics | None = None  # in the request's final delta
    # TensorRT-LLM's raw logits, when asked for (float32 numpy arrays): [prompt tokens, vocab] in the first
    # delta, and a [vocab] row per new token
    context_logits: "np.ndarray | None" = None
    new_generation_logits: list | None = None

    def __reduce__(self):
        """Pickled as its fields' values in order (a step's deltas go so to the Triton model's process):
        half the bytes and time of the default's field names with each value, a third to unpickle."""
        return RequestDelta, _delta_values(self)


_delta_values = operator.attrgetter(*(f.name for f in fields(RequestDelta)))


def compact_deltas(deltas: list[RequestDelta]) -> list:
    """A step's deltas for the pipe to the Triton model's process: a running completion's delta of tokens
    and text alone (most of them) as the tuple of its six values, the others whole (expand_deltas undoes
    it). 128 deltas pickled in 30 µs instead of 98 on the engine's side (0.7 µs a delta's reduction)."""
    return [(d.request_id, d.new_token_ids, d.new_text, d.num_prompt_tokens, d.num_output_tokens, d.index)
            if d.finish_reason is None and not d.finished and d.error is None and d.error_kind is None
            and d.new_logprobs is None and d.cumulative_logprob is None and d.prompt_logprobs is None
            and d.metrics is None and d.context_logits is None and d.new_generation_logits is None else d
            for d in deltas]


def expand_deltas(items: list) -> list[RequestDelta]:
    return [RequestDelta(item[0], item[1], item[2], False, None, item[3], item[4], index=item[5])
            if type(item) is tuple else item for item in items]


def joined(deltas: list[RequestDelta]) -> RequestDelta:
    """Successive deltas of one completion as one: the last, with what each brought joined in one go (a
    pair at a time, a long output's deltas took time quadratic in its length)."""
    first, last = deltas[0], deltas[-1]
    if len(deltas) == 1:
        return first
    logprobs = None if first.new_logprobs is None else [e for d in deltas for e in d.new_logprobs or ()]
    generation = None if first.new_generation_logits is None else \
        [row for d in deltas for row in d.new_generation_logits or ()]
    return replace(last, new_token_ids=[t for d in deltas for t in d.new_token_ids],
                   new_text="".join(d.new_text for d in deltas), new_logprobs=logprobs,
                   prompt_logprobs=next((d.prompt_logprobs for d in deltas if d.prompt_logprobs), last.prompt_logprobs),
                   context_logits=next((d.context_logits for d in deltas if d.context_logits is not None), None),
                   new_generation_logits=generation)


def coalesce(steps: list[list[RequestDelta]]) -> list[RequestDelta]:
    """Several steps' deltas as one delta per completion, in the order of each one's last delta (so a
    request's final delta stays after its other completions')."""
    by_completion: dict[tuple[str, int], list[RequestDelta]] = {}
    for deltas in steps:
        for delta in deltas:
            key = (delta.request_id, delta.index)
            parts = by_completion.pop(key, [])
            parts.append(delta)
            by_completion[key] = parts
    return [joined(parts) for parts in by_completion.values()]


@dataclass
class CompletionOutput:
    """One completion of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    generation_logits: "np.ndarray | None" = None  # [tokens, vocab] float32, with return_generation_logits


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    error: str | None = None  # why the engine ended the request, when finish_reason is "error"
    # With an error: "invalid" (the request was refused: bad input) or "unavailable" (the engine has
    # stopped); None: the engine failed while serving it.
    error_kind: str | None = None
    metrics: RequestMetrics | None = None  # its timings and what the prefix cache held
    context_logits: "np.ndarray | None" = None  # [prompt tokens, vocab] float32, with return_context_logits

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens found in the prefix cache (vLLM's name)."""
        return self.metrics.num_cached_tokens if self.metrics else 0

    # The first completion's, for the common case of one.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason
