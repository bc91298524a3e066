"""SamplingParams: the per-request knobs (vLLM's names), validated with errors that name the field."""

import json
import math
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

import numpy as np

from .logprobs import MAX_LOGPROBS

# What a request asks of a step beyond drawing a token at temperature 1 (the sampler's filters and
# processors, logprobs, raw logits, prompt logits), as the bits of SamplingParams.needs: a step ORs its
# rows' bits once (sampler.needs_of) where it scanned its rows for each feature (a dozen scans of 128
# rows, ~0.1 ms of the CI host's Python a step, twice that on the H200's host). The bits say what some
# row may need; the work itself still reads each row's values.
(GREEDY, TEMPERATURE, TOP_K, TOP_P, MIN_P, TOKEN_CONTROLS, REPETITION_PENALTY, PRESENCE_FREQUENCY_PENALTY,
 NO_REPEAT_NGRAMS, BAD_WORDS, MIN_TOKENS, LOGPROBS, STRUCTURED, SEEDED, RAW_LOGITS, PROMPT_LOGITS) = \
    (1 << i for i in range(16))


@dataclass
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # the stop string that ended the text stays in it
    bad_words: list[str] = field(default_factory=list)  # never generated (TensorRT-LLM's bad_words)
    no_repeat_ngram_size: int = 0  # HF's and TensorRT-LLM's: no n-gram of this size twice (prompt included)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before any other processing
    allowed_token_ids: list[int] | None = None  # only these tokens can be generated
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: as many as max_model_len)
    skip_special_tokens: bool = True
    detokenize: bool = True  # false: no text at all (token ids only; stop strings need the text)
    # One of {"json": schema}, {"json_object": True}, {"regex": ...}, {"choice": [...]}, {"grammar": ...}
    # (structured_output.py); checked and compiled when the request is added.
    structured_outputs: dict | None = None
    logprobs: int | None = None  # the sampled token's logprob plus this many most likely tokens' (0: only it)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    # TensorRT-LLM's: the model's raw logits at every prompt position, and those of each generated token
    return_context_logits: bool = False
    return_generation_logits: bool = False
    n: int = 1  # completions of the prompt, which is computed once (with beam search: the best n beams)
    # Beam search (HF transformers' algorithm, beam_search.py) when above 1: the beams kept each step.
    beam_width: int = 1
    length_penalty: float = 1.0  # a finished beam's score: its log probability / its length ** this
    early_stopping: bool | str = False  # True: stop at beam_width finished beams; "never": the exact search
    # Drafts of the first tokens (TensorRT-LLM's draft_input_ids: proposed by a draft model elsewhere), judged
    # in the step that computes the prompt's end; what is kept is the model's output (speculative.py).
    draft_token_ids: list[int] | None = None
    # The draft model's logits [drafts, vocab] (TensorRT-LLM's draft_logits): each draft was drawn from the
    # softmax of its row, which a sampled row judges it against; none: a one-hot proposal.
    draft_logits: np.ndarray | None = None

    # The engine's ceilings for words (each stop string and bad word is searched or tokenized per
    # request); a server may set lower limits (serving/settings.py).
    MAX_STOP_STRINGS = 64
    MAX_STOP_LENGTH = 256
    MAX_N = 64
    MAX_DRAFT_TOKENS = 64

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids", "bad_words"):
            if not isinstance(getattr(self, name), (list, tuple)):
                raise ValueError(f"{name} must be a list, got {getattr(self, name)!r}")
            setattr(self, name, list(getattr(self, name)))
        self._check_int("max_tokens", minimum=1)
        self._check_int("min_tokens", minimum=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        self._check_float("temperature", minimum=0.0)
        self._check_int("top_k", minimum=-1)
        self._check_float("top_p", minimum=0.0, maximum=1.0)
        if self.top_p <= 0.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self._check_float("min_p", minimum=0.0, maximum=1.0)
        if self.seed is not None:
            self._check_int("seed", minimum=0)
            if self.seed >= 2**64:
                raise ValueError(f"seed must be below 2**64, got {self.seed}")
        self._check_float("repetition_penalty", minimum=0.0)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        self._check_float("presence_penalty", minimum=-2.0, maximum=2.0)
        self._check_float("frequency_penalty", minimum=-2.0, maximum=2.0)
        self._check_int("no_repeat_ngram_size", minimum=0)
        for name in ("ignore_eos", "skip_special_tokens", "detokenize", "include_stop_str_in_output",
                     "return_context_logits", "return_generation_logits"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are searched for in the text: they need detokenize true")
        if len(self.stop) > self.MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(self.stop)} strings; at most {self.MAX_STOP_STRINGS} are allowed")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
            if len(s) > self.MAX_STOP_LENGTH:
                raise ValueError(f"stop strings must be at most {self.MAX_STOP_LENGTH} characters long")
        if len(self.bad_words) > self.MAX_STOP_STRINGS:
            raise ValueError(f"bad_words has {len(self.bad_words)} entries; at most {self.MAX_STOP_STRINGS} "
                             "are allowed")
        if any(not isinstance(w, str) or not w for w in self.bad_words):
            raise ValueError("bad_words must hold non-empty strings")
        if any(len(w) > self.MAX_STOP_LENGTH for w in self.bad_words):
            raise ValueError(f"bad_words must be at most {self.MAX_STOP_LENGTH} characters long")
        if len(self.stop_token_ids) > self.MAX_STOP_STRINGS:
            raise ValueError(f"stop_token_ids has more than {self.MAX_STOP_STRINGS} entries")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"stop_token_ids must hold non-negative integers, got {t!r}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                self._check_int(name, minimum=0)
                if getattr(self, name) > MAX_LOGPROBS:
                    raise ValueError(f"{name} must be at most {MAX_LOGPROBS}, got {getattr(self, name)}")
        self._check_token_controls()
        self._check_int("n", minimum=1)
        if self.n > self.MAX_N:
            raise ValueError(f"n must be at most {self.MAX_N}, got {self.n}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, dict):
            raise ValueError(f"structured_outputs must be an object, got {self.structured_outputs!r}")
        self._check_beam_search()
        self._check_drafts()
        self._check_draft_logits()

    # What beam search leaves at its default: it ranks beams by log probabilities (after token controls,
    # penalties and bans, as HF's logits processors), never filtered for sampling.
    _NOT_WITH_BEAM_SEARCH = {"top_k": (0, -1), "top_p": (1.0,), "min_p": (0.0,)}

    def _check_beam_search(self) -> None:
        self._check_int("beam_width", minimum=1)
        if self.beam_width > self.MAX_N:
            raise ValueError(f"beam_width must be at most {self.MAX_N}, got {self.beam_width}")
        self._check_float("length_penalty", minimum=-math.inf)
        if not isinstance(self.early_stopping, bool) and self.early_stopping != "never":
            raise ValueError(f"early_stopping must be true, false or \"never\", got {self.early_stopping!r}")
        if not self.beam_search:
            return
        if self.n > self.beam_width:
            raise ValueError(f"n ({self.n}) must not exceed beam_width ({self.beam_width}): beam search returns "
                             "its n best beams")
        if self.temperature not in (0.0, 1.0):
            raise ValueError(f"beam search ranks beams by the model's log probabilities: temperature must be 0 or "
                             f"1 (the default), got {self.temperature}")
        for name, defaults in self._NOT_WITH_BEAM_SEARCH.items():
            if getattr(self, name) not in defaults:
                raise ValueError(f"{name} is not supported with beam search (beam_width {self.beam_width})")
        if self.structured_outputs is not None and self.ignore_eos:
            raise ValueError("ignore_eos is not supported with structured_outputs under beam search: a beam's "
                             "grammar ends it with EOS")

    # What a draft's row needs left at its default: each draft is judged by its own row, before the tokens
    # before it are known (drafts_judged_alone; speculative.can_speculate for the engine's own drafts).
    _ROW_DEPENDS_ON_EARLIER_TOKENS = {"beam_width": (1,), "repetition_penalty": (1.0,), "presence_penalty": (0.0,),
                                      "frequency_penalty": (0.0,), "bad_words": ([],), "no_repeat_ngram_size": (0,),
                                      "return_generation_logits": (False,)}
    # Drafts given with the request also ride with its prompt's end: that row is its completions' first
    # (n forks them), the last prompt position's (context logits), and min_tokens has not begun.
    _NOT_WITH_DRAFTS = {"n": (1,), "min_tokens": (0,), "return_context_logits": (False,),
                        **_ROW_DEPENDS_ON_EARLIER_TOKENS}

    def _check_drafts(self) -> None:
        if self.draft_token_ids is None:
            return
        if not isinstance(self.draft_token_ids, (list, tuple)):
            raise ValueError(f"draft_token_ids must be a list of token ids, got {self.draft_token_ids!r}")
        if len(self.draft_token_ids) > self.MAX_DRAFT_TOKENS:
            raise ValueError(f"draft_token_ids has {len(self.draft_token_ids)} tokens; at most "
                             f"{self.MAX_DRAFT_TOKENS} are judged")
        self.draft_token_ids = [_token_id("draft_token_ids", t) for t in self.draft_token_ids] or None
        for name, defaults in self._NOT_WITH_DRAFTS.items():
            if self.draft_token_ids and getattr(self, name) not in defaults:
                raise ValueError(f"{name} is not supported with draft_token_ids (each draft is judged by its own "
                                 "row, before the tokens before it are known)")

    def _check_draft_logits(self) -> None:
        """[drafts, vocab] floats (-inf allowed: a token the draft model could not draw), under which each
        draft has a probability above 0; their width is checked against the model (check_token_ids)."""
        if self.draft_logits is None:
            return
        if not self.draft_token_ids:
            raise ValueError("draft_logits need draft_token_ids: the drafts drawn from them")
        try:
            logits = np.array(self.draft_logits, dtype=np.float32)
        except (TypeError, ValueError):
            raise ValueError("draft_logits must be numbers of shape [drafts, vocab]") from None
        if logits.ndim != 2 or len(logits) != len(self.draft_token_ids) or not logits.shape[1]:
            raise ValueError(f"draft_logits must have a row for each of the {len(self.draft_token_ids)} drafts, "
                             f"got shape {list(logits.shape)}")
        if np.isnan(logits).any() or np.isposinf(logits).any():
            raise ValueError("draft_logits must be finite numbers (or -inf)")
        self.draft_logits = logits
        # (a draft beyond the rows' width is left to check_token_ids, which names the width)
        drawable = [d >= logits.shape[1] or self.draft_probs[i, d] > 0 for i, d in enumerate(self.draft_token_ids)]
        if not all(drawable):
            raise ValueError(f"draft {drawable.index(False)} has no probability under its row of draft_logits: it "
                             "could not have been drawn from them")

    @cached_property
    def drafts_judged_alone(self) -> bool:
        """Whether a row of this request can judge a draft without knowing the tokens before it."""
        return all(getattr(self, name) in defaults for name, defaults in self._ROW_DEPENDS_ON_EARLIER_TOKENS.items())

    @property
    def beam_search(self) -> bool:
        return self.beam_width > 1

    @property
    def needs_prompt_logits(self) -> bool:
        """Logits at every prompt position (none may come from the prefix cache)."""
        return self.prompt_logprobs is not None or self.return_context_logits

    def _check_token_controls(self) -> None:
        """logit_bias (JSON's keys are strings: integers written as strings are read as such),
        allowed_token_ids and truncate_prompt_tokens; the ids' upper bound is the model's vocabulary,
        which the engine checks (`check_token_ids`)."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be an object of token id -> bias, got {self.logit_bias!r}")
            bias = {}
            for token, value in self.logit_bias.items():
                token = _token_id("logit_bias", token, strings_allowed=True)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise ValueError(f"logit_bias values must be finite numbers, got {value!r} for token {token}")
                if token in bias:
                    raise ValueError(f"logit_bias gives token {token} twice")
                bias[token] = float(value)
            self.logit_bias = bias
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids:
                raise ValueError(f"allowed_token_ids must be a non-empty list, got {self.allowed_token_ids!r}")
            self.allowed_token_ids = [_token_id("allowed_token_ids", t) for t in self.allowed_token_ids]
        keep = self.truncate_prompt_tokens
        if keep is not None and not (type(keep) is int and keep == -1):
            self._check_int("truncate_prompt_tokens", minimum=1)

    def check_token_ids(self, vocab_size: int) -> None:
        """The token ids of logit_bias, allowed_token_ids and draft_token_ids are within the model's
        vocabulary, and draft_logits rows span it."""
        for name, ids in (("logit_bias", self.logit_bias or ()), ("allowed_token_ids", self.allowed_token_ids or ()),
                          ("draft_token_ids", self.draft_token_ids or ())):
            beyond = sorted(t for t in ids if t >= vocab_size)
            if beyond:
                raise ValueError(f"{name} holds token ids beyond the vocabulary of {vocab_size}: {beyond[:8]}")
        if self.draft_logits is not None and self.draft_logits.shape[1] != vocab_size:
            raise ValueError(f"draft_logits rows have {self.draft_logits.shape[1]} entries; the model's vocabulary "
                             f"has {vocab_size}")

    @cached_property
    def draft_probs(self) -> np.ndarray:
        """The distributions the drafts were drawn from: softmax of draft_logits' rows (float32)."""
        with np.errstate(invalid="ignore"):  # (a row of -inf only: NaN, which _check_draft_logits refuses)
            exp = np.exp(self.draft_logits - self.draft_logits.max(axis=1, keepdims=True))
            return exp / exp.sum(axis=1, keepdims=True)

    @cached_property
    def allowed_array(self) -> np.ndarray:
        """allowed_token_ids as a sorted array without repeats (the sampler's form)."""
        return np.unique(np.asarray(self.allowed_token_ids, dtype=np.int64))

    @cached_property
    def allowed_set(self) -> frozenset[int]:
        return frozenset(self.allowed_token_ids)

    @cached_property
    def bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """logit_bias as (token ids, float32 biases)."""
        bias = self.logit_bias or {}
        return np.fromiter(bias.keys(), np.int64, len(bias)), np.fromiter(bias.values(), np.float32, len(bias))

    def truncated(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's last truncate_prompt_tokens tokens (all of them when it is not set)."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return token_ids
        keep = max_model_len if keep == -1 else keep
        return token_ids[-keep:] if len(token_ids) > keep else token_ids

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @cached_property
    def needs(self) -> int:
        """The work this request may ask of a step: bits of the constants above (the fields do not change
        once validated)."""
        asked = ((self.greedy, GREEDY), (self.temperature not in (0.0, 1.0), TEMPERATURE), (self.top_k > 0, TOP_K),
                 (self.top_p < 1.0, TOP_P), (self.min_p > 0, MIN_P),
                 (self.allowed_token_ids is not None or bool(self.logit_bias), TOKEN_CONTROLS),
                 (self.repetition_penalty != 1.0, REPETITION_PENALTY),
                 (bool(self.presence_penalty or self.frequency_penalty), PRESENCE_FREQUENCY_PENALTY),
                 (self.no_repeat_ngram_size > 0, NO_REPEAT_NGRAMS), (bool(self.bad_words), BAD_WORDS),
                 (self.min_tokens > 0, MIN_TOKENS), (self.logprobs is not None, LOGPROBS),
                 (self.structured_outputs is not None, STRUCTURED), (self.seed is not None, SEEDED),
                 (self.return_generation_logits or self.return_context_logits, RAW_LOGITS),
                 (self.needs_prompt_logits, PROMPT_LOGITS))
        return sum(bit for on, bit in asked if on)

    @property
    def stop_hold_back(self) -> int:
        """Characters of a running sequence's text kept from its stream: those that could be the start
        of a stop string, which would be cut. Nothing when the stop string is kept: a match then cuts only
        what follows it, which has not been sent."""
        if self.include_stop_str_in_output or not self.stop:  # (read for every token: no generator when none)
            return 0
        return self.stop_reach_back

    @property
    def stop_reach_back(self) -> int:
        """Characters before a new piece of text that a stop string ending in it can start at."""
        return max(len(s) for s in self.stop) - 1 if self.stop else 0

    def _check_int(self, name: str, minimum: int) -> None:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        if value < minimum:
            raise ValueError(f"{name} must be at least {minimum}, got {value}")

    def _check_float(self, name: str, minimum: float, maximum: float = math.inf) -> None:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name} must be a number, got {value!r}")
        if not math.isfinite(value) or not minimum <= value <= maximum:
            bounds = f" [{minimum}, {maximum}]" if math.isfinite(maximum) else \
                f" >= {minimum}" if math.isfinite(minimum) else ""
            raise ValueError(f"{name} must be a finite number{bounds}, got {value}")
        setattr(self, name, float(value))

    @classmethod
    def from_dict(cls, values: dict[str, Any], strings_allowed: bool = False) -> "SamplingParams":
        """Build from a mapping (a JSON object); see `parse_fields`."""
        return cls(**cls.parse_fields(values, strings_allowed))

    @classmethod
    def parse_fields(cls, values: dict[str, Any], strings_allowed: bool = False) -> dict[str, Any]:
        """Check a mapping's keys against the fields (unknown keys are an error) and, with
        `strings_allowed`, read scalar values sent as strings (genai-perf sends {"max_tokens": "32"})."""
        if not isinstance(values, dict):
            raise ValueError(f"sampling parameters must be a JSON object, got {type(values).__name__}")
        values = {name: value for name, value in values.items() if value is not None}  # null: the default
        _drop_vllm_defaults(values, strings_allowed)
        types = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(values) - set(types))
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return {name: _parse_string(name, value, types[name]) if strings_allowed and isinstance(value, str)
                else value for name, value in values.items()}


def _drop_vllm_defaults(values: dict[str, Any], strings_allowed: bool) -> None:
    """vLLM's SamplingParams fields that this engine does not have, taken out of `values` when they ask
    for nothing (a client that sends every field of vLLM's sends them): `spaces_between_special_tokens`
    true, `best_of` equal to n. Any other value is refused by name.
    vLLM's older beam search, `use_beam_search` with `best_of` beams, becomes beam_width."""
    def read(name: str, kind: type) -> Any:
        value = values[name]
        return _parse_string(name, value, kind) if strings_allowed and isinstance(value, str) else value

    if "spaces_between_special_tokens" in values:
        if read("spaces_between_special_tokens", bool) is not True:
            raise ValueError("spaces_between_special_tokens is not supported but at its default, true; got "
                             f"{values['spaces_between_special_tokens']!r}")
        del values["spaces_between_special_tokens"]
    use_beam_search = read("use_beam_search", bool) if "use_beam_search" in values else False
    values.pop("use_beam_search", None)
    if not isinstance(use_beam_search, bool):
        raise ValueError(f"use_beam_search must be a boolean, got {use_beam_search!r}")
    n = read("n", int) if "n" in values else 1
    best_of = read("best_of", int) if "best_of" in values else None
    values.pop("best_of", None)
    if use_beam_search:
        if isinstance(best_of, bool) or not isinstance(best_of, int) or best_of < 2:
            raise ValueError(f"use_beam_search needs best_of, the number of beams, above 1; got {best_of!r}")
        if values.get("beam_width", best_of) != best_of:
            raise ValueError(f"best_of ({best_of}) and beam_width ({values['beam_width']!r}) disagree")
        values["beam_width"] = best_of
    elif best_of is not None and (isinstance(best_of, bool) or best_of != n):
        raise ValueError(f"best_of is not supported but equal to n ({n!r}) or with use_beam_search; got {best_of!r}")


def _token_id(name: str, value: Any, strings_allowed: bool = False) -> int:
    if strings_allowed and isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            raise ValueError(f"{name} keys must be token ids, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must hold non-negative integer token ids, got {value!r}")
    return value


def _parse_string(name: str, text: str, annotation: Any) -> Any:
    kind = str(annotation)
    if "list[int]" in kind:  # token ids: a JSON list, or one id
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            raise ValueError(f"{name} could not be read from the string {text!r}") from None
        return value if isinstance(value, list) else [value]
    if "list" in kind:
        return [text]  # a single stop string or bad word
    if "dict" in kind:
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e.msg} at position {e.pos}") from None
    if kind == "bool | str" and text.strip().lower() not in ("true", "false", "1", "0"):
        return text  # early_stopping: "never"
    try:
        if "bool" in kind:
            lowered = text.strip().lower()
            if lowered not in ("true", "false", "1", "0"):
                raise ValueError
            return lowered in ("true", "1")
        if "int" in kind:
            return int(text)
        if "float" in kind:
            return float(text)
    except ValueError:
        raise ValueError(f"{name} could not be read from the string {text!r}") from None
    return text
