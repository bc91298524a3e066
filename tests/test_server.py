"""The `llm` model on a real tritonserver, through real tritonclient calls."""

import json
import random
import time
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "client"))

from grpc_stream import generate  # noqa: E402
from conftest import concurrently, running, serve  # noqa: E402
from lora_adapters import make_lora_adapters, trtllm_lora_tensors  # noqa: E402

pytestmark = pytest.mark.server

PROMPTS = [
    "In 1969, the first humans landed on",
    "The three primary colors are",
    "def fibonacci(n):",
    "Photosynthesis is the process by which",
    "Une phrase en français : le chat",
    "The capital of Japan is",
]
MAX_TOKENS = 24
SETTINGS = dict(num_kv_blocks=256, kv_cache_memory=None, max_num_seqs=64, max_num_batched_tokens=512,
                kv_offload_memory=1 << 28)


@pytest.fixture(scope="module")
def lora_modules(default_model, tmp_path_factory):
    """Two LoRA adapters of the default model, served beside it."""
    return make_lora_adapters(default_model, tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="module")
def server(lora_modules):
    yield from serve(**SETTINGS, lora_modules=lora_modules, lora_task_slots=2, serving_profile=True)


@pytest.fixture(scope="module")
def offline(default_model, lora_modules):
    """The offline engine, under the same settings."""
    from inflight import LLM

    return LLM(default_model, **SETTINGS, lora_modules=lora_modules, lora_task_slots=2)


@pytest.fixture(scope="module")
def offline_texts(offline):
    """The offline engine's greedy text for each prompt."""
    from inflight import SamplingParams

    outs = offline.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return {p: o.text for p, o in zip(PROMPTS, outs)}


def greedy(**extra):
    return dict(max_tokens=MAX_TOKENS, temperature=0.0, **extra)


def test_streamed_text_equals_offline_engine(server, offline_texts):
    for prompt in PROMPTS:
        result = generate(server.grpc_url, prompt, **greedy(return_finish_reason=True))
        assert result.error is None
        assert result.text == offline_texts[prompt]
        assert len(result.chunks) > 1, "a stream sends its text in pieces"
        assert result.finish_reason in ("stop", "length")


def test_non_streaming_sends_one_response(server, offline_texts):
    prompt = PROMPTS[0]
    result = generate(server.grpc_url, prompt, stream=False, **greedy(exclude_input_in_output=True))
    assert result.error is None and len(result.chunks) == 1
    assert result.text == offline_texts[prompt]
    with_prompt = generate(server.grpc_url, prompt, stream=False, **greedy())
    assert with_prompt.text == prompt + offline_texts[prompt]


def test_a_non_streamed_request_is_handed_over_once(server, offline_texts):
    """Not streamed, the engine hands the completion over when it ends (final-only): one response built
    for it, not one a token, and its latencies still counted (from the engine's times of its tokens)."""
    counts = ("inflight_time_to_first_token_seconds_count", "inflight_inter_token_latency_seconds_count")

    def settled():  # (the profile and the histograms reach the metrics port at most once a second)
        time.sleep(2.5)
        builds = server.serving_profile().get("build_response", (0, 0, 0))[2]
        return builds, [server.metrics().get(name, 0) for name in counts]

    builds, (ttft, itl) = settled()
    prompt = PROMPTS[3]
    result = generate(server.grpc_url, prompt, stream=False,
                      **greedy(exclude_input_in_output=True, return_num_output_tokens=True))
    assert result.error is None and result.text == offline_texts[prompt]
    tokens = int(result.responses[0]["num_output_tokens"][0])
    assert tokens > 2
    builds_after, (ttft_after, itl_after) = settled()
    assert builds_after - builds == 1, "one response built, not one a token"
    assert (ttft_after - ttft, itl_after - itl) == (1, tokens - 1)


def test_32_concurrent_streams(server, offline_texts):
    results = {}

    def run(i):
        prompt = PROMPTS[i % len(PROMPTS)]
        results[i] = (prompt, generate(server.grpc_url, prompt, **greedy()))

    with concurrently([lambda i=i: run(i) for i in range(32)], timeout=600):
        pass
    assert len(results) == 32
    for prompt, result in results.values():
        assert result.error is None
        assert result.text == offline_texts[prompt]
    server.wait_for_metric("inflight_kv_blocks_used", lambda v: v == 0)


WORDS = ("river", "copper", "violet", "engine", "harbor", "quantum", "lemon", "marble", "signal", "forest",
         "ledger", "orbit", "canvas", "thunder", "pepper", "glacier", "velvet", "comet", "saddle", "prism")


def random_request(rng: random.Random, earlier: list) -> tuple[str | None, dict, int | None]:
    """One request of a random served mix: its prompt (None: token ids), its inputs, and after how many
    responses its client cancels it (None: never). Every kind gives the same output whatever is batched:
    greedy or seeded, one completion or several, by text or by ids; each asks for its tokens' logprobs.
    A quarter repeat an earlier request's prompt, which the prefix cache then serves."""
    if earlier and rng.random() < 0.25:
        prompt, inputs = rng.choice(earlier)
        inputs = {"input_ids": inputs["input_ids"]} if prompt is None else {}
    elif rng.random() < 0.3:
        prompt, inputs = None, {"input_ids": np.array([rng.randrange(3, 49000) for _ in range(rng.randint(2, 70))],
                                                      dtype=np.int32)}
    else:
        prompt, inputs = " ".join([rng.choice(PROMPTS)] + rng.choices(WORDS, k=rng.randint(0, 60))), {}
    stream = rng.random() < 0.7
    inputs.update(stream=stream, max_tokens=rng.randint(1, 24), return_log_probs=True,
                  return_finish_reason=True)
    seed = np.array([rng.randrange(2 ** 32)], dtype=np.uint64)
    kind = rng.random()
    if kind < 0.3:
        inputs["temperature"] = 0.0
    elif kind < 0.6:
        inputs.update(temperature=0.9, top_p=0.95, seed=seed)
    elif kind < 0.8 or prompt is None:
        inputs.update(temperature=1.0, random_seed=seed, num_return_sequences=2)
    else:
        inputs["sampling_parameters"] = {"n": 2, "seed": int(seed[0]), "temperature": 0.8}
    if rng.random() < 0.2:
        inputs["stop_words"] = [rng.choice([" the", ".", "and"])]
    if rng.random() < 0.2:
        inputs["min_tokens"] = min(3, inputs["max_tokens"])
    if rng.random() < 0.2:
        inputs["repetition_penalty"] = 1.2
    if rng.random() < 0.2:
        inputs["exclude_input_in_output"] = True
    cancel_after = rng.randint(1, 2) if stream and rng.random() < 0.2 else None
    return prompt, inputs, cancel_after


def joined(result) -> dict:
    """A request's outputs joined over its responses (a stream that lags gets them coalesced), by
    (completion, entry, output name)."""
    out = {}
    for response in result.responses:
        index = int(response["sequence_index"][0]) if "sequence_index" in response else 0
        for name, value in response.items():
            if name in ("text_output", "finish_reason"):  # BYTES, an entry per completion (vllm_backend's n)
                for entry, piece in enumerate(value.reshape(-1)):
                    out[index, entry, name] = out.get((index, entry, name), b"") + piece
            elif name in ("output_ids", "output_log_probs"):
                out.setdefault((index, 0, name), []).extend(value.tolist())
    return out


def test_a_random_mix_of_streams_gives_each_request_its_output_alone(server):
    """32 requests of every kind at once, 16 at a time, some cancelled mid-stream: each request that ran
    to its end gets, sent again alone, the same responses' contents: tokens, text, finish reason and the
    tokens' logprobs bit for bit (on a CPU the engine's output does not depend on the batch, its chunks
    or the prefix cache: README, "The same output whatever the batch"); every block back after."""
    rng = random.Random(11)
    requests = []
    for _ in range(32):
        requests.append(random_request(rng, [(prompt, inputs) for prompt, inputs, _ in requests]))

    def run(prompt, inputs, cancel_after=None):
        return generate(server.grpc_url, prompt, cancel_after=cancel_after, **inputs)

    hits = server.metrics().get("inflight_prefix_cache_hit_tokens_total", 0)
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda request: run(*request), requests))
    server.wait_for_metric("inflight_prefix_cache_hit_tokens_total", lambda v: v > hits, timeout=5)
    finished = [(request, result) for request, result in zip(requests, together) if result.error != "cancelled"]
    assert all(result.error is None for _, result in finished), [result.error for _, result in finished]
    assert len(finished) < len(requests) and sum(1 for (_, _, c), _ in finished if c is None) > 20
    server.wait_for_metric("inflight_kv_blocks_used", lambda v: v == 0, timeout=10)
    for (prompt, inputs, _), result in finished:
        assert joined(run(prompt, inputs)) == joined(result), (prompt, inputs)
    server.wait_for_metric("inflight_kv_blocks_used", lambda v: v == 0, timeout=10)


def test_latency_histograms_on_the_metrics_port(server):
    """Time to first token and inter-token latency as Prometheus histograms: buckets by `le`, cumulative
    in every scrape (even one in the middle of a report), the +Inf one equal to the count once a report
    is out (counted in the model's process, sent at most once a second)."""
    generate(server.grpc_url, PROMPTS[0], max_tokens=8, temperature=0.0, ignore_eos=True)
    for name in ("inflight_time_to_first_token_seconds", "inflight_inter_token_latency_seconds"):
        server.wait_for_metric(f"{name}_count", lambda v: v > 0)
        deadline = time.monotonic() + 10
        while True:
            buckets, count = server.histogram(name), server.metrics()[f"{name}_count"]
            bounds = sorted(buckets, key=float)
            assert bounds[-1] == "+Inf" and len(bounds) == 13, buckets
            assert all(buckets[a] <= buckets[b] for a, b in zip(bounds, bounds[1:])), buckets
            if buckets["+Inf"] == count or time.monotonic() > deadline:
                break
            time.sleep(0.1)  # a scrape between the count's update and the buckets'
        assert buckets["+Inf"] == count and server.metrics()[f"{name}_sum"] > 0, (buckets, count)


def http_generate_stream(server, body: dict) -> list[dict]:
    request = urllib.request.Request(f"{server.http_url}/v2/models/llm/generate_stream",
                                     data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=120) as r:
        events = [line[len(b"data: "):] for line in r.read().splitlines() if line.startswith(b"data: ")]
    return [json.loads(e) for e in events]


def test_request_histograms_and_finish_reasons_on_the_metrics_port(server):
    """vllm_backend's request histograms and vLLM's request_success_total by finish reason: a request of
    8 tokens ending at its length adds 1 to each histogram's count, its prompt and output tokens to the
    token histograms' sums, 1 to the "length" ends and its 8 steps to the steps by their tokens and times."""
    def settled():  # (reports go out at most once a second, and when the engine falls idle)
        time.sleep(2.5)
        return server.metrics(), server.labeled("inflight_request_success_total", "finished_reason")

    before, ends = settled()
    result = generate(server.grpc_url, PROMPTS[1], max_tokens=8, temperature=0.0, ignore_eos=True,
                      return_num_input_tokens=True)
    assert result.error is None
    prompt_tokens = int(next(r["num_input_tokens"][0] for r in result.responses if "num_input_tokens" in r))
    after, ends_after = settled()
    assert ends_after.get("length", 0) - ends.get("length", 0) == 1
    assert ends_after.get("stop", 0) == ends.get("stop", 0) and ends_after.get("abort", 0) == ends.get("abort", 0)
    added = {name: after[f"{name}_count"] - before.get(f"{name}_count", 0) for name in (
        "inflight_e2e_request_latency_seconds", "inflight_request_queue_time_seconds",
        "inflight_request_prefill_time_seconds", "inflight_request_decode_time_seconds",
        "inflight_request_inference_time_seconds", "inflight_request_prompt_tokens",
        "inflight_request_generation_tokens", "inflight_request_params_n")}
    assert set(added.values()) == {1}, added
    sums = {name: after[f"{name}_sum"] - before.get(f"{name}_sum", 0)
            for name in ("inflight_request_prompt_tokens", "inflight_request_generation_tokens",
                         "inflight_e2e_request_latency_seconds", "inflight_request_decode_time_seconds")}
    assert (sums["inflight_request_prompt_tokens"], sums["inflight_request_generation_tokens"]) == (prompt_tokens, 8)
    assert 0 < sums["inflight_request_decode_time_seconds"] < sums["inflight_e2e_request_latency_seconds"]
    assert after["inflight_kv_cache_usage_perc"] == 0
    # The engine's steps by their tokens: its prompt's step, then a decode step for each token after the first.
    steps = after["inflight_iteration_tokens_count"] - before.get("inflight_iteration_tokens_count", 0)
    computed = after["inflight_iteration_tokens_sum"] - before.get("inflight_iteration_tokens_sum", 0)
    assert steps == 8 and 7 < computed <= prompt_tokens + 7, (steps, computed)
    timed = after["inflight_engine_step_seconds_count"] - before.get("inflight_engine_step_seconds_count", 0)
    assert timed == 8 and after["inflight_engine_step_seconds_sum"] > before.get("inflight_engine_step_seconds_sum", 0)


def test_http_generate_stream(server, offline_texts):
    prompt = PROMPTS[1]
    events = http_generate_stream(server, {"text_input": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                                           "stream": True})
    assert len(events) > 1 and all("error" not in e for e in events)
    assert "".join(e["text_output"] for e in events) == offline_texts[prompt]


def test_genai_perf_vllm_style_inputs(server):
    """genai-perf --backend vllm: JSON sampling parameters whose values are strings."""
    result = generate(server.grpc_url, PROMPTS[0], exclude_input_in_output=True, return_num_output_tokens=True,
                      sampling_parameters={"max_tokens": "9", "ignore_eos": "true", "temperature": "0"})
    assert result.error is None
    assert result.outputs["num_output_tokens"] == 9


def test_genai_perf_tensorrtllm_style_inputs(server):
    """genai-perf --backend tensorrtllm: max_tokens and min_length tensors."""
    result = generate(server.grpc_url, PROMPTS[2], exclude_input_in_output=True, max_tokens=7, min_length=7,
                      return_num_output_tokens=True, return_num_input_tokens=True, return_finish_reason=True)
    assert result.error is None
    assert result.outputs["num_output_tokens"] == 7
    assert result.outputs["num_input_tokens"] > 0
    assert result.finish_reason == "length"


def test_cancelled_stream_returns_its_blocks(server):
    """The request would run for minutes (4,000 tokens): its blocks are back within seconds only if the
    cancellation reached the engine, which counts it as aborted."""
    aborted = server.metrics().get("inflight_requests_aborted_total", 0)
    ends = server.labeled("inflight_request_success_total", "finished_reason").get("abort", 0)
    result = generate(server.grpc_url, PROMPTS[3], max_tokens=4000, ignore_eos=True, cancel_after=3)
    assert result.error == "cancelled"  # what the client did; the server's side is checked next
    server.wait_for_metric("inflight_requests_aborted_total", lambda v: v == aborted + 1, timeout=5)
    deadline = time.monotonic() + 5
    while server.labeled("inflight_request_success_total", "finished_reason").get("abort", 0) != ends + 1:
        assert time.monotonic() < deadline, "the abort is counted by its reason too"
        time.sleep(0.2)
    server.wait_for_metric("inflight_kv_blocks_used", lambda v: v == 0, timeout=5)
    server.wait_for_metric("inflight_num_requests_running", lambda v: v == 0, timeout=5)
    assert generate(server.grpc_url, PROMPTS[0], **greedy()).error is None


BAD_INPUTS = {
    "missing text_input": (None, {}, "text_input"),
    "empty prompt": ("", {}, "empty"),
    "not UTF-8": (b"\xff\xfe\xfa", {}, "UTF-8"),
    "negative max_tokens": ("hi", {"max_tokens": -3}, "max_tokens"),
    "zero max_tokens": ("hi", {"max_tokens": 0}, "max_tokens"),
    "negative temperature": ("hi", {"temperature": -1.0}, "temperature"),
    "NaN temperature": ("hi", {"temperature": float("nan")}, "temperature"),
    "top_p zero": ("hi", {"top_p": 0.0}, "top_p"),
    "malformed JSON": ("hi", {"sampling_parameters": "{not json"}, "JSON"),
    "unknown sampling parameter": ("hi", {"sampling_parameters": {"bogus": 1}}, "bogus"),
    "wrong dtype": ("hi", {"max_tokens": np.array([3.5], dtype=np.float32)}, "max_tokens"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_gets_an_error_naming_it(server, case):
    prompt, inputs, expected = BAD_INPUTS[case]
    if prompt is None:
        # a request without text_input: send only another input
        from grpc_stream import make_inputs
        import tritonclient.grpc as grpcclient
        client = grpcclient.InferenceServerClient(server.grpc_url)
        errors = []
        client.start_stream(callback=lambda result, error: errors.append(error or result))
        client.async_stream_infer("llm", make_inputs("x")[1:])
        client.stop_stream()
        assert errors and expected in str(errors[0])
    else:
        result = generate(server.grpc_url, prompt, **inputs)
        assert result.error is not None and expected in result.error, result.error
    assert server.alive()
    assert generate(server.grpc_url, PROMPTS[0], max_tokens=2).error is None


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "country": {"type": "string", "maxLength": 20}},
        "required": ["city", "country"], "additionalProperties": False}


def test_structured_outputs_in_both_conventions(server):
    """vllm_backend's `structured_outputs` in sampling_parameters (schema as an object or as JSON text),
    its older `guided_decoding` (as a serialized GuidedDecodingParams: a backend, other fields null) and
    TensorRT-LLM's guided decoding inputs, streamed: the same valid JSON; a structural tag as
    TensorRT-LLM's guide type."""
    import jsonschema

    prompt = "The capital of France, as JSON:"
    texts = []
    for inputs in (
        dict(sampling_parameters={"structured_outputs": {"json": CITY}, "max_tokens": 64, "temperature": 0}),
        dict(sampling_parameters={"structured_outputs": json.dumps({"json": json.dumps(CITY)}),
                                  "max_tokens": "64", "temperature": "0"}),
        dict(guided_decoding_guide_type="json_schema", guided_decoding_guide=json.dumps(CITY), max_tokens=64,
             temperature=0.0),
        dict(sampling_parameters={"guided_decoding": {"json": CITY, "regex": None, "backend": "xgrammar",
                                                      "whitespace_pattern": None}, "max_tokens": 64, "temperature": 0}),
    ):
        result = generate(server.grpc_url, prompt, return_finish_reason=True, **inputs)
        assert result.error is None and result.finish_reason == "stop" and len(result.chunks) > 1, result
        jsonschema.validate(json.loads(result.text), CITY)
        texts.append(result.text)
    assert texts[0] == texts[1] == texts[2] == texts[3]
    choice = generate(server.grpc_url, prompt, max_tokens=8, guided_decoding_guide_type="regex",
                      guided_decoding_guide="(Paris|Lyon)")
    assert choice.text in ("Paris", "Lyon")
    tag = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<city="], "at_least_one": True, "stop_after_first": True,
        "tags": [{"type": "tag", "begin": "<city=capital>", "end": "</city>",
                  "content": {"type": "json_schema", "json_schema": CITY}}]}}
    tagged = generate(server.grpc_url, prompt, max_tokens=120, temperature=0.0,
                      guided_decoding_guide_type="structural_tag", guided_decoding_guide=json.dumps(tag))
    assert tagged.error is None and tagged.text.startswith("<city=capital>") and tagged.text.endswith("</city>")
    jsonschema.validate(json.loads(tagged.text[len("<city=capital>"):-len("</city>")]), CITY)
    for inputs, words in ((dict(guided_decoding_guide_type="yaml", guided_decoding_guide="x"), "yaml"),
                          (dict(sampling_parameters={"structured_outputs": {"regex": "a("}}), "regex"),
                          (dict(sampling_parameters={"guided_decoding": {"regex": "a", "backend": "outlines"}}),
                           "outlines"),
                          (dict(guided_decoding_guide_type="json_schema"), "guided_decoding_guide")):
        error = generate(server.grpc_url, prompt, max_tokens=4, **inputs).error
        assert error and words in error, error
    server.wait_for_metric("inflight_kv_blocks_used", lambda v: v == 0)


def test_token_ids_in_and_out_with_tensorrt_llm_logprobs(server, offline):
    """input_ids instead of text_input; output_ids and output_log_probs / cum_log_probs back, streamed;
    only the outputs a client names, when it names some."""
    from inflight import SamplingParams

    prompt_ids = offline.encode(PROMPTS[5])
    expected = offline.generate([prompt_ids], SamplingParams(max_tokens=12, temperature=0.0, logprobs=0,
                                                             ignore_eos=True))[0]
    result = generate(server.grpc_url, None, input_ids=np.array(prompt_ids, np.int32), max_tokens=12,
                      temperature=0.0, ignore_eos=True, return_log_probs=True, beam_width=1)
    assert result.error is None and len(result.responses) > 1
    ids = [int(t) for r in result.responses for t in r["output_ids"]]
    logprobs = [float(v) for r in result.responses for v in r["output_log_probs"]]
    assert ids == expected.token_ids and result.text == expected.text
    reference = [e[t].logprob for t, e in zip(expected.token_ids, expected.outputs[0].logprobs)]
    assert np.allclose(logprobs, reference, atol=1e-4)
    assert abs(float(result.responses[-1]["cum_log_probs"][0]) - sum(reference)) < 1e-3
    # A client that names the outputs it wants gets those alone (the others are not even built).
    named = generate(server.grpc_url, None, input_ids=np.array(prompt_ids, np.int32), max_tokens=12,
                     temperature=0.0, ignore_eos=True, outputs=["output_ids"])
    assert named.error is None and {name for r in named.responses for name in r} == {"output_ids"}
    assert [int(t) for r in named.responses for t in r["output_ids"]] == expected.token_ids
    for bad, name in ((dict(beam_width=4, beam_search_diversity_rate=0.5), "beam_search_diversity_rate"),
                      (dict(num_return_sequences=0), "num_return_sequences")):
        error = generate(server.grpc_url, None, input_ids=np.array(prompt_ids, np.int32), **bad).error
        assert error and name in error, error


def test_tensorrt_llm_prompt_embedding_table(server, offline):
    """p-tuning through tritonserver: input_ids with virtual ids and an FP16 table, and a table alone
    (vLLM's prompt_embeds, here the text's own embeddings): the offline engine's tokens for the same
    vectors; a table the model cannot take is refused by name and the server serves on."""
    import torch

    from inflight import SamplingParams

    vocab, hidden = offline.runner.hf_config.vocab_size, offline.runner.hf_config.hidden_size
    soft = (torch.randn(4, hidden, generator=torch.Generator().manual_seed(0)) * 0.3).half().numpy()
    prompt_ids = offline.encode(PROMPTS[5])
    ids = list(range(vocab, vocab + 4)) + prompt_ids
    own = offline.runner.model.get_input_embeddings().weight[prompt_ids].detach().half().numpy()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in offline.generate(
        [{"prompt_token_ids": ids, "prompt_embedding_table": soft}, {"prompt_embeds": own}, prompt_ids], params)]
    assert expected[0] != expected[2], "the soft prompt changed nothing: a weak test"
    tokens = lambda result: [int(t) for r in result.responses for t in r["output_ids"]]  # noqa: E731
    given = generate(server.grpc_url, None, input_ids=np.array(ids, np.int32), prompt_embedding_table=soft,
                     prompt_vocab_size=4, prompt_table_extra_ids=np.array([1] * 4 + [0] * len(prompt_ids), np.uint64),
                     max_tokens=12, temperature=0.0, ignore_eos=True)
    assert given.error is None and tokens(given) == expected[0]
    alone = generate(server.grpc_url, None, prompt_embedding_table=own, max_tokens=12, temperature=0.0,
                     ignore_eos=True, return_num_input_tokens=True)
    assert alone.error is None and tokens(alone) == expected[1]
    assert int(alone.responses[-1]["num_input_tokens"][0]) == len(prompt_ids)
    for inputs, words in ((dict(input_ids=np.array(ids, np.int32), prompt_embedding_table=soft[:, :10]),
                           "hidden size"),
                          (dict(input_ids=np.array(prompt_ids, np.int32), prompt_embedding_table=soft),
                           "no prompt token id reads it"),
                          (dict(prompt_embedding_table=own, sampling_parameters={"prompt_logprobs": 1}),
                           "prompt_logprobs")):
        error = generate(server.grpc_url, None, **inputs).error
        assert error and words in error, error
    server.wait_for_metric("inflight_kv_blocks_used", lambda v: v == 0, timeout=5)


def test_tensorrt_llm_context_and_generation_logits(server, offline):
    """return_context_logits / return_generation_logits: context_logits [prompt, vocab] in the response
    with the first tokens, generation_logits [1, tokens, vocab] in each, streamed or not, and a beam
    search's, as the offline engine gives them."""
    from inflight import SamplingParams

    prompt_ids = offline.encode(PROMPTS[3])
    expected = offline.generate([prompt_ids], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                             return_context_logits=True,
                                                             return_generation_logits=True))[0]
    for stream in (True, False):
        result = generate(server.grpc_url, None, input_ids=np.array(prompt_ids, np.int32), max_tokens=6,
                          temperature=0.0, ignore_eos=True, stream=stream, exclude_input_in_output=True,
                          return_context_logits=True, return_generation_logits=True)
        assert result.error is None
        contexts = [r["context_logits"] for r in result.responses if "context_logits" in r]
        assert len(contexts) == 1 and np.allclose(contexts[0], expected.context_logits, atol=1e-5)
        generated = np.concatenate([r["generation_logits"][0] for r in result.responses], axis=0)
        assert generated.shape == (6, offline.runner.hf_config.vocab_size)
        assert np.allclose(generated, expected.outputs[0].generation_logits, atol=1e-5)
    error = generate(server.grpc_url, PROMPTS[3], return_generation_logits=True,
                     sampling_parameters={"n": 2, "max_tokens": 4}).error
    assert error and "num_return_sequences" in error
    # TensorRT-LLM's beam search with its logits (and a penalty): each beam's rows in its own responses.
    beams = offline.generate([prompt_ids], SamplingParams(max_tokens=6, beam_width=2, n=2, repetition_penalty=1.2,
                                                          return_context_logits=True,
                                                          return_generation_logits=True))[0]
    result = generate(server.grpc_url, None, input_ids=np.array(prompt_ids, np.int32), beam_width=2, max_tokens=6,
                      repetition_penalty=1.2, return_context_logits=True, return_generation_logits=True)
    assert result.error is None
    contexts = [r["context_logits"] for r in result.responses if "context_logits" in r]
    assert len(contexts) == 1 and np.allclose(contexts[0], beams.context_logits, atol=1e-5)
    for r in result.responses:
        completion = beams.outputs[int(r["sequence_index"][0])]
        assert [int(t) for t in r["output_ids"]] == completion.token_ids
        assert np.allclose(r["generation_logits"][0], completion.generation_logits, atol=1e-5)
    assert len(result.responses) == 2


def test_vllm_style_logprobs_priority_and_parameters_as_sampling_parameters(server, offline_texts):
    prompt = PROMPTS[0]
    result = generate(server.grpc_url, prompt, return_logprobs=True, return_cumulative_logprob=True, priority=-2,
                      sampling_parameters={"max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 2})
    assert result.error is None and result.text == offline_texts[prompt]
    entries = [e for r in result.responses for e in json.loads(r["logprobs"][0].decode())]
    assert len(entries) == MAX_TOKENS and all(2 <= len(e) <= 3 for e in entries)
    assert all({"logprob", "rank", "decoded_token"} <= set(v) for e in entries for v in e.values())
    # Greedy: each sampled token ranks first, and the cumulative logprob is the sum of theirs.
    firsts = [[v["logprob"] for v in e.values() if v["rank"] == 1] for e in entries]
    assert all(len(f) == 1 for f in firsts)
    assert abs(float(result.responses[-1]["cumulative_logprob"][0]) - sum(f[0] for f in firsts)) < 1e-3
    # Over HTTP, keys that are not inputs arrive as parameters and are read as sampling parameters.
    stop = offline_texts[prompt].split()[2]
    events = http_generate_stream(server, {"text_input": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                                           "stream": True, "stop": stop, "priority": 3})
    text = "".join(e["text_output"] for e in events)
    assert "error" not in events[-1] and text == offline_texts[prompt].split(stop)[0]


def test_n_completions_in_both_conventions(server, offline):
    """vllm_backend's n: every response holds one entry per completion. TensorRT-LLM's
    num_return_sequences: each completion in responses of its own, marked by sequence_index."""
    from inflight import SamplingParams

    params = dict(max_tokens=10, temperature=0.9, seed=11, ignore_eos=True)
    expected = offline.generate([PROMPTS[1]], SamplingParams(n=3, **params))[0].outputs
    result = generate(server.grpc_url, PROMPTS[1], sampling_parameters=dict(n=3, **params))
    assert result.error is None and all(len(r["text_output"]) == 3 for r in result.responses)
    texts = ["".join(r["text_output"][i].decode() for r in result.responses) for i in range(3)]
    assert texts == [c.text for c in expected]
    whole = generate(server.grpc_url, PROMPTS[1], stream=False, return_num_output_tokens=True,
                     sampling_parameters=dict(n=3, **params))
    assert len(whole.responses) == 1 and [t.decode() for t in whole.responses[0]["text_output"]] == [
        PROMPTS[1] + c.text for c in expected]
    assert list(whole.responses[0]["num_output_tokens"]) == [10, 10, 10]

    prompt_ids = offline.encode(PROMPTS[1])
    result = generate(server.grpc_url, None, input_ids=np.array(prompt_ids, np.int32), num_return_sequences=3,
                      max_tokens=10, temperature=0.9, seed=np.array([11], np.uint64), ignore_eos=True)
    assert result.error is None
    ids = {i: [] for i in range(3)}
    for r in result.responses:
        ids[int(r["sequence_index"][0])] += [int(t) for t in r["output_ids"]]
    assert [ids[i] for i in range(3)] == [c.token_ids for c in expected]
    cancelled = generate(server.grpc_url, PROMPTS[2], sampling_parameters={"n": 4, "max_tokens": 2000,
                                                                           "ignore_eos": True}, cancel_after=2)
    assert cancelled.error == "cancelled"
    server.wait_for_metric("inflight_kv_blocks_used", lambda v: v == 0, timeout=10)


def test_beam_search_in_both_conventions(server, offline):
    """Beam search served as the offline engine searches: vLLM's use_beam_search with best_of beams
    (or beam_width), every returned beam in each output of one response at the search's end;
    TensorRT-LLM's beam_width, len_penalty and early_stopping with input_ids, each beam in a response of
    its own (sequence_index); a cancelled search frees every block."""
    from inflight import SamplingParams

    params = SamplingParams(max_tokens=12, beam_width=3, n=2, length_penalty=0.5, early_stopping=True)
    expected = offline.generate([PROMPTS[4]], params)[0].outputs
    result = generate(server.grpc_url, PROMPTS[4], return_cumulative_logprob=True, sampling_parameters={
        "use_beam_search": True, "best_of": 3, "n": 2, "max_tokens": 12, "length_penalty": 0.5,
        "early_stopping": True})
    assert result.error is None and len(result.responses) == 1  # the beams come together, at the end
    texts = [t.decode() for t in result.responses[0]["text_output"]]
    assert texts == [c.text for c in expected] and texts[0] != texts[1]
    assert np.allclose(result.responses[-1]["cumulative_logprob"], [c.cumulative_logprob for c in expected],
                       atol=1e-4)

    prompt_ids = offline.encode(PROMPTS[4])
    result = generate(server.grpc_url, None, input_ids=np.array(prompt_ids, np.int32), beam_width=3,
                      num_return_sequences=2, max_tokens=12, len_penalty=0.5, early_stopping=True,
                      return_log_probs=True)
    assert result.error is None
    ids = {i: [] for i in range(2)}
    for r in result.responses:
        ids[int(r["sequence_index"][0])] += [int(t) for t in r["output_ids"]]
    assert [ids[i] for i in range(2)] == [c.token_ids for c in expected]
    # TensorRT-LLM's stop_words end beams as stop strings ("l'église" in the best beam: a beam stops there)
    stop = "glise"
    assert stop in expected[0].text
    stopped = offline.generate([PROMPTS[4]], SamplingParams(max_tokens=12, beam_width=3, n=2, stop=[stop]))[0].outputs
    result = generate(server.grpc_url, PROMPTS[4], beam_width=3, num_return_sequences=2, max_tokens=12,
                      stop_words=[stop])
    assert result.error is None
    texts = {int(r["sequence_index"][0]): r["text_output"][0].decode() for r in result.responses}
    assert [texts[i] for i in range(2)] == [c.text for c in stopped]
    assert "stop" in [c.finish_reason for c in stopped] and stop not in "".join(texts.values())
    # A search streams nothing before its end: cancelled while it runs, its blocks all come back.
    import tritonclient.grpc as grpcclient
    from grpc_stream import make_inputs

    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda **_: None)
    client.async_stream_infer("llm", make_inputs(PROMPTS[2], sampling_parameters={
        "beam_width": 4, "max_tokens": 2000, "ignore_eos": True}), request_id="cancelled-search")
    server.wait_for_metric("inflight_kv_blocks_used", lambda v: v > 0, timeout=30)
    client.stop_stream(cancel_requests=True)
    client.close()
    server.wait_for_metric("inflight_kv_blocks_used", lambda v: v == 0, timeout=10)


def test_token_controls_prompt_truncation_and_kept_stop_strings(server, offline):
    """vllm_backend's sampling_parameters logit_bias, allowed_token_ids, truncate_prompt_tokens and
    include_stop_str_in_output, TensorRT-LLM's embedding_bias_words / _weights, and no_repeat_ngram_size
    both ways, served as the offline engine generates them."""
    from inflight import SamplingParams

    prompt = PROMPTS[3]
    plain = offline.generate([prompt], SamplingParams(**greedy()))[0]
    first = plain.token_ids[0]
    word = offline.tokenizer.decode([first])
    cases = [  # (sampling_parameters, other inputs, the offline engine's SamplingParams)
        ({"logit_bias": {str(first): -100, "1234": 3.5}}, {}, dict(logit_bias={first: -100.0, 1234: 3.5})),
        ({"allowed_token_ids": plain.token_ids[2:9]}, {}, dict(allowed_token_ids=plain.token_ids[2:9])),
        ({"truncate_prompt_tokens": 3}, {}, dict(truncate_prompt_tokens=3)),
        ({"stop": [plain.text[5:9]], "include_stop_str_in_output": True}, {},
         dict(stop=[plain.text[5:9]], include_stop_str_in_output=True)),
        ({}, {"embedding_bias_words": [word, " the"], "embedding_bias_weights": np.array([-50, 4], np.float32)},
         dict(logit_bias={first: -50.0, **{t: 4.0 for t in offline.encode(" the", add_special_tokens=False)}})),
        ({"no_repeat_ngram_size": 1}, {}, dict(no_repeat_ngram_size=1)),
        ({}, {"no_repeat_ngram_size": 1}, dict(no_repeat_ngram_size=1)),
    ]
    # All at once, offline as one batch and served as concurrent streams.
    expected = offline.generate([prompt] * len(cases), [SamplingParams(**greedy(**params)) for *_, params in cases])
    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(lambda case: generate(server.grpc_url, prompt, return_num_input_tokens=True,
                                                      sampling_parameters={**greedy(), **case[0]}, **case[1]), cases))
    for (sampling, inputs, _), result, want in zip(cases, results, expected):
        assert result.error is None and result.text == want.text != plain.text, (sampling, inputs)
        assert int(result.responses[0]["num_input_tokens"][0]) == len(want.prompt_token_ids)
    # A client that sends every field of vLLM's SamplingParams: nulls and the defaults of fields we lack.
    every_field = {**greedy(), "seed": None, "logit_bias": None, "best_of": None, "detokenize": True,
                   "spaces_between_special_tokens": True, "guided_decoding": None}
    result = generate(server.grpc_url, prompt, sampling_parameters=every_field)
    assert result.error is None and result.text == plain.text, result.error
    error = generate(server.grpc_url, prompt, sampling_parameters={"allowed_token_ids": [10**6]}).error
    assert error and "allowed_token_ids" in error and "vocabulary" in error, error
    # Constraints that leave no token: an error for that request alone, the one beside it served.
    impossible = {"allowed_token_ids": [first], "structured_outputs": {"regex": "[0-9]+"}, "max_tokens": 4}
    with ThreadPoolExecutor(2) as pool:
        failed, served = pool.map(lambda sampling: generate(server.grpc_url, prompt, sampling_parameters=sampling),
                                  (impossible, greedy()))
    assert failed.error and "no token can follow" in failed.error, failed.error
    assert served.error is None and served.text == plain.text
    server.wait_for_metric("inflight_kv_blocks_used", lambda v: v == 0, timeout=10)


def test_tensorrt_llm_perf_metrics_in_the_final_response(server):
    """return_perf_metrics: the final response carries the request's times, in order, and its KV blocks;
    the same prompt again finds all its full blocks but the last token's in the prefix cache."""
    prompt = "A prompt of its own, for the perf metrics: " + PROMPTS[3] * 5
    names = ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")
    started = time.time_ns()
    reused = []
    for _ in range(2):
        result = generate(server.grpc_url, prompt, return_perf_metrics=True, return_num_input_tokens=True,
                          **greedy(ignore_eos=True))
        assert result.error is None
        assert not any("arrival_time_ns" in r for r in result.responses[:-1])  # the final response only
        final = result.responses[-1]
        times = [int(final[name][0]) for name in names]
        assert started <= times[0] and times == sorted(times) and times[-1] <= time.time_ns()
        blocks = {name: int(final[f"kv_cache_{name}"][0]) for name in ("alloc_new_blocks", "reused_blocks",
                                                                       "alloc_total_blocks")}
        prompt_tokens = int(final["num_input_tokens"][0])
        assert blocks["alloc_total_blocks"] == -(-(prompt_tokens + MAX_TOKENS - 1) // 16)
        assert blocks["alloc_new_blocks"] + blocks["reused_blocks"] == blocks["alloc_total_blocks"]
        reused.append((blocks["reused_blocks"], (prompt_tokens - 1) // 16))
    assert reused[0][0] == 0 and reused[1][0] == reused[1][1] > 0, reused
    plain = generate(server.grpc_url, prompt, **greedy())
    assert not any("arrival_time_ns" in r for r in plain.responses)


def test_a_prompt_found_again_in_the_host_tier_after_the_pool_moved_on(server):
    """kv_offload_memory: a prompt whose blocks the pool (256 blocks) handed to other prompts since is found
    again in the host tier: the same text, its full blocks reported reused, and the host tier's metrics."""
    prompt = "A prompt for the host tier: " + PROMPTS[4] * 8
    first = generate(server.grpc_url, prompt, return_perf_metrics=True, **greedy(ignore_eos=True))
    loaded = server.metrics().get("inflight_kv_offload_loaded_blocks_total", 0)
    for i in range(5):  # (about 57 blocks each: more than the pool, so every block cached before is handed out)
        filler = generate(server.grpc_url, f"Filler {i}: " + " ".join(PROMPTS) * 20, max_tokens=1, temperature=0.0)
        assert filler.error is None
    again = generate(server.grpc_url, prompt, return_perf_metrics=True, return_num_input_tokens=True,
                     **greedy(ignore_eos=True))
    assert first.error is None and again.error is None and again.text == first.text
    reused = int(again.responses[-1]["kv_cache_reused_blocks"][0])
    assert reused == (int(again.responses[-1]["num_input_tokens"][0]) - 1) // 16 > 0
    server.wait_for_metric("inflight_kv_offload_loaded_blocks_total", lambda v: v >= loaded + reused, timeout=10)
    metrics = server.metrics()
    assert metrics["inflight_kv_offload_stored_blocks_total"] >= reused
    assert 0 < metrics["inflight_kv_offload_blocks_used"] <= metrics["inflight_kv_offload_blocks_total"]


def test_lora_adapters_by_name_beside_the_base_model(server, offline):
    """vllm_backend's lora_name (in sampling_parameters; over HTTP also as a parameter): requests of each
    adapter and of the base model at once, each served as the offline engine generates it; an adapter
    the server does not have is refused by name."""
    from inflight import SamplingParams

    prompt = PROMPTS[4]
    expected = {name: offline.generate([prompt], SamplingParams(**greedy()), lora_name=name)[0].text
                for name in (None, "alpha", "beta")}
    assert len(set(expected.values())) == 3, expected
    named = lambda name: {"lora_name": name} if name else {}  # noqa: E731
    with ThreadPoolExecutor(len(expected)) as pool:
        results = list(pool.map(lambda name: generate(server.grpc_url, prompt,
                                                      sampling_parameters={**greedy(), **named(name)}), expected))
    assert [(r.error, r.text) for r in results] == [(None, text) for text in expected.values()]
    events = http_generate_stream(server, {"text_input": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                                           "stream": True, "lora_name": "beta"})
    assert "error" not in events[-1] and "".join(e["text_output"] for e in events) == expected["beta"]
    error = generate(server.grpc_url, prompt, sampling_parameters={"lora_name": "gamma"}).error
    assert error and "unknown LoRA adapter 'gamma'" in error, error
    server.wait_for_metric("inflight_kv_blocks_used", lambda v: v == 0, timeout=10)
    deadline = time.monotonic() + 10  # the engine reports its state once idle
    while server.labeled("inflight_lora_requests_total", "adapter") != {"alpha": 1, "beta": 2}:
        assert time.monotonic() < deadline, server.labeled("inflight_lora_requests_total", "adapter")
        time.sleep(0.1)
    assert server.labeled("inflight_lora_requests_running", "adapter") == {"alpha": 0, "beta": 0}


def test_tensorrt_llm_lora_inputs(server, offline, lora_modules):
    """TensorRT-LLM's LoRA inputs: an adapter sent as FP16 lora_weights and lora_config with its first
    request, then named by lora_task_id alone, beside the base model: the offline engine's tokens for
    the same tensors; a task never sent and a module the engine does not adapt are refused by name."""
    from inflight import LoRATask, SamplingParams

    weights, config = trtllm_lora_tensors(lora_modules["alpha"], np.float16)
    prompt_ids = offline.encode(PROMPTS[3])
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in offline.generate([prompt_ids] * 2, params,
                                                      lora_task=[LoRATask(41, weights, config), None])]
    assert expected[0] != expected[1], "the adapter changed nothing: a weak test"
    tokens = lambda result: [int(t) for r in result.responses for t in r["output_ids"]]  # noqa: E731
    request = dict(input_ids=np.array(prompt_ids, np.int32), max_tokens=12, temperature=0.0, ignore_eos=True)
    task = np.array([41], np.uint64)
    sent = generate(server.grpc_url, None, lora_task_id=task, lora_weights=weights, lora_config=config, **request)
    assert sent.error is None and tokens(sent) == expected[0]
    with ThreadPoolExecutor(2) as pool:  # by its id alone, beside a request of the base model
        again, base = pool.map(lambda inputs: generate(server.grpc_url, None, **inputs, **request),
                               [dict(lora_task_id=task), {}])
    assert (again.error, tokens(again), base.error, tokens(base)) == (None, expected[0], None, expected[1])
    for inputs, words in ((dict(lora_task_id=np.array([42], np.uint64)), "LoRA task 42 is not in the cache"),
                          (dict(lora_task_id=task, lora_weights=weights[:1],
                                lora_config=np.array([[9, 0, 8]], np.int32)), "module cross_attn_q is not served"),
                          (dict(lora_weights=weights, lora_config=config), "go with 'lora_task_id'")):
        error = generate(server.grpc_url, None, **inputs, **request).error
        assert error and words in error, error
    server.wait_for_metric("inflight_kv_blocks_used", lambda v: v == 0, timeout=10)
    server.wait_for_metric("inflight_lora_task_loads_total", lambda v: v == 1, timeout=10)  # sent once, used twice


def test_adapters_added_by_loading_the_model_again(tmp_path, lora_modules, offline, offline_texts):
    """vllm_backend's way of adding adapters to a running server: list them in multi_lora.json beside
    model.json, turn on enable_lora, and load the model again. tritonserver starts a new engine while the
    old one serves; a stream in flight ends complete on the old one, the next requests reach the
    adapters, and the old engine's processes are gone once its last stream has ended. A load that fails
    (an adapter that cannot be read) says why and leaves the running engine serving. (After a failed
    load, tritonserver 2.51 waits out its whole exit timeout at shutdown, whatever the model: a short
    one here.)"""
    import shutil

    from inflight import SamplingParams
    from server_process import TritonServer

    shutil.copytree(ROOT / "model_repository", tmp_path / "repository", ignore=shutil.ignore_patterns("__pycache__"))
    long_params = dict(max_tokens=160, temperature=0.0, ignore_eos=True)
    expected_long, expected_alpha = (o.text for o in offline.generate(  # one batch, the base model beside alpha
        [PROMPTS[0], PROMPTS[4]], [SamplingParams(**long_params), SamplingParams(**greedy())],
        lora_name=[None, "alpha"]))
    with running(TritonServer(repository=tmp_path / "repository", device="cpu",
                              server_args=("--exit-timeout-secs", "5"), **SETTINGS)) as server:
        error = generate(server.grpc_url, PROMPTS[4], sampling_parameters={**greedy(), "lora_name": "alpha"}).error
        assert error and "this server has none" in error, error
        load = urllib.request.Request(f"{server.http_url}/v2/repository/models/llm/load", data=b"{}", method="POST")
        adapters_file = server.settings_path.parent / "multi_lora.json"
        server.settings_path.write_text(json.dumps({**json.loads(server.settings_path.read_text()),
                                                    "enable_lora": True}))
        # An adapter that cannot be loaded: the load fails saying why, and the running engine serves on.
        adapters_file.write_text(json.dumps({**lora_modules, "broken": str(tmp_path / "nowhere")}))
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(load, timeout=300)
        assert "LoRA adapter 'broken' could not be read" in failed.value.read().decode()
        assert server.model_ready()
        assert generate(server.grpc_url, PROMPTS[4], **greedy()).text == offline_texts[PROMPTS[4]]
        with ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(generate, server.grpc_url, PROMPTS[0], sampling_parameters=long_params)
            time.sleep(1.0)
            adapters_file.write_text(json.dumps(lora_modules))
            assert not in_flight.done(), "the stream was meant to be in flight when the model loads again"
            with urllib.request.urlopen(load, timeout=300) as reply:
                assert reply.status == 200
            served = generate(server.grpc_url, PROMPTS[4], sampling_parameters={**greedy(), "lora_name": "alpha"})
            assert (served.error, served.text) == (None, expected_alpha)
            long = in_flight.result(timeout=300)
        assert (long.error, long.text) == (None, expected_long)
        deadline = time.monotonic() + 30
        while len(server.descendants("triton_python_backend_stub")) > 1 or len(server.descendants("run_child")) > 1:
            assert time.monotonic() < deadline, "the old engine's processes are still running"
            time.sleep(0.2)


def test_fused_layers_compile_in_the_triton_models_own_process(offline_texts):
    """The engine on a thread of the Triton model's process (engine_process false) serves the offline
    engine's text, with fused layers (a GPU's default; asked for here) compiled in the model's stub,
    whose embedded Python reads files as ASCII unless told otherwise (inductor's code templates are
    UTF-8). In an engine process of its own they compile as in any Python process (test_fused_layers.py);
    a server for that cost CI a minute of cold C++ compiles (the stub's Python and the venv's share no
    entries of inductor's cache)."""
    for server in serve(**SETTINGS, fused_layers=True, engine_process=False):
        for prompt in PROMPTS[:2]:
            result = generate(server.grpc_url, prompt, **greedy())
            assert result.error is None, result.error
            assert result.text == offline_texts[prompt]


def test_a_port_taken_meanwhile_moves_the_server_to_others(offline_texts):
    """The tests' and benchmarks' TritonServer: a port another process takes between free_ports finding it
    free and tritonserver binding it (a server starting beside this one) makes it start again on fresh
    ports, and serve there."""
    import socket

    from server_process import TritonServer

    server = TritonServer(device="cpu", **SETTINGS)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", server.grpc_port))
        taken.listen()
        with running(server):
            assert [ports[1] for ports in server.ports_taken] == [taken.getsockname()[1]]
            assert server.grpc_port != taken.getsockname()[1]
            assert generate(server.grpc_url, PROMPTS[4], **greedy()).text == offline_texts[PROMPTS[4]]
