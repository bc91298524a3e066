"""Turn a request's deltas into the output tensors of its Triton responses (name -> numpy array), in
the conventions of vllm_backend (`text_output`, `finish_reason`, `logprobs` as JSON,
`cumulative_logprob`, token counts; with `n` completions, one entry per completion in every output) and
the TensorRT-LLM backend (`output_ids`, `output_log_probs`, `cum_log_probs`, the perf metrics; with
`num_return_sequences`, each completion in responses of its own, marked by `sequence_index`)."""

import json

import numpy as np

from ..outputs import RequestDelta, RequestMetrics, TokenLogprobs, joined
from .request import ParsedRequest


def logprobs_json(entries: list[TokenLogprobs]) -> str:
    """vllm_backend's format: per token, {token_id: {"logprob", "rank", "decoded_token"}}."""
    return json.dumps([{str(token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                        for token_id, lp in entry.items()} for entry in entries])


def perf_outputs(metrics: RequestMetrics) -> list[tuple[str, int | float, type]]:
    """TensorRT-LLM's perf metrics outputs: (name, value, dtype). Times are nanoseconds since the epoch
    (0: never reached), as INT64: a float cannot hold them to the nanosecond."""
    times = [(name, getattr(metrics, name) or 0, np.int64) for name in
             ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")]
    drafts, accepted = metrics.num_draft_tokens, metrics.num_accepted_draft_tokens
    return [("kv_cache_alloc_new_blocks", metrics.kv_new_blocks, np.int32),
            ("kv_cache_reused_blocks", metrics.kv_reused_blocks, np.int32),
            ("kv_cache_alloc_total_blocks", metrics.kv_total_blocks, np.int32), *times,
            ("acceptance_rate", accepted / drafts if drafts else 0.0, np.float32),
            ("total_accepted_draft_tokens", accepted, np.int32), ("total_draft_tokens", drafts, np.int32)]


class RequestResponses:
    """One request's responses. Streamed, a response goes out for each delta that brings text (or
    tokens, when the request asked for ids or logprobs); a delta with nothing to send is merged into
    the next. Not streamed, the text (after the prompt, unless exclude_input_in_output) goes out at the
    end. Responses carry either one completion (n = 1, or TensorRT-LLM's num_return_sequences) or all
    n of them (vllm_backend's n: every output has one entry per completion)."""

    def __init__(self, parsed: ParsedRequest, requested_outputs: frozenset[str] | None = None):
        self.parsed = parsed
        # The outputs the client named (Triton returns only those): the others are not built, a cost of
        # every response (a BYTES tensor's most of all). None: the client named none, so all of them.
        self._requested = requested_outputs or None
        self._n = parsed.params.n
        self._all_completions = self._n > 1 and not parsed.per_completion_responses
        self._pending: dict[int, list[RequestDelta]] = {}  # deltas not sent yet, by completion index
        self._last: dict[int, RequestDelta] = {}  # each completion's last delta sent
        # (a client that takes no text, whose engine decodes none: for_outputs, streams by tokens)
        self._wants_tokens = isinstance(parsed.prompt, list) or parsed.params.logprobs is not None \
            or not self._wants("text_output")

    def add(self, delta: RequestDelta) -> dict[str, np.ndarray] | None:
        """The outputs of the response this delta completes, or None when nothing is to be sent yet."""
        self._pending.setdefault(delta.index, []).append(delta)
        # (Judged by the new delta alone: had an earlier one been ready, it would have been sent.)
        if self.parsed.params.beam_search and self._all_completions:
            ready = delta.finished  # a search's beams all come in its last step: one response for them
        elif self.parsed.stream:
            ready = (delta.finished or delta.new_text or delta.finish_reason is not None
                     or (self._wants_tokens and delta.new_token_ids))
        else:
            ready = delta.finished or (delta.finish_reason is not None and not self._all_completions)
        if not ready:
            return None
        if self._all_completions:
            parts = [joined(self._pending.pop(i)) if i in self._pending else self._nothing(delta, i)
                     for i in range(self._n)]
        else:
            parts = [joined(self._pending.pop(delta.index))]
        self._last.update((d.index, d) for d in parts)
        return self._outputs(parts)

    def _nothing(self, like: RequestDelta, index: int) -> RequestDelta:
        """An empty delta for a completion that brought nothing since its last response."""
        last = self._last.get(index)
        return RequestDelta(like.request_id, [], "", like.finished, last and last.finish_reason, like.num_prompt_tokens,
                            last.num_output_tokens if last else 0, index=index,
                            cumulative_logprob=last and last.cumulative_logprob)

    def _outputs(self, parts: list[RequestDelta]) -> dict[str, np.ndarray]:
        parsed = self.parsed
        texts = [d.new_text for d in parts]
        ids = parts[0].new_token_ids
        if not parsed.stream and not parsed.exclude_input_in_output:
            if isinstance(parsed.prompt, list):
                ids = parsed.prompt + ids
            else:
                texts = [parsed.prompt + t for t in texts]
        wants = self._wants
        outputs = {}
        if wants("text_output"):
            outputs["text_output"] = np.array([t.encode("utf-8") for t in texts], dtype=np.object_)
        if isinstance(parsed.prompt, list) and wants("output_ids"):
            outputs["output_ids"] = np.array(ids, dtype=np.int32)
        if parsed.per_completion_responses and wants("sequence_index"):
            outputs["sequence_index"] = np.array([parts[0].index], dtype=np.int32)
        if parsed.return_finish_reason and wants("finish_reason"):
            outputs["finish_reason"] = np.array([(d.finish_reason or "").encode() for d in parts], dtype=np.object_)
        if parsed.return_num_input_tokens and wants("num_input_tokens"):
            outputs["num_input_tokens"] = np.array([parts[0].num_prompt_tokens], dtype=np.uint32)
        if parsed.return_num_output_tokens and wants("num_output_tokens"):
            outputs["num_output_tokens"] = np.array([d.num_output_tokens for d in parts], dtype=np.uint32)
        if parsed.return_logprobs and wants("logprobs"):
            outputs["logprobs"] = np.array([logprobs_json(d.new_logprobs or []).encode() for d in parts],
                                           dtype=np.object_)
        if parsed.return_cumulative_logprob and wants("cumulative_logprob"):
            outputs["cumulative_logprob"] = np.array([d.cumulative_logprob for d in parts], dtype=np.float32)
        if parsed.return_log_probs:
            delta = parts[0]
            if wants("output_log_probs"):
                sampled = [entry[token].logprob for entry, token in zip(delta.new_logprobs or [], delta.new_token_ids)]
                outputs["output_log_probs"] = np.array(sampled, dtype=np.float32)
            if wants("cum_log_probs"):
                outputs["cum_log_probs"] = np.array([delta.cumulative_logprob], dtype=np.float32)
        params = parsed.params
        if params.return_context_logits and wants("context_logits"):
            context = next((d.context_logits for d in parts if d.context_logits is not None), None)
            if context is not None:  # (in the response that brings the first tokens)
                outputs["context_logits"] = context
        if params.return_generation_logits and wants("generation_logits"):  # TensorRT-LLM's [beams, tokens, vocab]
            rows = parts[0].new_generation_logits or []
            outputs["generation_logits"] = (np.stack(rows) if rows else np.zeros((0, 0), np.float32))[None]
        metrics = next((d.metrics for d in parts if d.metrics), None)  # the request's final response
        if parsed.return_perf_metrics and metrics is not None:
            outputs.update((name, np.array([value], dtype=dtype)) for name, value, dtype in perf_outputs(metrics)
                           if wants(name))
        return outputs

    def _wants(self, name: str) -> bool:
        """Whether output `name` is built: every output, unless the client named the ones it wants."""
        return self._requested is None or name in self._requested

