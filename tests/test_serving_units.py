"""The Triton-free pieces of the serving layer: request parsing, the engine thread and process, the
metrics and the serving profile."""

import dataclasses
import gc
import json
import os
import pickle
import random
import signal
import threading
import time

import numpy as np
import pytest

from conftest import random_prompts
from inflight import LLM, SamplingParams
from inflight import engine as engine_module
from inflight.outputs import RequestDelta, RequestMetrics, coalesce, compact_deltas, expand_deltas, joined
from inflight.engine import EngineDeadError
from inflight.serving.engine_process import EngineProcess
from inflight.serving.engine_thread import EngineThread
from inflight.serving.metrics import TritonMetrics
from inflight.serving.profile import PARTS, ServingProfile
from inflight.serving.request import KNOWN_INPUTS, VLLM_PARAMETERS, for_outputs, parse_request, with_word_bias
from inflight.structured_output import canonical_spec
from inflight.config import EngineConfig
from inflight.serving.settings import place_instance, resolve_lora_modules, split_settings


def text(s: str | bytes) -> np.ndarray:
    return np.array([s.encode() if isinstance(s, str) else s], dtype=np.object_)


def test_parse_vllm_style():
    parsed = parse_request({"text_input": text("hello"), "stream": np.array([True]),
                            "sampling_parameters": text('{"max_tokens": "32", "temperature": "0.5", "stop": ["x"]}')})
    assert parsed.prompt == "hello" and parsed.stream
    assert (parsed.params.max_tokens, parsed.params.temperature, parsed.params.stop) == (32, 0.5, ["x"])


def test_parse_tensorrtllm_style():
    parsed = parse_request({"text_input": text("hi"), "max_tokens": np.array([7], np.int32),
                            "min_length": np.array([3], np.int32), "end_id": np.array([2], np.int32),
                            "stop_words": np.array([b"END", b""], dtype=np.object_),
                            "bad_words": np.array([b"darn"], dtype=np.object_),
                            "random_seed": np.array([42], np.uint64),
                            "no_repeat_ngram_size": np.array([3], np.int32)})
    p = parsed.params
    assert (p.max_tokens, p.min_tokens, p.stop_token_ids, p.stop, p.bad_words) == (7, 3, [2], ["END"], ["darn"])
    assert p.seed == 42 and p.no_repeat_ngram_size == 3


def test_parse_beam_search_in_both_conventions():
    """TensorRT-LLM's beam_width returns every beam unless num_return_sequences says fewer (with
    input_ids, a response per beam); vLLM's use_beam_search takes best_of beams and returns n."""
    ids = np.array([5, 6], np.int32)
    beams = {"beam_width": np.array([4], np.int32), "len_penalty": np.array([0.5], np.float32),
             "early_stopping": np.array([True])}
    parsed = parse_request({"text_input": text("hi"), **beams})
    p = parsed.params
    assert (p.beam_width, p.n, p.length_penalty, p.early_stopping) == (4, 4, 0.5, True)
    assert not parsed.per_completion_responses
    parsed = parse_request({"input_ids": ids, **beams, "num_return_sequences": np.array([2], np.int32),
                            "pad_id": np.array([0], np.int32)})
    assert (parsed.params.beam_width, parsed.params.n, parsed.per_completion_responses) == (4, 2, True)
    assert parse_request({"input_ids": ids, **beams}).per_completion_responses
    parsed = parse_request({"text_input": text("hi")}, parameters={"use_beam_search": True, "best_of": 3, "n": 2,
                                                                    "early_stopping": "never"})
    assert (parsed.params.beam_width, parsed.params.n, parsed.params.early_stopping) == (3, 2, "never")
    assert parse_request({"text_input": text("hi"), "beam_width": np.array([1], np.int32)}).params.n == 1
    ensemble = {"beam_width": np.array([2], np.int32), "length_penalty": np.array([0.25], np.float32)}
    assert parse_request({"text_input": text("hi"), **ensemble}).params.length_penalty == 0.25
    for inputs, words in (({"beam_search_diversity_rate": np.array([0.3], np.float32)}, "diverse beam search"),
                          ({"pad_id": np.array([-1], np.int32)}, "pad_id"),
                          ({"beam_width": np.array([2], np.int32), "top_p": np.array([0.5], np.float32)},
                           "top_p is not supported with beam search"),
                          ({"beam_width": np.array([2], np.int32), "num_return_sequences": np.array([3], np.int32)},
                           "must not exceed beam_width")):
        with pytest.raises(ValueError, match=words):
            parse_request({"text_input": text("hi"), **inputs})


def test_parse_tensorrtllm_embedding_bias_words():
    """Each word's weight goes to every token of the word (TensorRT-LLM's reading), added to the
    logit_bias from sampling_parameters; an empty word is skipped."""
    parsed = parse_request({"text_input": text("hi"), "sampling_parameters": text('{"logit_bias": {"11": 1.0}}'),
                            "embedding_bias_words": np.array([b"ab", b"", b"c"], dtype=np.object_),
                            "embedding_bias_weights": np.array([2.0, 9.0, -0.5], np.float32)})
    assert parsed.bias_words == [("ab", 2.0), ("c", -0.5)]
    tokens = {"ab": [11, 12, 12], "c": [13]}
    params = with_word_bias(parsed.params, parsed.bias_words, tokens.__getitem__)
    assert params.logit_bias == {11: 3.0, 12: 4.0, 13: -0.5} and parsed.params.logit_bias == {11: 1.0}
    assert with_word_bias(parsed.params, [], tokens.__getitem__) is parsed.params
    words = np.array([b"ab", b"c"], dtype=np.object_)
    for inputs, error in (({"embedding_bias_words": words}, "go together"),
                          ({"embedding_bias_words": words, "embedding_bias_weights": np.array([1.0], np.float32)},
                           "for each of the 2"),
                          ({"embedding_bias_words": words, "embedding_bias_weights": np.array([1, 2], np.int32)},
                           "FP32"),
                          ({"embedding_bias_words": words, "embedding_bias_weights": np.array([1, np.nan], np.float32)},
                           "finite")):
        with pytest.raises(ValueError, match=error):
            parse_request({"text_input": text("hi"), **inputs})


def test_parse_vllms_older_guided_decoding():
    """vLLM's older name for structured_outputs, as vllm_backend still reads it: an object or its JSON
    text, its xgrammar backend dropped and its options that ask for nothing (null, false) ignored."""
    spec = {"regex": "[0-9]+", "backend": "xgrammar", "json": None, "disable_fallback": False}
    for sampling in ({"guided_decoding": spec}, {"guided_decoding": json.dumps(spec)}):
        parsed = parse_request({"text_input": text("hi"), "sampling_parameters": text(json.dumps(sampling))})
        assert canonical_spec(parsed.params.structured_outputs) == ("regex", "[0-9]+")
    over_http = parse_request({"text_input": text("hi")}, parameters={"guided_decoding": '{"choice": ["a", "b"]}'})
    assert over_http.params.structured_outputs == {"choice": ["a", "b"]}
    for sampling, error in (({"guided_decoding": {"regex": "a", "backend": "outlines"}}, "outlines"),
                            ({"guided_decoding": {"regex": "a"}, "structured_outputs": {"regex": "b"}}, "not both"),
                            ({"guided_decoding": "{oops"}, "guided_decoding is not valid JSON")):
        with pytest.raises(ValueError, match=error):
            parse_request({"text_input": text("hi"), "sampling_parameters": text(json.dumps(sampling))})
    with pytest.raises(ValueError, match="whitespace_pattern"):
        canonical_spec({"regex": "a", "whitespace_pattern": "[ ]"})


def test_cancellation_polls_spread_over_the_interval():
    """Each request is asked about once an interval, a share of them each call (the thread that asks
    sends no token meanwhile); a cancelled or ended request is not asked about again."""
    from inflight.serving.cancellation import CancellationPoller

    poller = CancellationPoller(interval_s=1.0)
    for i in range(100):
        poller.add(str(i))
    asked = []

    def is_cancelled(request_id):
        asked.append(request_id)
        return None if request_id == "7" else request_id in ("3", "50")

    assert poller.poll(is_cancelled, now=0.0) == ["3", "50"]  # the first call asks about every request
    assert len(asked) == 100
    asked.clear()
    found = [poller.poll(is_cancelled, now=0.1 * k) for k in range(1, 11)]  # one interval in 10 calls
    assert found == [[]] * 10 and sorted(asked, key=int) == [str(i) for i in range(100) if i not in (3, 7, 50)]
    assert max(len(asked[i:i + 10]) for i in range(0, len(asked), 10)) <= 10  # about a tenth each call
    asked.clear()
    poller.poll(is_cancelled, now=1.05)
    assert 3 <= len(asked) <= 6  # half of a tenth of the 97 left
    asked.clear()
    poller.poll(is_cancelled, now=60.0)  # after a long quiet spell: each request once, not more
    assert sorted(asked, key=int) == [str(i) for i in range(100) if i not in (3, 7, 50)]


def test_responses_carry_only_the_outputs_the_client_named():
    from inflight.serving.response import RequestResponses

    parsed = parse_request({"input_ids": np.array([5, 6], np.int32), "stream": np.array([True]),
                            "return_finish_reason": np.array([True])})
    delta = RequestDelta("r", [7], "x", False, None, 2, 1)
    everything = RequestResponses(parsed).add(delta)
    assert set(everything) == {"text_output", "output_ids", "finish_reason"}
    named = RequestResponses(parsed, frozenset({"output_ids", "finish_reason"})).add(delta)
    assert set(named) == {"output_ids", "finish_reason"} and named["output_ids"].tolist() == [7]


def test_a_client_that_names_outputs_without_text_gets_none_decoded():
    """The engine decodes no text for a client that names its outputs without text_output (not where
    stop strings read it), and that client's stream goes by tokens: a text prompt's too."""
    from inflight.serving.response import RequestResponses

    params = SamplingParams(max_tokens=4)
    assert for_outputs(params, frozenset({"output_ids", "finish_reason"})).detokenize is False
    for requested in (frozenset(), frozenset({"text_output"}), frozenset({"text_output", "output_ids"})):
        assert for_outputs(params, requested) is params
    stopping = SamplingParams(max_tokens=4, stop=["."])
    assert for_outputs(stopping, frozenset({"output_ids"})) is stopping
    parsed = parse_request({"text_input": text("hi"), "stream": np.array([True]),
                            "return_num_output_tokens": np.array([True])})
    tokens_only = RequestDelta("r", [7], "", False, None, 2, 1)  # (no text: none was decoded)
    sent = RequestResponses(parsed, frozenset({"num_output_tokens"})).add(tokens_only)
    assert sent is not None and sent["num_output_tokens"].tolist() == [1]
    assert RequestResponses(parsed).add(tokens_only) is None  # (text awaited: it comes with the next)


def test_completions_answered_each_on_their_own_or_all_in_one_response():
    """TensorRT-LLM's num_return_sequences, not streamed: each completion's response goes when that
    completion ends, before the request does. vllm_backend's n, streamed: every response has an entry per
    completion, and one that ended keeps its finish reason in the responses after."""
    from inflight.serving.response import RequestResponses

    apart = RequestResponses(parse_request({"input_ids": np.array([5, 6], np.int32),
                                            "num_return_sequences": np.array([2], np.int32),
                                            "sampling_parameters": text('{"seed": 1, "temperature": 1.0}')}))
    second = apart.add(RequestDelta("r", [7, 8], "", False, "length", 2, 2, index=1))
    assert second["sequence_index"].tolist() == [1] and second["output_ids"].tolist() == [5, 6, 7, 8]
    first = apart.add(RequestDelta("r", [9, 3], "", True, "length", 2, 2, index=0))
    assert first["sequence_index"].tolist() == [0] and first["output_ids"].tolist() == [5, 6, 9, 3]

    together = RequestResponses(parse_request({"text_input": text("hi"), "stream": np.array([True]),
                                               "return_finish_reason": np.array([True]),
                                               "sampling_parameters": text('{"n": 2, "seed": 1}')}))
    ended = together.add(RequestDelta("r", [7], "a", False, "stop", 2, 1, index=1))
    assert ended["text_output"].tolist() == [b"", b"a"] and ended["finish_reason"].tolist() == [b"", b"stop"]
    later = together.add(RequestDelta("r", [8], "b", True, "length", 2, 1, index=0))
    assert later["text_output"].tolist() == [b"b", b""] and later["finish_reason"].tolist() == [b"length", b"stop"]


@pytest.mark.parametrize("inputs, words", [
    ({}, "text_input"),
    ({"text_input": text(b"\xff")}, "UTF-8"),
    ({"text_input": text("hi"), "sampling_parameters": text("[1]")}, "JSON object"),
    ({"text_input": text("hi"), "max_tokens": np.array([3, 4], np.int32)}, "exactly one"),
    ({"text_input": text("hi"), "temperature": np.array([np.inf], np.float32)}, "finite"),
])
def test_parse_errors_name_the_problem(inputs, words):
    with pytest.raises(ValueError, match=words):
        parse_request(inputs)


def test_parse_joins_sampling_parameters_lists_with_tensorrtllms_inputs():
    """Stop strings, stop ids and bad words given both ways add up (a single stop string, as vLLM takes
    it, is one)."""
    parsed = parse_request({"text_input": text("hi"), "end_id": np.array([2], np.int32),
                            "stop_words": np.array([b"END"], dtype=np.object_),
                            "bad_words": np.array([b"darn"], dtype=np.object_),
                            "sampling_parameters": text('{"stop": "###", "stop_token_ids": [5], "bad_words": ["x"]}')})
    p = parsed.params
    assert (p.stop, p.stop_token_ids, p.bad_words) == (["###", "END"], [5, 2], ["x", "darn"])


@pytest.mark.parametrize("inputs, words", [
    ({"text_input": text("hi"), "stop_words": np.array([b"END"], dtype=np.object_),
      "sampling_parameters": text('{"stop": false}')}, "stop must be a list, got False"),
    ({"text_input": text("hi"), "end_id": np.array([2], np.int32),
      "sampling_parameters": text('{"stop_token_ids": NaN}')}, "stop_token_ids must be a list, got nan"),
    ({"input_ids": np.array([[1, 2]], np.int32), "beam_width": np.array([b"2"], dtype=np.object_)}, "beam_width"),
])
def test_parse_refuses_mistyped_values_beside_inputs_that_extend_them(inputs, words):
    """Found by random requests (below): these were internal errors (TypeError), not the client's."""
    with pytest.raises(ValueError, match=words):
        parse_request(inputs)


def random_input(rng: random.Random) -> np.ndarray:
    """An input tensor of any kind a client could send: strings (JSON among them), numbers of each type
    with NaN, infinities and extremes, empty, two-dimensional."""
    values = [None, True, 0, -1, 7, 2**63, 0.5, float("nan"), float("inf"), "", "a", "[1]", [], [1, "x"], {"a": 1}]
    kind = rng.choice(["bytes", "int32", "int64", "float32", "bool", "empty", "2d", "object int"])
    if kind == "bytes":
        return text(rng.choice([b"hi", b"", b"\xff", json.dumps(rng.choice(values)).encode()]))
    if kind in ("int32", "int64"):
        return np.array([rng.choice([0, 1, -1, 5, 2**31 - 1])], dtype=kind)
    if kind == "float32":
        return np.array([rng.choice([0.0, 0.5, -1.0, np.nan, np.inf, 1e30])], dtype=np.float32)
    if kind == "bool":
        return np.array([rng.random() < 0.5])
    if kind == "empty":
        return np.zeros((0,), dtype=rng.choice([np.int32, np.object_, np.float32]))
    if kind == "object int":
        return np.array([3], dtype=np.object_)
    return np.ones((rng.randint(1, 3), rng.randint(0, 3)), dtype=rng.choice([np.int32, np.float32, np.object_]))


def test_random_requests_are_parsed_or_refused_with_a_value_error():
    """Requests of random inputs and sampling parameters (every field, with values of every JSON type):
    each is parsed or refused with a ValueError naming the problem, which the model turns into the
    client's error, never another exception (an internal error)."""
    values = [None, True, False, 0, 3, -2, 2**64 + 1, 0.5, -3.5, float("nan"), float("inf"), "", "1", "yes", "x",
              [], [1, 2], ["a", None], {}, {"regex": "a+"}]
    names = sorted({f.name for f in dataclasses.fields(SamplingParams)} | VLLM_PARAMETERS)
    parsed = 0
    for seed in range(4000):
        rng = random.Random(seed)
        inputs = {rng.choice(["text_input", "input_ids"]): rng.choice([text("hello"), np.array([[1, 2, 3]], np.int32)])}
        inputs.update({rng.choice(sorted(KNOWN_INPUTS)): random_input(rng) for _ in range(rng.randint(0, 4))})
        chosen = {rng.choice(names): rng.choice(values) for _ in range(rng.randint(1, 5))}
        if rng.random() < 0.6:
            inputs["sampling_parameters"] = text(json.dumps(chosen))
        parameters = chosen if "sampling_parameters" not in inputs and rng.random() < 0.5 else None
        try:
            parse_request(inputs, parameters)
            parsed += 1
        except ValueError:
            pass
    assert parsed > 100  # (some of them valid: the checks past the first are reached too)


def test_parse_tensorrtllm_prompt_embedding_table():
    """With input_ids, the table's rows stand for ids from the vocabulary's size up; alone, its rows are
    the prompt (vLLM's prompt_embeds); beside text, or with a prompt_vocab_size of other rows, refused."""
    table = np.ones((3, 8), np.float16)
    ids = np.array([5, 9000, 9001], np.int32)
    parsed = parse_request({"input_ids": ids, "prompt_embedding_table": table,
                            "prompt_vocab_size": np.array([3], np.int32),
                            "prompt_table_extra_ids": np.array([0, 7, 7], np.uint64)})
    prompt = parsed.engine_prompt(parsed.prompt)
    assert prompt["prompt_token_ids"] == [5, 9000, 9001] and prompt["prompt_embedding_table"] is table
    alone = parse_request({"prompt_embedding_table": table[None]})
    assert alone.prompt == [] and alone.engine_prompt([])["prompt_embeds"].shape == (3, 8)
    assert parse_request({"input_ids": ids}).engine_prompt([5]) == [5]
    for inputs, words in (({"text_input": text("hi"), "prompt_embedding_table": table}, "not with 'text_input'"),
                          ({"input_ids": ids, "prompt_embedding_table": table,
                            "prompt_vocab_size": np.array([2], np.int32)}, "must be the number of rows"),
                          ({"input_ids": ids, "prompt_vocab_size": np.array([3], np.int32)}, "needs 'prompt_embedding"),
                          ({"prompt_embedding_table": np.ones((0, 8), np.float16)}, r"floats of shape \[rows"),
                          ({"input_ids": ids, "prompt_embedding_table": table,
                            "prompt_table_extra_ids": np.array([0, 7], np.uint64)}, r"one per input token \(3\)"),
                          ({"prompt_embedding_table": table, "prompt_table_extra_ids": np.array([0], np.uint64)},
                           "goes with 'input_ids'"),
                          ({"input_ids": ids, "prompt_table_extra_ids": np.array([0, 7, 7], np.uint64)},
                           "'prompt_table_extra_ids' needs 'prompt_embedding_table'")):
        with pytest.raises(ValueError, match=words):
            parse_request(inputs)


def test_parse_tensorrtllm_draft_logits():
    """draft_logits [drafts, vocab] beside draft_input_ids; given twice (input and sampling_parameters),
    refused."""
    ids, drafts = np.array([5, 6], np.int32), np.array([7, 8, 9], np.int32)
    logits = np.zeros((3, 16), np.float32)
    parsed = parse_request({"input_ids": ids, "draft_input_ids": drafts, "draft_logits": logits})
    assert parsed.params.draft_token_ids == [7, 8, 9] and parsed.params.draft_logits.shape == (3, 16)
    with pytest.raises(ValueError, match="not both"):
        parse_request({"input_ids": ids, "draft_input_ids": drafts, "draft_logits": logits,
                       "sampling_parameters": text(json.dumps({"draft_logits": logits.tolist()}))})
    with pytest.raises(ValueError, match="draft_logits need draft_token_ids"):
        parse_request({"input_ids": ids, "draft_logits": logits})


def test_input_sizes_are_limited_by_the_settings():
    settings = split_settings({"model": "m", "max_input_bytes": 100, "max_words": 3, "max_word_chars": 5,
                               "max_tokens_limit": 50})[1]
    words = lambda *ws: np.array([w.encode() for w in ws], dtype=np.object_)  # noqa: E731
    cases = [
        ({"text_input": text("x" * 101)}, "max_input_bytes"),
        ({"text_input": text("hi"), "bad_words": words("a" * 6)}, "max_word_chars"),
        ({"text_input": text("hi"), "stop_words": words("a", "b", "c", "d")}, "max_words"),
        ({"text_input": text("hi"), "sampling_parameters": text('{"bad_words": ["a", "b", "c", "d"]}')}, "max_words"),
        ({"text_input": text("hi"), "sampling_parameters": text('{"stop": ["abcdef"]}')}, "max_word_chars"),
        ({"text_input": text("hi"), "max_tokens": np.array([51], np.int32)}, "limit of 50"),
        ({"text_input": text("hi"), "embedding_bias_words": words("a", "b", "c", "d"),
          "embedding_bias_weights": np.ones(4, np.float32)}, "max_words"),
        ({"text_input": text("hi"), "embedding_bias_words": words("abcdef"),
          "embedding_bias_weights": np.ones(1, np.float32)}, "max_word_chars"),
    ]
    for inputs, words_in_error in cases:
        with pytest.raises(ValueError, match=words_in_error):
            parse_request(inputs, settings=settings)
    at_limits = parse_request({"text_input": text("x" * 100), "bad_words": words("abcde", "b", "c"),
                               "max_tokens": np.array([50], np.int32)}, settings=settings)
    assert at_limits.params.bad_words == ["abcde", "b", "c"] and at_limits.params.max_tokens == 50
    with pytest.raises(ValueError, match="max_words must be at most 64"):
        split_settings({"model": "m", "max_words": 65})


def test_unknown_parameters_are_refused_but_triton_ones_pass():
    with pytest.raises(ValueError, match="colour"):
        parse_request({"text_input": text("hi")}, parameters={"colour": "blue"})
    assert parse_request({"text_input": text("hi")}, parameters={"triton_enable_empty_final_response": True})


def test_parse_tensorrtllm_lora_inputs():
    """lora_task_id alone (a task sent before), or with lora_weights and lora_config (as tritonserver
    hands them, [rows, width] and [rows, 3]; the engine checks their shapes); never without the id."""
    weights, config = np.ones((2, 64), np.float16), np.array([[1, 0, 4], [3, 0, 4]], np.int32)
    task = parse_request({"text_input": text("hi"), "lora_task_id": np.array([7], np.uint64),
                          "lora_weights": weights, "lora_config": config}).lora_task
    assert (task.task_id, task.weights is weights, task.config is config) == (7, True, True)
    alone = parse_request({"text_input": text("hi"), "lora_task_id": np.array([2**64 - 1], np.uint64)}).lora_task
    assert (alone.task_id, alone.weights, alone.config) == (2**64 - 1, None, None)
    assert parse_request({"text_input": text("hi")}).lora_task is None
    for inputs, words in (({"lora_weights": weights, "lora_config": config}, "go with 'lora_task_id'"),
                          ({"lora_config": config}, "go with 'lora_task_id'"),
                          ({"lora_task_id": np.array([1, 2], np.uint64)}, "lora_task_id")):
        with pytest.raises(ValueError, match=words):
            parse_request({"text_input": text("hi"), **inputs})


def test_parse_lora_name_in_both_places():
    """vllm_backend's lora_name in sampling_parameters, and over HTTP as a parameter of the request."""
    parsed = parse_request({"text_input": text("hi"), "sampling_parameters": text('{"lora_name": "sql", "top_k": 3}')})
    assert (parsed.lora_name, parsed.params.top_k) == ("sql", 3)
    assert parse_request({"text_input": text("hi")}, parameters={"lora_name": "sql"}).lora_name == "sql"
    assert parse_request({"text_input": text("hi")}).lora_name is None
    for bad in ('{"lora_name": 3}', '{"lora_name": ""}'):
        with pytest.raises(ValueError, match="lora_name must be the name of a LoRA adapter"):
            parse_request({"text_input": text("hi"), "sampling_parameters": text(bad)})


def test_lora_modules_from_model_json_or_multi_lora_json(tmp_path):
    """model.json's lora_modules, or (enable_lora, vllm_backend's convention) multi_lora.json beside it;
    relative folders are taken from the project root."""
    root = str(tmp_path / "root")
    assert resolve_lora_modules(None, False, str(tmp_path), root) is None
    assert resolve_lora_modules({"a": "adapters/a", "b": "/abs/b"}, False, str(tmp_path), root) == {
        "a": os.path.join(root, "adapters/a"), "b": "/abs/b"}
    with pytest.raises(ValueError, match="multi_lora.json.*could not be read"):
        resolve_lora_modules(None, True, str(tmp_path), root)
    (tmp_path / "multi_lora.json").write_text(json.dumps({"doctor": "/w/doctor", "sql": "sql"}))
    _, serving = split_settings({"model": "m", "enable_lora": "true"})  # as vllm_backend's model.json writes it
    assert resolve_lora_modules(None, serving.enable_lora, str(tmp_path), root) == {
        "doctor": "/w/doctor", "sql": os.path.join(root, "sql")}
    with pytest.raises(ValueError, match="leave lora_modules out"):
        resolve_lora_modules({"a": "a"}, True, str(tmp_path), root)
    (tmp_path / "multi_lora.json").write_text("{nope")
    with pytest.raises(ValueError, match="not valid JSON"):
        resolve_lora_modules(None, True, str(tmp_path), root)
    with pytest.raises(ValueError, match="enable_lora"):
        split_settings({"model": "m", "enable_lora": "yes"})


def test_settings_split_and_unknown_keys():
    engine, limits = split_settings({"model": "m", "max_num_seqs": 8, "max_queued_requests": 3})
    assert engine == {"model": "m", "max_num_seqs": 8} and limits.max_queued_requests == 3
    with pytest.raises(ValueError, match="bogus"):
        split_settings({"model": "m", "bogus": 1})
    with pytest.raises(ValueError, match="max_tokens_limit"):
        split_settings({"model": "m", "max_tokens_limit": 0})
    with pytest.raises(ValueError, match="overlap_sending"):
        split_settings({"model": "m", "overlap_sending": "yes"})
    assert split_settings({"model": "m", "overlap_sending": False})[1].overlap_sending is False
    for threads in (0, 65, "4", True, 2.0):
        with pytest.raises(ValueError, match="sender_threads"):
            split_settings({"model": "m", "sender_threads": threads})
    assert split_settings({"model": "m", "sender_threads": 64})[1].sender_threads == 64
    assert split_settings({"model": "m", "sender_threads": None})[1].sender_threads is None
    for name in ("cancel_poll_interval_s", "metrics_interval_s"):
        for seconds in (-0.1, 11, "1", True):
            with pytest.raises(ValueError, match=name):
                split_settings({"model": "m", name: seconds})
        assert getattr(split_settings({"model": "m", name: 0})[1], name) == 0
    for seconds in (0, -1, 86401, "300", True):
        with pytest.raises(ValueError, match="step_timeout_s"):
            split_settings({"model": "m", "step_timeout_s": seconds})
    assert split_settings({"model": "m", "step_timeout_s": None})[1].step_timeout_s is None
    assert split_settings({"model": "m"})[1].step_timeout_s == 300


def test_random_settings_are_taken_or_refused_with_a_value_error():
    """model.json's settings, serving's and the engine's, with values of every JSON type: each set is
    taken or refused with a ValueError naming the setting (the model then fails to load saying so), never
    another exception; a share of memory must be a number (a list was a TypeError, true passed as 1)."""
    from inflight.serving.settings import ServingSettings

    values = [None, True, False, 0, 1, -1, 16, 2**40, 0.5, 1.5, float("nan"), float("inf"), "", "auto", "cuda", "x",
              "bfloat16", [], [0, 0], {}, {"method": "ngram"}, {"a": "b"}]
    names = sorted({f.name for f in dataclasses.fields(ServingSettings)}
                   | {f.name for f in dataclasses.fields(EngineConfig)} - {"model"})
    taken = 0
    for seed in range(3000):
        rng = random.Random(seed)
        settings = {rng.choice(names): rng.choice(values) for _ in range(rng.randint(1, 3))}
        try:
            EngineConfig.from_dict(split_settings({"model": "m", **settings})[0])
            taken += 1
        except ValueError:
            pass
    assert taken > 50
    for fraction in ([0, 0], True, "0.5"):
        with pytest.raises(ValueError, match="kv_cache_memory_fraction must be in"):
            EngineConfig(model="m", kv_cache_memory_fraction=fraction)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_sends_overlap_the_next_step_unless_a_cpu_engine_shares_the_process(device):
    """Left to the device (null): a CPU engine on a thread of the model's process waits for its step's
    sends (they would preempt its torch threads); in a process of its own, or on a GPU, it steps on."""
    on_delta = lambda delta: None  # noqa: E731
    here = EngineThread(make_engine=lambda: None, on_delta=on_delta, senders=1)
    apart = EngineProcess({"model": "m"}, on_delta=on_delta, senders=1)
    for engine_thread in (here, apart):
        engine_thread._configure_for(device)
    assert here._overlap_sending is (device != "cpu")
    assert apart._overlap_sending is True
    forced = EngineProcess({"model": "m"}, on_delta=on_delta, senders=1, overlap_sending=False)
    forced._configure_for(device)
    assert forced._overlap_sending is False


def test_several_senders_keep_each_requests_responses_in_order_on_one_thread():
    """With several sender threads (a GPU's default), a request's deltas all go to one of them, in the
    order they came (its final response after its other completions'), while other requests' are sent
    at the same time; a send that fails is that request's alone."""
    sent, lock = [], threading.Lock()

    def on_delta(delta):
        time.sleep(0.001)  # (a send waiting for the server: the threads interleave)
        if delta.request_id == "r3":
            raise RuntimeError("the client is gone")
        with lock:
            sent.append((delta.request_id, delta.index, threading.get_ident()))

    senders = EngineThread(make_engine=lambda: None, on_delta=on_delta, senders=3)
    senders._configure_for("cuda")
    deltas = [RequestDelta(f"r{r}", [i], "", i == 3, "stop" if i == 3 else None, 4, 1, index=i)
              for i in range(4) for r in range(11)]
    senders._hand_on(deltas)
    senders._senders.shutdown()
    for request in {f"r{r}" for r in range(11)} - {"r3"}:
        mine = [(index, thread) for request_id, index, thread in sent if request_id == request]
        assert [index for index, _ in mine] == [0, 1, 2, 3] and len({thread for _, thread in mine}) == 1
    assert len(sent) == 10 * 4 and len({thread for *_, thread in sent}) > 1


def test_each_gpu_instance_gets_its_own_gpus():
    # KIND_GPU, instance_group gpus [0, 2] with tensor parallelism 2: instances on GPUs 0-1 and 2-3.
    settings = {"model": "m", "device": "cuda", "tensor_parallel_size": 2}
    placed = [EngineConfig(**place_instance(settings, "GPU", gpu, 2)).rank_devices() for gpu in (0, 2)]
    assert placed == [["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]]
    assert EngineConfig(**place_instance({"model": "m", "device": "cpu"}, "GPU", 5, 1)).device == "cuda:5"
    with pytest.raises(ValueError, match="leave gpu_device_ids out"):
        place_instance({**settings, "gpu_device_ids": [4, 5]}, "GPU", 0, 2)
    # KIND_MODEL: model.json says where; two such instances would share those GPUs.
    one = EngineConfig(**place_instance({**settings, "gpu_device_ids": [6, 3]}, "MODEL", 0, 1))
    assert one.rank_devices() == ["cuda:6", "cuda:3"]
    with pytest.raises(ValueError, match="2 model instances of kind MODEL would all run on the same GPUs"):
        place_instance(settings, "MODEL", 0, 2)
    assert place_instance({"model": "m", "device": "cpu"}, "CPU", 0, 2)["device"] == "cpu"


def collect(thread_kwargs, submit, send_delay_s: float = 0.0, thread_class=EngineThread):
    """Run an EngineThread (or EngineProcess); submit(thread) queues work; returns (the engine,
    {id: (deltas, errors)}) once all finish. Each delta's handling takes `send_delay_s` (a slow send)."""
    results, done, lock = {}, threading.Event(), threading.Lock()
    expected = []

    def check_done():
        # Only once submit has named them all: a request refused at once may end before the rest are sent.
        if expected and all(r in results and results[r][0][-1].finished for r in expected):
            done.set()

    def on_delta(delta):
        threading.Event().wait(send_delay_s)
        with lock:
            results.setdefault(delta.request_id, ([], []))[0].append(delta)
            if delta.finished:
                results[delta.request_id][1].append(delta.error)
                check_done()

    thread = thread_class(on_delta=on_delta, **thread_kwargs)
    engine = thread.start()
    submitted = submit(thread)
    with lock:
        expected.extend(submitted)
        check_done()
    assert done.wait(120)
    thread.stop()
    return engine, results


def test_engine_thread_serves_and_cancels(tiny_models):
    model = tiny_models["llama"]
    prompts = random_prompts(4, 5, 40, vocab=512, seed=2)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model, num_kv_blocks=64).generate(prompts, params)]
    cancel = {"long"}
    engines = []

    def poll():
        # Cancel "long" once it is running (the early-abort test covers an abort that comes first).
        if cancel and "long" in engines[0].unfinished_request_ids() and engines[0].stats()["num_running"]:
            return [cancel.pop()]
        return []

    def submit(thread):
        for i, p in enumerate(prompts):
            thread.submit(str(i), p, params)
        thread.submit("whole", prompts[1], params, final_only=True)  # (as a request not streamed)
        thread.submit("long", prompts[0], SamplingParams(max_tokens=500, ignore_eos=True))
        return [*map(str, range(len(prompts))), "whole", "long"]

    def make_engine():
        engines.append(LLM(model, num_kv_blocks=64))
        return engines[0]

    engine, results = collect(dict(make_engine=make_engine, poll_cancelled=poll), submit)
    for i in range(len(prompts)):
        deltas, errors = results[str(i)]
        assert [t for d in deltas for t in d.new_token_ids] == expected[i] and errors == [None]
    whole = results["whole"][0]
    assert len(whole) == 1 and whole[0].new_token_ids == expected[1] and whole[0].metrics is not None
    long_deltas = results["long"][0]
    assert long_deltas[-1].finish_reason == "abort" and long_deltas[-1].num_output_tokens < 500
    assert engine.stats()["requests_aborted_total"] == 1
    engine.block_manager.check_all_free()


def test_an_abort_that_overtakes_its_request_is_kept(tiny_models, monkeypatch):
    """A client that cancels at once: the abort reaches the engine (and is drained) first."""
    engine = LLM(tiny_models["llama"], num_kv_blocks=64)
    engine.abort("early")
    assert engine.step() == []  # drained: the id is unknown yet
    engine.add_request("early", [5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True))
    deltas = engine.step()
    assert [(d.request_id, d.finish_reason, d.num_output_tokens) for d in deltas] == [("early", "abort", 0)]
    assert not engine.has_unfinished() and engine.stats()["requests_aborted_total"] == 1
    engine.block_manager.check_all_free()
    # Kept a while, not for ever: a request that comes long after an abort of its id runs.
    monkeypatch.setattr(engine_module, "EARLY_ABORT_MEMORY_S", 0.0)
    engine.abort("stale")
    engine.step()
    time.sleep(0.01)
    engine.step()  # (forgotten)
    engine.add_request("stale", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished():
        deltas += engine.step()
    assert deltas[-1].request_id == "stale" and deltas[-1].finish_reason == "length"


def test_engine_failure_ends_requests_with_an_error_and_keeps_serving(tiny_models, monkeypatch):
    model = tiny_models["llama"]
    engine = LLM(model, num_kv_blocks=64)
    calls = {"n": 0}
    real_execute = engine.runner.execute

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated device error")
        return real_execute(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    _, results = collect(dict(make_engine=lambda: engine),
                         lambda t: [t.submit("a", [5, 6, 7], params), "a"][1:])
    assert "simulated device error" in results["a"][1][0] and results["a"][0][-1].finish_reason == "error"
    engine.block_manager.check_all_free()
    _, again = collect(dict(make_engine=lambda: engine), lambda t: [t.submit("b", [5, 6, 7], params), "b"][1:])
    assert again["b"][1] == [None] and len([x for d in again["b"][0] for x in d.new_token_ids]) == 5


def test_coalesce_joins_each_completions_deltas_in_order():
    def delta(rid, ids, text, finished=False, index=0, reason=None):
        return RequestDelta(rid, ids, text, finished, reason or ("length" if finished else None), 3, 0,
                            index=index)

    steps = [[delta("a", [1], "x"), delta("b", [7], "p")], [delta("b", [8], "q"), delta("d", [4], "m", index=1)],
             [delta("a", [2, 3], "yz", finished=True), delta("c", [9], "r"),
              delta("d", [5], "n", index=0, reason="stop"), delta("d", [6], "o", index=1, finished=True)]]
    merged = coalesce(steps)
    # Each completion's deltas joined, in the order of their last delta: a request's final one comes last.
    assert [(d.request_id, d.index, d.new_token_ids, d.new_text, d.finished) for d in merged] == [
        ("b", 0, [7, 8], "pq", False), ("a", 0, [1, 2, 3], "xyz", True), ("c", 0, [9], "r", False),
        ("d", 0, [5], "n", False), ("d", 1, [4, 6], "mo", True)]
    assert merged[1].finish_reason == "length" and steps[0][0].new_token_ids == [1]  # inputs untouched


def test_a_delta_pickles_whole_as_its_values():
    """Deltas cross from the engine's process to the Triton model's pickled as their fields' values:
    every field comes back, none left at its default (a field added later is in it too)."""
    from dataclasses import fields

    from inflight.outputs import Logprob, RequestMetrics

    delta = RequestDelta("a", [1, 2], "xy", True, "stop", 3, 2, error="boom", error_kind="invalid",
                         new_logprobs=[{1: Logprob(-0.5, 1, "x")}, {2: Logprob(-0.25, 2, "y")}],
                         cumulative_logprob=-0.75, prompt_logprobs=[None, {7: Logprob(-1.0, 1, "p")}], index=1,
                         metrics=RequestMetrics(5, first_token_time_ns=9), context_logits=np.ones((3, 4)),
                         new_generation_logits=[np.zeros(4), np.full(4, 2.0)])
    assert all(getattr(delta, f.name) != f.default for f in fields(RequestDelta) if f.name != "context_logits")
    back = pickle.loads(pickle.dumps(delta))
    for f in fields(RequestDelta):
        mine, theirs = getattr(delta, f.name), getattr(back, f.name)
        if f.name == "context_logits":
            assert np.array_equal(mine, theirs)
        elif f.name == "new_generation_logits":
            assert [row.tolist() for row in mine] == [row.tolist() for row in theirs]
        else:
            assert mine == theirs, f.name


def test_a_steps_deltas_cross_compacted_and_come_back_whole():
    """A running completion's delta of tokens and text alone crosses as a tuple of its values; one with
    any other field set (each field in turn: a field added later too) crosses whole."""
    from dataclasses import fields, replace

    from inflight.outputs import RequestMetrics

    plain = RequestDelta("a", [1, 2], "xy", False, None, 3, 2, index=1)
    others = {"finished": True, "finish_reason": "stop", "error": "boom", "error_kind": "invalid",
              "new_logprobs": [], "cumulative_logprob": -0.5, "prompt_logprobs": [None],
              "metrics": RequestMetrics(5), "context_logits": np.ones((1, 2)), "new_generation_logits": []}
    assert set(others) == {f.name for f in fields(RequestDelta)} - {"request_id", "new_token_ids", "new_text",
                                                                     "num_prompt_tokens", "num_output_tokens", "index"}
    deltas = [plain, *(replace(plain, **{name: value}) for name, value in others.items())]
    wire = pickle.loads(pickle.dumps(compact_deltas(deltas)))
    assert type(wire[0]) is tuple and all(isinstance(item, RequestDelta) for item in wire[1:])
    back = expand_deltas(wire)
    assert back[0] == plain and type(back[0]) is RequestDelta
    for (name, value), delta in zip(others.items(), back[1:]):
        assert getattr(delta, name) is not None and type(getattr(delta, name)) is type(value), name


def test_joined_deltas_keep_logprobs_and_logits_once_each():
    first = RequestDelta("a", [1], "x", False, None, 3, 1, new_logprobs=[{1: -0.5}], cumulative_logprob=-0.5,
                         prompt_logprobs=[None, {7: -1.0}], context_logits=np.ones((3, 4)),
                         new_generation_logits=[np.zeros(4)])
    middle = RequestDelta("a", [], "", False, None, 3, 1, new_logprobs=[], cumulative_logprob=-0.5,
                          new_generation_logits=[])
    last = RequestDelta("a", [2, 3], "yz", True, "stop", 3, 3, new_logprobs=[{2: -0.25}, {3: -0.125}],
                        cumulative_logprob=-0.875, new_generation_logits=[np.ones(4), np.full(4, 2.0)])
    whole = joined([first, middle, last])
    assert (whole.new_token_ids, whole.new_text, whole.finished, whole.finish_reason) == \
        ([1, 2, 3], "xyz", True, "stop")
    assert whole.new_logprobs == [{1: -0.5}, {2: -0.25}, {3: -0.125}] and whole.cumulative_logprob == -0.875
    assert whole.prompt_logprobs == [None, {7: -1.0}] and whole.context_logits is first.context_logits
    assert [row[0] for row in whole.new_generation_logits] == [0.0, 1.0, 2.0] and whole.num_output_tokens == 3
    plain = joined([RequestDelta("b", [4], "p", False, None, 2, 1), RequestDelta("b", [5], "q", True, "length", 2, 2)])
    assert plain.new_logprobs is None and plain.new_generation_logits is None and plain.context_logits is None
    assert joined([first]) is first


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "step-then-send"])
def test_a_slow_responder_loses_nothing(tiny_models, overlap):
    """Sending far slower than a step: overlapped, the responder catches up with fewer, larger deltas;
    otherwise the engine waits for each step's sends, so every step's delta goes out on its own."""
    model = tiny_models["llama"]
    prompts = random_prompts(3, 5, 20, vocab=512, seed=4)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = LLM(model, num_kv_blocks=64).generate(prompts, params)

    def submit(thread):
        for i, p in enumerate(prompts):
            thread.submit(str(i), p, params)
        return [str(i) for i in range(len(prompts))]

    _, results = collect(dict(make_engine=lambda: LLM(model, num_kv_blocks=64), overlap_sending=overlap),
                         submit, send_delay_s=0.02)
    calls = sum(len(deltas) for deltas, _ in results.values())
    if overlap:
        assert calls < len(prompts) * params.max_tokens
    else:
        assert calls == len(prompts) * params.max_tokens
    for i, out in enumerate(expected):
        deltas, errors = results[str(i)]
        assert [t for d in deltas for t in d.new_token_ids] == out.token_ids
        assert "".join(d.new_text for d in deltas) == out.text
        assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True] and errors == [None]


def test_engine_process_serves_refuses_and_cancels(tiny_models):
    """The engine in a process of its own: greedy output as offline, a refused request ends with an
    "invalid" error of its own, a cancelled one with "abort", and every block is free after. Its
    start-up heap is frozen, out of the garbage collector's full passes (serving/heap.py)."""
    model = tiny_models["llama"]
    prompts = random_prompts(4, 5, 40, vocab=512, seed=2)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model, num_kv_blocks=64).generate(prompts, params)]
    seen_long = threading.Event()
    cancel = {"long"}

    def poll():
        return [cancel.pop()] if cancel and seen_long.is_set() else []

    processes = []

    def submit(thread):
        processes.append(thread)
        for i, p in enumerate(prompts):
            thread.submit(str(i), p, params)
        thread.submit("bad", [10**6], params)  # no such token
        thread.submit("whole", prompts[1], params, final_only=True)  # (as a request not streamed)
        thread.submit("long", prompts[0], SamplingParams(max_tokens=500, ignore_eos=True))
        return [*map(str, range(len(prompts))), "bad", "whole", "long"]

    settings = dict(model=model, num_kv_blocks=64)
    engine, results = collect(dict(settings=settings, poll_cancelled=poll, on_step=lambda stats: seen_long.set()
                                    if stats["num_running"] else None), submit, thread_class=EngineProcess)
    for i in range(len(prompts)):
        deltas, errors = results[str(i)]
        assert [t for d in deltas for t in d.new_token_ids] == expected[i] and errors == [None]
    bad = results["bad"][0]
    assert len(bad) == 1 and bad[0].error_kind == "invalid" and "prompt token ids" in bad[0].error
    whole = results["whole"][0]
    assert len(whole) == 1 and whole[0].new_token_ids == expected[1] and whole[0].metrics is not None
    long_deltas = results["long"][0]
    assert long_deltas[-1].finish_reason == "abort" and long_deltas[-1].num_output_tokens < 500
    assert processes[0].engine_frozen_objects > 50_000, "the engine process froze its start-up heap"
    deadline = time.monotonic() + 10
    while engine.stats()["kv_blocks_used"] or engine.stats()["requests_aborted_total"] != 1:
        assert time.monotonic() < deadline, engine.stats()  # the idle engine reports its final state
        time.sleep(0.05)


def test_the_engine_process_adds_requests_with_images_on_a_thread_of_their_own():
    """While a request's images are encoded (held here), the commands thread reads on: another request is
    added, an abort and an acknowledged send are read (a step waits for those); then the held request is
    added."""
    import multiprocessing

    from inflight.serving.engine_process import _Serve

    release, added = threading.Event(), []

    class Engine:
        def add_request(self, request_id, prompt, *args, **kwargs):
            if isinstance(prompt, dict):
                release.wait(10)  # (the vision tower)
            added.append(request_id)

        def abort(self, request_id):
            added.append(f"abort {request_id}")

    ours, theirs = multiprocessing.Pipe()
    serve = _Serve(Engine(), theirs)
    threads = [threading.Thread(target=serve.read_commands), threading.Thread(target=serve.add_with_images)]
    for thread in threads:
        thread.start()
    with_images = {"prompt": "<image>", "multi_modal_data": {"image": [b"an image file"]}}
    ours.send(("add", "with-images", with_images, SamplingParams(), 0, None, False, None, None))
    ours.send(("add", "text", [1, 2], SamplingParams(), 0, None, False, None, None))
    ours.send(("abort", "with-images"))
    ours.send(("sent",))
    assert serve.sends_done.acquire(timeout=5), "the acknowledged send waited for the images"
    assert added == ["text", "abort with-images"]
    release.set()
    ours.send(("stop",))
    for thread in threads:
        thread.join(5)
    assert added == ["text", "abort with-images", "with-images"]


def test_an_idle_engine_process_reports_once_its_last_responses_are_out(tiny_models):
    """The report of an engine that fell idle (the metrics' last until the next request) comes once the
    responder has handed on every delta: it must count their latencies and the serving profile's parts."""
    handed, reports = [], []

    def on_delta(delta):
        time.sleep(0.3 if delta.finished else 0.0)  # a slow last send
        handed.append(delta)

    process = EngineProcess(settings=dict(model=tiny_models["llama"], num_kv_blocks=64), on_delta=on_delta,
                            on_step=lambda stats: reports.append((stats["num_running"], len(handed))))
    process.start()
    try:
        process.submit("a", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        deadline = time.monotonic() + 60
        while not (handed and handed[-1].finished):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(1.0)  # (a report still to come)
        assert reports[-1] == (0, len(handed)), reports
    finally:
        process.stop()


def ended_mid_stream(model: str, end) -> list[str]:
    """An engine process streaming a long request, ended by `end(process)`: what on_dead said (waited
    for: nothing may hang); later requests must be refused as unavailable."""
    dead, first = [], threading.Event()
    process = EngineProcess(dict(model=model, num_kv_blocks=64), None, on_delta=lambda delta: first.set(),
                            on_dead=dead.append)
    process.start()
    process.submit("long", [5, 6, 7], SamplingParams(max_tokens=4000, ignore_eos=True))
    assert first.wait(60)
    end(process)
    deadline = time.monotonic() + 10
    while not dead:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(EngineDeadError):
        process.submit("later", [5, 6, 7], SamplingParams(max_tokens=4))
    process.stop()
    return dead


def test_the_engine_process_dying_ends_every_request(tiny_models):
    """Killed mid-stream (as by the out-of-memory killer): on_dead names the exit."""
    dead = ended_mid_stream(tiny_models["llama"], lambda process: os.kill(process.pid, signal.SIGKILL))
    assert dead == ["the engine process was killed by SIGKILL"]


def test_a_message_from_the_engine_process_that_cannot_be_read_ends_it(tiny_models):
    """A message the model's process cannot unpickle ends the engine process as a death would (before,
    the receiving thread died alone and every request hung)."""
    def unreadable():
        raise pickle.UnpicklingError("truncated")

    dead = ended_mid_stream(tiny_models["llama"], lambda process: setattr(process._conn, "recv", unreadable))
    assert dead == ["a message from the engine process could not be read: UnpicklingError: truncated"]


def test_an_engine_process_whose_step_hangs_is_stopped_and_ends_every_request(tiny_models):
    """A step that never ends (fault "hang": the model forward of the engine's 2nd step never returns, as
    on a hung GPU) while a request waits on it: step_timeout_s after the request came the engine process
    is stopped and on_dead names the time-out. An idle engine, however long idle after a request ended, is
    never taken for hung, nor is the time it was idle counted against its next step."""
    dead, deltas = [], []
    process = EngineProcess(dict(model=tiny_models["llama"], num_kv_blocks=64), "hang@2", step_timeout_s=2.0,
                            on_delta=deltas.append, on_dead=dead.append)
    process.start()
    try:
        process.submit("first", [5, 6, 7], SamplingParams(max_tokens=1, ignore_eos=True))  # (its one step)
        deadline = time.monotonic() + 20
        while not any(delta.finished for delta in deltas):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(3.0)  # idle, past the time-out
        assert not dead
        submitted = time.monotonic()
        process.submit("a", [5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True))
        while not dead:
            assert time.monotonic() < submitted + 20, "the hung engine process was not stopped"
            time.sleep(0.05)
        assert 2.0 <= time.monotonic() - submitted < 10
        assert dead == ["no engine step ended within step_timeout_s (2 s) while 1 request(s) waited on it (a "
                        "hung GPU or kernel?): the engine process was stopped"]
        assert process._process.poll() is not None, "the engine process was killed"
        with pytest.raises(EngineDeadError):
            process.submit("later", [5, 6, 7], SamplingParams(max_tokens=4))
    finally:
        process.stop()


def test_the_engine_process_serves_on_through_sigterm_and_ctrl_c(tiny_models):
    """A SIGTERM or a ctrl-c to the whole process group (systemd stopping the service, a terminal)
    reaches the engine process too, from its first import on: it serves on, since tritonserver drains
    the requests in flight, and leaves when it is stopped (launch.tie_to_parent)."""
    from inflight.launch import start_engine_process

    model = tiny_models["llama"]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    expected = LLM(model, num_kv_blocks=64).generate([[5, 6, 7]], params)[0].token_ids
    started = start_engine_process()
    time.sleep(1.0)  # it is importing torch
    for signum in (signal.SIGTERM, signal.SIGINT):
        os.kill(started[0].pid, signum)

    def submit(thread):
        thread.submit("a", [5, 6, 7], params)
        for signum in (signal.SIGTERM, signal.SIGINT):
            os.kill(thread.pid, signum)
        return ["a"]

    _, results = collect(dict(settings=dict(model=model, num_kv_blocks=64), started=started), submit,
                         thread_class=EngineProcess)
    deltas, errors = results["a"]
    assert [t for d in deltas for t in d.new_token_ids] == expected and errors == [None]
    assert started[0].wait(10) == 0


def test_an_engine_process_that_cannot_start_says_why(tmp_path):
    process = EngineProcess(dict(model=str(tmp_path / "missing")), None, on_delta=lambda delta: None)
    with pytest.raises(RuntimeError, match="the engine process did not start: .*missing"):
        process.start()


def test_the_stub_that_only_completes_the_config_starts_no_engine_process():
    """tritonserver 2.51's stub command lines (without --disable-auto-complete-config, it starts one for
    the model to complete its config before each instance's): only the instance's starts an engine
    process early (model.py)."""
    from inflight.launch import started_to_complete_config

    stub = ["/srv/backends/python/triton_python_backend_stub", "/srv/models/llm/1/model.py",
            "triton_python_backend_shm_region_a0aa87f9", "1048576", "1048576", "20001", "/srv/backends/python",
            "336"]
    assert started_to_complete_config("llm", stub + ["llm", "DEFAULT", ""])
    assert not started_to_complete_config("llm", stub + ["llm_0_0", "DEFAULT", ""])
    assert not started_to_complete_config("llm", stub + ["llm_1_3", "DEFAULT", ""])
    assert not started_to_complete_config("llm", [])


def test_make_serve_refuses_ports_it_cannot_listen_on_before_starting_tritonserver():
    """tritonserver binds its ports only after loading every model, and then exits (leaving its stub and
    engine process behind until it is reaped): `make serve` (scripts/serve.py) says at once which of its
    ports another process listens on or which two settings name one port, and starts nothing."""
    import socket
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, "scripts"))
    from serve import ports_refused

    with socket.socket() as held, socket.socket() as spare, socket.socket() as other:
        held.bind(("127.0.0.1", 0))
        held.listen()
        for s in (spare, other):
            s.bind(("127.0.0.1", 0))
        taken, free, metrics = (s.getsockname()[1] for s in (held, spare, other))
        spare.close()  # (closed without a connection: free to bind again)
        other.close()
        assert ports_refused("127.0.0.1", {"HTTP_PORT": free}) == []
        # A server stopped just now: its port's last connection, closed by the server, is in TIME_WAIT; a
        # new tritonserver could listen there (its listeners reuse such addresses), so serve.py lets it.
        with socket.socket() as listener:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as tritonserver's listeners)
            listener.bind(("127.0.0.1", free))
            listener.listen()
            client = socket.create_connection(("127.0.0.1", free))
            accepted, _ = listener.accept()
            accepted.close()  # (the server's side closes first: its end waits in TIME_WAIT)
            client.close()
        assert ports_refused("127.0.0.1", {"HTTP_PORT": free}) == []
        assert ports_refused("127.0.0.1", {"HTTP_PORT": free, "GRPC_PORT": taken}) == [
            f"GRPC_PORT {taken} on 127.0.0.1: Address already in use"]
        assert ports_refused("0.0.0.0", {"GRPC_PORT": taken}) == [  # (every address: the loopback's too)
            f"GRPC_PORT {taken} on 0.0.0.0: Address already in use"]
        assert ports_refused("127.0.0.1", {"HTTP_PORT": free, "GRPC_PORT": free}) == [
            f"HTTP_PORT and GRPC_PORT are both {free}"]
        # (no tritonserver where serve.py would look: had it not refused, it would say so instead)
        result = subprocess.run([sys.executable, os.path.join(root, "scripts", "serve.py"), "--http-port", str(free),
                                 "--grpc-port", str(taken), "--metrics-port", str(metrics)],
                                env={**os.environ, "TRITONSERVER_HOME": os.path.join(root, "no-such-bundle")},
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("cannot serve: ") and \
        f"GRPC_PORT {taken} on 127.0.0.1: Address already in use" in result.stderr, result.stderr


def test_the_serving_profile_sums_threads_and_the_engine_process():
    profile = ServingProfile()
    with profile.timing("send_response"):
        time.sleep(0.01)
    worker = threading.Thread(target=_time_part, args=(profile, "send_response"))
    worker.start()
    worker.join()
    profile.remote = {part: (1.0, 0.5, 3) if part == "engine_step" else (0.0, 0.0, 0) for part in PARTS}
    snapshot = profile.snapshot()
    assert snapshot["send_response"][2] == 2 and snapshot["send_response"][0] >= 0.01
    assert snapshot["send_response"][1] < snapshot["send_response"][0]  # sleeping is no CPU time
    assert snapshot["engine_step"] == (1.0, 0.5, 3) and snapshot["poll_cancelled"] == (0.0, 0.0, 0)
    collected = snapshot["collect_garbage"]
    gc.collect()  # the collector's pauses, whichever thread they stop
    after = profile.snapshot()["collect_garbage"]
    assert after[2] > collected[2] and after[0] > collected[0]
    off = ServingProfile(enabled=False)  # the default in the Triton model: timing costs nothing
    _time_part(off, "send_response")
    assert off.snapshot()["send_response"] == (0, 0, 0)


def _time_part(profile: ServingProfile, part: str) -> None:
    with profile.timing(part):
        pass


class FakeMetricsApi:
    """pb_utils' custom-metrics API, recording each message to the server."""

    def __init__(self):
        self.messages = []
        api = self

        class Metric:
            def __init__(self, name, labels):
                self.name, self.labels = name, labels

            def increment(self, value):
                api.messages.append(("increment", self.name, self.label, value))

            def set(self, value):
                api.messages.append(("set", self.name, self.label, value))

            @property
            def label(self):  # the label that tells a family's metrics apart
                return next((self.labels[k] for k in ("part", "le", "adapter", "finished_reason", "position")
                             if k in self.labels), None)

            def observe(self, value):  # a message per observation, as tritonserver 2.51's histograms
                api.messages.append(("observe", self.name, None, value))

        class MetricFamily:
            COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

            def __init__(self, name, description, kind):
                self.name = name

            def Metric(self, labels, buckets=None):
                return Metric(self.name, labels)

        self.MetricFamily = MetricFamily


def idle_stats() -> dict:
    """An engine's statistics with nothing counted yet (what TritonMetrics.update reads)."""
    return {**dict.fromkeys(("kv_blocks_used", "kv_blocks_total", "num_running", "num_waiting", "num_preemptions",
                             "prompt_tokens_total", "generation_tokens_total", "computed_tokens_total",
                             "prefix_cache_queried_tokens", "prefix_cache_hit_tokens", "requests_aborted_total",
                             "requests_failed_total", "failed_steps_total", "step_seconds_total"), 0),
            "steps_by_tokens": [0] * (len(engine_module.STEP_TOKEN_BUCKETS) + 1),
            "steps_by_seconds": [0] * (len(engine_module.STEP_SECONDS_BUCKETS) + 1)}


def test_latencies_of_a_request_sent_whole_come_from_the_engines_times():
    """Not streamed, a request's tokens reach the model's process at its end: its time to first token
    and inter-token latency are the engine's (a mean, counted once an interval, as a stream's would)."""
    api = FakeMetricsApi()
    metrics = TritonMetrics(api, {"model": "llm", "version": "1"})
    times = RequestMetrics(arrival_time_ns=5_000_000_000, first_token_time_ns=5_030_000_000,
                           last_token_time_ns=5_130_000_000)
    metrics.observe_from_engine(4_990_000_000, times, 11)
    metrics.observe_from_engine(4_990_000_000, RequestMetrics(5_000_000_000), 0)  # (ended before a token)
    metrics.observe_from_engine(4_990_000_000, RequestMetrics(5_000_000_000, first_token_time_ns=5_010_000_000,
                                                              last_token_time_ns=5_010_000_000), 1)
    metrics.update(idle_stats())
    sent = {(m[1], m[2]): round(m[3], 6) for m in api.messages if m[1].startswith("inflight_")}
    assert sent[("inflight_time_to_first_token_seconds_count", None)] == 2
    assert sent[("inflight_time_to_first_token_seconds_sum", None)] == 0.06  # 0.04 and 0.02 from arrival
    assert sent[("inflight_inter_token_latency_seconds_count", None)] == 10  # 10 intervals of 0.01
    assert sent[("inflight_inter_token_latency_seconds_sum", None)] == 0.1
    assert sent[("inflight_inter_token_latency_seconds_bucket", "0.01")] == 10


def test_a_requests_end_is_counted_by_reason_with_its_times_and_tokens():
    """vllm_backend's request histograms (end to end, queue, prefill, decode, prompt and generated tokens)
    for requests that ended with "stop" or "length", and every end but a failure counted by its reason."""
    api = FakeMetricsApi()
    metrics = TritonMetrics(api, {"model": "llm", "version": "1"})
    arrival = 4_990_000_000
    times = RequestMetrics(arrival_time_ns=5_000_000_000, first_scheduled_time_ns=5_020_000_000,
                           first_token_time_ns=5_070_000_000, last_token_time_ns=6_070_000_000)
    metrics.observe_finished("length", 1.25, arrival, times, 30, 100, n=2)
    # (scheduled, then ended before a token: no prefill or decode time)
    metrics.observe_finished("stop", 0.5, arrival, RequestMetrics(5_000_000_000, first_scheduled_time_ns=5_000_000_000),
                             7, 0)
    metrics.count_end("abort")
    metrics.observe_finished("error", 0.1, arrival, times, 30, 5)
    assert api.messages == []  # recorded locally until the report
    metrics.update({**idle_stats(), "kv_blocks_used": 3, "kv_blocks_total": 12})
    sent = {(m[1], m[2]): round(m[3], 6) for m in api.messages}
    assert {reason: sent.get(("inflight_request_success_total", reason)) for reason in ("stop", "length", "abort")} \
        == {"stop": 1, "length": 1, "abort": 1}
    assert ("inflight_request_success_total", "error") not in sent
    assert sent[("inflight_kv_cache_usage_perc", None)] == 0.25
    histograms = {name: (sent[(f"{name}_count", None)], sent[(f"{name}_sum", None)]) for name in (
        "inflight_e2e_request_latency_seconds", "inflight_request_queue_time_seconds",
        "inflight_request_prefill_time_seconds", "inflight_request_decode_time_seconds",
        "inflight_request_inference_time_seconds", "inflight_request_prompt_tokens",
        "inflight_request_generation_tokens", "inflight_request_params_n")}
    assert histograms == {"inflight_e2e_request_latency_seconds": (2, 1.75),
                          "inflight_request_queue_time_seconds": (2, 0.04),  # 0.03 and 0.01 after arrival
                          "inflight_request_prefill_time_seconds": (1, 0.05),
                          "inflight_request_decode_time_seconds": (1, 1.0),
                          "inflight_request_inference_time_seconds": (1, 1.05),
                          "inflight_request_prompt_tokens": (2, 37),
                          "inflight_request_generation_tokens": (2, 100),
                          "inflight_request_params_n": (2, 3)}
    prompt_buckets = {le: n for (name, le), n in sent.items() if name == "inflight_request_prompt_tokens_bucket"}
    assert "5" not in prompt_buckets  # (still 0, never sent: 7 and 30 tokens)
    assert (prompt_buckets["10"], prompt_buckets["20"], prompt_buckets["50"], prompt_buckets["1e+06"],
            prompt_buckets["+Inf"]) == (1, 1, 2, 2, 2)
    api.messages.clear()
    metrics.update({**idle_stats(), "kv_blocks_used": 3, "kv_blocks_total": 12})
    assert api.messages == []  # nothing changed: nothing sent


def test_drafts_kept_by_position_are_counters_made_as_positions_come():
    """vLLM's spec_decode_num_accepted_tokens_per_pos: a counter for each position after a sequence's last
    token, made when the engine first reports a draft kept there, each advanced by what it gained."""
    api = FakeMetricsApi()
    metrics = TritonMetrics(api, {"model": "llm", "version": "1"})
    spec = {"spec_decode_drafts_total": 4, "spec_decode_draft_tokens_total": 12, "spec_decode_accepted_tokens_total": 8}
    metrics.update({**idle_stats(), **spec, "spec_decode_accepted_tokens_per_pos": [5, 3]})
    metrics.update({**idle_stats(), **spec, "spec_decode_accepted_tokens_per_pos": [6, 3, 1]})
    sent = [(m[2], m[3]) for m in api.messages if m[1] == "inflight_spec_decode_num_accepted_tokens_per_pos"]
    assert sent == [("0", 5), ("1", 3), ("0", 1), ("2", 1)]


def test_the_engines_steps_by_their_tokens_and_times_are_histograms(tiny_models):
    """vllm_backend's iteration tokens: the engine counts each step in its bucket (a decode step of 3
    sequences: le 8; three prompts of 32 tokens: le 32), and each step that ran a batch by its time; the
    metrics send their totals as histograms' series."""
    llm = LLM(tiny_models["llama"], num_kv_blocks=64, max_num_batched_tokens=64)
    for i, length in enumerate((20, 6, 6)):
        llm.add_request(str(i), list(range(1, length + 1)), SamplingParams(max_tokens=3, ignore_eos=True))
    llm.step()  # the three prompts: 32 tokens (a bucket's bound is in it)
    llm.step()  # three decodes
    stats = llm.stats()
    counts = dict(zip([*engine_module.STEP_TOKEN_BUCKETS, "more"], stats["steps_by_tokens"]))
    assert (counts[8], counts[32], sum(counts.values()), stats["computed_tokens_total"]) == (1, 1, 2, 35)
    assert sum(stats["steps_by_seconds"]) == 2 and stats["step_seconds_total"] > 0
    while llm.has_unfinished():
        llm.step()
    ran = sum(llm.stats()["steps_by_seconds"])
    for _ in range(3):
        llm.step()  # nothing to run: not a step
    assert sum(llm.stats()["steps_by_seconds"]) == ran == 3  # the prompts' and two decode steps
    api = FakeMetricsApi()
    metrics = TritonMetrics(api, {"model": "llm", "version": "1"})
    metrics.update({**idle_stats(), "steps_by_tokens": stats["steps_by_tokens"], "computed_tokens_total": 35,
                    "steps_by_seconds": stats["steps_by_seconds"], "step_seconds_total": 0.25})
    sent = {(m[1], m[2]): m[3] for m in api.messages if m[1].startswith(("inflight_iteration", "inflight_engine"))}
    assert (sent[("inflight_iteration_tokens_count", None)], sent[("inflight_iteration_tokens_sum", None)]) == (2, 35)
    assert (sent[("inflight_engine_step_seconds_count", None)], sent[("inflight_engine_step_seconds_sum", None)],
            sent[("inflight_engine_step_seconds_bucket", "+Inf")]) == (2, 0.25, 2)
    assert (sent[("inflight_iteration_tokens_bucket", "8")], sent[("inflight_iteration_tokens_bucket", "16")],
            sent[("inflight_iteration_tokens_bucket", "32")], sent[("inflight_iteration_tokens_bucket", "+Inf")]) \
        == (1, 1, 2, 2)


def test_metrics_send_latencies_in_one_batch_and_only_what_changed():
    api = FakeMetricsApi()
    metrics = TritonMetrics(api, {"model": "llm", "version": "1"})
    for value in (0.01, 0.02, 0.03):
        metrics.observe_inter_token_latency(value)
    assert api.messages == []  # recording is local: no message per token
    stats = idle_stats()
    profile = {part: (0.0, 0.0, 0) for part in PARTS}
    metrics.update(stats, {**profile, "send_response": (0.5, 0.1, 7)})
    itl = {(m[1].removeprefix("inflight_inter_token_latency_seconds"), m[2]): round(m[3], 6)
           for m in api.messages if m[1].startswith("inflight_inter_token_latency")}
    # A histogram's series, cumulative by bucket: 0.01 <= 0.01, 0.02 <= 0.02, all three <= 0.05 and above.
    assert itl == {("_count", None): 3, ("_sum", None): 0.06, ("_bucket", "0.01"): 1, ("_bucket", "0.02"): 2,
                   **{("_bucket", le): 3 for le in ("0.05", "0.1", "0.2", "0.5", "1", "2", "5", "10", "30", "+Inf")}}
    # The largest bucket first: a scrape in the middle of a report still sees cumulative buckets.
    order = [m[2] for m in api.messages if m[1] == "inflight_inter_token_latency_seconds_bucket"]
    assert order[0] == "+Inf" and [float(le) for le in order[1:]] == sorted(map(float, order[1:]), reverse=True)
    assert {m[2] for m in api.messages if m[1].startswith("inflight_serving")} == {"send_response"}
    api.messages.clear()
    metrics.update(stats, {**profile, "send_response": (0.5, 0.1, 7)})
    assert api.messages == []  # nothing changed: nothing sent
    # However many latencies a report carries, a histogram is at most one message a series (15).
    for i in range(10_000):
        metrics.observe_inter_token_latency(0.001 * (i % 100))
    metrics.update(stats, {**profile, "send_response": (0.5, 0.1, 7)})
    assert 0 < len(api.messages) <= 15
    assert ("increment", "inflight_inter_token_latency_seconds_count", None, 10_000) in api.messages
    # Each LoRA adapter's requests, by an `adapter` label, made when an engine with adapters first reports.
    api.messages.clear()
    metrics.update({**stats, "lora_requests": {"alpha": (2, 1, 5), "beta": (0, 0, 0)}})
    assert sorted(api.messages) == [("increment", "inflight_lora_requests_total", "alpha", 5),
                                    ("set", "inflight_lora_requests_running", "alpha", 2),
                                    ("set", "inflight_lora_requests_waiting", "alpha", 1)]
    api.messages.clear()
    metrics.update({**stats, "lora_requests": {"alpha": (0, 0, 6), "beta": (0, 0, 0)}})
    assert sorted(api.messages) == [("increment", "inflight_lora_requests_total", "alpha", 1),
                                    ("set", "inflight_lora_requests_running", "alpha", 0),
                                    ("set", "inflight_lora_requests_waiting", "alpha", 0)]


def test_the_host_tiers_gauges_and_counters_are_made_when_the_engine_reports_them():
    """With kv_offload_memory the engine reports its host tier (kv_offload.py): two gauges set, two counters
    advanced by what they gained; an engine without one sends none of them."""
    api = FakeMetricsApi()
    metrics = TritonMetrics(api, {"model": "llm", "version": "1"})
    metrics.update(idle_stats())
    assert not [m for m in api.messages if "offload" in m[1]]
    tier = {"kv_offload_blocks_used": 5, "kv_offload_blocks_total": 40, "kv_offload_stored_blocks_total": 9,
            "kv_offload_loaded_blocks_total": 4}
    metrics.update({**idle_stats(), **tier})
    metrics.update({**idle_stats(), **tier, "kv_offload_blocks_used": 3, "kv_offload_loaded_blocks_total": 6})
    sent = [m[:2] + m[3:] for m in api.messages if "offload" in m[1]]
    assert sent == [("set", "inflight_kv_offload_blocks_used", 5), ("set", "inflight_kv_offload_blocks_total", 40),
                    ("increment", "inflight_kv_offload_stored_blocks_total", 9),
                    ("increment", "inflight_kv_offload_loaded_blocks_total", 4),
                    ("set", "inflight_kv_offload_blocks_used", 3),
                    ("increment", "inflight_kv_offload_loaded_blocks_total", 2)]
