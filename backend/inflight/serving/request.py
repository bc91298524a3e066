"""Turn the inputs of one Triton request into a prompt and SamplingParams.

The input names are a superset of NVIDIA's vllm_backend (`text_input`, `stream`,
`exclude_input_in_output`, `sampling_parameters` as JSON) and of the TensorRT-LLM backend (`max_tokens`,
`min_length`, `end_id`, `stop_words`, ...), so genai-perf, perf_analyzer and existing clients work
unchanged. Every problem raises a ValueError that names the input.
"""

import json
import math
from dataclasses import dataclass

import numpy as np

from ..sampling_params import SamplingParams

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
    "ignore_eos": "ignore_eos",
}
FLAGS = ("stream", "exclude_input_in_output", "return_finish_reason", "return_num_input_tokens",
         "return_num_output_tokens")
KNOWN_INPUTS = {"text_input", "sampling_parameters", "end_id", "stop_words", "bad_words",
                *SCALAR_PARAMS, *FLAGS}
MAX_TEXT_BYTES = 1 << 20


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


def _text(name: str, value) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, (bytes, bytearray)):
        raise ValueError(f"input '{name}' must be BYTES (a UTF-8 string), got {type(value).__name__}")
    if len(value) > MAX_TEXT_BYTES:
        raise ValueError(f"input '{name}' is {len(value)} bytes long; at most {MAX_TEXT_BYTES} are accepted")
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"input '{name}' is not valid UTF-8 ({e.reason} at byte {e.start})") from None


def _word_list(name: str, array: np.ndarray) -> list[str]:
    words = [_text(name, v) for v in array.reshape(-1)]
    return [w for w in words if w]


def parse_request(inputs: dict[str, np.ndarray], defaults: dict | None = None,
                  parameters: dict | None = None) -> ParsedRequest:
    """`inputs` maps each input name the request carried to its numpy array; `parameters` are the
    request's parameters (HTTP generate turns unknown JSON keys into parameters, so a misspelt input
    arrives there and must not pass silently)."""
    unknown = sorted(set(inputs) - KNOWN_INPUTS)
    if unknown:
        raise ValueError(f"unknown input(s): {', '.join(unknown)}")
    unknown = sorted(k for k in (parameters or {}) if not k.startswith("triton_"))
    if unknown:
        raise ValueError(f"unknown parameter(s): {', '.join(unknown)}; inputs are: {', '.join(sorted(KNOWN_INPUTS))}")
    if "text_input" not in inputs:
        raise ValueError("input 'text_input' is required")
    prompt = _text("text_input", _scalar("text_input", inputs["text_input"]))
    if not prompt:
        raise ValueError("input 'text_input' must not be empty")

    values = dict(defaults or {})
    if "sampling_parameters" in inputs:
        raw = _text("sampling_parameters", _scalar("sampling_parameters", inputs["sampling_parameters"]))
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
        values["stop"] = list(values.get("stop", [])) + _word_list("stop_words", inputs["stop_words"])
    if "bad_words" in inputs:
        values["bad_words"] = list(values.get("bad_words", [])) + _word_list("bad_words", inputs["bad_words"])

    flags = {}
    for name in FLAGS:
        if name in inputs:
            value = _scalar(name, inputs[name])
            if not isinstance(value, bool):
                raise ValueError(f"input '{name}' must be BOOL, got {value!r}")
            flags[name] = value
    return ParsedRequest(prompt=prompt, params=SamplingParams(**values), **flags)
