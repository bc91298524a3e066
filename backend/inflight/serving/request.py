"""Turn the inputs of one Triton request into a prompt and SamplingParams.

The input names follow NVIDIA's vllm_backend (`text_input`, `stream`, `exclude_input_in_output`,
`sampling_parameters` as JSON, `return_logprobs`, ...) and the TensorRT-LLM backend (`input_ids`,
`max_tokens`, `min_length`, `end_id`, `stop_words`, `return_log_probs`, guided decoding, ...), so
genai-perf, perf_analyzer and existing clients work unchanged (the README lists what is not
supported). Every problem raises a ValueError that names the input. Sizes are checked against the
server's limits (ServingSettings) before anything is tokenized.
"""

import base64
import binascii
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

import numpy as np

from ..lora_tasks import LoRATask
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
    "no_repeat_ngram_size": "no_repeat_ngram_size",
    "seed": "seed",
    "random_seed": "seed",  # TensorRT-LLM's name
    "ignore_eos": "ignore_eos",
    "beam_width": "beam_width",  # TensorRT-LLM's beam search, with its len_penalty and early_stopping
    "len_penalty": "length_penalty",
    "length_penalty": "length_penalty",  # (the name of TensorRT-LLM's ensemble and BLS models)
    "early_stopping": "early_stopping",
    "return_context_logits": "return_context_logits",  # TensorRT-LLM's raw logits outputs
    "return_generation_logits": "return_generation_logits",
}
FLAGS = ("stream", "exclude_input_in_output", "return_finish_reason", "return_num_input_tokens",
         "return_num_output_tokens",
         "return_logprobs", "return_cumulative_logprob",  # vllm_backend's
         "return_log_probs",  # TensorRT-LLM's: outputs output_log_probs and cum_log_probs
         "return_perf_metrics")  # TensorRT-LLM's: the request's timings and KV cache reuse, at its end
SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}
# Also read as sampling parameters: vLLM's names that SamplingParams takes out or vllm_backend renames.
VLLM_PARAMETERS = {"priority", "lora_name", "guided_decoding", "best_of", "use_beam_search", "detokenize",
                   "spaces_between_special_tokens"}
GUIDE_INPUTS = ("guided_decoding_guide_type", "guided_decoding_guide")  # TensorRT-LLM's structured outputs
BIAS_INPUTS = ("embedding_bias_words", "embedding_bias_weights")  # TensorRT-LLM's logit bias by words
LORA_TASK_INPUTS = ("lora_task_id", "lora_weights", "lora_config")  # TensorRT-LLM's LoRA adapters (lora_tasks.py)
KNOWN_INPUTS = {"text_input", "input_ids", "sampling_parameters", "end_id", "stop_words", "bad_words",
                "priority", "num_return_sequences", "beam_search_diversity_rate", "pad_id", "draft_input_ids",
                "draft_logits",
                "prompt_embedding_table", "prompt_vocab_size", "prompt_table_extra_ids",
                "image",  # vllm_backend's: base64-encoded image files, for a vision-language model
                *LORA_TASK_INPUTS, *SCALAR_PARAMS, *FLAGS,
                *GUIDE_INPUTS, *BIAS_INPUTS}


@dataclass
class ParsedRequest:
    prompt: str | list[int]  # text, or token ids (input_ids); [] where a prompt_embedding_table is the whole prompt
    params: SamplingParams
    priority: int = 0
    lora_name: str | None = None  # vllm_backend's: the LoRA adapter (one of the server's lora_modules)
    lora_task: LoRATask | None = None  # TensorRT-LLM's: an adapter sent with the request, or its task id
    stream: bool = False
    exclude_input_in_output: bool = False
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_logprobs: bool = False
    return_cumulative_logprob: bool = False
    return_log_probs: bool = False
    return_perf_metrics: bool = False
    per_completion_responses: bool = False  # TensorRT-LLM's num_return_sequences: a response per completion
    bias_words: list[tuple[str, float]] = field(default_factory=list)  # (word, bias), for `with_word_bias`
    # TensorRT-LLM's p-tuning table [rows, hidden]: input_ids from the model's vocab_size up read its rows;
    # without input_ids, its rows are the whole prompt (vLLM's prompt_embeds).
    prompt_embedding_table: np.ndarray | None = None
    images: list[bytes] | None = None  # vllm_backend's `image`: each an image file's bytes, for text_input

    def engine_prompt(self, token_ids: list[int]) -> list[int] | dict:
        """What the engine takes (LLMEngine.add_request): the token ids, the prompt of embeddings, or the
        text with its images (the model's processor tokenizes it, placing the images' tokens)."""
        if self.images is not None:
            return {"prompt": self.prompt, "multi_modal_data": {"image": self.images}}
        table = self.prompt_embedding_table
        if table is None:
            return token_ids
        if not token_ids:
            return {"prompt_embeds": table}
        return {"prompt_token_ids": token_ids, "prompt_embedding_table": table}


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


def _words(name: str, array: np.ndarray, settings: ServingSettings) -> list[str]:
    """The words of a BYTES input, empty ones included."""
    if array.size > settings.max_words:
        raise ValueError(f"input '{name}' holds {array.size} words; this server accepts at most "
                         f"{settings.max_words} (max_words)")
    return [_text(name, v, settings.max_input_bytes) for v in array.reshape(-1)]


def _word_list(name: str, array: np.ndarray, settings: ServingSettings) -> list[str]:
    return [w for w in _words(name, array, settings) if w]


def _check_words(field: str, words: list, settings: ServingSettings) -> None:
    if len(words) > settings.max_words:
        raise ValueError(f"{field} holds {len(words)} words; this server accepts at most {settings.max_words} "
                         "(max_words)")
    for word in words:
        if isinstance(word, str) and len(word) > settings.max_word_chars:
            raise ValueError(f"{field} holds a word of {len(word)} characters; this server accepts at most "
                             f"{settings.max_word_chars} (max_word_chars)")


def _joined(values: dict, name: str, more: list) -> list:
    """A list from sampling_parameters (`values[name]`, a string already one item of it) followed by
    `more`, what an input of TensorRT-LLM's adds to it."""
    given = values.get(name, [])
    if not isinstance(given, (list, tuple)):
        raise ValueError(f"{name} must be a list, got {given!r}")
    return [*given, *more]


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


def _bias_words(inputs: dict[str, np.ndarray], settings: ServingSettings) -> list[tuple[str, float]]:
    """TensorRT-LLM's embedding_bias_words with their embedding_bias_weights, one weight a word."""
    if not all(name in inputs for name in BIAS_INPUTS):
        raise ValueError("inputs 'embedding_bias_words' and 'embedding_bias_weights' go together")
    words = _words("embedding_bias_words", inputs["embedding_bias_words"], settings)
    _check_words("embedding_bias_words", words, settings)
    weights = inputs["embedding_bias_weights"]
    if weights.dtype.kind != "f" or weights.size != len(words) or not np.isfinite(weights).all():
        raise ValueError(f"input 'embedding_bias_weights' must hold a finite FP32 number for each of the "
                         f"{len(words)} embedding_bias_words, got {weights.dtype} {list(weights.shape)}")
    return [(word, float(w)) for word, w in zip(words, weights.reshape(-1)) if word]


def with_word_bias(params: SamplingParams, bias_words: list[tuple[str, float]],
                   encode: Callable[[str], list[int]]) -> SamplingParams:
    """`params` with each word's bias added to the logit bias of every token of the word (as the
    TensorRT-LLM backend reads embedding_bias_words; `encode` without special tokens)."""
    if not bias_words:
        return params
    bias = dict(params.logit_bias or {})
    for word, weight in bias_words:
        for token in encode(word):
            bias[token] = bias.get(token, 0.0) + weight
    return replace(params, logit_bias=bias)


def for_outputs(params: SamplingParams, requested_outputs: frozenset[str]) -> SamplingParams:
    """`params` for a client that named the outputs it wants (Triton's requested outputs; none named:
    every output): one that names them without `text_output` gets no text, so the engine decodes none
    (detokenize false; not where stop strings read the text)."""
    if not requested_outputs or "text_output" in requested_outputs or params.stop or not params.detokenize:
        return params
    return replace(params, detokenize=False)


def _prompt(inputs: dict[str, np.ndarray], max_bytes: int) -> str | list[int]:
    """The prompt: text_input, or input_ids (token ids, for clients that tokenize themselves); no ids
    where a prompt_embedding_table comes alone (its rows are the prompt)."""
    if "prompt_embedding_table" in inputs:
        if "text_input" in inputs:
            raise ValueError("input 'prompt_embedding_table' goes with 'input_ids' (ids from the model's vocab_size up "
                             "read its rows) or alone (its rows are the prompt), not with 'text_input'")
        if "input_ids" not in inputs:
            return []
    if ("text_input" in inputs) == ("input_ids" in inputs):
        raise ValueError("exactly one of the inputs 'text_input' and 'input_ids' is required")
    if "input_ids" in inputs:
        ids = _token_ids("input_ids", inputs["input_ids"])
        if not ids:
            raise ValueError("input 'input_ids' must not be empty")
        return ids
    prompt = _text("text_input", _scalar("text_input", inputs["text_input"]), max_bytes)
    if not prompt:
        raise ValueError("input 'text_input' must not be empty")
    return prompt


def _images(inputs: dict[str, np.ndarray], prompt: str | list[int], max_bytes: int) -> list[bytes] | None:
    """vllm_backend's `image` input: one base64-encoded image file (PNG, JPEG, ...) per element, each
    where a placeholder of text_input says."""
    if "image" not in inputs:
        return None
    if not isinstance(prompt, str):
        raise ValueError("input 'image' goes with 'text_input' (its image placeholders say where each image goes)")
    images = []
    for k, value in enumerate(inputs["image"].reshape(-1)):
        if isinstance(value, str):
            value = value.encode("ascii", "replace")
        if not isinstance(value, (bytes, bytearray)):
            raise ValueError(f"input 'image' must be BYTES (base64-encoded image files), got {type(value).__name__}")
        if len(value) > max_bytes:
            raise ValueError(f"image {k} is {len(value)} bytes long (base64); this server accepts at most "
                             f"{max_bytes} (max_image_bytes)")
        try:
            images.append(base64.b64decode(value, validate=True))
        except binascii.Error as e:
            raise ValueError(f"image {k} is not base64: {e}") from None
    if not images:
        raise ValueError("input 'image' holds no image")
    return images


def _embedding_table(inputs: dict[str, np.ndarray]) -> np.ndarray | None:
    """TensorRT-LLM's prompt_embedding_table [rows, hidden] (or [1, rows, hidden]), with its
    prompt_vocab_size (the number of rows) when given."""
    if "prompt_embedding_table" not in inputs:
        for name in ("prompt_vocab_size", "prompt_table_extra_ids"):
            if name in inputs:
                raise ValueError(f"input '{name}' needs 'prompt_embedding_table'")
        return None
    table = inputs["prompt_embedding_table"]
    if table.ndim == 3 and table.shape[0] == 1:
        table = table[0]
    if table.ndim != 2 or table.dtype.kind != "f" or 0 in table.shape:
        raise ValueError(f"input 'prompt_embedding_table' must be floats of shape [rows, hidden size], got "
                         f"{table.dtype} {list(table.shape)}")
    rows = _scalar("prompt_vocab_size", inputs["prompt_vocab_size"]) if "prompt_vocab_size" in inputs else len(table)
    if rows != len(table):
        raise ValueError(f"input 'prompt_vocab_size' ({rows}) must be the number of rows of 'prompt_embedding_table' "
                         f"({len(table)})")
    _check_extra_ids(inputs)
    return table


def _check_extra_ids(inputs: dict[str, np.ndarray]) -> None:
    """TensorRT-LLM's prompt_table_extra_ids, an id per input token telling its prefix cache which
    virtual tokens share rows: read and checked, never needed (the prefix cache compares the rows
    themselves, so equal rows share blocks and different ones never do)."""
    if "prompt_table_extra_ids" not in inputs:
        return
    if "input_ids" not in inputs:
        raise ValueError("input 'prompt_table_extra_ids' goes with 'input_ids' and 'prompt_embedding_table'")
    extra, tokens = inputs["prompt_table_extra_ids"], inputs["input_ids"].size
    if extra.dtype.kind not in "iu" or extra.ndim > 2 or extra.size != tokens:
        raise ValueError(f"input 'prompt_table_extra_ids' must be UINT64 ids, one per input token ({tokens}), got "
                         f"{extra.dtype} {list(extra.shape)}")


def _lora_task(inputs: dict[str, np.ndarray]) -> LoRATask | None:
    """TensorRT-LLM's lora_task_id, with lora_weights and lora_config the first time (the engine checks
    their shapes against the model)."""
    if not any(name in inputs for name in LORA_TASK_INPUTS):
        return None
    if "lora_task_id" not in inputs:
        raise ValueError("inputs 'lora_weights' and 'lora_config' go with 'lora_task_id'")
    task_id = _scalar("lora_task_id", inputs["lora_task_id"])
    if isinstance(task_id, bool) or not isinstance(task_id, int) or task_id < 0:
        raise ValueError(f"input 'lora_task_id' must be a UINT64 task id, got {task_id!r}")
    return LoRATask(task_id, inputs.get("lora_weights"), inputs.get("lora_config"))


def _token_ids(name: str, ids: np.ndarray) -> list[int]:
    """Token ids of shape [n] or [1, n] (their range is checked against the vocabulary later)."""
    if ids.dtype.kind not in "iu" or ids.ndim > 2 or (ids.ndim == 2 and ids.shape[0] != 1):
        raise ValueError(f"input '{name}' must be INT32 token ids of shape [n] or [1, n], got "
                         f"{ids.dtype} {list(ids.shape)}")
    return [int(t) for t in ids.reshape(-1)]


def _priority(from_json, inputs: dict[str, np.ndarray]) -> int:
    """The priority from sampling_parameters (possibly a string) and/or the `priority` input."""
    given = [("sampling_parameters", from_json)] if from_json is not None else []
    if "priority" in inputs:
        given.append(("priority", _scalar("priority", inputs["priority"])))
    values = []
    for name, value in given:
        if isinstance(value, str):
            try:
                value = int(value)
            except ValueError:
                raise ValueError(f"priority could not be read from the string {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, int) or abs(value) >= 2**31:
            raise ValueError(f"priority (in {name}) must be a 32-bit integer, got {value!r}")
        values.append(value)
    if len(set(values)) > 1:
        raise ValueError(f"inputs 'sampling_parameters' and 'priority' disagree ({values[0]} vs {values[1]})")
    return values[0] if values else 0


# The grammar backends a request may name under vLLM's older `guided_decoding`: ours is xgrammar.
XGRAMMAR_BACKENDS = ("xgrammar", "xgrammar:no-fallback", "auto")


def _rename_guided_decoding(values: dict) -> None:
    """vLLM's older name for structured_outputs, which vllm_backend still reads (a JSON object or its
    text), with its `backend` when that is xgrammar."""
    guided = values.pop("guided_decoding")
    if guided is None:
        return
    if values.get("structured_outputs") is not None:
        raise ValueError("give either 'structured_outputs' or 'guided_decoding' in sampling_parameters, not both")
    if isinstance(guided, str):
        try:
            guided = json.loads(guided)
        except json.JSONDecodeError as e:
            raise ValueError(f"guided_decoding is not valid JSON: {e.msg} at position {e.pos}") from None
    if isinstance(guided, dict) and "backend" in guided:
        guided = dict(guided)
        backend = guided.pop("backend")
        if backend is not None and backend not in XGRAMMAR_BACKENDS:
            raise ValueError(f"guided_decoding.backend {backend!r} is not available: this server's grammars are "
                             f"xgrammar's ({', '.join(XGRAMMAR_BACKENDS)})")
    values["structured_outputs"] = guided


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
    # Without sampling_parameters, the request's own parameters are read as sampling parameters, as
    # vllm_backend does; anything else among them is an error (HTTP generate turns misspelt inputs
    # into parameters, which must not pass silently).
    parameters = {k: v for k, v in (parameters or {}).items() if not k.startswith("triton_")}
    allowed = set() if "sampling_parameters" in inputs else SAMPLING_FIELDS | VLLM_PARAMETERS
    unknown = sorted(set(parameters) - allowed)
    if unknown:
        raise ValueError(f"unknown parameter(s): {', '.join(unknown)}; inputs are: {', '.join(sorted(KNOWN_INPUTS))}")
    prompt = _prompt(inputs, max_bytes)

    values = {"max_tokens": settings.default_max_tokens}
    if "sampling_parameters" in inputs:
        raw = _text("sampling_parameters", _scalar("sampling_parameters", inputs["sampling_parameters"]), max_bytes)
        try:
            from_json = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"input 'sampling_parameters' is not valid JSON: {e.msg} at position {e.pos}") from None
        if not isinstance(from_json, dict):
            raise ValueError(f"input 'sampling_parameters' must be a JSON object, got {type(from_json).__name__}")
    else:
        from_json = dict(parameters)
    priority = _priority(from_json.pop("priority", None), inputs)
    lora_name = from_json.pop("lora_name", None)
    if lora_name is not None and (not isinstance(lora_name, str) or not lora_name):
        raise ValueError(f"lora_name must be the name of a LoRA adapter, got {lora_name!r}")
    if "guided_decoding" in from_json:
        _rename_guided_decoding(from_json)
    from_json = SamplingParams.parse_fields(from_json, strings_allowed=True)
    values.update(from_json)

    given = {name: ("sampling_parameters", value) for name, value in from_json.items()}
    for name, target in SCALAR_PARAMS.items():
        if name not in inputs:
            continue
        value = _scalar(name, inputs[name])
        if target in given and given[target][1] != value:
            raise ValueError(f"inputs '{given[target][0]}' and '{name}' disagree ({given[target][1]} vs {value})")
        given[target] = (name, value)
        values[target] = value
    if "end_id" in inputs:
        values["stop_token_ids"] = _joined(values, "stop_token_ids", [_scalar("end_id", inputs["end_id"])])
    if "stop_words" in inputs:
        values["stop"] = _joined(values, "stop", _word_list("stop_words", inputs["stop_words"], settings))
    if "bad_words" in inputs:
        values["bad_words"] = _joined(values, "bad_words", _word_list("bad_words", inputs["bad_words"], settings))
    for name in ("stop", "bad_words"):
        if isinstance(values.get(name), (list, tuple)):
            _check_words(name, values[name], settings)
    if "draft_input_ids" in inputs:  # TensorRT-LLM's drafts from a draft model (draft-target speculative decoding)
        if "draft_token_ids" in from_json:
            raise ValueError("give drafts either as 'draft_token_ids' in 'sampling_parameters' or as "
                             "'draft_input_ids', not both")
        values["draft_token_ids"] = _token_ids("draft_input_ids", inputs["draft_input_ids"])
    if "draft_logits" in inputs:  # the draft model's logits, [drafts, vocab]: what each draft was drawn from
        if "draft_logits" in from_json:
            raise ValueError("give draft logits either in 'sampling_parameters' or as 'draft_logits', not both")
        values["draft_logits"] = inputs["draft_logits"]
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
    if "pad_id" in inputs:  # TensorRT-LLM pads beams to one length; here each beam is a response of its own
        pad_id = _scalar("pad_id", inputs["pad_id"])
        if isinstance(pad_id, bool) or not isinstance(pad_id, int) or pad_id < 0:
            raise ValueError(f"input 'pad_id' must be a token id, got {pad_id!r}")
    if "beam_search_diversity_rate" in inputs and _scalar("beam_search_diversity_rate",
                                                          inputs["beam_search_diversity_rate"]) != 0:
        raise ValueError("input 'beam_search_diversity_rate' must be 0: diverse beam search is not supported")
    # TensorRT-LLM's beam_width input returns every beam unless num_return_sequences says fewer; with
    # input_ids, each in a response of its own (its output_ids), as num_return_sequences' completions.
    beam_width = values.get("beam_width", 1)  # (not an integer: SamplingParams refuses it below)
    beams_by_input = "beam_width" in inputs and isinstance(beam_width, int) and beam_width > 1
    if beams_by_input and "num_return_sequences" not in inputs:
        values.setdefault("n", values["beam_width"])
    per_completion = "num_return_sequences" in inputs or (beams_by_input and isinstance(prompt, list))
    if "num_return_sequences" in inputs:
        n = _scalar("num_return_sequences", inputs["num_return_sequences"])
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= SamplingParams.MAX_N:
            raise ValueError(f"input 'num_return_sequences' must be an integer in [1, {SamplingParams.MAX_N}], "
                             f"got {n!r}")
        if values.get("n", n) != n:
            raise ValueError(f"inputs 'sampling_parameters' and 'num_return_sequences' disagree ({values['n']} vs {n})")
        values["n"] = n
    elif isinstance(prompt, list) and values.get("n", 1) != 1 and not per_completion:
        raise ValueError("with 'input_ids', several completions come from 'num_return_sequences' (a response "
                         "per completion, each with its output_ids), not from n")
    n = values.get("n", 1)  # (not an integer: SamplingParams refuses it below)
    if values.get("return_generation_logits") and isinstance(n, int) and n > 1 and not per_completion:
        raise ValueError("with n > 1, generation logits come in a response per completion: ask for them with "
                         "num_return_sequences")
    bias_words = _bias_words(inputs, settings) if any(name in inputs for name in BIAS_INPUTS) else []
    if any(flags.get(name) for name in ("return_logprobs", "return_cumulative_logprob", "return_log_probs")):
        values.setdefault("logprobs", 0)  # the sampled tokens' logprobs at least
    params = SamplingParams(**values)
    if params.max_tokens > settings.max_tokens_limit:
        raise ValueError(f"max_tokens ({params.max_tokens}) exceeds this server's limit of "
                         f"{settings.max_tokens_limit}")
    return ParsedRequest(prompt=prompt, params=params, priority=priority, lora_name=lora_name,
                         per_completion_responses=per_completion, bias_words=bias_words,
                         prompt_embedding_table=_embedding_table(inputs), lora_task=_lora_task(inputs),
                         images=_images(inputs, prompt, settings.max_image_bytes), **flags)
