"""Faults and hostile input against a real tritonserver: every stream gets exactly one final response,
no KV block is lost, a persistent fault (or the engine process's death) makes the model not-ready,
and oversized inputs are refused quickly without stalling good streams."""

import http.client
import json
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "client"))

from grpc_stream import generate, make_inputs  # noqa: E402
from conftest import (PROMPTS, assert_all_blocks_free, assert_not_ready, concurrently, greedy, running,  # noqa: E402
                      serve, stream_to_the_end, wait_gone)
from server_process import TritonServer  # noqa: E402

pytestmark = pytest.mark.server

# Four sequences at a time, so that each injected fault hits one batch of four and spares the rest.
SETTINGS = dict(device="cpu", num_kv_blocks=128, kv_cache_memory=None, max_num_seqs=4, max_num_batched_tokens=256,
                max_model_len=512)
# With 16 streams of 32 tokens in waves of four, each fault ends the wave it hits; the waves between
# the faults run through.
FAULTS = "forward@10,sampler@40,detokenize@70"


@pytest.fixture(scope="module")
def faulty_server():
    yield from serve(env={"INFLIGHT_FAULTS": FAULTS}, **SETTINGS)


@pytest.fixture(scope="module")
def server():
    yield from serve(**SETTINGS)


def test_faults_in_forward_sampler_and_detokenizer_end_each_stream_once(faulty_server, reference):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} (stream {i})" for i in range(16)]
    expected = reference(prompts, 32)
    results = {}

    def run(i):
        results[i] = stream_to_the_end(faulty_server.grpc_url, prompts[i], **greedy(32))

    with concurrently([lambda i=i: run(i) for i in range(len(prompts))], timeout=600):
        pass
    assert all(r["finals"] == 1 and r["after_final"] == 0 for r in results.values())
    failed = [i for i, r in results.items() if r["error"]]
    stages = {stage for i in failed for stage in ("forward", "sampler", "detokenize")
              if f"injected {stage} fault" in results[i]["error"]}
    assert stages == {"forward", "sampler", "detokenize"}, [results[i]["error"] for i in failed]
    assert len(failed) <= 12
    for i in set(results) - set(failed):
        assert results[i]["text"] == expected[i]
    metrics = faulty_server.metrics()
    assert metrics["inflight_failed_steps_total"] == 3 and metrics["inflight_requests_failed_total"] == len(failed)
    assert_all_blocks_free(faulty_server)
    after = [generate(faulty_server.grpc_url, p, **greedy(16)) for p in PROMPTS[:2]]
    assert [r.text for r in after] == reference(PROMPTS[:2], 16)


def test_cancelling_within_a_millisecond_of_sending(server):
    import tritonclient.grpc as grpcclient

    for _ in range(20):
        client = grpcclient.InferenceServerClient(server.grpc_url)
        client.start_stream(callback=lambda result, error: None)
        client.async_stream_infer("llm", make_inputs(PROMPTS[0], max_tokens=4000, ignore_eos=True))
        client.stop_stream(cancel_requests=True)
        client.close()
    # Each would run for minutes: the blocks come back only if every cancellation took effect.
    server.wait_for_metric("inflight_kv_blocks_used", lambda v: v == 0, timeout=10)
    server.wait_for_metric("inflight_num_requests_waiting", lambda v: v == 0, timeout=10)
    assert generate(server.grpc_url, PROMPTS[1], **greedy(4)).error is None


def test_an_http_client_that_disconnects_mid_stream(server, reference):
    host, port = server.http_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"text_input": PROMPTS[2], "max_tokens": 64, "temperature": 0.0, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v2/models/llm/generate_stream", body=json.dumps(body))
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    aborted = server.metrics().get("inflight_requests_aborted_total", 0)
    conn.sock.close()  # gone mid-stream
    conn.close()
    assert_all_blocks_free(server)
    print(f"\nHTTP client gone mid-stream: aborted by the server: "
          f"{server.metrics().get('inflight_requests_aborted_total', 0) > aborted}")
    assert generate(server.grpc_url, PROMPTS[3], **greedy(16)).text == reference(PROMPTS[3:4], 16)[0]
    assert server.alive()


def test_a_persistent_fault_makes_the_model_not_ready():
    with running(TritonServer(env={"INFLIGHT_FAULTS": "forward@5+"}, max_consecutive_failed_steps=3,
                              **SETTINGS)) as server:
        results = [stream_to_the_end(server.grpc_url, PROMPTS[0], quiet_s=0.3, **greedy(8)) for _ in range(4)]
        assert results[0]["error"] is not None and "injected forward fault" in results[0]["error"]
        assert all(r["finals"] == 1 and r["after_final"] == 0 for r in results)
        assert_not_ready(server)
        start = time.monotonic()
        refused = stream_to_the_end(server.grpc_url, PROMPTS[1], quiet_s=0.3, **greedy(8))
        assert refused["error"] and refused["finals"] == 1 and time.monotonic() - start < 5
        assert server.alive()


def test_a_hung_engine_step_ends_every_stream_and_makes_the_model_not_ready():
    """The model forward of the engine's 6th step never returns (as on a hung GPU): after step_timeout_s
    each stream gets one final response, an UNAVAILABLE error naming the time-out, and the model reports
    not-ready for an orchestrator to restart it; tritonserver lives on."""
    with running(TritonServer(env={"INFLIGHT_FAULTS": "hang@6"}, step_timeout_s=3, **SETTINGS)) as server:
        started = time.monotonic()
        results = {}

        def run(i):
            results[i] = stream_to_the_end(server.grpc_url, PROMPTS[i], quiet_s=0.3, max_tokens=100, ignore_eos=True)

        with concurrently([lambda i=i: run(i) for i in range(2)], timeout=60):
            pass
        assert 3 <= time.monotonic() - started < 30
        assert all(r["finals"] == 1 and r["after_final"] == 0 for r in results.values()), results
        assert all("step_timeout_s (3 s)" in (r["error"] or "") for r in results.values()), results
        assert_not_ready(server)
        assert server.alive()


def engine_process(server):
    engine = server.descendants("inflight.serving.engine_process")
    assert len(engine) == 1
    return engine[0]


def test_the_engine_process_killed_mid_stream_ends_every_stream():
    """The engine process dies (as by the out-of-memory killer) while 6 streams run: each gets exactly
    one final response, an UNAVAILABLE error naming the death, none hangs; the model then reports
    not-ready and refuses at once, and tritonserver itself lives on."""
    with running(TritonServer(**SETTINGS)) as server:
        results = {}

        def run(i):
            results[i] = stream_to_the_end(server.grpc_url, PROMPTS[i % len(PROMPTS)], quiet_s=0.3,
                                           max_tokens=400, ignore_eos=True)

        with concurrently([lambda i=i: run(i) for i in range(6)], timeout=300):
            server.wait_for_metric("inflight_num_requests_running", lambda v: v >= 4, timeout=60)
            engine_process(server).kill()
        assert all(r["finals"] == 1 and r["after_final"] == 0 for r in results.values()), results
        assert all("the engine process was killed by SIGKILL" in (r["error"] or "") for r in results.values())
        assert_not_ready(server)
        start = time.monotonic()
        refused = stream_to_the_end(server.grpc_url, PROMPTS[1], quiet_s=0.3, **greedy(8))
        assert refused["error"] and refused["finals"] == 1 and time.monotonic() - start < 5
        assert server.alive()


def test_tritonserver_killed_and_not_yet_reaped_leaves_no_process_of_the_model():
    """tritonserver killed (as by the out-of-memory killer) under a launcher that reads its output to the
    end before it waits for it: a zombie that keeps its pid, which the Python backend's stub takes for a
    live tritonserver. The stub leaves all the same, and the engine process with it, within seconds
    (before, both ran on for good, holding the launcher's pipes and the model's memory)."""
    import signal

    import psutil

    server = TritonServer(**SETTINGS).start()
    try:
        model = server.descendants("triton_python_backend_stub") + [engine_process(server)]
        assert len(model) == 2
        server.process.send_signal(signal.SIGKILL)  # (and nothing reaps it: no wait, no poll, until the end)
        left = wait_gone(model, timeout=10)
        assert psutil.Process(server.process.pid).status() == psutil.STATUS_ZOMBIE
        assert not left, f"still running with tritonserver gone: {[p.pid for p in left]}"
    finally:
        server.stop()


def test_hostile_sizes_are_refused_quickly_while_good_streams_flow(server, reference):
    """Inputs at and beyond every limit, many at once, beside 8 good streams whose token gaps are
    measured against a quiet run of the same streams."""
    mib = 1 << 20
    word = "w" * 256
    hostile = {  # name: (prompt, inputs, words expected in the error or None if it is served)
        "prompt of max_input_bytes": ("x " * (mib // 2), {}, "max_model_len"),
        "prompt beyond max_input_bytes": ("x" * (mib + 1), {}, "max_input_bytes"),
        "64 bad words of 256 characters": ("Hi", {"bad_words": [word] * 64}, None),
        "65 bad words": ("Hi", {"bad_words": ["w"] * 65}, "max_words"),
        "a bad word of 257 characters": ("Hi", {"bad_words": [word + "w"]}, "max_word_chars"),
        "a bad word of 1 MiB": ("Hi", {"bad_words": ["w" * mib]}, "max_word_chars"),
        "64 stop words of 256 characters": ("Hi", {"stop_words": [word] * 64}, None),
        "a stop word of 257 characters": ("Hi", {"stop_words": [word + "w"]}, "max_word_chars"),
        "sampling_parameters beyond max_input_bytes": ("Hi", {"sampling_parameters": {"stop": ["s" * mib]}},
                                                       "max_input_bytes"),
    }
    good_prompts = [f"{PROMPTS[i % len(PROMPTS)]} (good {i})" for i in range(8)]
    expected = reference(good_prompts, 40)

    def good_streams():
        gaps, results = {}, {}

        def run(i):
            stamps = []
            results[i] = generate(server.grpc_url, good_prompts[i], on_text=lambda t: stamps.append(
                time.monotonic()), **greedy(40))
            assert results[i].error is None and len(stamps) > 1, results[i].error
            gaps[i] = max(b - a for a, b in zip(stamps, stamps[1:]))
        return run, gaps, results

    alone = {}
    for name, (prompt, inputs, words) in hostile.items():
        if words is not None:  # a refusal on an idle server: quick, whatever the input's size
            start = time.monotonic()
            assert words in (generate(server.grpc_url, prompt, max_tokens=4, **inputs).error or ""), name
            alone[name] = time.monotonic() - start
    assert max(alone.values()) < 2.0, alone
    run, quiet_gaps, _ = good_streams()
    with concurrently([lambda i=i: run(i) for i in range(8)], timeout=600):
        pass
    run, gaps, results = good_streams()
    outcomes, times = {}, {}

    def attack(name, k):
        prompt, inputs, _ = hostile[name]
        start = time.monotonic()
        outcomes[name, k] = generate(server.grpc_url, prompt, max_tokens=4, **inputs)
        times[name, k] = time.monotonic() - start

    attacks = [lambda n=n, k=k: attack(n, k) for n in hostile for k in range(4)]
    with concurrently([lambda i=i: run(i) for i in range(8)] + attacks, timeout=600):
        pass
    for (name, k), result in outcomes.items():
        words = hostile[name][2]
        if words is None:
            assert result.error is None, (name, result.error)
        else:
            assert result.error and words in result.error, (name, result.error)
    assert [results[i].text for i in range(8)] == expected
    slowest = {name: max(t for (n, _), t in times.items() if n == name) for name in hostile}
    quiet, loaded = max(quiet_gaps.values()), max(gaps.values())
    print("\nhostile sizes, time to the response (served ones queue for a slot behind the good streams):\n"
          + "\n".join(f"  {name}: alone {alone.get(name, 0):.2f} s, slowest of 4 in the burst {t:.2f} s"
                      for name, t in slowest.items())
          + f"\n  good streams' largest gap between two tokens: {quiet * 1000:.0f} ms quiet, "
            f"{loaded * 1000:.0f} ms under attack")
    # Refused before tokenization: at once. Over-long prompts are tokenized one at a time on a thread
    # of their own (about 1 s per MiB), never on the thread that admits the other requests.
    assert all(t < 1.0 for name, t in slowest.items() if hostile[name][2] not in (None, "max_model_len"))
    # Before the fix, one 1 MiB bad word held every stream for 1.85 s. The tokenizer takes one of the
    # two cores here: with libgomp's default spinning the engine's steps slowed up to 10x meanwhile
    # (gaps of 0.83 to 1.35 s), with the model's shorter spin (model.py) to 0.27-0.29 s.
    assert loaded < quiet + 0.75
    assert engine_process(server).environ().get("GOMP_SPINCOUNT") == "10000"
    assert_all_blocks_free(server)
