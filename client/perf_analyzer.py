"""Run perf_analyzer 2.51 (from .tools/, put there by `make setup-serving`; on a machine with no package
registry, unpacked there from scripts/pack_tritonserver.sh's bundle) against the `llm` model."""

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PERF = ROOT / ".tools" / "perf"
# The libraries it links that a machine may lack: the CUDA runtime (linked, never used here) as the setup
# installs it, and the bundle's folder of both it and libb64.
LIBRARY_DIRS = (PERF / "cuda" / "nvidia" / "cuda_runtime" / "lib", PERF / "lib")


# perf_analyzer 2.51 at times exits, reporting success, with its export cut short (at a multiple of 64 KiB,
# or empty): about one run in 30 of 64 requests here.
EXPORT_ATTEMPTS = 3


def available() -> bool:
    return (PERF / "bin" / "perf_analyzer").is_file()


def perf_env() -> dict:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = ":".join([*map(str, LIBRARY_DIRS), *filter(None, [env.get("LD_LIBRARY_PATH")])])
    env["PATH"] = f"{PERF / 'bin'}:{env.get('PATH', '')}"
    return env


def input_entry(prompt: str | list[int], max_tokens: int) -> dict:
    """One entry of perf_analyzer's --input-data: greedy, EOS ignored, streamed; a text prompt (the output
    without it) or token ids."""
    given = {"text_input": [prompt], "exclude_input_in_output": [True]} if isinstance(prompt, str) else \
        {"input_ids": {"content": prompt, "shape": [len(prompt)]}}
    return {**given, "max_tokens": [max_tokens], "ignore_eos": [True], "temperature": [0.0], "stream": [True]}


def write_input_data(path: Path, prompts: list, max_tokens: list[int]) -> Path:
    """perf_analyzer's --input-data JSON: an entry per prompt (input_entry), each with its max_tokens."""
    path.write_text(json.dumps({"data": [input_entry(p, n) for p, n in zip(prompts, max_tokens)]}))
    return path


def command(grpc_url: str, data: Path, concurrency: int, request_count: int) -> list[str]:
    """One fixed-size streamed run at one concurrency, the inputs taken from `data` in turn. A warm-up
    below the concurrency hangs perf_analyzer 2.51, so there is none."""
    return [str(PERF / "bin" / "perf_analyzer"), "-m", "llm", "-i", "grpc", "--streaming", "-u", grpc_url,
            "--input-data", str(data), "--concurrency-range", f"{concurrency}:{concurrency}",
            "--request-count", str(request_count), "--warmup-request-count", "0",
            "--measurement-mode", "count_windows", "--stability-percentage", "999"]


def run_perf_analyzer(grpc_url: str, concurrency: int, request_count: int, prompts: list[str], max_tokens: int,
                      timeout: float) -> dict:
    """One run of text prompts. Returns the figures perf_analyzer printed and its output."""
    with tempfile.TemporaryDirectory() as tmp:
        data = write_input_data(Path(tmp) / "inputs.json", prompts, [max_tokens] * len(prompts))
        proc = subprocess.run(command(grpc_url, data, concurrency, request_count), env=perf_env(),
                              capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    figures = {"returncode": proc.returncode, "output": out}
    for key, pattern in (("requests", r"Request count: (\d+)"), ("throughput", r"Throughput: ([\d.]+) infer/sec"),
                         ("avg_latency_us", r"Avg latency: (\d+) usec")):
        m = re.search(pattern, out)
        figures[key] = float(m.group(1)) if m else None
    return figures


@dataclasses.dataclass
class StreamedRun:
    """What perf_analyzer's export tells of a run of requests whose output lengths are known (greedy,
    EOS ignored: each request's max_tokens), by genai-perf's definitions."""

    requests: int
    output_tokens: int
    responses: int
    seconds: float  # from the first request sent to the last response
    ttft: list[float]  # each request's time to its first response (seconds)
    itl: list[float]  # each request's (last response - first) / (its tokens - 1), where it has two or more


def streamed_run(export: dict) -> StreamedRun:
    """A StreamedRun from perf_analyzer's --profile-export-file (its timestamps are nanoseconds)."""
    records = export["experiments"][0]["requests"]
    ttft, itl, tokens, responses = [], [], 0, 0
    for record in records:
        sent, times, n = record["timestamp"], record["response_timestamps"], int(record["request_inputs"]["max_tokens"])
        if not times:
            raise ValueError(f"a request of the export has no response: {record['request_inputs']}")
        ttft.append((times[0] - sent) / 1e9)
        if n > 1:
            itl.append((times[-1] - times[0]) / 1e9 / (n - 1))
        tokens += n
        responses += len(times)
    start = min(r["timestamp"] for r in records)
    end = max(r["response_timestamps"][-1] for r in records)
    return StreamedRun(len(records), tokens, responses, (end - start) / 1e9, ttft, itl)


def stream_token_ids(grpc_url: str, concurrency: int, prompts: list[list[int]], max_tokens: list[int],
                     timeout: float) -> StreamedRun:
    """Every prompt (token ids) once, streamed at `concurrency`, greedy with EOS ignored: the C++ client
    beside the Python ones of client/bench_served.py. It asks for every output (perf_analyzer names none),
    the text among them, as genai-perf's runs do."""
    with tempfile.TemporaryDirectory() as tmp:
        inputs = write_input_data(Path(tmp) / "inputs.json", prompts, max_tokens)
        exported = Path(tmp) / "export.json"
        for attempt in range(1, EXPORT_ATTEMPTS + 1):
            exported.unlink(missing_ok=True)
            proc = subprocess.run([*command(grpc_url, inputs, concurrency, len(prompts)),
                                   "--profile-export-file", str(exported)],
                                  env=perf_env(), capture_output=True, text=True, timeout=timeout)
            if proc.returncode != 0 or not exported.exists():
                raise RuntimeError(f"perf_analyzer failed (exit {proc.returncode}):\n"
                                   f"{(proc.stdout + proc.stderr)[-3000:]}")
            try:
                return streamed_run(json.loads(exported.read_text()))
            except json.JSONDecodeError as e:  # (the run itself went well: run it again)
                print(f"perf_analyzer's export was cut short ({exported.stat().st_size} bytes, {e}), try {attempt} "
                      f"of {EXPORT_ATTEMPTS}", file=sys.stderr)
    raise RuntimeError(f"perf_analyzer's export was cut short {EXPORT_ATTEMPTS} times")
