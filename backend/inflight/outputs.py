"""What the engine hands out: per-step deltas for streaming, and whole results for generate()."""

from dataclasses import dataclass


@dataclass
class RequestDelta:
    """What one step added to one request. The concatenation of a request's deltas is its output."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    num_prompt_tokens: int
    num_output_tokens: int


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
