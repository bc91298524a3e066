"""What the engine hands out: per-step deltas for streaming, and whole results for generate()."""

from dataclasses import dataclass, replace


@dataclass
class RequestDelta:
    """What one step added to one request. The concatenation of a request's deltas is its output."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" once finished
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None = None  # why the engine ended the request, when finish_reason is "error"

    def followed_by(self, later: "RequestDelta") -> "RequestDelta":
        """This delta and a later one of the same request, as one."""
        return replace(later, new_token_ids=self.new_token_ids + later.new_token_ids,
                       new_text=self.new_text + later.new_text)


def coalesce(steps: list[list[RequestDelta]]) -> list[RequestDelta]:
    """Several steps' deltas as one delta per request, in the order requests first appear."""
    merged: dict[str, RequestDelta] = {}
    for deltas in steps:
        for delta in deltas:
            earlier = merged.get(delta.request_id)
            merged[delta.request_id] = delta if earlier is None else earlier.followed_by(delta)
    return list(merged.values())


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    error: str | None = None  # why the engine ended the request, when finish_reason is "error"
