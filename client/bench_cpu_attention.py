"""CPU benchmark of the paged attention's C kernels against the torch paths they replace.

    .venv/bin/python client/bench_cpu_attention.py            # also part of `make bench` (peer "attention")

For each mix of (context, new tokens) per sequence, on shuffled block tables as a long-running pool
has them, float32: `torch_ops.paged_attention` with the C kernels (prefill chunks all in one call,
decodes straight from the cache) and without them (SDPA's fused CPU kernel per chunk over its gathered
keys and values; decodes gathered in groups), milliseconds per call as one layer of a step sees it
(the step's plan made once, median of the calls; freed memory kept in the process, as the engine
keeps it). Prefill rows report GFLOP/s over the causal pairs
only; decode rows the keys and values read per second (small mixes partly from the processor's cache).
Then the cost of an image whose tokens see each other (Gemma 3's, `attend_within_spans`) beside the
attention of the chunk that holds it, with and without Gemma 3's window of 1,024.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend"))

from bench_kernels import SPAN_SHAPES, build, causal_flops, image_span  # noqa: E402
from inflight.cpu_runtime import keep_freed_memory  # noqa: E402
from inflight.ops import cpu_kernels, torch_ops  # noqa: E402

MIXES = {
    # name: list of (context_len, new_tokens)
    "prefill: one prompt of 264": [(0, 264)],
    "prefill: one prompt of 512": [(0, 512)],
    "prefill: 4 prompts, 512 tokens": [(0, 200), (0, 150), (0, 100), (0, 62)],
    "prefill: a chunk of 512 after 388": [(388, 512)],
    "prefill: 12 prompts of 40": [(0, 40)] * 12,
    "decode: 48 x 350": [(350, 1)] * 48,
    "decode: 8 x 1000": [(1000, 1)] * 8,
    "decode: 128 x 500": [(500, 1)] * 128,  # the engine's decode steps: ~100 MB, from memory
}
SHAPES = {  # name: (query heads, KV heads, head_dim)
    "smollm2": (9, 3, 64),
    "llama3-8b": (32, 8, 128),
}


def per_call(call, calls: int) -> float:
    call()  # makes the step's plan
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench(shape: str, calls: int) -> list[tuple]:
    """Rows of (mix, ms without the kernels, ms with them, rate without, rate with, unit)."""
    heads, kv_heads, head_dim = SHAPES[shape]
    keep_freed_memory()
    torch.manual_seed(0)
    rows = []
    for name, seqs in MIXES.items():
        inputs = build(seqs, heads, kv_heads, head_dim, 16, torch.float32, device="cpu")
        out = torch.empty_like(inputs[0])

        def attend():
            torch_ops.paged_attention(*inputs, head_dim ** -0.5, out=out)

        decode_kernel, prefill_kernel = cpu_kernels.decode_attention, cpu_kernels.prefill_attention
        with_kernels = per_call(attend, calls)
        try:
            cpu_kernels.decode_attention = cpu_kernels.prefill_attention = lambda: None
            without = per_call(attend, calls)
        finally:
            cpu_kernels.decode_attention, cpu_kernels.prefill_attention = decode_kernel, prefill_kernel
        if all(q > 1 for _, q in seqs):
            work, unit = causal_flops(seqs, heads, head_dim) / 1e9, "GFLOP/s"
        else:
            work, unit = sum(2 * (c + q) * kv_heads * head_dim * 4 for c, q in seqs) / 1e9, "GB/s"
        rows.append((name, 1000 * without, 1000 * with_kernels, work / without, work / with_kernels, unit))
        print(f"  {shape} {name}: {rows[-1]}", file=sys.stderr)
    return rows


def print_table(shape: str, rows: list[tuple], threads: int) -> None:
    heads, kv_heads, head_dim = SHAPES[shape]
    print(f"\n| {shape} shape ({heads} query heads, {kv_heads} KV heads, head_dim {head_dim}), float32, {threads} "
          "threads | torch path, ms | C kernels, ms | speed-up | torch path | C kernels |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, without, with_kernels, rate_without, rate_with, unit in rows:
        print(f"| {name} | {without:.3f} | {with_kernels:.3f} | {without / with_kernels:.2f}x "
              f"| {rate_without:.0f} {unit} | {rate_with:.0f} {unit} |")


# A chunk of 512 tokens with an image of 256 (Gemma 3's) after 100 of them: (context, image start)
SPAN_MIXES = {"a prompt of 512, an image at 100": (0, 100),
              "a chunk of 512 after 1,024, an image at 1,124": (1024, 1124)}
GEMMA3_4B = SPAN_SHAPES["gemma3-4b"]


def span_rows(calls: int) -> list[tuple]:
    """Rows of (mix, window, ms of the chunk's attention with the C kernels, ms of its image's rows again)."""
    heads, kv_heads, head_dim = GEMMA3_4B
    torch.manual_seed(0)
    rows = []
    for name, (context, image) in SPAN_MIXES.items():
        query, key_cache, value_cache, cu, lens, tables = build([(context, 512)], heads, kv_heads, head_dim, 16,
                                                                torch.float32, device="cpu")
        out = torch.empty_like(query)
        spans = image_span(context, image)
        for window in (None, 1024):
            chunk = per_call(lambda: torch_ops.paged_attention(query, key_cache, value_cache, cu, lens, tables,
                                                               head_dim ** -0.5, window, out=out), calls)
            again = per_call(lambda: torch_ops.attend_within_spans(out, query, key_cache, value_cache, tables, spans,
                                                                   head_dim ** -0.5, window), calls)
            rows.append((name, window, 1000 * chunk, 1000 * again))
    return rows


def print_span_table(rows: list[tuple], threads: int) -> None:
    heads, kv_heads, head_dim = GEMMA3_4B
    print(f"\n| Gemma 3 4B's attention ({heads} query heads, {kv_heads} KV heads, head_dim {head_dim}), float32, "
          f"{threads} threads, one layer | window | the chunk, C kernels (ms) | its image's 256 rows again (ms) |")
    print("|---|---:|---:|---:|")
    for name, window, chunk, again in rows:
        print(f"| {name} | {window or 'none'} | {chunk:.2f} | {again:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_kernels.decode_attention() is None or cpu_kernels.prefill_attention() is None:
        sys.exit("the C kernels did not build here (see the warning above)")
    for shape in args.shapes.split(","):
        print_table(shape, bench(shape, args.calls), args.threads)
    print_span_table(span_rows(args.calls), args.threads)


if __name__ == "__main__":
    main()
