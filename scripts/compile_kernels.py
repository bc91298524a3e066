"""Compile the Triton kernels ahead of time for NVIDIA GPUs, on any machine (no GPU needed: Triton
ships ptxas). Catches what the CPU interpreter cannot: code that does not lower to a GPU, and tiles
that need more registers or shared memory than the GPU has. Prints one row per kernel variant.

    .venv/bin/python scripts/compile_kernels.py                  # sm_80 and sm_90, every dtype
    .venv/bin/python scripts/compile_kernels.py --targets 90 --dtypes float16
    .venv/bin/python scripts/compile_kernels.py --jobs 1        # one variant at a time (default: a core each)

The variants are those the engine launches: decode (whole and split-KV) and prefill tiles for the
default model's shape (9 query heads on 3 KV heads, head_dim 64) and a Llama-3-8B-like one (32 on 8,
head_dim 128), with and without a sliding window, Gemma-2-9B's (16 on 8, head_dim 256, a softcap) and
gpt-oss-20b's (64 on 8, head_dim 64, sinks, a window of 128), and the split-KV merge; and decode and
prefill over a KV cache of another dtype than the query's (kv_cache_dtype: 16-bit and fp8, and the KV
writes into fp8 caches; fp8 e4m3 for sm_90 only, sm_80 does not convert it).

    .venv/bin/python scripts/compile_kernels.py --shapes gemma2-9b,gpt-oss-20b   # some shapes only

With --sweep, instead, the launch-parameter variants `client/bench_kernels.py --sweep` tries on a GPU
(its tile, split, warps and stages grids, its two shapes), listing those that spill: the GPU's sweep
leaves them out (bench_kernels.SPILLING_BY_TRITON), since the engine may not choose one (the rows without
--sweep must not spill).

    .venv/bin/python scripts/compile_kernels.py --sweep --targets 90 --dtypes bfloat16

With --listed-spilling besides, only the sweep variants bench_kernels.SPILLING_BY_TRITON lists for the
installed triton, each of which must spill (else the exit status is 1): the check the tests run, a seventh of
the whole sweep's compiles. (A variant spilling unlisted costs the GPU's sweep a try; one listed wrongly would
keep a variant from it; and the engine's own variants, which the sweep's best may become, are compiled
above, where a spill is an error.)

    .venv/bin/python scripts/compile_kernels.py --sweep --listed-spilling --targets 90 --dtypes bfloat16
"""

import argparse
import ast
import contextlib
import io
import itertools
import json
import multiprocessing
import os
import re
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run without TRITON_INTERPRET=1: the interpreter replaces the kernels this compiles")

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "backend"), str(ROOT / "client")]

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.cache import get_cache_manager  # noqa: E402

import bench_kernels  # noqa: E402
from inflight.ops import triton_ops, triton_top_p  # noqa: E402

TRITON_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float8_e5m2: "fp8e5",
                torch.float8_e4m3fn: "fp8e4nv"}
# Shared memory a block may use (bytes): A100 (sm_80), H100/H200 (sm_90).
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
SHAPES = {  # name: (query heads, KV heads, head_dim, sliding window, attention's options)
    "smollm2": (9, 3, 64, None, {}),
    "llama3-8b": (32, 8, 128, None, {}),
    "llama3-8b+window": (32, 8, 128, 4096, {}),
    "gemma2-9b": (16, 8, 256, 4096, dict(softcap=50.0)),
    "gpt-oss-20b": (64, 8, 64, 128, dict(sinks=True)),
}
METADATA = ("cu_seqlens_q_ptr", "seq_lens_ptr", "block_tables_ptr", "slot_ptr")  # int64 tensors
FLOAT_ARGUMENTS = ("qk_scale",)
# (query, KV cache, output) dtypes of a model whose cache has a dtype of its own (kv_cache_dtype), compiled
# where the model's dtype (the output's) is asked for: a float32 model over a bfloat16 cache launches the
# 16-bit kernel (its query rounded, triton_ops.paged_attention), a bfloat16 one reads a float16 cache.
MIXED_DTYPES = [(torch.bfloat16, torch.bfloat16, torch.float32), (torch.bfloat16, torch.float16, torch.bfloat16)]
# fp8 caches (kv_cache_dtype fp8_e5m2, fp8_e4m3) under 16-bit queries (a float32 model's rounded to bfloat16),
# and the KV writes into them; e4m3 only where the GPU converts it (model_runner.kv_cache_dtype).
FP8_CACHES = [torch.float8_e5m2, torch.float8_e4m3fn]
FP8_DTYPES = [(query, cache, out) for cache in FP8_CACHES for query, out in
              ((torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16))]
FP8_LEAST_ARCH = {torch.float8_e4m3fn: 89}
USAGE_FILE = "ptxas_usage.json"  # registers and spill stores, kept beside each kernel in Triton's cache
NEW_KV_LEAST_ARCH = 90  # prefill tiles reading the step's new keys and values (tensor descriptors): Hopper on


def supported(arch: int, dtype, constants: dict) -> bool:
    """Whether a variant's cache dtype is one the GPU of `arch` converts, and it has what the variant reads
    through tensor descriptors."""
    cache = dtype[1] if isinstance(dtype, tuple) else dtype
    return arch >= FP8_LEAST_ARCH.get(cache, 0) and (arch >= NEW_KV_LEAST_ARCH or not constants.get("NEW_KV"))


def type_name(dtype) -> str:
    """A variant's dtype, or its query's, its cache's and its output's."""
    if isinstance(dtype, tuple):
        return f"{TRITON_TYPES[dtype[0]]}, {TRITON_TYPES[dtype[1]]} cache, {TRITON_TYPES[dtype[2]]} out"
    return TRITON_TYPES[dtype]


def signature(kernel, constants: dict, dtype, multiples_of_16: set[str]) -> tuple[dict, dict]:
    """Argument types and hints as the JIT gives them at the engine's launches: tensors as pointers
    (16-byte aligned, as torch allocates them, but for those the kernel does not specialize on alignment;
    of `dtype`, or of a (query, cache, output) triple's dtypes), `scale` a float, other scalars 32-bit ints, with the
    JIT's divisibility-by-16 specialization on the integers named in `multiples_of_16`. Without that
    hint ptxas sees unaligned rows: no vector loads, twice the registers, spills that no launch has."""
    types, attrs = {}, {}
    query_dtype, cache_dtype, out_dtype = dtype if isinstance(dtype, tuple) else (dtype,) * 3
    for i, name in enumerate(kernel.arg_names):
        if name in constants:
            types[name] = "constexpr"
        elif name.endswith("_desc"):  # a tensor descriptor of a tile of keys or values (new_kv)
            tile = f"{constants['TILE_N']}, 1, {constants['DIM_PAD']}"
            types[name] = f"tensordesc<{TRITON_TYPES[query_dtype]}[{tile}]>"
        elif name.endswith("_ptr"):
            tensor_dtype = cache_dtype if "_cache_" in name else out_dtype if name == "out_ptr" else query_dtype
            if name == "sinks_ptr":  # the model's parameter
                tensor_dtype = out_dtype
            pointee = ("i64" if name in METADATA else "fp32" if name.startswith("part_") else
                       "i32" if name == "arrivals_ptr" else TRITON_TYPES[tensor_dtype])
            types[name] = f"*{pointee}"
            if name not in kernel.do_not_specialize_on_alignment:  # (hinted at no launch: triton_ops)
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            types[name] = "fp32" if name in FLOAT_ARGUMENTS else "i32"
            if name in multiples_of_16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return types, attrs


def multiples_of_16(kernel, heads: int, head_dim: int) -> set[str]:
    """The integer arguments that are multiples of 16 at every launch for this shape: the strides of
    query, output, new keys and values and the caches are multiples of head_dim (attention.py passes
    views of transformers' [1, heads, T, D] tensors), `num_heads` is the model's. Token and sequence
    counts are never specialized (triton_ops), and the block table's width depends on max_model_len: the
    generic variant is compiled for them."""
    names = {name for name in kernel.arg_names if name.startswith("stride_") and name != "stride_bt"}
    if head_dim % 16:
        names = set()
    if heads % 16 == 0:
        names.add("num_heads")
    return names & set(kernel.arg_names)


def compile_variant(kernel, constants: dict, dtype, arch: int, hinted: set[str] = frozenset()):
    """The variant compiled for `arch`, and its registers and spill stores a thread (spill stores: ptxas ran
    out of registers), from the verbose report of Triton's own ptxas run, kept beside the kernel in Triton's
    cache: a kernel found there costs no ptxas run (ptxas was most of this script's time)."""
    constants = dict(constants)
    if "HAS_SINKS" in constants and not constants["HAS_SINKS"]:
        constants["sinks_ptr"] = None  # launched with None: a constant, no argument
    if "NEW_KV" in constants and not constants["NEW_KV"]:
        constants["new_key_desc"] = constants["new_value_desc"] = None
    options = {"num_warps": constants.pop("num_warps", 4)}
    if "num_stages" in constants:  # else Triton's default, as at a launch without it
        options["num_stages"] = constants.pop("num_stages")
    types, attrs = signature(kernel, constants, dtype, hinted)
    source = ASTSource(fn=kernel, signature=types, constexprs=constants, attrs=attrs)
    target = GPUTarget("cuda", arch, 32)
    triton.knobs.nvidia.dump_ptxas_log = True  # Triton prints its ptxas run's report
    for again in (False, True):  # compiled again when the cache has the kernel without its report
        triton.knobs.compilation.always_compile = again
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            compiled = triton.compile(source, target=target, options=options)
        cache, report = get_cache_manager(compiled.hash), printed.getvalue()
        if "Used " in report:
            usage = {"registers": int(re.search(r"Used (\d+) registers", report).group(1)),
                     "spills": int(re.search(r"(\d+) bytes spill stores", report).group(1))}
            cache.put(json.dumps(usage), USAGE_FILE, binary=False)
            return compiled, usage
        if (kept := cache.get_file(USAGE_FILE)) is not None:
            return compiled, json.loads(Path(kept).read_text())
    raise RuntimeError(f"no ptxas report from Triton {triton.__version__}'s compile")


# phase: (tokens, sequences, KV splits) of the launch compiled
PHASES = {"decode": (64, 64, 1), "decode split-KV": (8, 8, 8), "prefill": (2048, 4, 1)}


def launches(dtype: torch.dtype, cache_dtype: torch.dtype):
    """(phase, tokens, sequences, KV splits) of every launch compiled for a shape whose queries are `dtype`
    over a `cache_dtype` cache: the PHASES, and steps verifying drafts, split (triton_ops.verify_steps_split)."""
    for phase, (tokens, seqs, splits) in PHASES.items():
        yield phase, tokens, seqs, splits
    if triton_ops.verify_steps_split(5, dtype, cache_dtype):  # (5 tokens a sequence: 4 drafts)
        yield "verify split-KV", 8 * 5, 8, 8


def variants(dtypes: list[torch.dtype], shapes: list[str] = list(SHAPES), block_size: int = 16, arch: int = 90):
    """(name, kernel, constants, dtype, integer arguments hinted as multiples of 16) for every kernel
    variant worth compiling for the compute capability `arch` (prefill tiles are laid out by it)."""
    attention, write, merge = (triton_ops._paged_attention_kernel, triton_ops._write_kv_cache_kernel,
                               triton_ops._merge_splits_kernel)
    for dtype in dtypes:
        for shape in shapes:
            heads, kv_heads, head_dim, window, options = SHAPES[shape]
            for phase, tokens, seqs, splits in launches(dtype, dtype):
                _, constants = triton_ops.attention_meta(tokens, seqs, heads, kv_heads, head_dim, block_size,
                                                         dtype, window, num_splits=splits, **options, arch=arch)
                yield (f"paged_attention {shape} {phase}", attention, constants, dtype,
                       multiples_of_16(attention, heads, head_dim))
            tokens, seqs, splits = PHASES["decode split-KV"]
            _, constants = triton_ops.attention_meta(tokens, seqs, heads, kv_heads, head_dim, block_size, dtype,
                                                     window, num_splits=splits, merge_last=True, **options, arch=arch)
            if constants["MERGE_LAST"]:  # (16-bit heads up to 128 from Hopper on: triton_ops.attention_meta)
                yield (f"paged_attention {shape} decode split-KV merged by the last split", attention, constants,
                       dtype, multiples_of_16(attention, heads, head_dim))
            if dtype != torch.float32:  # (triton_ops reads new keys and values under 16-bit queries only)
                tokens, seqs, _ = PHASES["prefill"]
                _, constants = triton_ops.attention_meta(tokens, seqs, heads, kv_heads, head_dim, block_size, dtype,
                                                         window, new_kv=True, **options, arch=arch)
                yield (f"paged_attention {shape} prefill new-kv", attention, constants, dtype,
                       multiples_of_16(attention, heads, head_dim))
            if window is None:
                _, constants = triton_ops.kv_write_meta(64, kv_heads, head_dim, block_size)
                yield f"write_kv_cache {shape}", write, constants, dtype, multiples_of_16(write, heads, head_dim)
                constants = dict(NUM_SPLITS=8, HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim))
                yield f"merge_splits {shape}", merge, constants, dtype, multiples_of_16(merge, heads, head_dim)
    cache_dtype_shapes = [shape for shape in ("smollm2", "llama3-8b") if shape in shapes]  # (in order: by index)
    for query_dtype, cache_dtype, out_dtype in MIXED_DTYPES + FP8_DTYPES:
        if out_dtype not in dtypes:
            continue
        for shape in cache_dtype_shapes:
            heads, kv_heads, head_dim, window, _ = SHAPES[shape]
            for phase, tokens, seqs, splits in launches(query_dtype, cache_dtype):
                _, constants = triton_ops.attention_meta(tokens, seqs, heads, kv_heads, head_dim, block_size,
                                                         query_dtype, window, num_splits=splits,
                                                         cache_dtype=cache_dtype, arch=arch)
                yield (f"paged_attention {shape} {phase}", attention, constants, (query_dtype, cache_dtype, out_dtype),
                       multiples_of_16(attention, heads, head_dim))
    for cache_dtype in FP8_CACHES:  # new keys and values converted to the cache's dtype before the launch
        for shape in cache_dtype_shapes:
            heads, kv_heads, head_dim, _, _ = SHAPES[shape]
            _, constants = triton_ops.kv_write_meta(64, kv_heads, head_dim, block_size)
            yield f"write_kv_cache {shape}", write, constants, cache_dtype, multiples_of_16(write, heads, head_dim)
    if torch.float32 in dtypes:  # the sampler's, over float32 logits whatever the model's dtype
        yield "top_p_cut", triton_top_p._top_p_cut_kernel, triton_top_p.LAUNCH, torch.float32, set()


def sweep_variants(dtypes: list[torch.dtype], shapes: list[str], block_size: int = 16, arch: int = 90):
    """variants() of the launch parameters bench_kernels.py --sweep tries, for its shapes among `shapes`:
    each decode (split or whole) and prefill variant of its grids, named by its parameters."""
    attention = triton_ops._paged_attention_kernel
    grids = (("decode", PHASES["decode"], bench_kernels.SWEEP_DECODE),
             ("prefill", PHASES["prefill"], bench_kernels.SWEEP_PREFILL))
    for dtype, shape, (phase, (tokens, seqs, _), grid) in itertools.product(
            dtypes, [s for s in shapes if s in bench_kernels.SHAPES], grids):
        heads, kv_heads, head_dim, window, options = SHAPES[shape]
        for values in itertools.product(*grid.values()):
            params = dict(zip(grid, values))
            _, constants = triton_ops.attention_meta(tokens, seqs, heads, kv_heads, head_dim, block_size, dtype,
                                                     window, **params, **options, arch=arch)
            name = f"paged_attention {shape} {phase} " + " ".join(f"{k}={v}" for k, v in params.items())
            yield name, attention, constants, dtype, multiples_of_16(attention, heads, head_dim)


def sweep_entry(name: str) -> tuple[str, str, dict]:
    """(shape, phase, launch parameters) of a sweep variant by its name: "paged_attention smollm2 decode
    num_splits=1 tile_n=64 ...", as bench_kernels.spills takes them."""
    _, shape, phase, *params = name.split()
    return shape, phase, {key: ast.literal_eval(value) for key, value in (p.split("=") for p in params)}


def report(job: tuple[int, list[str], list[str], int, bool]) -> tuple[str, bool]:
    """Compile the index-th variant of `dtypes` (of the sweep's, with `sweep`) for `arch`: its table row,
    and whether it failed (did not compile, spilled, or needs more shared memory than the GPU has).
    Variants are found by index, so that worker processes rebuild them rather than receive kernels."""
    arch, dtype_names, shapes, index, sweep = job
    found = (sweep_variants if sweep else variants)([getattr(torch, n) for n in dtype_names], shapes, arch=arch)
    name, kernel, constants, dtype, hinted = list(found)[index]
    try:
        compiled, usage = compile_variant(kernel, constants, dtype, arch, hinted)
    except Exception as e:  # report every failing variant, not just the first
        return (f"| sm_{arch} | {name} | {type_name(dtype)} | FAILED: {type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''} | | | |"), True
    shared = compiled.metadata.shared
    too_big = shared > SHARED_LIMIT.get(arch, SHARED_LIMIT[80])
    return (f"| sm_{arch} | {name} | {type_name(dtype)} | {compiled.metadata.num_warps} | "
            f"{usage['registers']} | {usage['spills']}{' (spilled)' if usage['spills'] else ''} | "
            f"{shared}{' (over the limit)' if too_big else ''} |"), too_big or usage["spills"] > 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", default="80,90", help="compute capabilities, comma-separated")
    parser.add_argument("--dtypes", default="float16,bfloat16,float32")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="variants compiled at once")
    parser.add_argument("--sweep", action="store_true", help="bench_kernels.py's sweep variants: which spill")
    parser.add_argument("--listed-spilling", action="store_true",
                        help="with --sweep: only those SPILLING_BY_TRITON lists, each of which must spill")
    args = parser.parse_args()
    if args.listed_spilling and not args.sweep:
        parser.error("--listed-spilling picks among the sweep's variants: give --sweep too")
    if args.listed_spilling and bench_kernels.installed_triton() not in bench_kernels.SPILLING_BY_TRITON:
        parser.error(f"bench_kernels.SPILLING_BY_TRITON has no list for triton {triton.__version__}")
    dtype_names, shapes = args.dtypes.split(","), args.shapes.split(",")
    listed = sweep_variants if args.sweep else variants
    jobs = [(arch, dtype_names, shapes, i, args.sweep) for arch in map(int, args.targets.split(","))
            for i, (name, _, constants, dtype, _) in enumerate(listed([getattr(torch, n) for n in dtype_names],
                                                                      shapes, arch=arch))
            if supported(arch, dtype, constants)
            and not (args.listed_spilling and not bench_kernels.spills(*sweep_entry(name)))]
    print("| target | kernel | dtype | warps | registers | spill stores (bytes) | shared memory (bytes) |")
    print("|---|---|---|---:|---:|---:|---:|")
    failures = 0
    if args.jobs > 1:  # (spawned: a forked torch is not safe to compile in)
        pool = multiprocessing.get_context("spawn").Pool(args.jobs)
        rows = pool.imap(report, jobs)
    else:
        pool, rows = None, map(report, jobs)
    for row, failed in rows:
        print(row, flush=True)
        failures += failed
    if pool is not None:
        pool.close()
        pool.join()
    if args.listed_spilling:
        print(f"\n{failures} of the {len(jobs)} sweep variants listed as spilling spilled or did not compile")
        return 0 if failures == len(jobs) else 1
    if args.sweep:  # (variants for the GPU to try: spilling ones are listed to be left out, not an error)
        print(f"\n{failures} of {len(jobs)} sweep variants spilled or did not compile")
        return 0
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
