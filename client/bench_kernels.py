"""GPU benchmark of the Triton paged attention against torch's fused SDPA on the same ragged batches.

    make bench-kernels                       # needs a CUDA GPU: both shapes, the engine's launch parameters
    .venv/bin/python client/bench_kernels.py --sweep   # also every tile / split / warps / stages variant
    .venv/bin/python client/bench_kernels.py --sweep --shapes smollm2 --mixes prefill   # a part of it

For each mix it times: our kernel over the paged cache as the engine launches it (one launch for the
ragged batch, split-KV where the engine would split; the decodes that lead a mixed batch in a launch of their
own), and torch SDPA over the same sequences laid out contiguously and padded
to a batch, which is the best torch does without paging; it names the SDPA backend torch picked (from
the kernels it ran). Both are timed as the GPU runs them (calls captured in a CUDA graph, the L2 cache
overwritten before each: `kernel_seconds`); the last column is our kernel launched from Python, the
host's launch cost included, as an eager step runs it. Decode rows report achieved bandwidth, KV bytes
read per second against the measured device-copy bandwidth; prefill rows report TFLOP/s (causal pairs
only). With --sweep, each mix also tries the launch parameters below and prints the fastest, for the
tuned table in triton_ops. Then the sampler's top-p kernel against sorting every row, and the rows of an
image whose tokens see each other (Gemma 3's) attended again after the chunk that holds it.
"""

import argparse
import itertools
import statistics
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend"))

MIXES = {
    # name: list of (context_len, new_tokens)
    "decode 64 x 1k": [(1024, 1)] * 64,
    "decode 256 x 2k": [(2048, 1)] * 256,
    "decode 32 x 8k": [(8192, 1)] * 32,
    "decode 4 x 8k": [(8192, 1)] * 4,
    "decode 2 x 32k": [(32768, 1)] * 2,
    "decode 32 x 8k, window 4k": [(8192, 1)] * 32,
    "prefill 8 x 2k": [(0, 2048)] * 8,
    "prefill 2 x 8k": [(0, 8192)] * 2,
    # Mixed: decodes first, as the engine schedules them (and launches them apart from the chunks' tiles).
    "mixed: 128 decodes x 1k + 1 chunk of 2k": [(1024, 1)] * 128 + [(0, 2048)],
    "mixed: 8 decodes x 8k + 1 chunk of 512": [(8192, 1)] * 8 + [(0, 512)],
}


# A mix's sliding window (Mistral 7B's and Gemma 2's size): the keys inside it every query sees whole, run
# through the kernel's unmasked loop; SDPA's peer attends to the last WINDOWS[name] keys alone, the same work.
WINDOWS = {"decode 32 x 8k, window 4k": 4096}


def leading_decodes(seqs) -> int:
    """How many sequences lead the mix with one new token each: the engine's num_decodes."""
    return next((i for i, (_, new) in enumerate(seqs) if new != 1), len(seqs))


SHAPES = {  # name: (query heads, KV heads, head_dim)
    "llama3-8b": (32, 8, 128),
    "smollm2": (9, 3, 64),
}
# 64 splits: beyond the engine's cap of 16 (triton_ops.MAX_SPLITS), to learn whether few long contexts want more.
# Decode keeps 4 warps: the 2026-11-30 sweep found 4 fastest on every decode mix (each variant compiles once).
SWEEP_DECODE = {"num_splits": [1, 4, 16, 64], "tile_n": [32, 64, 128], "num_warps": [4], "num_stages": [2, 3, 4]}
# new_kv: the step's own keys and values read from the new ones (tensor descriptors) or gathered from the cache.
SWEEP_PREFILL = {"block_m": [64, 128], "tile_n": [32, 64, 128], "num_warps": [4, 8], "num_stages": [2, 3],
                 "new_kv": [False, True]}
# The sweep variants that spill registers on sm_90 (`scripts/compile_kernels.py --sweep --targets 90 --dtypes
# bfloat16`, 2026-12-05, query-head groups packed unpadded), by triton version: the engine may not launch one, so
# the sweep leaves them out. A variant is left out when its parameters include every item of an entry for its
# shape and phase. With 3.8 (this machine's; a test compiles those it leaves out: each must spill), 24 of the
# 168: 4-warp prefill tiles larger than 64 by 64 and a few more, and a default-shape decode tile of 64 keys at 2
# stages. With 3.6 (the GPU image's, installed beside the venv for the run), 37: also decode tiles of one split
# with 64 keys at 3 stages (the default shape) or 128 keys (the Llama-3-8B shape).
SPILLING_BY_TRITON = {
    "3.8": {
        ("smollm2", "decode"): [dict(num_splits=1, tile_n=64, num_stages=2)],
        ("smollm2", "prefill"): [dict(block_m=128, tile_n=64, num_warps=4, num_stages=3),
                                 dict(block_m=128, tile_n=128, num_warps=4)],
        ("llama3-8b", "prefill"): [dict(tile_n=128, num_warps=4), dict(block_m=128, num_warps=4),
                                   dict(block_m=128, tile_n=128, num_stages=2, new_kv=True)],
    },
    "3.6": {
        ("smollm2", "decode"): [dict(num_splits=1, tile_n=64, num_stages=3)],
        ("smollm2", "prefill"): [dict(tile_n=128, num_warps=4, new_kv=True),
                                 dict(block_m=128, tile_n=64, num_warps=4, num_stages=3),
                                 dict(block_m=128, tile_n=128, num_warps=4)],
        ("llama3-8b", "decode"): [dict(num_splits=1, tile_n=128)],
        ("llama3-8b", "prefill"): [dict(tile_n=64, num_warps=4, num_stages=2, new_kv=True),
                                   dict(tile_n=64, num_warps=4, num_stages=3, new_kv=False),
                                   dict(tile_n=128, num_warps=4),
                                   dict(tile_n=128, new_kv=False), dict(tile_n=128, num_stages=3),
                                   dict(block_m=128, num_warps=4), dict(block_m=128, tile_n=128)],
    },
}


def installed_triton() -> str:
    """The installed triton's major.minor, as SPILLING_BY_TRITON is keyed."""
    import triton

    return ".".join(triton.__version__.split(".")[:2])


def spills(shape: str, phase: str, params: dict, version: str | None = None) -> bool:
    """Whether a sweep variant spills with this triton (`version`: its major.minor; None: the installed
    one's), by SPILLING_BY_TRITON; under a version it does not list, with any version it lists."""
    version = version or installed_triton()
    lists = [SPILLING_BY_TRITON[version]] if version in SPILLING_BY_TRITON else SPILLING_BY_TRITON.values()
    return any(entry.items() <= params.items() for spilling in lists for entry in spilling.get((shape, phase), []))


def timed(fn, iters: int = 20) -> float:
    """Seconds per call of `fn` launched from Python, one after another: a call the GPU finishes before
    the host has launched the next takes the host's time (Python, Triton's launcher), not the kernel's."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / 1000


L2_OVERWRITE_BYTES = 256 << 20  # more than any GPU's L2 cache (the H100's and H200's: 50 MB)


def _graph_of(calls: list) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return graph


def _replay_seconds(graph: torch.cuda.CUDAGraph, repeats: int = 3) -> float:
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats / 1000


def kernel_seconds(fn, iters: int = 20) -> float:
    """Seconds per call of `fn` as the GPU runs it: `iters` calls captured in one CUDA graph and replayed
    (no launch cost: the engine replays its decode steps so; launched from Python, every small decode mix
    of the default model's shape took 0.13-0.15 ms on the H200, 25 to 200 MB of keys and values alike:
    the host's time), each after the L2 cache is overwritten (a small mix's keys and values would stay
    in it), less the time of the overwrites alone."""
    side = torch.cuda.Stream()  # warm-up (compiles, cuBLAS/cuDNN workspaces) outside the capture
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    scratch = torch.empty(L2_OVERWRITE_BYTES, dtype=torch.uint8, device="cuda")

    def overwrite():
        scratch.fill_(1)

    try:
        with_calls = _graph_of([call for _ in range(iters) for call in (overwrite, fn)])
    except RuntimeError as e:  # (not capturable: timed as launched, and said so)
        print(f"could not capture {getattr(fn, '__name__', fn)} in a CUDA graph ({e}): launched from Python",
              file=sys.stderr)
        return timed(fn, iters)
    overwrites = _graph_of([overwrite] * iters)
    return max(_replay_seconds(with_calls) - _replay_seconds(overwrites), 0.0) / iters


def copy_bandwidth() -> float:
    x = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    seconds = timed(lambda: y.copy_(x))
    return 2 * x.numel() / seconds  # read + write


def build(seqs, heads, kv_heads, head_dim, block_size, dtype, device: str = "cuda"):
    """A ragged batch over a paged cache whose blocks are handed out shuffled, as a long-running pool has
    them: (query, key cache, value cache, cu_seqlens_q, seq_lens, block tables)."""
    lens = [c + q for c, q in seqs]
    blocks = [-(-n // block_size) for n in lens]
    perm = torch.randperm(sum(blocks), device=device)
    tables, used = [], 0
    for b in blocks:
        tables.append(perm[used:used + b])
        used += b
    width = max(blocks)
    block_tables = torch.stack([F.pad(t, (0, width - len(t))) for t in tables])
    kc = torch.randn(sum(blocks), block_size, kv_heads, head_dim, device=device, dtype=dtype)
    vc = torch.randn_like(kc)
    q_lens = torch.tensor([q for _, q in seqs], device=device)
    cu = F.pad(torch.cumsum(q_lens, 0), (1, 0))
    query = torch.randn(int(cu[-1]), heads, head_dim, device=device, dtype=dtype)
    return query, kc, vc, cu, torch.tensor(lens, device=device), block_tables


def new_keys_and_values(key_cache, value_cache, seqs, cu_seqlens, block_tables) -> list[torch.Tensor]:
    """The keys and values of each sequence's new tokens [T, Hkv, D], read back from the cache and laid out
    as the attention hook passes them (transformers' [1, Hkv, T, D], transposed)."""
    block_size, device = key_cache.shape[1], key_cache.device
    q_lens = cu_seqlens[1:] - cu_seqlens[:-1]
    seq = torch.repeat_interleave(torch.arange(len(seqs), device=device), q_lens)
    contexts = torch.tensor([c for c, _ in seqs], device=device)
    positions = torch.arange(int(cu_seqlens[-1]), device=device) - cu_seqlens[seq] + contexts[seq]
    blocks, slots = block_tables[seq, positions // block_size], positions % block_size
    return [cache[blocks, slots].transpose(0, 1).contiguous().transpose(0, 1) for cache in (key_cache, value_cache)]


def causal_flops(seqs, heads: int, head_dim: int) -> float:
    """Matmul FLOPs of attention over the visible (causal) query-key pairs: 2 matmuls x 2 FLOPs each."""
    pairs = sum(q * c + q * (q + 1) // 2 for c, q in seqs)
    return 4.0 * pairs * heads * head_dim


def sdpa_backend(call) -> str:
    """Which SDPA backend torch ran for `call`, from the names of the CUDA kernels it launched."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    names = " ".join(e.key.lower() for e in prof.key_averages())
    backends = (("cudnn", ("cudnn",)), ("flash", ("flash",)), ("efficient", ("fmha", "efficient", "cutlass")),
                ("math", ("softmax",)))
    for backend, marks in backends:
        if any(mark in names for mark in marks):
            return backend
    return "?"


def sweep(run, grid: dict, groupings: list[tuple[str, ...]], spilling=lambda params: False) -> str:
    """The fastest launch parameters of `run(**params)` over `grid`, and for each grouping the fastest
    time at each value of its parameters (what a rule for the engine's defaults is chosen from);
    variants that spill (`spilling(params)`) are left out, those that fail to compile or launch (too much
    shared memory) skipped."""
    times, left_out = [], 0
    for values in itertools.product(*grid.values()):
        params = dict(zip(grid, values))
        if spilling(params):
            left_out += 1
            continue
        try:
            times.append((kernel_seconds(lambda: run(**params), iters=10), params))
        except Exception:  # noqa: BLE001 - an impossible variant on this GPU
            continue
    if not times:
        return "no variant ran"
    ranked = sorted(times, key=lambda item: item[0])
    seconds, params = ranked[0]
    summary = f"{seconds * 1e3:.3f} ms: {params}" + (f" ({left_out} spilling variants left out)" if left_out else "")
    for by in groupings:
        per_value = {}
        for t, p in ranked:
            per_value.setdefault(tuple(p[key] for key in by), t)
        summary += f"; fastest by {'/'.join(by)}: " + ", ".join(
            f"{'/'.join(map(str, value))} {t * 1e3:.3f}" for value, t in sorted(per_value.items()))
    return summary


def bench_shape(shape: str, dtype, block_size: int, bandwidth: float, do_sweep: bool, mixes: list[str]) -> None:
    from inflight.ops import triton_ops

    heads, kv_heads, head_dim = SHAPES[shape]
    print(f"\n{shape}: {heads} heads / {kv_heads} KV heads, head_dim {head_dim}, block {block_size}\n")
    print("| mix | inflight Triton (ms) | torch SDPA (ms), backend | ratio | decode bandwidth / prefill TFLOP/s "
          "(ours, SDPA) | inflight launched from Python (ms) | the engine's launch with an option switched (ms) |"
          + (" fastest sweep variant |" if do_sweep else "") + "\n|---|---:|---:|---:|---:|---:|---:|"
          + ("---|" if do_sweep else ""))
    scale = head_dim ** -0.5
    options = {}  # option -> [(seconds without it, with it)]: the summary under the table
    for name in mixes:
        seqs = MIXES[name]
        query, kc, vc, cu, seq_lens, tables = build(seqs, heads, kv_heads, head_dim, block_size, dtype)
        out = torch.empty_like(query)
        new_key, new_value = new_keys_and_values(kc, vc, seqs, cu, tables)

        decodes = leading_decodes(seqs)  # (counted once a step by the engine, not at each launch)
        window = WINDOWS.get(name)
        reach = window or sys.maxsize  # the most keys a query sees

        def ours_with(**params):
            params = dict(num_decodes=decodes) | params
            return triton_ops.paged_attention(query, kc, vc, cu, seq_lens, tables, scale, window, out=out,
                                              new_key=new_key, new_value=new_value, **params)

        ours = kernel_seconds(ours_with)
        # torch: the same sequences contiguous and padded into one batch (what SDPA can take); under a
        # window (decodes only), the keys inside it.
        max_len, max_q = min(int(seq_lens.max()), reach), int((cu[1:] - cu[:-1]).max())
        k = torch.randn(len(seqs), kv_heads, max_len, head_dim, device="cuda", dtype=dtype)
        v = torch.randn_like(k)
        q = torch.randn(len(seqs), heads, max_q, head_dim, device="cuda", dtype=dtype)
        causal = all(c == 0 for c, _ in seqs)

        def sdpa():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

        theirs = kernel_seconds(sdpa)
        decode = all(n == 1 for _, n in seqs)
        if decode:
            keys = sum(min(c + n, reach) for c, n in seqs)
            kv_bytes = keys * 2 * kv_heads * head_dim * kc.element_size()
            rate = (f"{kv_bytes / ours / 1e12:.2f} TB/s ({kv_bytes / ours / bandwidth:.0%}), "
                    f"{kv_bytes / theirs / 1e12:.2f} TB/s")
        else:
            flops = causal_flops(seqs, heads, head_dim)
            rate = f"{flops / ours / 1e12:.0f}, {flops / theirs / 1e12:.0f} TFLOP/s"
        variants = []  # the engine's launch with each option that applies switched
        for option, (on, off, default_on) in mix_options(seqs, query, kv_heads).items():
            switched, default = (off, on) if default_on else (on, off)
            expected = ours_with(**default).clone()
            error = (ours_with(**switched).float() - expected.float()).abs().max().item()
            seconds = kernel_seconds(lambda: ours_with(**switched))
            options.setdefault(option, []).append((seconds, ours) if default_on else (ours, seconds))
            variants.append(f"{option} {'off' if default_on else 'on'}: {seconds * 1e3:.3f} "
                            f"(max difference {error:.1e})")
        row = (f"| {name} | {ours * 1e3:.3f} | {theirs * 1e3:.3f}, {sdpa_backend(sdpa)} | {ours / theirs:.2f}x "
               f"| {rate} | {timed(ours_with) * 1e3:.3f} | {'; '.join(variants) or '-'} |")
        if do_sweep and window is not None:
            row += " (not swept: the sweep's spilling lists are of kernels without a window) |"
        elif do_sweep:
            grid, groupings = ((SWEEP_DECODE, [("tile_n",), ("num_splits",)]) if decode
                               else (SWEEP_PREFILL, [("block_m", "tile_n"), ("new_kv",)]))
            phase = "decode" if decode else "prefill"
            row += f" {sweep(ours_with, grid, groupings, lambda params: spills(shape, phase, params))} |"
        print(row, flush=True)
    for option, times in options.items():
        print(option_summary(option, times))


def mix_options(seqs, query, kv_heads: int) -> dict[str, tuple[dict, dict, bool]]:
    """The launch options that apply to a mix, each as paged_attention's arguments with it on and off, and
    whether the engine has it on: new_kv (prefill tiles read the step's own keys and values from the new
    ones) on prefill and mixed mixes, merge_last (split decodes merged by their last split) on decode mixes
    the engine splits, decodes_apart (the leading decodes launched apart from the prefill tiles) on mixes of
    decodes then prefill chunks."""
    from inflight.ops import triton_ops

    decodes = leading_decodes(seqs)
    found = {}
    if decodes < len(seqs):
        found["new_kv"] = (dict(new_kv=True), dict(new_kv=False), triton_ops.NEW_KV_FOR_PREFILL)
    elif triton_ops._default_splits(query, len(seqs), kv_heads) > 1:
        found["merge_last"] = (dict(merge_last=True), dict(merge_last=False), triton_ops.MERGE_IN_LAST_SPLIT)
    if 0 < decodes < len(seqs):
        found["decodes_apart"] = (dict(num_decodes=decodes), dict(num_decodes=0), True)
    return found


def option_summary(option: str, times: list[tuple[float, float]]) -> str:
    """Whether an option (mix_options) was faster on the mixes it applies to, from their times (without it,
    with it): the line a GPU session reads before setting its default."""
    ratios = sorted(without / with_it for without, with_it in times)
    faster = sum(ratio > 1.0 for ratio in ratios)
    return (f"{option}: faster on {faster} of {len(ratios)} mixes, {statistics.median(ratios):.2f}x the engine's "
            f"launch without it (median; {ratios[0]:.2f}x to {ratios[-1]:.2f}x)")


TOP_P_VOCABS = {"default model": 49152, "Llama 3 (the 1.2B shape's)": 128256}


def bench_top_p() -> None:
    """Top-p's cuts for a decode step's rows: the sampler's kernel against sorting every row (its way on
    a GPU for batches under sampler.TOP_P_KERNEL_MIN_ROWS, which these rows are to set), on logits
    spread as a model's (scaled normal noise)."""
    from inflight import sampler
    from inflight.ops.triton_top_p import top_p_cuts

    print("\ntop-p cuts (top_p 0.9), kernel time in a CUDA graph\n")
    print("| vocabulary | rows | top-p kernel (ms) | sort every row (ms) | equal cuts |\n|---|---:|---:|---:|---|")
    for (name, vocab), rows in itertools.product(TOP_P_VOCABS.items(), (8, 32, 128)):
        logits = torch.randn(rows, vocab, device="cuda") * 4.0
        top_p = torch.full((rows, 1), 0.9, device="cuda")

        def kernel():
            return top_p_cuts(logits, top_p)

        def by_sorting():
            return sampler.sorted_top_p_cuts(logits, top_p)

        equal = torch.equal(kernel(), by_sorting())
        print(f"| {name}, {vocab:,} | {rows} | {kernel_seconds(kernel) * 1e3:.3f} | "
              f"{kernel_seconds(by_sorting) * 1e3:.3f} | {'yes' if equal else 'NO'} |", flush=True)


# Gemma 3's attention (query heads, KV heads, head_dim) and a chunk of 512 tokens after 1,024 holding an
# image of 256 at 1,124, under its window of 1,024
SPAN_SHAPES = {"gemma3-4b": (8, 4, 256), "gemma3-27b": (32, 16, 128)}


def image_span(context: int, image: int) -> np.ndarray:
    """attend_within_spans' spans of one chunk after `context` tokens holding an image of 256 at `image`."""
    return np.array([[0, image - context, image, image + 256]])


def bench_spans(dtype, block_size: int) -> None:
    """The engine's eager step with an image in it: the chunk's kernel, then the image's rows again
    (ops.attend_within_spans), each launched from Python as such a step launches them."""
    from inflight.ops import attend_within_spans, triton_ops

    print("\nan image's 256 tokens seeing each other: a chunk of 512 after 1,024, window 1,024, launched from "
          "Python\n")
    print("| shape | the chunk, Triton (ms) | the image's rows again (ms) |\n|---|---:|---:|")
    spans = image_span(1024, 1124)
    for name, (heads, kv_heads, head_dim) in SPAN_SHAPES.items():
        query, kc, vc, cu, seq_lens, tables = build([(1024, 512)], heads, kv_heads, head_dim, block_size, dtype)
        out = torch.empty_like(query)
        scale = head_dim ** -0.5

        def chunk():
            triton_ops.paged_attention(query, kc, vc, cu, seq_lens, tables, scale, 1024, out=out, num_decodes=0)

        def again():
            attend_within_spans(out, query, kc, vc, tables, spans, scale, 1024)

        print(f"| {name} ({heads}/{kv_heads} heads, head_dim {head_dim}) | {timed(chunk) * 1e3:.3f} | "
              f"{timed(again) * 1e3:.3f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--sweep", action="store_true", help="also try every launch-parameter variant")
    parser.add_argument("--mixes", default="", help="only the mixes whose names contain one of these "
                        "comma-separated words (e.g. prefill,32k), to fit a sweep into a GPU session's time")
    args = parser.parse_args()
    words = list(filter(None, args.mixes.split(",")))
    mixes = [name for name in MIXES if not words or any(word in name for word in words)]
    if not mixes:
        sys.exit(f"--mixes {args.mixes!r} names none of: {', '.join(MIXES)}")
    if not torch.cuda.is_available():
        sys.exit("bench-kernels needs a CUDA GPU; on CPU the kernels are tested under TRITON_INTERPRET=1")
    dtype = getattr(torch, args.dtype)
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}; "
          f"device copy {bandwidth / 1e12:.2f} TB/s")
    for shape in args.shapes.split(","):
        bench_shape(shape, dtype, args.block_size, bandwidth, args.sweep, mixes)
    if not args.sweep:
        bench_top_p()
        bench_spans(dtype, args.block_size)


if __name__ == "__main__":
    main()
