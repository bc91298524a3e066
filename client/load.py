"""Load-test a running server (`make serve`) with perf_analyzer and genai-perf over a concurrency
sweep, offline, with the model's own tokenizer. Prints a table and writes a PNG of throughput and
latency against concurrency.

    make load                              # runs under .tools/genai-perf/bin/python
    make load CONCURRENCY=1,4,16 REQUESTS=32
"""

import argparse
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from perf_analyzer import perf_env, run_perf_analyzer  # noqa: E402

PROMPTS = ["Explain how a rainbow forms.", "Write a short poem about the sea.", "What is a prime number?",
           "Describe the water cycle.", "Give three tips for learning a language.", "Why is the sky blue?"]


def genai_perf(grpc_url: str, tokenizer: str, concurrency: int, requests: int, input_tokens: int,
               output_tokens: int, artifacts: Path) -> dict:
    artifacts.mkdir(parents=True, exist_ok=True)
    command = [str(Path(sys.executable).parent / "genai-perf"), "profile", "-m", "llm", "--backend", "vllm",
               "--streaming", "-u", grpc_url, "--tokenizer", tokenizer,
               "--synthetic-input-tokens-mean", str(input_tokens), "--synthetic-input-tokens-stddev", "0",
               "--output-tokens-mean", str(output_tokens), "--output-tokens-mean-deterministic",
               "--concurrency", str(concurrency), "--request-count", str(requests),
               "--warmup-request-count", str(concurrency), "--artifact-dir", str(artifacts)]
    env = perf_env()
    env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"genai-perf failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    exported = next(artifacts.rglob("*genai_perf.json"))
    data = json.loads(exported.read_text())

    def avg(key: str) -> float:
        return float(data[key]["avg"])

    return {"ttft_ms": avg("time_to_first_token"), "itl_ms": avg("inter_token_latency"),
            "output_tok_s": avg("output_token_throughput"), "requests_s": avg("request_throughput")}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = [r["concurrency"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(c, [r["output_tok_s"] for r in rows], marker="o")
    left.set(xlabel="concurrency", ylabel="output tokens/s", title="Throughput (genai-perf)", xscale="log", xticks=c)
    left.set_xticklabels(c)
    right.plot(c, [r["ttft_ms"] for r in rows], marker="o", label="time to first token")
    right.plot(c, [r["itl_ms"] for r in rows], marker="s", label="inter-token latency")
    right.set(xlabel="concurrency", ylabel="ms", title="Latency (genai-perf)", xscale="log", yscale="log", xticks=c)
    right.set_xticklabels(c)
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grpc-port", type=int, default=int(os.environ.get("GRPC_PORT", 8001)))
    parser.add_argument("--http-port", type=int, default=int(os.environ.get("HTTP_PORT", 8000)))
    parser.add_argument("--concurrency", default="1,2,4,8,16,32")
    parser.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    parser.add_argument("--input-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--tokenizer", default=str(ROOT / "models" / "SmolLM2-135M-Instruct"))
    parser.add_argument("--out", default=str(ROOT / "artifacts" / "load"))
    args = parser.parse_args()
    grpc_url = f"127.0.0.1:{args.grpc_port}"
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{args.http_port}/v2/models/llm/ready", timeout=5)
    except OSError:
        sys.exit(f"no ready server on 127.0.0.1:{args.http_port}: start one with `make serve`")
    out = Path(args.out)
    rows = []
    for c in map(int, args.concurrency.split(",")):
        requests = max(args.requests, c)
        pa = run_perf_analyzer(grpc_url, c, requests, PROMPTS, args.output_tokens, timeout=1800)
        if pa["returncode"] != 0:
            sys.exit(f"perf_analyzer failed at concurrency {c}:\n{pa['output'][-3000:]}")
        gp = genai_perf(grpc_url, args.tokenizer, c, requests, args.input_tokens, args.output_tokens, out / f"c{c}")
        rows.append({"concurrency": c, "pa_infer_s": pa["throughput"], "pa_latency_ms": pa["avg_latency_us"] / 1000,
                     **gp})
        print(f"concurrency {c}: {gp['output_tok_s']:.1f} output tok/s, TTFT {gp['ttft_ms']:.0f} ms, "
              f"ITL {gp['itl_ms']:.1f} ms", file=sys.stderr)
    print(f"\ngenai-perf: {args.input_tokens} input tokens, {args.output_tokens} output tokens per request; "
          f"perf_analyzer: short prompts, {args.output_tokens} output tokens\n")
    print("| concurrency | output tok/s | TTFT avg (ms) | ITL avg (ms) | requests/s | perf_analyzer infer/s | "
          "perf_analyzer latency (ms) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['output_tok_s']:.1f} | {r['ttft_ms']:.0f} | {r['itl_ms']:.1f} | "
              f"{r['requests_s']:.2f} | {r['pa_infer_s']:.2f} | {r['pa_latency_ms']:.0f} |")
    out.mkdir(parents=True, exist_ok=True)
    plot(rows, out / "load.png")
    (out / "load.json").write_text(json.dumps(rows, indent=2))
    print(f"\nplot: {out / 'load.png'}")


if __name__ == "__main__":
    main()
