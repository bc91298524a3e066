"""inflight: continuous batching over a paged KV cache, for NVIDIA Triton Inference Server."""

from .config import EngineConfig
from .engine import LLMEngine
from .llm import LLM
from .outputs import RequestDelta, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestDelta", "RequestOutput"]
