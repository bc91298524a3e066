"""Turn the inputs of one Triton request into a prompt and SamplingParams.

The input names are a superset of NVIDIA's vllm_backend (`text_input`, `stream`,
`exclude_input_in_output`, `sampling_parameters` as JSON) and of the TensorRT-LLM backend (`max_tokens`,
`min_length`, `end_id`, `stop_words`, ...), so genai-perf, perf_analyzer and existing clients work
unchanged. Every problem raises a ValueError that names the input. Sizes are checked against the
server's limits (ServingSettings) before anything is tokenized.
"""

import json
import math
from dataclasses import dataclass

import numpy as np

from ..sampling_params import SamplingParams
from ..structured_output import TENSORRT_LLM_GUIDE_TYPES
from .settings import ServingSettings

# Tensor inputs that carry a sampling parameter: input name -> SamplingParams field.
SCALAR_PARAMS = {
    "max_tokens": "max_tokens",
    "min_tokens": "min_tokens",
    "min_length": "min_tokens",  # TensorRT-LLM's name
    "top_k": "top_k",
    "top_p": "top_p",
    "temperature": "temperature",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "seed": "seed",
    "random_seed": "seed",  # TensorRT-LLM's name
    "ignore_eos": "ignore_eos",
}
FLAGS = ("stream", "exclude_input_in_output", "return_finish_reason", "return_num_input_tokens",
         "return_num_output_tokens")
GUIDE_INPUTS = ("guided_decoding_guide_type", "guided_decoding_guide")  # TensorRT-LLM's structured outputs
KNOWN_INPUTS = {"text_input", "sampling_parameters", "end_id", "stop_words", "bad_words",
                *SCALAR_PARAMS, *FLAGS, *GUIDE_INPUTS}


@dataclass
class ParsedRequest:
    prompt: str
    params: SamplingParams
    stream: bool = False
    exclude_input_in_output: bool = False
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False


def _scalar(name: str, array: np.ndarray):
    if array.size != 1:
        raise ValueError(f"input '{name}' must hold exactly one value, got shape {list(array.shape)}")
    value = array.reshape(-1)[0]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"input '{name}' must be a finite number, got {value}")
    return value


def _text(name: str, value, max_bytes: int) -> str:
    if isinstance(value, str):
        value = value.encode("utf-8")
    if not isinstance(value, (bytes, bytearray)):
        raise ValueError(f"input '{name}' must be BYTES (a UTF-8 string), got {type(value).__name__}")
    if len(value) > max_bytes:
        raise ValueError(f"input '{name}' is {len(value)} bytes long; this server accepts at most {max_bytes} "
                         "(max_input_bytes)")
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"input '{name}' is not valid UTF-8 ({e.reason} at byte {e.start})") from None


def _word_list(name: str, array: np.ndarray, settings: ServingSettings) -> list[str]:
    if array.size > settings.max_words:
        raise ValueError(f"input '{name}' holds {array.size} words; this server accepts at most "
                         f"{settings.max_words} (max_words)")
    words = [_text(name, v, settings.max_input_bytes) for v in array.reshape(-1)]
    return [w for w in words if w]


def _check_words(field: str, words: list, settings: ServingSettings) -> None:
    if len(words) > settings.max_words:
        raise ValueError(f"{field} holds {len(words)} words; this server accepts at most {settings.max_words} "
                         "(max_words)")
    for word in words:
        if isinstance(word, str) and len(word) > settings.max_word_chars:
            raise ValueError(f"{field} holds a word of {len(word)} characters; this server accepts at most "
                             f"{settings.max_word_chars} (max_word_chars)")


def _guide(inputs: dict[str, np.ndarray], max_bytes: int) -> dict:
    """TensorRT-LLM's guided decoding inputs as a structured_outputs value."""
    if "guided_decoding_guide_type" not in inputs:
        raise ValueError("input 'guided_decoding_guide' needs 'guided_decoding_guide_type'")
    kind = _text("guided_decoding_guide_type", _scalar("guided_decoding_guide_type",
                                                       inputs["guided_decoding_guide_type"]), max_bytes)
    if kind not in TENSORRT_LLM_GUIDE_TYPES:
        raise ValueError(f"input 'guided_decoding_guide_type' must be one of "
                         f"{', '.join(TENSORRT_LLM_GUIDE_TYPES)}, got {kind!r}")
    key = TENSORRT_LLM_GUIDE_TYPES[kind]
    if key == "json_object":
        return {key: True}
    if "guided_decoding_guide" not in inputs:
        raise ValueError(f"input 'guided_decoding_guide' is required for guide type {kind!r}")
    return {key: _text("guided_decoding_guide", _scalar("guided_decoding_guide", inputs["guided_decoding_guide"]),
                       max_bytes)}


def parse_request(inputs: dict[str, np.ndarray], parameters: dict | None = None,
                  settings: ServingSettings | None = None) -> ParsedRequest:
    """`inputs` maps each input name the request carried to its numpy array; `parameters` are the
    request's parameters (HTTP generate turns unknown JSON keys into parameters, so a misspelt input
    arrives there and must not pass silently); `settings` give the defaults and limits."""
    settings = settings or ServingSettings()
    max_bytes = settings.max_input_bytes
    unknown = sorted(set(inputs) - KNOWN_INPUTS)
    if unknown:
        raise ValueError(f"unknown input(s): {', '.join(unknown)}")
    unknown = sorted(k for k in (parameters or {}) if not k.startswith("triton_"))
    if unknown:
        raise ValueError(f"unknown parameter(s): {', '.join(unknown)}; inputs are: {', '.join(sorted(KNOWN_INPUTS))}")
    if "text_input" not in inputs:
        raise ValueError("input 'text_input' is required")
    prompt = _text("text_input", _scalar("text_input", inputs["text_input"]), max_bytes)
    if not prompt:
        raise ValueError("input 'text_input' must not be empty")

    values = {"max_tokens": settings.default_max_tokens}
    if "sampling_parameters" in inputs:
        raw = _text("sampling_parameters", _scalar("sampling_parameters", inputs["sampling_parameters"]), max_bytes)
        try:
            from_json = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"input 'sampling_parameters' is not valid JSON: {e.msg} at position {e.pos}") from None
        if not isinstance(from_json, dict):
            raise ValueError(f"input 'sampling_parameters' must be a JSON object, got {type(from_json).__name__}")
        from_json = SamplingParams.parse_fields(from_json, strings_allowed=True)
        values.update(from_json)
    else:
        from_json = {}

    given = {field: ("sampling_parameters", value) for field, value in from_json.items()}
    for name, field in SCALAR_PARAMS.items():
        if name not in inputs:
            continue
        value = _scalar(name, inputs[name])
        if field in given and given[field][1] != value:
            raise ValueError(f"inputs '{given[field][0]}' and '{name}' disagree ({given[field][1]} vs {value})")
        given[field] = (name, value)
        values[field] = value
    if "end_id" in inputs:
        values["stop_token_ids"] = list(values.get("stop_token_ids", [])) + [_scalar("end_id", inputs["end_id"])]
    if "stop_words" in inputs:
        values["stop"] = list(values.get("stop", [])) + _word_list("stop_words", inputs["stop_words"], settings)
    if "bad_words" in inputs:
        values["bad_words"] = list(values.get("bad_words", [])) + _word_list("bad_words", inputs["bad_words"],
                                                                             settings)
    for field in ("stop", "bad_words"):
        if isinstance(values.get(field), (list, tuple)):
            _check_words(field, values[field], settings)
    if any(name in inputs for name in GUIDE_INPUTS):
        if "structured_outputs" in from_json:
            raise ValueError("give structured outputs either in 'sampling_parameters' or as "
                             "'guided_decoding_guide_type' / 'guided_decoding_guide', not both")
        values["structured_outputs"] = _guide(inputs, max_bytes)

    flags = {}
    for name in FLAGS:
        if name in inputs:
            value = _scalar(name, inputs[name])
            if not isinstance(value, bool):
                raise ValueError(f"input '{name}' must be BOOL, got {value!r}")
            flags[name] = value
    params = SamplingParams(**values)
    if params.max_tokens > settings.max_tokens_limit:
        raise ValueError(f"max_tokens ({params.max_tokens}) exceeds this server's limit of "
                         f"{settings.max_tokens_limit}")
    return ParsedRequest(prompt=prompt, params=params, **flags)
