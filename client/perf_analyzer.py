"""Run perf_analyzer 2.51 (from .tools/, put there by `make setup-serving`) against the `llm` model."""

import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PERF = ROOT / ".tools" / "perf"


def perf_env() -> dict:
    env = dict(os.environ)
    cuda = PERF / "cuda" / "nvidia" / "cuda_runtime" / "lib"  # linked, never used on CPU
    env["LD_LIBRARY_PATH"] = f"{cuda}:{env['LD_LIBRARY_PATH']}" if env.get("LD_LIBRARY_PATH") else str(cuda)
    env["PATH"] = f"{PERF / 'bin'}:{env.get('PATH', '')}"
    return env


def write_input_data(path: Path, prompts: list[str], max_tokens: int) -> Path:
    """perf_analyzer's --input-data JSON: one entry per prompt, greedy, EOS ignored, streamed."""
    data = [{"text_input": [p], "max_tokens": [max_tokens], "ignore_eos": [True], "temperature": [0.0],
             "stream": [True], "exclude_input_in_output": [True]} for p in prompts]
    path.write_text(json.dumps({"data": data}))
    return path


def run_perf_analyzer(grpc_url: str, concurrency: int, request_count: int, prompts: list[str], max_tokens: int,
                      timeout: float) -> dict:
    """One fixed-size run at one concurrency. Returns the figures perf_analyzer printed and its output.
    A warm-up below the concurrency hangs perf_analyzer 2.51, so there is none."""
    with tempfile.TemporaryDirectory() as tmp:
        data = write_input_data(Path(tmp) / "inputs.json", prompts, max_tokens)
        command = [str(PERF / "bin" / "perf_analyzer"), "-m", "llm", "-i", "grpc", "--streaming", "-u", grpc_url,
                   "--input-data", str(data), "--concurrency-range", f"{concurrency}:{concurrency}",
                   "--request-count", str(request_count), "--warmup-request-count", "0",
                   "--measurement-mode", "count_windows", "--stability-percentage", "999"]
        proc = subprocess.run(command, env=perf_env(), capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    figures = {"returncode": proc.returncode, "output": out}
    for key, pattern in (("requests", r"Request count: (\d+)"), ("throughput", r"Throughput: ([\d.]+) infer/sec"),
                         ("avg_latency_us", r"Avg latency: (\d+) usec")):
        m = re.search(pattern, out)
        figures[key] = float(m.group(1)) if m else None
    return figures
