"""Soak: perf_analyzer at concurrency 32 against a tritonserver started for the purpose, for 10
minutes by default. Reports requests served, failures, resident-memory growth of the model's process
and KV blocks still used at the end.

    make soak                 # 10 minutes
    make soak MINUTES=2
"""

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from perf_analyzer import run_perf_analyzer  # noqa: E402
from server_process import TritonServer  # noqa: E402

PROMPTS = ["In 1969, the first humans landed on the Moon. Tell me more about it.",
           "The three primary colors are red, yellow and blue. Tell me more about it.",
           "Photosynthesis is the process by which plants make sugar. Tell me more about it.",
           "def fibonacci(n): # explain this function"]


@dataclass
class SoakResult:
    seconds: float
    requests: int
    failed_runs: int
    rss_growth_mib: float
    kv_blocks_used_after: float
    failures: list[str]


MODEL_PROCESSES = ("triton_python_backend_stub", "inflight.serving.engine_process")


def model_rss(server: TritonServer) -> int:
    """Resident memory of the Python backend stub and of the engine process it started."""
    rss = sum(process.memory_info().rss for name in MODEL_PROCESSES for process in server.descendants(name))
    if not rss:
        raise RuntimeError("the Python backend stub process was not found")
    return rss


def soak(server: TritonServer, seconds: float, concurrency: int = 32, requests_per_run: int = 160,
         max_tokens: int = 16) -> SoakResult:
    run_perf_analyzer(server.grpc_url, concurrency, 2 * concurrency, PROMPTS, max_tokens, timeout=600)  # warm-up
    rss_before = model_rss(server)
    start = time.monotonic()
    requests, failures = 0, []
    while time.monotonic() - start < seconds:
        figures = run_perf_analyzer(server.grpc_url, concurrency, requests_per_run, PROMPTS, max_tokens, timeout=900)
        if figures["returncode"] != 0 or "error" in figures["output"].lower():
            failures.append(figures["output"][-2000:])
        requests += int(figures["requests"] or 0)
    elapsed = time.monotonic() - start
    server.wait_for_metric("inflight_kv_blocks_used", lambda v: v == 0, timeout=60)
    return SoakResult(elapsed, requests, len(failures), (model_rss(server) - rss_before) / 2**20,
                      server.metrics()["inflight_kv_blocks_used"], failures)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    with TritonServer() as server:
        result = soak(server, args.minutes * 60, args.concurrency)
    print(f"| soak | seconds | requests | failed runs | model RSS growth (MiB) | KV blocks used after |\n"
          f"|---|---:|---:|---:|---:|---:|\n"
          f"| perf_analyzer, concurrency {args.concurrency} | {result.seconds:.0f} | {result.requests} | "
          f"{result.failed_runs} | {result.rss_growth_mib:.1f} | {result.kv_blocks_used_after:.0f} |")
    for failure in result.failures:
        print(failure, file=sys.stderr)
    sys.exit(1 if result.failed_runs or result.kv_blocks_used_after else 0)


if __name__ == "__main__":
    main()
