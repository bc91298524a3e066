"""inflight: continuous batching over a paged KV cache, for NVIDIA Triton Inference Server.

The names below load on first use: a light module of the package (launch.py) can be imported without
torch and transformers (seconds to import)."""

import importlib

_EXPORTS = {"EngineConfig": ".config", "LLMEngine": ".engine", "LLM": ".llm", "LoRATask": ".lora_tasks",
            "RequestDelta": ".outputs", "RequestOutput": ".outputs", "SamplingParams": ".sampling_params"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value
