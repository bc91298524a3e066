"""Structured outputs: JSON schema, any JSON object, regex, choice and EBNF grammars, and structural
tags, on xgrammar.

A request's `structured_outputs` names one constraint (vLLM's keys): {"json": schema} (a dict or its
JSON text), {"json_object": true}, {"regex": "..."}, {"choice": ["yes", "no"]}, {"grammar": "<EBNF>"}
or {"structural_tag": tag} (a dict or its JSON text: xgrammar's {"type": "structural_tag", "format":
...}, or the older {"structures": [{"begin", "schema", "end"}], "triggers": [...]}: free text, but
after a trigger the tag it begins, whose content follows the schema; the tool calls of function
calling).
It is compiled when the request is added (a bad one raises ValueError there, naming the problem);
compiled grammars are kept by their text, so a thousand requests with one schema compile it once.
Each step, the constrained rows of the sampling batch get their allowed-token bitmask applied to the
logits in one call; unconstrained rows are not touched. EOS is allowed only where the grammar can end.
"""

import json
import re
import threading
from collections import OrderedDict

import torch

from .input_buffers import to_device

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# vLLM's options that may be true here: JSON schemas are compiled compact and closed (xgrammar's strict
# mode: no properties or items the schema does not name) whatever they say; `json_object` takes
# disable_any_whitespace; there is no other backend to fall back to.
OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "disable_fallback")
# TensorRT-LLM's guided_decoding_guide_type -> our key (its "json" is any JSON object).
TENSORRT_LLM_GUIDE_TYPES = {"json": "json_object", "json_schema": "json", "regex": "regex",
                            "ebnf_grammar": "grammar", "structural_tag": "structural_tag"}
CACHED_GRAMMARS = 256


def canonical_spec(spec) -> tuple[str, str]:
    """(kind, text) for a `structured_outputs` value; raises ValueError naming what is wrong."""
    if not isinstance(spec, dict):
        raise ValueError(f"structured_outputs must be an object with one of {', '.join(KINDS)}, got "
                         f"{type(spec).__name__}")
    given = [k for k in spec if spec[k] is not None and spec[k] is not False and k not in OPTIONS]
    # (vLLM's other options may come along null or false, as a serialized StructuredOutputsParams has
    # them: they ask for nothing)
    for option in OPTIONS:
        if spec.get(option) not in (None, False, True):
            raise ValueError(f"structured_outputs.{option} must be true or false, got {spec[option]!r}")
    unknown = sorted(set(given) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown structured_outputs key(s): {', '.join(unknown)}; use one of {', '.join(KINDS)}")
    if len(given) != 1:
        raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}, got {given or 'none'}")
    kind, value = given[0], spec[given[0]]
    if kind == "json":
        value = _json_value("json", value)
        if not isinstance(value, (dict, bool)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        return kind, json.dumps(value)  # property order is generation order: kept
    if kind == "json_object":
        if value is not True:
            raise ValueError("structured_outputs.json_object must be true")
        return kind, "compact" if spec.get("disable_any_whitespace") else ""
    if kind == "structural_tag":
        return kind, _structural_tag(value)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        # An EBNF alternation of string literals (JSON's escapes are EBNF's).
        return kind, "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
    if not isinstance(value, str) or not value:
        raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
    return kind, value


def _json_value(name: str, value):
    """A value given as itself or as its JSON text."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"structured_outputs.{name} is not valid JSON: {e.msg} at position {e.pos}") from None


def _structural_tag(value) -> str:
    """A structural tag as xgrammar's JSON text; the older form ({"structures", "triggers"}, which vLLM
    and TensorRT-LLM take too) as the triggered tags it means."""
    value = _json_value("structural_tag", value)
    if not isinstance(value, dict):
        raise ValueError("structured_outputs.structural_tag must be a JSON object")
    if "structures" in value:
        structures, triggers = value["structures"], value.get("triggers")
        if (not isinstance(structures, list) or not structures or not isinstance(triggers, list) or not triggers
                or not all(isinstance(t, str) and t for t in triggers)
                or not all(isinstance(s, dict) and {"begin", "schema", "end"} <= set(s) for s in structures)):
            raise ValueError("structured_outputs.structural_tag: 'structures' must be a non-empty list of "
                             "{begin, schema, end} and 'triggers' a non-empty list of strings")
        value = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": [
            {"type": "tag", "begin": s["begin"], "end": s["end"], "content": {"type": "json_schema", "json_schema":
                                                                             _json_value("schema", s["schema"])}}
            for s in structures]}}
    return json.dumps(value)


class StructuredOutputs:
    """The engine's grammar compiler: tokenizer info built once, compiled grammars cached by text."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar as xgr

        self._xgr = xgr
        self._info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                        stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=2, cache_enabled=False)
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()  # requests are added from several threads
        self.num_compiled = 0  # grammars compiled (not found in the cache)

    def matcher(self, spec):
        """A fresh matcher for one sequence under `spec` (a structured_outputs value)."""
        key = canonical_spec(spec)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is None:
                compiled = self._compile(*key)
                self._compiled[key] = compiled
                self.num_compiled += 1
                if len(self._compiled) > CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(key)
        return self._xgr.GrammarMatcher(compiled)

    def _compile(self, kind: str, text: str):
        try:
            if kind == "json":
                return self._compiler.compile_json_schema(text, any_whitespace=False)
            if kind == "json_object":  # an object, as asked (xgrammar's builtin JSON grammar takes any value)
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=text != "compact")
            if kind == "regex":
                return self._compiler.compile_regex(text)
            if kind == "structural_tag":
                return self._compiler.compile_structural_tag(text)
            return self._compiler.compile_grammar(text)  # grammar, or choice as a grammar
        except Exception as e:  # xgrammar raises RuntimeError with the position of the problem
            message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            message = re.sub(r"^\[[^]]*\] (\S+:\d+: )?", "", message)  # "[time] file.cc:line: "
            raise ValueError(f"structured_outputs.{kind} could not be compiled: {message}") from None

    def apply(self, logits: torch.Tensor, matchers: list) -> None:
        """Mask, in place, the rows of `logits` whose matcher is not None to the tokens their grammar
        allows next."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        bitmask = self._xgr.allocate_token_bitmask(len(matchers), self._info.vocab_size)
        for i in rows:
            matchers[i].fill_next_token_bitmask(bitmask, i)
        self._mask(logits, bitmask, rows)

    def apply_drafts(self, logits: torch.Tensor, matchers: list, drafts: list[list[int]]) -> None:
        """Mask the rows of drafting sequences (speculative.py), a sequence's len(drafts) + 1 rows after
        another's in `logits`: row i to what the grammar allows after the sequence's first i drafts (taken
        by the matcher, then rolled back). Past a draft the grammar refuses (or its end), the rows keep the
        last mask: that draft is never kept, so they judge nothing."""
        bitmask = self._xgr.allocate_token_bitmask(len(logits), self._info.vocab_size)
        rows, start = [], 0
        for matcher, seq_drafts in zip(matchers, drafts):
            count = len(seq_drafts) + 1
            if matcher is not None:
                taken = 0
                for i in range(count):
                    if i == 0 or (i == taken and not matcher.is_terminated()):  # every draft before it taken
                        matcher.fill_next_token_bitmask(bitmask, start + i)
                        if i < len(seq_drafts) and matcher.accept_token(seq_drafts[i]):
                            taken += 1
                    else:  # after a refused draft (or the grammar's end): a row that judges nothing
                        bitmask[start + i] = bitmask[start + i - 1]
                matcher.rollback(taken)
                rows += range(start, start + count)
            start += count
        if rows:
            self._mask(logits, bitmask, rows)

    def _mask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        # Through pinned memory, the rows as a tensor: a plain copy to a GPU would wait for it.
        self._xgr.apply_token_bitmask_inplace(logits, to_device(bitmask, logits.device, torch.int32),
                                              indices=to_device(rows, logits.device, torch.int32))


def grammatical_prefix(matcher, drafts: list[int]) -> int:
    """How many of the drafts, in order, the grammar's matcher takes (it is rolled back after): a
    proposer drafts no further than that."""
    taken = 0
    while taken < len(drafts) and not matcher.is_terminated() and matcher.accept_token(drafts[taken]):
        taken += 1
    matcher.rollback(taken)
    return taken
