"""Settings of the Triton model, from model_repository/llm/1/model.json: the engine's own knobs (the
names of `LLM(...)`) plus the admission limits that protect the server."""

from dataclasses import dataclass, fields

from ..config import EngineConfig


@dataclass
class AdmissionLimits:
    max_queued_requests: int = 1024  # waiting requests past which new ones are refused (UNAVAILABLE)
    max_tokens_limit: int = 4096  # the largest max_tokens a request may ask for
    max_prompt_tokens: int | None = None  # the longest prompt accepted (max_model_len applies anyway)
    default_max_tokens: int = 16  # max_tokens of a request that does not say

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "max_prompt_tokens":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{f.name} must be a positive integer, got {value!r}")


def split_settings(settings: dict) -> tuple[dict, AdmissionLimits]:
    """Engine settings (validated later by EngineConfig) and admission limits; unknown keys are an error."""
    engine_keys = {f.name for f in fields(EngineConfig)}
    limit_keys = {f.name for f in fields(AdmissionLimits)}
    unknown = sorted(set(settings) - engine_keys - limit_keys)
    if unknown:
        raise ValueError(f"unknown setting(s) in model.json: {', '.join(unknown)}")
    limits = AdmissionLimits(**{k: v for k, v in settings.items() if k in limit_keys})
    return {k: v for k, v in settings.items() if k in engine_keys}, limits
