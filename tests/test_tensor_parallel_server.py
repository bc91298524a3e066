"""Tensor parallelism through a real tritonserver (3 ranks on CPU, gloo): streams exact, cancellation
and bad requests handled, and no process left behind on unload; a worker killed mid-run ends every
stream with an error and the model reports not-ready."""

import os
import signal
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "client"))

from conftest import (PROMPTS, assert_all_blocks_free, assert_not_ready, concurrently, greedy,  # noqa: E402
                      running, stream_to_the_end, wait_gone)
from grpc_stream import generate  # noqa: E402
from server_process import TritonServer  # noqa: E402

pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(torch.cuda.is_available(), reason="these tests shard over CPU processes (see "
                                                         "test_tensor_parallel.py)"),
]

SETTINGS = dict(device="cpu", tensor_parallel_size=3, num_threads=1, num_kv_blocks=128, kv_cache_memory=None,
                max_num_seqs=8, max_num_batched_tokens=128)


def engine_processes(server: TritonServer) -> dict[str, list[psutil.Process]]:
    """The Python backend's stub and the tensor-parallel workers it started, under tritonserver."""
    return {"stub": server.descendants("triton_python_backend_stub"),
            "worker": server.descendants("run_child('inflight.parallel', 'worker_main')")}


def test_streams_cancellation_bad_input_and_unload_leave_no_process(reference):
    with running(TritonServer(**SETTINGS)) as server:
        processes = engine_processes(server)
        assert len(processes["stub"]) == 1 and len(processes["worker"]) == 2, processes
        prompts = [f"{PROMPTS[i % len(PROMPTS)]} ({i})" for i in range(6)]
        expected = reference(prompts, 16)
        results = {}
        calls = [lambda i=i: results.__setitem__(i, generate(server.grpc_url, prompts[i], **greedy(16)))
                 for i in range(6)]
        calls.append(lambda: results.__setitem__("bad", generate(server.grpc_url, PROMPTS[0], max_tokens=-3)))
        calls.append(lambda: results.__setitem__("cancelled", generate(server.grpc_url, PROMPTS[1], cancel_after=2,
                                                                        **greedy(2000))))
        with concurrently(calls, timeout=300):
            pass
        assert [results[i].text for i in range(6)] == expected
        assert "max_tokens" in (results["bad"].error or "")
        assert_all_blocks_free(server)
        # Unload (as tritonserver does at exit, or an operator through the repository API): the stub and
        # every worker are gone.
        request = urllib.request.Request(f"{server.http_url}/v2/repository/models/llm/unload", method="POST",
                                         data=b"{}")
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200
        assert_not_ready(server)
        left = wait_gone(processes["worker"] + processes["stub"], timeout=60)
        assert not left, f"still running after unload: {[p.pid for p in left]}"
        assert server.alive()


def test_a_killed_worker_ends_every_stream_with_an_error_and_the_model_unloads():
    with running(TritonServer(**SETTINGS)) as server:
        processes = engine_processes(server)
        results = {}
        calls = [lambda i=i: results.__setitem__(i, stream_to_the_end(server.grpc_url, PROMPTS[i], quiet_s=0.5,
                                                                        **greedy(2000)))
                 for i in range(4)]
        with concurrently(calls, timeout=120):
            server.wait_for_metric("inflight_num_requests_running", lambda v: v == 4, timeout=60)
            time.sleep(1.0)  # a few steps in
            victim = processes["worker"][0]
            os.kill(victim.pid, signal.SIGKILL)
            killed_at = time.monotonic()
        for result in results.values():
            assert result["finals"] == 1 and result["after_final"] == 0
            assert result["error"] and "tensor-parallel step failed" in result["error"], result["error"]
        print(f"\nworker killed: every stream ended within {time.monotonic() - killed_at:.1f} s; "
              f"error: {results[0]['error'][:200]}")
        assert_not_ready(server)
        left = wait_gone(processes["worker"] + processes["stub"], timeout=60)
        assert not left, f"still running after the worker died: {[p.pid for p in left]}"
        refused = stream_to_the_end(server.grpc_url, PROMPTS[0], quiet_s=0.3, **greedy(4))
        assert refused["error"] and refused["finals"] == 1
        assert server.alive()


@pytest.mark.parametrize("how", ["ctrl-c and SIGTERM", "stub killed"])
def test_server_exit_or_a_lost_stub_leaves_no_worker(how, reference):
    server = TritonServer(**SETTINGS).start()
    try:
        processes = engine_processes(server)
        assert len(processes["worker"]) == 2
        if how == "ctrl-c and SIGTERM":  # to the whole process group, as a terminal's ctrl-c and systemd
            # stopping a service send them: tritonserver lets the stream in flight end (the engine
            # process and the workers serve on), then unloads and exits
            results = []
            with concurrently([lambda: results.append(generate(server.grpc_url, PROMPTS[0], **greedy(24)))],
                              timeout=120):
                server.wait_for_metric("inflight_num_requests_running", lambda v: v == 1, timeout=60)
                os.killpg(server.process.pid, signal.SIGINT)
                os.killpg(server.process.pid, signal.SIGTERM)
            assert results[0].error is None and results[0].text == reference([PROMPTS[0]], 24)[0], results[0]
            server.process.wait(timeout=90)
        else:  # the stub dies without a word: the workers notice their parent is gone
            processes["stub"][0].kill()
        left = wait_gone(processes["worker"] + processes["stub"], timeout=30)
        assert not left, f"still running after {how}: {[p.pid for p in left]}"
    finally:
        server.stop()
