"""Turn a request's deltas into the output tensors of its Triton responses (name -> numpy array), in
the conventions of vllm_backend (`text_output`, `finish_reason`, `logprobs` as JSON,
`cumulative_logprob`, token counts) and the TensorRT-LLM backend (`output_ids`, `output_log_probs`,
`cum_log_probs`)."""

import json

import numpy as np

from ..outputs import RequestDelta, TokenLogprobs
from .request import ParsedRequest


def logprobs_json(entries: list[TokenLogprobs]) -> str:
    """vllm_backend's format: per token, {token_id: {"logprob", "rank", "decoded_token"}}."""
    return json.dumps([{str(token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                        for token_id, lp in entry.items()} for entry in entries])


class RequestResponses:
    """One request's responses. A streamed request gets one per delta that brings text (or tokens,
    when it asked for ids or logprobs; a delta that brings nothing to send is merged into the next);
    a non-streamed one gets one at the end, starting with the prompt unless exclude_input_in_output."""

    def __init__(self, parsed: ParsedRequest):
        self.parsed = parsed
        self._pending: RequestDelta | None = None
        self._wants_tokens = isinstance(parsed.prompt, list) or parsed.params.logprobs is not None

    def add(self, delta: RequestDelta) -> dict[str, np.ndarray] | None:
        """The outputs of the response this delta completes, or None when nothing is to be sent yet."""
        pending = delta if self._pending is None else self._pending.followed_by(delta)
        if self.parsed.stream:
            ready = pending.finished or pending.new_text or (self._wants_tokens and pending.new_token_ids)
        else:
            ready = pending.finished
        if not ready:
            self._pending = pending
            return None
        self._pending = None
        return self._outputs(pending)

    def _outputs(self, delta: RequestDelta) -> dict[str, np.ndarray]:
        parsed = self.parsed
        text, ids = delta.new_text, delta.new_token_ids
        if not parsed.stream and not parsed.exclude_input_in_output:
            if isinstance(parsed.prompt, list):
                ids = parsed.prompt + ids
            else:
                text = parsed.prompt + text
        outputs = {"text_output": np.array([text.encode("utf-8")], dtype=np.object_)}
        if isinstance(parsed.prompt, list):
            outputs["output_ids"] = np.array(ids, dtype=np.int32)
        if parsed.return_finish_reason:
            reason = (delta.finish_reason or "") if delta.finished else ""
            outputs["finish_reason"] = np.array([reason.encode()], dtype=np.object_)
        if parsed.return_num_input_tokens:
            outputs["num_input_tokens"] = np.array([delta.num_prompt_tokens], dtype=np.uint32)
        if parsed.return_num_output_tokens:
            outputs["num_output_tokens"] = np.array([delta.num_output_tokens], dtype=np.uint32)
        new_logprobs = delta.new_logprobs or []
        if parsed.return_logprobs:
            outputs["logprobs"] = np.array([logprobs_json(new_logprobs).encode()], dtype=np.object_)
        if parsed.return_cumulative_logprob:
            outputs["cumulative_logprob"] = np.array([delta.cumulative_logprob], dtype=np.float32)
        if parsed.return_log_probs:
            sampled = [entry[token].logprob for entry, token in zip(new_logprobs, delta.new_token_ids)]
            outputs["output_log_probs"] = np.array(sampled, dtype=np.float32)
            outputs["cum_log_probs"] = np.array([delta.cumulative_logprob], dtype=np.float32)
        return outputs
