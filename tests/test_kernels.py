"""The Triton kernels against the torch reference (under TRITON_INTERPRET=1 on a CPU machine).

Tolerances: float32 1e-5, float16 2e-3 (absolute, on unit-variance inputs). Shapes are small and
tiles large, because the interpreter costs milliseconds per program and loop iteration.
"""

import itertools
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inflight import ops
from inflight.ops import torch_ops

ROOT = Path(__file__).resolve().parents[1]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}
if DEVICE == "cuda":
    TOLERANCE[torch.bfloat16] = 2e-2


def make_batch(seqs, block_size, num_kv_heads, group, head_dim, dtype, num_blocks=None, seed=0, cache_dtype=None):
    """seqs: (context_len, new_tokens) per sequence. Blocks are handed out in a shuffled order, so
    every block table is scattered. The caches hold `cache_dtype` (default: the query's `dtype`)."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(c + q) // block_size) for c, q in seqs]
    num_blocks = num_blocks or sum(needed) + 3
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    tables, used = [], 0
    for n in needed:
        tables.append(order[used:used + n])
        used += n
    width = max(needed)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q_lens = [q for _, q in seqs]
    cu = torch.tensor([0] + torch.cumsum(torch.tensor(q_lens), 0).tolist())
    seq_lens = torch.tensor([c + q for c, q in seqs])
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(cache_dtype or dtype)
    value_cache = torch.randn(shape, generator=gen).to(cache_dtype or dtype)
    query = torch.randn(int(cu[-1]), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return [to(t) for t in (query, key_cache, value_cache, cu, seq_lens, block_tables)]


CASES = {
    # name: (seqs, block_size, kv_heads, group, head_dim, sliding_window)
    "decode-only": ([(1, 1), (15, 1), (16, 1), (17, 1), (70, 1)], 16, 2, 3, 64, None),
    "prefill-only": ([(0, 9), (0, 33)], 16, 2, 2, 64, None),
    "mixed": ([(0, 20), (40, 1), (5, 1), (0, 3), (31, 1)], 16, 2, 4, 64, None),
    "chunk-mid-sequence": ([(37, 24), (16, 16)], 16, 2, 2, 64, None),
    "context-block-size-minus-one": ([(7, 1), (7, 3)], 8, 1, 4, 64, None),
    "context-block-size": ([(8, 1), (8, 5)], 8, 1, 4, 64, None),
    "context-block-size-plus-one": ([(9, 1), (9, 2)], 8, 1, 4, 64, None),
    "mqa": ([(20, 1), (0, 12), (33, 4)], 16, 1, 8, 64, None),
    # groups that are not a power of two, packed: a tile of 128 rows holds 42 tokens' 3 heads (126 rows), or
    # 21 tokens' 6; the chunks span tiles
    "group-of-three": ([(20, 1), (0, 50), (33, 47)], 16, 2, 3, 64, None),
    "group-of-six": ([(0, 30), (45, 23), (9, 1)], 16, 1, 6, 64, None),
    "mha": ([(20, 1), (0, 12)], 16, 4, 1, 64, None),
    "block-size-32": ([(50, 1), (0, 40), (70, 9)], 32, 2, 2, 64, None),
    "head-dim-128": ([(20, 1), (3, 10)], 16, 2, 2, 128, None),
    "sliding-window": ([(40, 1), (0, 30), (25, 12)], 16, 2, 2, 64, 9),
    # a window over several tiles: masked tiles where it begins and at the diagonal, unmasked ones between
    # (each reading the next one's blocks), in decodes and prefill tiles
    "long-sliding-window": ([(300, 1), (150, 40), (0, 200)], 16, 2, 2, 64, 150),
}


# (query dtype, cache dtype) pairs of a model whose KV cache has a dtype of its own (kv_cache_dtype; on a GPU
# never a wider one: model_runner.kv_cache_dtype); the interpreter computes float32 and float16 only. fp8
# caches: on a GPU a float32 query over them is rounded to bfloat16 (its tolerance), and e4m3 needs sm_89.
FP8 = (torch.float8_e5m2, torch.float8_e4m3fn)
MIXED_DTYPES = [(torch.float32, torch.float16), (torch.float32, torch.float8_e5m2),
                (torch.float32, torch.float8_e4m3fn)]
if DEVICE == "cuda":
    MIXED_DTYPES += [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16),
                     (torch.bfloat16, torch.float8_e5m2)]
    if torch.cuda.get_device_capability() < (8, 9):
        MIXED_DTYPES = [pair for pair in MIXED_DTYPES if pair[1] != torch.float8_e4m3fn]


# A model's options of attention (Gemma 2's softcap, gpt-oss's sinks), strong enough to change every result.
OPTIONS = {"softcap": dict(softcap=1.5), "sinks": dict(sinks=[2.0, -1.0, 0.5, 3.0]),
           "softcap-and-sinks": dict(softcap=2.5, sinks=[-0.5, 1.0, 4.0, 0.0])}


def attention_options(option: str, num_heads: int) -> dict:
    """The option's softcap and sinks (a float32 tensor of one logit per query head) on the test device."""
    options = dict(OPTIONS[option])
    if "sinks" in options:
        options["sinks"] = torch.tensor((options["sinks"] * num_heads)[:num_heads], device=DEVICE)
    return options


@pytest.mark.parametrize("dtype, cache_dtype", [(dtype, dtype) for dtype in TOLERANCE] + MIXED_DTYPES,
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("case", CASES)
def test_paged_attention_matches_torch(case, dtype, cache_dtype):
    """Within the dtype's tolerance of the torch reference over the same cache. Over a cache of another
    dtype the kernel converts what it loads to its matmuls' dtype: on a GPU the 16-bit one of the two (a
    float32 query over a 16-bit cache is rounded), within that dtype's tolerance; the interpreter
    computes float32."""
    seqs, block_size, kv_heads, group, head_dim, window = CASES[case]
    query, key_cache, value_cache, cu, seq_lens, tables = make_batch(seqs, block_size, kv_heads, group, head_dim,
                                                                     dtype, cache_dtype=cache_dtype)
    scale = head_dim ** -0.5
    expected = torch_ops.paged_attention(query, key_cache, value_cache, cu, seq_lens, tables, scale, window)
    got = ops.paged_attention(query, key_cache, value_cache, cu, seq_lens, tables, scale, window, impl="triton")
    assert got.dtype == dtype and got.shape == query.shape and key_cache.dtype == cache_dtype
    err = (got.float() - expected.float()).abs().max().item()
    tolerance = TOLERANCE[dtype]
    if DEVICE == "cuda":  # the matmuls' dtype: the 16-bit one of the two, bfloat16 over fp8
        tolerance = max(tolerance, TOLERANCE[torch.bfloat16 if cache_dtype in FP8 else cache_dtype])
    assert err <= tolerance, f"max abs error {err:.2e}"


@pytest.mark.parametrize("dtype", TOLERANCE, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("case, num_splits", [("decode-only", 1), ("decode-only", 4), ("mixed", 1),
                                              ("sliding-window", 1), ("mqa", 2)])
@pytest.mark.parametrize("option", OPTIONS)
def test_softcap_and_sinks_match_torch(option, case, num_splits, dtype):
    """A model's softcap and sinks (OPTIONS) in the kernel, with its context split or not (the sinks
    belong to the first split only), within the dtype's tolerance of the torch reference."""
    from inflight.ops import triton_ops

    seqs, block_size, kv_heads, group, head_dim, window = CASES[case]
    query, key_cache, value_cache, cu, seq_lens, tables = make_batch(seqs, block_size, kv_heads, group, head_dim,
                                                                     dtype)
    options = attention_options(option, kv_heads * group)
    scale = head_dim ** -0.5
    expected = torch_ops.paged_attention(query, key_cache, value_cache, cu, seq_lens, tables, scale, window, **options)
    got = triton_ops.paged_attention(query, key_cache, value_cache, cu, seq_lens, tables, scale, window, **options,
                                     num_splits=num_splits)
    err = (got.float() - expected.float()).abs().max().item()
    assert err <= TOLERANCE[dtype], f"max abs error {err:.2e}"


def float32_error(case: str, **launch) -> float:
    """Max abs error of the Triton kernel, launched with `launch` parameters, against the torch reference
    on `case` in float32 (what the interpreter computes)."""
    from inflight.ops import triton_ops

    seqs, block_size, kv_heads, group, head_dim, window = CASES[case]
    query, key_cache, value_cache, cu, seq_lens, tables = make_batch(seqs, block_size, kv_heads, group,
                                                                     head_dim, torch.float32)
    scale = head_dim ** -0.5
    expected = torch_ops.paged_attention(query, key_cache, value_cache, cu, seq_lens, tables, scale, window)
    got = triton_ops.paged_attention(query, key_cache, value_cache, cu, seq_lens, tables, scale, window, **launch)
    return (got - expected).abs().max().item()


@pytest.mark.parametrize("case, num_splits", [
    (case, splits) for case in ("decode-only", "mixed", "sliding-window", "long-sliding-window", "mqa", "head-dim-128")
    for splits in (2, 4, 16, 64) if splits < 64 or case in ("decode-only", "mixed")])
def test_split_kv_matches_torch(case, num_splits):
    """Contexts split across programs and merged (flash-decoding), split counts the engine may pick and
    64, which the kernel sweep tries (on two cases: the interpreter runs each program in turn): some
    splits get no keys at all; float32 (what the interpreter computes)."""
    err = float32_error(case, num_splits=num_splits)
    assert err <= TOLERANCE[torch.float32], f"max abs error {err:.2e}"


# Steps verifying drafts as a CUDA graph replays them: every sequence padded to the verify length (its
# padding tokens' rows unread), some over long contexts, one with a window.
VERIFY_CASES = {
    "group-of-three": ([(0, 5), (37, 5), (130, 5), (16, 5)], 16, 2, 3, 64, None),
    "group-of-four": ([(200, 4), (9, 4), (63, 4)], 16, 2, 4, 64, None),
    "window": ([(120, 5), (3, 5), (60, 5)], 16, 1, 4, 64, 50),
}


@pytest.mark.parametrize("dtype", [d for d in TOLERANCE if d != torch.float32],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("num_splits", [None, 1, 4, 16])
@pytest.mark.parametrize("case", VERIFY_CASES)
def test_steps_verifying_drafts_split_their_contexts(case, num_splits, dtype):
    """A 16-bit batch of sequences of one query length (a padded step verifying drafts: query_len): prefill
    tiles, each context whole or split as a decode batch's (None: as the engine chooses, on a GPU from the
    batch's shape), within the dtype's tolerance of the torch reference."""
    from inflight.ops import triton_ops

    seqs, block_size, kv_heads, group, head_dim, window = VERIFY_CASES[case]
    query_len = seqs[0][1]
    query, key_cache, value_cache, cu, seq_lens, tables = make_batch(seqs, block_size, kv_heads, group, head_dim,
                                                                     dtype)
    # (float32 ones, and over a cache of another dtype, launch as any step: whole; split, some spilled)
    assert triton_ops.verify_steps_split(query_len, dtype, dtype) and not triton_ops.verify_steps_split(1, dtype, dtype)
    assert not triton_ops.verify_steps_split(query_len, torch.float32, torch.float32)
    assert not triton_ops.verify_steps_split(query_len, dtype, torch.float8_e5m2)
    launched, meta = [], triton_ops.attention_meta

    def recorded(*args, **kwargs):
        grid, constants = meta(*args, **kwargs)
        launched.append((constants["DECODE"], constants["NUM_SPLITS"]))
        return grid, constants

    scale = head_dim ** -0.5
    expected = torch_ops.paged_attention(query, key_cache, value_cache, cu, seq_lens, tables, scale, window)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_ops, "attention_meta", recorded)
        got = triton_ops.paged_attention(query, key_cache, value_cache, cu, seq_lens, tables, scale, window,
                                         num_splits=num_splits, query_len=query_len)
    err = (got.float() - expected.float()).abs().max().item()
    assert err <= TOLERANCE[dtype], f"max abs error {err:.2e}"
    engine_splits = triton_ops.decode_splits(len(seqs), kv_heads, triton_ops._multiprocessors(None)) \
        if DEVICE == "cuda" else 1
    assert launched == [(False, engine_splits if num_splits is None else num_splits)]


@pytest.mark.parametrize("dtype", TOLERANCE, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("case, num_splits", [("decode-only", 2), ("decode-only", 16), ("mixed", 4),
                                              ("sliding-window", 4), ("mqa", 2), ("head-dim-128", 4)])
def test_splits_merged_by_the_last_match_torch(case, num_splits, dtype):
    """Split contexts merged by each tile's last split to finish (an atomic count a tile), not by a second
    kernel: within the dtype's tolerance of the torch reference, twice in a row (the counts are left at
    zero for the next launch). Compiled, only 16-bit kernels from Hopper on merge so (the others spilled):
    float32 is merged by the second kernel there."""
    from inflight.ops import triton_ops

    seqs, block_size, kv_heads, group, head_dim, window = CASES[case]
    query, key_cache, value_cache, cu, seq_lens, tables = make_batch(seqs, block_size, kv_heads, group, head_dim,
                                                                     dtype)
    constants = triton_ops.attention_meta(len(query), len(seqs), kv_heads * group, kv_heads, head_dim, block_size,
                                          dtype, window, num_splits=num_splits, merge_last=True,
                                          arch=triton_ops._arch(query.device))[1]
    assert constants["MERGE_LAST"] == (DEVICE == "cpu" or dtype != torch.float32 and
                                       torch.cuda.get_device_capability() >= (9, 0))
    scale = head_dim ** -0.5
    expected = torch_ops.paged_attention(query, key_cache, value_cache, cu, seq_lens, tables, scale, window)
    for _ in range(2):
        got = triton_ops.paged_attention(query, key_cache, value_cache, cu, seq_lens, tables, scale, window,
                                         num_splits=num_splits, merge_last=True)
        err = (got.float() - expected.float()).abs().max().item()
        assert err <= TOLERANCE[dtype], f"max abs error {err:.2e}"
    assert not triton_ops._ARRIVALS[query.device].any()


@pytest.mark.parametrize("dtype", TOLERANCE, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("case", [case for case in CASES if case != "decode-only"])
def test_new_keys_and_values_read_directly_match_torch(case, dtype):
    """Prefill tiles reading the step's own keys and values from the new ones (tensor descriptors), those
    before them from the cache, within the dtype's tolerance of the torch reference; and the same as
    reading them all from the cache."""
    from inflight.ops import triton_ops

    seqs, block_size, kv_heads, group, head_dim, window = CASES[case]
    query, key_cache, value_cache, cu, seq_lens, tables = make_batch(seqs, block_size, kv_heads, group, head_dim,
                                                                     dtype)
    sys.path.insert(0, str(ROOT / "client"))
    from bench_kernels import new_keys_and_values  # (make bench-kernels' way of laying them out)

    new_key, new_value = new_keys_and_values(key_cache, value_cache, seqs, cu, tables)
    assert new_key.shape == (len(query), kv_heads, head_dim)
    assert kv_heads == 1 or new_key.stride(1) == len(query) * head_dim  # (heads apart, as the hook passes them)
    scale = head_dim ** -0.5
    if DEVICE == "cuda" and (dtype == torch.float32 or torch.cuda.get_device_capability() < (9, 0)):
        with pytest.raises(ValueError, match="16-bit dtype, on a GPU that takes tensor descriptors"):
            triton_ops.paged_attention(query, key_cache, value_cache, cu, seq_lens, tables, scale, window,
                                       new_key=new_key, new_value=new_value, new_kv=True)
        return  # (compiled, float32 tiles of large heads spilled; before Hopper, no tensor descriptors)
    expected = torch_ops.paged_attention(query, key_cache, value_cache, cu, seq_lens, tables, scale, window)
    got = triton_ops.paged_attention(query, key_cache, value_cache, cu, seq_lens, tables, scale, window,
                                     new_key=new_key, new_value=new_value, new_kv=True)
    gathered = triton_ops.paged_attention(query, key_cache, value_cache, cu, seq_lens, tables, scale, window,
                                          new_key=new_key, new_value=new_value, new_kv=False)
    err = (got.float() - expected.float()).abs().max().item()
    assert err <= TOLERANCE[dtype], f"max abs error {err:.2e}"
    assert (got.float() - gathered.float()).abs().max().item() <= TOLERANCE[dtype]


# 35 decodes first, as the engine schedules them (more than a 32-token tile of the prefill chunks' layout, so
# that its first tile lies before them), then prefill chunks, one over a cached context, and a decode after.
DECODES_FIRST = [(5 + 3 * i, 1) for i in range(35)] + [(0, 20), (30, 9), (0, 3), (17, 1)]


@pytest.mark.parametrize("dtype", TOLERANCE, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("decode_splits, tile_splits", [(1, 1), (4, 1), (1, 2)], ids=["whole", "decodes-split",
                                                                                    "tiles-split"])
def test_decodes_launched_apart_match_torch(decode_splits, tile_splits, dtype, monkeypatch):
    """The decodes that lead a batch launched as a decode batch of their own (num_decodes) and the rest as
    prefill tiles: two launches, within the dtype's tolerance of the torch reference; the decodes' contexts
    split or not (the engine splits them on a GPU when few), and the tiles' too (their merge must leave the
    decodes' rows alone)."""
    from inflight.ops import triton_ops

    query, key_cache, value_cache, cu, seq_lens, tables = make_batch(DECODES_FIRST, 16, 2, 4, 64, dtype)
    monkeypatch.setattr(triton_ops, "_default_splits", lambda query, seqs, kv_heads: decode_splits)
    launched, meta = [], triton_ops.attention_meta

    def recorded(*args, **kwargs):
        grid, constants = meta(*args, **kwargs)
        launched.append((args[1], constants["DECODE"], constants["NUM_SPLITS"]))
        return grid, constants

    monkeypatch.setattr(triton_ops, "attention_meta", recorded)
    scale = 64 ** -0.5
    expected = torch_ops.paged_attention(query, key_cache, value_cache, cu, seq_lens, tables, scale)
    got = triton_ops.paged_attention(query, key_cache, value_cache, cu, seq_lens, tables, scale, num_decodes=35,
                                     num_splits=tile_splits)
    assert launched == [(35, True, decode_splits), (4, False, tile_splits)]
    err = (got.float() - expected.float()).abs().max().item()
    assert err <= TOLERANCE[dtype], f"max abs error {err:.2e}"


@pytest.mark.parametrize("case", ["mixed", "chunk-mid-sequence", "sliding-window", "mqa", "head-dim-128"])
def test_tiles_before_hopper_match_torch(case):
    """Prefill tiles of 64 rows by 32 keys, the 16-bit default before Hopper (Hopper's of 128 by 64 are
    what the interpreter lays out); float32 (what the interpreter computes)."""
    err = float32_error(case, block_m=64, tile_n=32)
    assert err <= TOLERANCE[torch.float32], f"max abs error {err:.2e}"


def test_prefill_tiles_by_architecture():
    """16-bit prefill tiles of 128 rows by 64 keys at 8 warps from Hopper on (and under the interpreter),
    64 by 32 at 8 warps before; heads of 256 and decodes keep theirs; never fewer keys than a block's."""
    from inflight.ops.triton_ops import attention_meta

    def tile(arch, head_dim=128, tokens=2048, dtype=torch.bfloat16):
        constants = attention_meta(tokens, 4, 32, 8, head_dim, 16, dtype, arch=arch)[1]
        return constants["BLOCK_M"], constants["TILE_N"], constants["num_warps"]

    assert tile(90) == tile(None) == (128, 64, 8) and tile(90, head_dim=64) == (128, 64, 8)
    assert tile(80) == (64, 32, 8) and tile(80, head_dim=64) == (64, 32, 8)
    assert tile(90, head_dim=256) == (64, 32, 8) and tile(90, tokens=4) == (16, 32, 4)
    # (a tile reads whole pages: a sweep's tile of 16 keys over blocks of 32 is refused, not compiled)
    assert attention_meta(2048, 4, 32, 8, 128, 32, torch.bfloat16, arch=90)[1]["TILE_N"] == 64
    with pytest.raises(ValueError, match="tile_n must be a power of two of at least the block size"):
        attention_meta(2048, 4, 32, 8, 128, 32, torch.bfloat16, tile_n=16, arch=90)


@pytest.mark.parametrize("group", [3, 5, 6, 4, 8])
def test_tiles_pack_groups_without_padding(group, monkeypatch):
    """A prefill tile holds as many tokens' query heads as fit (128 rows, a group of 3: 42 tokens, 126 rows),
    not a group padded to a power of two (32 tokens); launched alone, the first tile writes its tokens and
    nothing of the next one's, whose heads its last rows would hold (the next tile writes them)."""
    from inflight.ops import triton_ops

    dtype = torch.float16
    arch = triton_ops._arch(torch.device(DEVICE))
    constants = triton_ops.attention_meta(1000, 1, group, 1, 64, 16, dtype, arch=arch)[1]
    tokens = constants["BLOCK_Q"]
    assert tokens == constants["BLOCK_M"] // group and (DEVICE == "cuda" or constants["BLOCK_M"] == 128)
    query, key_cache, value_cache, cu, seq_lens, tables = make_batch([(7, 2 * tokens)], 16, 1, group, 64, dtype)
    meta = triton_ops.attention_meta
    monkeypatch.setattr(triton_ops, "attention_meta", lambda *a, **k: ((1, 1, 1), meta(*a, **k)[1]))
    out = torch.full_like(query, float("nan"))
    triton_ops.paged_attention(query, key_cache, value_cache, cu, seq_lens, tables, 0.125, out=out, num_splits=1)
    expected = torch_ops.paged_attention(query, key_cache, value_cache, cu, seq_lens, tables, 0.125)
    assert (out[:tokens].float() - expected[:tokens].float()).abs().max().item() <= TOLERANCE[dtype]
    assert out[tokens:].isnan().all()


@pytest.mark.parametrize("case", ["mixed", "chunk-mid-sequence", "context-block-size-plus-one", "sliding-window",
                                  "head-dim-128"])
def test_sixteen_key_tiles_match_torch(case):
    """Tiles of 16 keys (one page of 16 slots, two of 8), what compiled float32 prefill with head_dim
    128 launches; float32 (what the interpreter computes)."""
    err = float32_error(case, tile_n=16)
    assert err <= TOLERANCE[torch.float32], f"max abs error {err:.2e}"


@pytest.mark.parametrize("case", ["sliding-window", "long-sliding-window"])
def test_sixteen_row_window_tiles_match_torch(case):
    """Tiles of 16 rows by 16 keys, what compiled float32 prefill under a sliding window launches with heads
    of 65 to 128: masked tiles where the window begins and at the diagonal, unmasked ones between; float32."""
    err = float32_error(case, block_m=16, tile_n=16)
    assert err <= TOLERANCE[torch.float32], f"max abs error {err:.2e}"


def test_decode_splits_fill_the_gpu():
    from inflight.ops.triton_ops import decode_splits

    assert decode_splits(32, 3, 132) == 4  # 96 programs: 384 >= 264 with 4 splits
    assert decode_splits(256, 8, 132) == 1
    assert decode_splits(1, 1, 132) == 16  # at most 16
    assert decode_splits(64, 1, 132) == 8  # 64 x 4 = 256 is still short of 264


def test_decode_batches_launch_a_program_a_sequence():
    """A decode batch (one query token a sequence) launches a program per sequence, KV head and split,
    with no search for its sequence; other batches a tile per BLOCK_Q tokens and a gap per sequence."""
    from inflight.ops.triton_ops import attention_meta

    grid, constants = attention_meta(64, 64, 9, 3, 64, 16, torch.float16, num_splits=2)
    assert grid == (64, 3, 2) and constants["DECODE"]
    grid, constants = attention_meta(65, 64, 9, 3, 64, 16, torch.float16)
    assert grid == (65 // constants["BLOCK_Q"] + 64, 3, 1) and not constants["DECODE"]


def test_start_up_compiles_every_attention_variant_without_writing_kv(tiny_models, hf_reference, monkeypatch):
    """The start-up warm-up (kernel_warmup.py, run on a GPU) launches the kernels as a prefill step and a
    decode step of each split count would, writes nothing into the KV cache, and leaves the engine's
    output as it was; with a made-up SM count (and through the interpreter on a CPU)."""
    from conftest import random_prompts
    from inflight import LLM, SamplingParams
    from inflight.kernel_warmup import compile_attention_kernels, decode_batch_per_split_count
    from inflight.ops import triton_ops

    assert decode_batch_per_split_count(128, 3, 132) == {16: 1, 8: 11, 4: 22, 2: 44, 1: 88}
    assert all(triton_ops.decode_splits(seqs, 8, 132) == splits
               for splits, seqs in decode_batch_per_split_count(256, 8, 132).items())
    monkeypatch.setenv("INFLIGHT_ATTENTION", "triton")
    model = tiny_models["mistral"]  # sliding-window layers
    llm = LLM(model, num_kv_blocks=32, max_num_batched_tokens=32, max_num_seqs=4, enable_prefix_caching=False,
              device=DEVICE, dtype="float32")
    runner = llm.runner
    launches = []
    meta = triton_ops.attention_meta

    def record(num_tokens, num_seqs, *args, **kwargs):
        grid, constants = meta(num_tokens, num_seqs, *args, **kwargs)
        launches.append((num_tokens, constants["NUM_SPLITS"]))
        return grid, constants

    monkeypatch.setattr(triton_ops, "attention_meta", record)
    # As on a GPU of 2 SMs (on a CPU the kernels never split decodes).
    monkeypatch.setattr(triton_ops, "_default_splits", lambda query, seqs, kv_heads: (
        triton_ops.decode_splits(seqs, kv_heads, 2) if query.shape[0] == seqs else 1))
    runner.kv_cache.fill_(7.0)
    compile_attention_kernels(runner._forward, runner.buffers, 4, 32, runner.num_kv_heads, runner.block_size, 2)
    assert bool((runner.kv_cache == 7.0).all()), "the warm-up wrote into the KV cache"
    # A prefill of 16 tokens, then decodes of 1 and 2 sequences: 1 x 2 KV heads needs 2 splits to give each
    # of 2 SMs 2 programs, 2 x 2 needs none; those are all the split counts batches up to 4 can have.
    per_layer = sorted(set(launches))
    assert per_layer == [(1, 2), (2, 1), (16, 1)], per_layer
    assert {splits for tokens, splits in per_layer if tokens < 16} == {
        triton_ops.decode_splits(seqs, runner.num_kv_heads, 2) for seqs in range(1, 5)}
    runner.kv_cache.zero_()
    prompts = random_prompts(3, 5, 40, vocab=512, seed=3)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert [out.token_ids for out in outs] == [hf_reference(model, prompt, 6) for prompt in prompts]


# (query dtype, cache dtype): the model's own, and a float32 model with a 16-bit cache (kv_cache_dtype).
REFERENCE_DTYPES = [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
                    (torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.float32, torch.float8_e5m2),
                    (torch.float32, torch.float8_e4m3fn)]


@pytest.mark.parametrize("cpu_kernel", [True, False], ids=["c-kernel", "gathered"])
@pytest.mark.parametrize("sliding_window", [None, 7])
@pytest.mark.parametrize("dtype, cache_dtype", REFERENCE_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_reference_matches_dense_attention(dtype, cache_dtype, sliding_window, cpu_kernel, monkeypatch):
    """The torch reference itself against plain causal SDPA over each sequence's full context, in the
    query's dtype over the cache's values. On a CPU, decodes and prefill chunks over float32 and bfloat16
    caches take the C kernels, over float16 ones (and all without them) the gathered groups and SDPA per
    sequence; head_dim 64 and 128 are the decode kernel's unrolled cases, 80 its general one (and one the
    prefill kernel pads to 128)."""
    if not cpu_kernel:
        monkeypatch.setattr(torch_ops.cpu_kernels, "decode_attention", lambda: None)
        monkeypatch.setattr(torch_ops.cpu_kernels, "prefill_attention", lambda: None)
    elif DEVICE != "cpu" or cache_dtype not in torch_ops.cpu_kernels.CACHE_DTYPES:
        pytest.skip("the C kernels read float32, bfloat16 and fp8 caches on a CPU")
    for head_dim in (64, 128, 80):
        check_reference_matches_dense_attention(dtype, sliding_window, head_dim, cache_dtype)


@pytest.mark.parametrize("cpu_kernel", [True, False], ids=["c-kernel", "gathered"])
@pytest.mark.parametrize("sliding_window", [None, 7])
@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16)],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("option", OPTIONS)
def test_reference_with_softcap_and_sinks_matches_dense_attention(option, dtype, cache_dtype, sliding_window,
                                                                  cpu_kernel, monkeypatch):
    """As above, with a softcap (each scaled score s as softcap * tanh(s / softcap)) and sinks (a logit per
    query head in each softmax's denominator, with no value), which the dense reference applies as
    transformers' eager attention does. The C kernels (decode and prefill) take both; without them, the
    gathered groups and the path that materializes each chunk's scores (SDPA takes neither)."""
    if not cpu_kernel:
        monkeypatch.setattr(torch_ops.cpu_kernels, "decode_attention", lambda: None)
        monkeypatch.setattr(torch_ops.cpu_kernels, "prefill_attention", lambda: None)
    elif DEVICE != "cpu":
        pytest.skip("the C kernels are for a CPU")
    for head_dim in (64, 128, 80, 256):  # 256: Gemma's, whose Gemma 2 has the softcap
        check_reference_matches_dense_attention(dtype, sliding_window, head_dim, cache_dtype,
                                                **attention_options(option, 4))


def check_reference_matches_dense_attention(dtype, sliding_window, head_dim, cache_dtype, softcap=None, sinks=None):
    seqs = [(0, 9), (12, 1), (20, 6), (37, 1), (4, 1), (30, 1)]
    query, key_cache, value_cache, cu, seq_lens, tables = make_batch(seqs, 8, 2, 2, head_dim, dtype,
                                                                     cache_dtype=cache_dtype)
    scale = head_dim ** -0.5
    got = torch_ops.paged_attention(query, key_cache, value_cache, cu, seq_lens, tables, scale,
                                    sliding_window=sliding_window, softcap=softcap, sinks=sinks)
    for i, (context, q_len) in enumerate(seqs):
        slots = [tables[i, p // 8].item() * 8 + p % 8 for p in range(context + q_len)]
        k = key_cache.view(-1, 2, head_dim)[slots].transpose(0, 1).repeat_interleave(2, 0).float()
        v = value_cache.view(-1, 2, head_dim)[slots].transpose(0, 1).repeat_interleave(2, 0).float()
        q = query[cu[i]:cu[i + 1]].transpose(0, 1).float()
        scores = (q @ k.transpose(1, 2)) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(context, context + q_len, device=query.device)[:, None]
        k_pos = torch.arange(context + q_len, device=query.device)[None, :]
        hidden = k_pos > q_pos
        if sliding_window is not None:
            hidden |= q_pos - k_pos >= sliding_window
        scores.masked_fill_(hidden, float("-inf"))
        if sinks is not None:  # transformers' eager attention: one more column, dropped after the softmax
            scores = torch.cat([scores, sinks.float()[:, None, None].expand(-1, q_len, 1)], dim=-1)
        expected = (scores.softmax(-1)[..., :context + q_len] @ v).transpose(0, 1).to(dtype)
        tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
        torch.testing.assert_close(got[cu[i]:cu[i + 1]], expected, atol=tolerance, rtol=tolerance)
    kernel_expected = (DEVICE == "cpu" and cache_dtype in torch_ops.cpu_kernels.CACHE_DTYPES
                       and torch_ops.cpu_kernels.decode_attention() is not None)
    assert (torch_ops._last_plan.kernel_decodes is not None) == kernel_expected
    prefill_kernel_expected = (DEVICE == "cpu" and cache_dtype in torch_ops.cpu_kernels.CACHE_DTYPES
                               and torch_ops.cpu_kernels.prefill_attention() is not None)
    assert (torch_ops._last_plan.kernel_prefills is not None) == prefill_kernel_expected
    assert not torch_ops._last_plan.prefills if prefill_kernel_expected else len(torch_ops._last_plan.prefills) == 2


# (query dtype, cache dtype) of the C kernels: the model's float32 or bfloat16, a float32 model over fp8.
C_KERNEL_DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                   (torch.float32, torch.float8_e4m3fn), (torch.float32, torch.float8_e5m2)]


@pytest.mark.skipif(DEVICE != "cpu", reason="the C kernel is for a CPU")
@pytest.mark.parametrize("dtype, cache_dtype", C_KERNEL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_decode_kernel_builds_and_serves_decodes(threads, dtype, cache_dtype, monkeypatch):
    """The CI machines have a C compiler: the kernel must build there, and decodes over float32, bfloat16
    and fp8 caches must take it (a silent fall-back to the gathered path would pass the tests above and
    lose the speed). Two decodes on two threads are split by KV head, on one thread not: both equal the
    gathered path."""
    from inflight.ops import cpu_kernels

    assert cpu_kernels.decode_attention() is not None
    query, key_cache, value_cache, cu, seq_lens, tables = make_batch([(30, 1), (5, 1)], 8, 2, 3, 64, dtype,
                                                                     cache_dtype=cache_dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = torch_ops.paged_attention(query, key_cache, value_cache, cu, seq_lens, tables, 0.125)
    finally:
        torch.set_num_threads(previous)
    assert torch_ops._last_plan.kernel_decodes is not None and not torch_ops._last_plan.decode_groups
    monkeypatch.setattr(cpu_kernels, "decode_attention", lambda: None)
    expected = torch_ops.paged_attention(query, key_cache, value_cache, cu, seq_lens, tables, 0.125)
    assert torch_ops._last_plan.kernel_decodes is None
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3  # both in float32, each rounded to bfloat16 at the end
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.skipif(DEVICE != "cpu", reason="the C kernel is for a CPU")
@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
def test_cpu_kernels_widen_every_fp8_value(cache_dtype):
    """The C kernels widen an fp8 byte by moving its bits into a float32's: every finite value of both
    formats (subnormals and negative zero included) must come out exactly as torch's conversion. A
    sequence of one token attends to it alone, so its output is that token's value row: 4 KV heads of 64
    hold all 256 bytes (those of NaN and infinity, which a cache never holds, as zeros)."""
    from inflight.ops import cpu_kernels

    assert cpu_kernels.decode_attention() is not None and cpu_kernels.prefill_attention() is not None
    bits = torch.arange(256, dtype=torch.uint8)
    values = torch.where(bits.view(cache_dtype).float().isfinite(), bits, 0).view(cache_dtype)
    value_cache = values.view(1, 1, 4, 64).expand(1, 8, 4, 64).contiguous()
    key_cache = torch.zeros_like(value_cache)
    query = torch.randn(1, 4, 64)
    tables = torch.zeros(1, 1, dtype=torch.int64)
    for cu, seq_lens in ((torch.tensor([0, 1]), torch.tensor([1])),):  # a decode: the decode kernel
        out = torch_ops.paged_attention(query, key_cache, value_cache, cu, seq_lens, tables, 0.125)
        assert torch_ops._last_plan.kernel_decodes is not None
        assert torch.equal(out.view(-1), values.float()), "a value widened wrongly by the decode kernel"
    query2 = torch.randn(2, 4, 64)  # a prefill chunk of two tokens over the same row, then its own
    value_cache[0, 1] = value_cache[0, 0]
    out = torch_ops.paged_attention(query2, key_cache, value_cache, torch.tensor([0, 2]), torch.tensor([2]), tables,
                                    0.125)
    assert torch_ops._last_plan.kernel_prefills is not None
    assert torch.equal(out[0].view(-1), values.float()), "a value widened wrongly by the prefill kernel"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn], ids=str)
def test_start_up_builds_the_cpu_kernel_for_the_dtypes_it_reads(dtype, monkeypatch):
    """The runner's start-up (`ops.prepare`) builds the C kernels for each dtype they serve, so that no
    request's first step waits a second for the compiler; float16 attention never takes them."""
    from inflight import ops
    from inflight.ops import cpu_kernels

    built = []
    monkeypatch.setattr(cpu_kernels, "decode_attention", lambda: built.append(("decode", dtype)))
    monkeypatch.setattr(cpu_kernels, "prefill_attention", lambda: built.append(("prefill", dtype)))
    ops.prepare("torch", "cpu", dtype)
    ops.prepare("torch", "cuda", dtype)
    assert built == ([] if dtype == torch.float16 else [("decode", dtype), ("prefill", dtype)])


# Prefill chunks for the C prefill kernel (cpu_prefill_attention.c: key tiles of 64, work items of up to
# 96 query rows = positions x the group's heads): (seqs, block_size, kv_heads, group, head_dim, window).
PREFILL_CASES = {
    # several key tiles and query items; a chunk after a context; a 2-token chunk; a chunk of one tile
    "default-model-shape": ([(0, 300), (500, 200), (0, 50), (128, 2), (63, 64)], 16, 3, 3, 64, None),
    "llama-shape": ([(0, 130), (200, 70)], 16, 2, 4, 128, None),
    "sliding-window": ([(0, 150), (300, 90), (5, 40)], 8, 2, 2, 64, 48),
    "window-of-few": ([(100, 20), (0, 70)], 16, 1, 4, 64, 7),
    "window-wider-than-context": ([(30, 100)], 32, 2, 2, 64, 200),
    # head dims padded to 16, 32, 128 (48 -> 64); one KV head serving 100 query heads (items of one position)
    "head-dim-16": ([(0, 100), (70, 33)], 8, 2, 2, 16, None),
    "head-dim-32": ([(0, 77), (12, 5)], 32, 4, 1, 32, None),
    "head-dim-48": ([(64, 64)], 16, 1, 5, 48, 100),
    "head-dim-80": ([(0, 200)], 16, 2, 3, 80, None),
    "head-dim-256": ([(0, 150), (100, 40)], 16, 2, 2, 256, None),  # Gemma's heads
    "group-of-100": ([(0, 9), (20, 3)], 16, 1, 100, 16, None),
}


@pytest.mark.skipif(DEVICE != "cpu", reason="the C kernel is for a CPU")
@pytest.mark.parametrize("dtype, cache_dtype", C_KERNEL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_cpu_prefill_kernel_matches_sdpa(case, threads, dtype, cache_dtype, monkeypatch):
    """Every prefill chunk of a step through the C kernel at once, against SDPA over each sequence's
    gathered keys (the path without the kernel), both in float32 from the same cache."""
    from inflight.ops import cpu_kernels

    assert cpu_kernels.prefill_attention() is not None, "CI machines have a C compiler: the kernel must build"
    seqs, block_size, kv_heads, group, head_dim, window = PREFILL_CASES[case]
    query, key_cache, value_cache, cu, seq_lens, tables = make_batch(seqs, block_size, kv_heads, group, head_dim,
                                                                     dtype, cache_dtype=cache_dtype)
    scale = head_dim ** -0.5
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = torch_ops.paged_attention(query, key_cache, value_cache, cu, seq_lens, tables, scale, window)
    finally:
        torch.set_num_threads(previous)
    assert torch_ops._last_plan.kernel_prefills is not None and not torch_ops._last_plan.prefills
    monkeypatch.setattr(cpu_kernels, "prefill_attention", lambda: None)
    expected = torch_ops.paged_attention(query, key_cache, value_cache, cu, seq_lens, tables, scale, window)
    assert torch_ops._last_plan.kernel_prefills is None
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3  # both in float32, each rounded to bfloat16 at the end
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)


def _has_avx512() -> bool:
    try:
        return " avx512f " in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def _kernels_for_sixteen_vector_registers() -> tuple:
    """Both attention kernels built with AVX-512 off (AVX2's tiling), as ctypes functions."""
    import ctypes

    from inflight.ops import cpu_kernels

    built = []
    for source, native in ((cpu_kernels._DECODE_SOURCE, cpu_kernels.decode_attention()),
                           (cpu_kernels._PREFILL_SOURCE, cpu_kernels.prefill_attention())):
        library = ctypes.CDLL(str(cpu_kernels._build(source, [*cpu_kernels._ATTENTION_FLAGS, "-mno-avx512f"])))
        function = getattr(library, native.__name__)
        function.argtypes, function.restype = native.argtypes, native.restype
        built.append(function)
    return tuple(built)


@pytest.mark.skipif(DEVICE != "cpu" or not _has_avx512(),
                    reason="where AVX-512 is missing, the kernel built for the machine is this tiling")
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_cpu_prefill_kernel_tiled_for_sixteen_vector_registers(case, monkeypatch):
    """The prefill kernel sizes its register tiles to the target: AVX-512's 32 registers of 16 floats,
    or 16 of 8 (AVX2; NEON's 32 of 4 hold as many floats). Built here with AVX-512 off, the second tiling
    (smaller key tiles, value rows in blocks of columns) must equal the SDPA path as the first does."""
    from inflight.ops import cpu_kernels

    _, function = _kernels_for_sixteen_vector_registers()
    seqs, block_size, kv_heads, group, head_dim, window = PREFILL_CASES[case]
    inputs = make_batch(seqs, block_size, kv_heads, group, head_dim, torch.float32)
    monkeypatch.setattr(cpu_kernels, "prefill_attention", lambda: function)
    got = torch_ops.paged_attention(*inputs, head_dim ** -0.5, window)
    assert torch_ops._last_plan.kernel_prefills is not None
    monkeypatch.setattr(cpu_kernels, "prefill_attention", lambda: None)
    expected = torch_ops.paged_attention(*inputs, head_dim ** -0.5, window)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(DEVICE != "cpu", reason="the C kernel is for a CPU")
@pytest.mark.parametrize("cuts", [[30], [1], [69], [10, 20, 37], [63, 64, 65]], ids=str)
def test_cpu_prefill_kernel_gives_a_prompt_the_same_bits_however_it_is_cut(cuts):
    """A prompt of 70 tokens attended in one chunk, and in chunks cut at `cuts` (one-token chunks among
    them, which num_decodes=0 names prefill chunks): every row bit for bit the same. Each row's sums run in
    one order whatever rows and keys its work item holds (the kernel is built without reassociation)."""
    query, key_cache, value_cache, _, _, tables = make_batch([(0, 70)], 8, 2, 2, 16, torch.float32)

    def attend(start, end):
        cu, seq_lens = torch.tensor([0, end - start]), torch.tensor([end])
        return torch_ops.paged_attention(query[start:end].contiguous(), key_cache, value_cache, cu, seq_lens, tables,
                                         0.25, num_decodes=0)

    whole = attend(0, 70)
    assert torch_ops._last_plan.kernel_prefills is not None
    bounds = [0, *cuts, 70]
    assert torch.equal(torch.cat([attend(a, b) for a, b in zip(bounds, bounds[1:])]), whole)


# Prompts whose every row is computed by both C kernels: (prompt length, block_size, kv_heads, group,
# head_dim, window, query dtype, cache dtype). Head dims that fill whole vectors and that do not (48 by
# 16 lanes; 80 padded to 128), blocks that tiles of 64 keys cut (12), windows, 16-bit and fp8 caches.
SAME_BITS_CASES = {
    "default-model-shape": (300, 16, 3, 3, 64, None, torch.float32, torch.float32),
    "llama-shape": (200, 16, 2, 4, 128, None, torch.float32, torch.float32),
    "head-dim-16": (70, 8, 2, 2, 16, None, torch.float32, torch.float32),
    "head-dim-48-blocks-of-12": (130, 12, 1, 5, 48, None, torch.float32, torch.float32),
    "head-dim-80": (100, 16, 2, 3, 80, None, torch.float32, torch.float32),
    "head-dim-256": (90, 32, 1, 2, 256, None, torch.float32, torch.float32),
    "sliding-window": (150, 8, 2, 2, 64, 48, torch.float32, torch.float32),
    "window-of-few": (100, 16, 1, 4, 64, 7, torch.float32, torch.float32),
    "bfloat16": (129, 16, 3, 3, 64, None, torch.bfloat16, torch.bfloat16),
    "fp8-cache": (100, 16, 2, 3, 64, 70, torch.float32, torch.float8_e4m3fn),
}


@pytest.mark.skipif(DEVICE != "cpu", reason="the C kernels are for a CPU")
@pytest.mark.parametrize("tiling", ["native", "sixteen-registers"])
@pytest.mark.parametrize("extras", ["plain", "softcap", "sinks"])
@pytest.mark.parametrize("case", SAME_BITS_CASES)
def test_cpu_decode_kernel_gives_a_token_the_bits_the_prefill_kernel_gives_it(case, extras, tiling, monkeypatch):
    """A token decoded (the decode kernel, its query alone) and the same token as a row of its prompt
    (the prefill kernel), whole or cut in two: the same bits, at positions on both sides of the tiles'
    edges (tiles start at multiples of 64 whatever the chunk or the window). So a token's keys
    and values do not depend on which kernel computed them: not after preemption, which computes a
    sequence's generated tokens again as a prompt, nor in a prompt that finds another request's answer
    in the prefix cache."""
    from inflight.ops import cpu_kernels

    if tiling == "sixteen-registers":
        if not _has_avx512():
            pytest.skip("without AVX-512, the kernels built for the machine are this tiling")
        decode, prefill = _kernels_for_sixteen_vector_registers()
        monkeypatch.setattr(cpu_kernels, "decode_attention", lambda: decode)
        monkeypatch.setattr(cpu_kernels, "prefill_attention", lambda: prefill)
    length, block_size, kv_heads, group, head_dim, window, dtype, cache_dtype = SAME_BITS_CASES[case]
    query, key_cache, value_cache, _, _, tables = make_batch([(0, length)], block_size, kv_heads, group, head_dim,
                                                             dtype, cache_dtype=cache_dtype)
    softcap = 20.0 if extras == "softcap" else None
    sinks = torch.randn(kv_heads * group, generator=torch.Generator().manual_seed(1)) if extras == "sinks" else None
    scale = head_dim ** -0.5

    def attend(rows: slice, num_decodes: int) -> torch.Tensor:
        q = query[rows].contiguous()
        return torch_ops.paged_attention(q, key_cache, value_cache, torch.tensor([0, len(q)]),
                                         torch.tensor([rows.stop]), tables, scale, window, softcap, sinks,
                                         num_decodes=num_decodes)

    prompt = attend(slice(0, length), 0)
    assert torch_ops._last_plan.kernel_prefills is not None
    cut = length // 2 + 3  # and its second half as a chunk after the first (with a window, past its reach)
    assert torch.equal(attend(slice(cut, length), 0), prompt[cut:])
    for position in sorted({p for p in (1, 2, 63, 64, 65, 128, 129, length // 2, length - 1, length) if p <= length}):
        decoded = attend(slice(position - 1, position), 1)
        assert torch_ops._last_plan.kernel_decodes is not None
        assert torch.equal(decoded[0], prompt[position - 1]), position


@pytest.mark.skipif(DEVICE != "cpu", reason="the C kernel is for a CPU")
def test_cpu_prefill_kernel_leaves_other_rows_and_long_heads_alone():
    """The kernel writes the rows of prefill chunks only (decodes' rows are the decode kernel's), and
    heads longer than its tiles hold go through SDPA."""
    query, key_cache, value_cache, cu, seq_lens, tables = make_batch([(0, 20), (30, 1), (5, 7)], 16, 2, 2, 64,
                                                                     torch.float32)
    out = torch.full_like(query, float("nan"))
    torch_ops._last_plan = None
    torch_ops.paged_attention(query, key_cache, value_cache, cu, seq_lens, tables, 0.125, out=out)
    assert out.isfinite().all()
    plan = torch_ops._last_plan
    assert plan.kernel_prefills.token_rows.tolist() == [*range(20), *range(21, 28)]
    plan.kernel_decodes = None  # the same plan, decodes left out: their row stays untouched
    out = torch.full_like(query, float("nan"))
    torch_ops.paged_attention(query, key_cache, value_cache, cu, seq_lens, tables, 0.125, out=out)
    assert out[20].isnan().all() and out[:20].isfinite().all() and out[21:].isfinite().all()

    long_heads = make_batch([(0, 12)], 16, 1, 2, 512, torch.float32)
    torch_ops.paged_attention(*long_heads, 512 ** -0.5)
    assert torch_ops._last_plan.kernel_prefills is None and len(torch_ops._last_plan.prefills) == 1


@pytest.mark.skipif(DEVICE != "cpu", reason="the C kernel is for a CPU")
def test_cpu_decode_kernel_leaves_subnormals_alone(tmp_path):
    """Built afresh and loaded, the library must not switch on flush-to-zero for the process (what
    -ffast-math in a shared library does with GCC before 13): subnormal floats still compute."""
    script = (
        "from inflight.ops import cpu_kernels\n"
        "assert 5e-324 * 1.0 != 0.0\n"
        "assert cpu_kernels.decode_attention() is not None and cpu_kernels.prefill_attention() is not None\n"
        "assert 5e-324 * 1.0 != 0.0, 'loading the kernels turned on flush-to-zero'\n"
    )
    env = {**os.environ, "INFLIGHT_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT / "backend")}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert list((tmp_path / "cpu_kernels").glob("*.so")), "the kernel was not built afresh"


@pytest.mark.skipif(DEVICE != "cpu", reason="the C kernels are for a CPU")
def test_cpu_kernels_rebuild_when_their_shared_header_changes(tmp_path, monkeypatch):
    """Every kernel source includes cpu_kernels.h: a library built before the header changed must not
    be loaded after it (the cache key covers the header, not only the source)."""
    from inflight.ops import cpu_kernels

    monkeypatch.setenv("INFLIGHT_CACHE_DIR", str(tmp_path))
    before = cpu_kernels._build(cpu_kernels._LAYER_OPS_SOURCE, cpu_kernels._FLAGS)
    changed = tmp_path / "cpu_kernels.h"
    changed.write_bytes(cpu_kernels._SHARED_HEADER.read_bytes() + b"/* changed */\n")
    monkeypatch.setattr(cpu_kernels, "_SHARED_HEADER", changed)
    after = cpu_kernels._build(cpu_kernels._LAYER_OPS_SOURCE, cpu_kernels._FLAGS)
    assert after != before and after.exists() and before.exists()


def test_cpu_decode_kernel_falls_back_where_no_compiler_works(tmp_path):
    """A compiler that fails: a warning naming it, and attention through torch operations, correct (the
    layer kernels' absence: test_fused_layers.py)."""
    script = (
        "import logging, torch\n"
        "logging.basicConfig()\n"
        "from inflight.ops import cpu_kernels, torch_ops\n"
        "assert cpu_kernels.decode_attention() is None and cpu_kernels.prefill_attention() is None\n"
        "assert cpu_kernels.layer_ops() is None\n"
        "q, k, v = torch.randn(3, 4, 64), torch.randn(4, 8, 2, 64), torch.randn(4, 8, 2, 64)\n"
        "tables = torch.tensor([[2, 0], [1, 3]])\n"
        "out = torch_ops.paged_attention(q, k, v, torch.tensor([0, 1, 3]), torch.tensor([9, 4]), tables, 0.125)\n"
        "plan = torch_ops._last_plan\n"
        "assert plan.kernel_decodes is None and plan.kernel_prefills is None and len(plan.prefills) == 1\n"
        "assert out.isfinite().all()\n"
    )
    env = {**os.environ, "CC": "/bin/false", "INFLIGHT_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": str(ROOT / "backend")}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "CPU decode attention kernel unavailable" in result.stderr and "/bin/false failed" in result.stderr
    assert "CPU prefill attention kernel unavailable" in result.stderr
    assert "CPU layer kernels unavailable" in result.stderr


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("block_size, kv_heads, head_dim", [(8, 3, 64), (16, 3, 64), (32, 3, 64), (16, 8, 128)])
def test_write_kv_cache_matches_torch(block_size, kv_heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, tokens = 6, 21
    key = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    value = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[0, 5, 20]] = -1  # tokens with no slot are skipped
    slots = slots.to(DEVICE)
    caches = {}
    for impl in ("torch", "triton"):
        kc = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=DEVICE)
        vc = torch.zeros_like(kc)
        ops.write_kv_cache(key, value, kc, vc, slots, impl=impl)
        caches[impl] = (kc, vc)
    assert torch.equal(caches["torch"][0], caches["triton"][0])
    assert torch.equal(caches["torch"][1], caches["triton"][1])
    flat = caches["triton"][0].view(-1, kv_heads, head_dim)
    for t in (1, 2, 19):
        assert torch.equal(flat[slots[t]], key[t])
    assert int((caches["triton"][0] != 0).any(-1).any(-1).sum()) == tokens - 3


@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
def test_write_kv_cache_into_fp8_saturates(cache_dtype):
    """Keys and values into an fp8 cache (kv_cache_dtype fp8_e5m2, fp8_e4m3): rounded, the same bytes from
    both implementations, and saturated at the dtype's largest finite value rather than turned into NaN
    or infinity (unscaled, as vLLM's fp8 caches with their default scale of 1)."""
    if DEVICE == "cuda" and cache_dtype == torch.float8_e4m3fn and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("this GPU does not convert fp8 e4m3")
    gen = torch.Generator().manual_seed(3)
    key = torch.randn(9, 2, 64, generator=gen) * 3
    key[0, 0, :4] = torch.tensor([1e3, -1e3, 1e6, -1e6])
    key, value, slots = key.to(DEVICE), (-key).to(DEVICE), torch.tensor([4, -1, 0, 7, 9, 12, 3, 30, 31], device=DEVICE)
    caches = {}
    for impl in ("torch", "triton"):
        kc = torch.zeros(4, 8, 2, 64, dtype=cache_dtype, device=DEVICE)
        vc = torch.zeros_like(kc)
        ops.write_kv_cache(key, value, kc, vc, slots, impl=impl)
        caches[impl] = (kc.view(torch.uint8), vc.view(torch.uint8))
    assert all(torch.equal(a, b) for a, b in zip(caches["torch"], caches["triton"]))
    stored = caches["torch"][0].view(cache_dtype).view(-1, 2, 64).float()
    # (1e3: in e5m2's range, beyond e4m3's 448; clamped first, as torch before 2.13 turns it into NaN.)
    largest = torch.finfo(cache_dtype).max
    thousand = torch.tensor(1e3).clamp(-largest, largest).to(cache_dtype).item()
    assert stored[4, 0, :4].tolist() == [thousand, -thousand, largest, -largest]  # token 0's slot: 4
    assert stored.isfinite().all()
    assert torch.allclose(stored[7], key[3].float().cpu(), rtol=0.13, atol=0)  # token 3's slot; 2 or 3 mantissa bits


def test_dispatch(monkeypatch):
    monkeypatch.delenv("INFLIGHT_ATTENTION", raising=False)
    assert ops.resolve_impl(None, "cpu") == "torch"
    assert ops.resolve_impl(None, "cuda") == "triton"
    monkeypatch.setenv("INFLIGHT_ATTENTION", "torch")
    assert ops.resolve_impl(None, "cuda") == "torch"
    monkeypatch.setenv("INFLIGHT_ATTENTION", "bogus")
    with pytest.raises(ValueError, match="bogus"):
        ops.resolve_impl(None, "cpu")


@pytest.mark.parametrize("new_kv", [False, True], ids=["gathered", "new-kv"])
def test_engine_greedy_with_triton_kernels(tiny_models, hf_reference, monkeypatch, new_kv):
    """End to end: the engine's token-exact greedy test with attention through the Triton kernels, the
    prefill chunks' own keys and values gathered back from the cache or read from the new ones (chunks of
    48 tokens: prompts of up to 70 go in two, the second over a cached context)."""
    from conftest import random_prompts
    from inflight import LLM, SamplingParams
    from inflight.ops import triton_ops

    if DEVICE == "cuda" and new_kv:
        pytest.skip("a GPU reads new keys and values under 16-bit queries only, and this test is float32 (HF's "
                    "exact tokens): test_new_keys_and_values_read_directly_match_torch compares them in 16 bits")
    monkeypatch.setenv("INFLIGHT_ATTENTION", "triton")
    monkeypatch.setattr(triton_ops, "NEW_KV_FOR_PREFILL", new_kv)
    launched, meta = [], triton_ops.attention_meta
    apart, attend = [], triton_ops.paged_attention

    def recorded(*args, **kwargs):
        grid, constants = meta(*args, **kwargs)
        launched.append(constants["NEW_KV"])
        return grid, constants

    def attend_recorded(*args, num_decodes=None, **kwargs):
        apart.append(0 < num_decodes < len(args[4]))  # (args[4]: seq_lens)
        return attend(*args, num_decodes=num_decodes, **kwargs)

    monkeypatch.setattr(triton_ops, "attention_meta", recorded)
    monkeypatch.setattr(triton_ops, "paged_attention", attend_recorded)
    model = tiny_models["qwen2"]
    llm = LLM(model, num_kv_blocks=64, max_num_batched_tokens=48, max_num_seqs=8, enable_prefix_caching=False,
              device=DEVICE, dtype="float32")  # compiled on a GPU, interpreted on CPU
    assert llm.runner.attention_impl == "triton"
    prompts = random_prompts(5, 1, 70, vocab=512, seed=11)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_reference(model, prompt, 8)
    llm.block_manager.check_all_free()
    assert any(launched) == new_kv and not all(launched)  # (decode steps never: they read the cache alone)
    assert any(apart) and not all(apart)  # steps whose decodes were launched apart from prefill chunks


@pytest.mark.parametrize("arch", [80, 90])
def test_kernels_compile_for_gpus(arch):
    """Every kernel variant the engine launches compiles for sm_80 and sm_90 (Triton's own ptxas,
    no GPU needed) within the GPUs' shared memory and without spilling registers: what the interpreter
    cannot check. (A test per target: without Triton's cache each takes minutes of its worker's core.)"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_kernels.py"), "--targets", str(arch),
                             "--jobs", str(torch.get_num_threads())], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith(f"| sm_{arch} | ")]
    hopper = arch == 90
    # 19 variants for each of 3 dtypes (5 shapes' decode, split decode and prefill; 2 KV writes and 2
    # merges), 12 over a 16-bit cache of another dtype; over fp8 e5m2 caches 18 and 2 KV writes, over e4m3
    # as many on sm_90 alone (sm_80 does not convert it); on sm_90 alone, prefill reading new keys and
    # values, 5 shapes in 2 16-bit dtypes, and split decodes merged by the last split, 4 shapes (not Gemma
    # 2's heads of 256) in 2 16-bit dtypes; the sampler's top-p kernel; steps verifying drafts, split, for 5
    # shapes in 2 16-bit dtypes and 2 over a cache of the query's dtype with a float32 output
    # (triton_ops.verify_steps_split)
    assert len(rows) == (3 * 19 + 12) + (18 + 2) + hopper * ((18 + 2) + 2 * 5 + 2 * 4) + 1 + (2 * 5 + 2)
    assert not any("FAILED" in row for row in rows)
    verify = [row for row in rows if " verify " in row]
    assert len(verify) == 2 * 5 + 2 and not any(row.split("|")[3].strip() == "fp32" for row in verify)
    assert sum("new-kv" in row for row in rows) == 10 * hopper
    merged = [row for row in rows if "merged by the last" in row]
    assert len(merged) == 8 * hopper and not any("fp32" in row for row in merged)
    assert sum("top_p_cut" in row for row in rows) == 1


def test_sweep_leaves_out_only_variants_that_spill():
    """bench_kernels.SPILLING_BY_TRITON names, for the installed triton, sweep variants that spill on sm_90 in
    bfloat16 (compile_kernels.py --sweep --listed-spilling compiles just those): the GPU's sweep keeps from
    its tries no variant the engine could launch. (The other way, a spilling variant the list misses costs
    the sweep a try; the engine's own variants, which a sweep's best may become, must not spill:
    test_kernels_compile_for_gpus. The whole sweep, which finds the list, is 7x the compiles.)"""
    sys.path.insert(0, str(ROOT / "client"))
    import bench_kernels

    if bench_kernels.installed_triton() not in bench_kernels.SPILLING_BY_TRITON:
        pytest.skip(f"no list of spilling variants for triton {bench_kernels.installed_triton()}")
    listed = [(shape, phase, params) for shape in bench_kernels.SHAPES
              for phase, grid in (("decode", bench_kernels.SWEEP_DECODE), ("prefill", bench_kernels.SWEEP_PREFILL))
              for params in (dict(zip(grid, values)) for values in itertools.product(*grid.values()))
              if bench_kernels.spills(shape, phase, params)]
    assert listed
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_kernels.py"), "--sweep",
                             "--listed-spilling", "--targets", "90", "--dtypes", "bfloat16",
                             "--jobs", str(torch.get_num_threads())], env=env, capture_output=True, text=True,
                            timeout=600)
    rows = [row for row in result.stdout.splitlines() if row.startswith("| sm_90 | paged_attention ")]
    assert sorted(tuple(row.split(" | ")[1].split()[1:3]) for row in rows) == sorted((s, p) for s, p, _ in listed)
    not_spilled = [row for row in rows if not ("(spilled)" in row or "FAILED" in row or "(over the limit)" in row)]
    assert not not_spilled and result.returncode == 0, "\n".join(not_spilled) + result.stderr[-3000:]


def test_bench_kernels_says_whether_each_option_was_faster():
    """make bench-kernels ends each shape's table with a line an option off by default (new_kv, merge_last)
    is judged by: on how many mixes it was faster, and by how much."""
    sys.path.insert(0, str(ROOT / "client"))
    import bench_kernels

    line = bench_kernels.option_summary("new_kv", [(2.0, 1.0), (1.0, 2.0), (3.0, 2.0)])
    assert line == "new_kv: faster on 2 of 3 mixes, 1.50x the engine's launch without it (median; 0.50x to 2.00x)"


def test_bench_kernels_switches_the_options_that_apply_to_each_mix(monkeypatch):
    """make bench-kernels times, beside the engine's launch, each option that applies to a mix switched:
    new_kv where prefill tiles run, decodes_apart (on by default) where decodes lead prefill chunks, and
    merge_last on decode mixes the engine splits (on a GPU: a CPU never splits)."""
    from inflight.ops import triton_ops

    sys.path.insert(0, str(ROOT / "client"))
    import bench_kernels

    query = torch.zeros(2, 4, 64)
    mixed = bench_kernels.MIXES["mixed: 128 decodes x 1k + 1 chunk of 2k"]
    assert bench_kernels.leading_decodes(mixed) == 128
    assert bench_kernels.mix_options(mixed, query, 2) == {
        "new_kv": (dict(new_kv=True), dict(new_kv=False), triton_ops.NEW_KV_FOR_PREFILL),
        "decodes_apart": (dict(num_decodes=128), dict(num_decodes=0), True)}
    assert list(bench_kernels.mix_options(bench_kernels.MIXES["prefill 8 x 2k"], query, 2)) == ["new_kv"]
    assert bench_kernels.mix_options(bench_kernels.MIXES["decode 4 x 8k"], query, 2) == {}
    monkeypatch.setattr(triton_ops, "_default_splits", lambda query, seqs, kv_heads: 4)  # (as a GPU would)
    assert bench_kernels.mix_options(bench_kernels.MIXES["decode 4 x 8k"], query, 2) == {
        "merge_last": (dict(merge_last=True), dict(merge_last=False), triton_ops.MERGE_IN_LAST_SPLIT)}


def test_kernel_strides_are_multiples_of_head_dim(tiny_models, monkeypatch):
    """compile_kernels.py compiles the kernels with every stride hinted as a multiple of 16, as the
    JIT specializes them at the engine's launches when head_dim is one: the tensors the attention hook
    hands the kernels (views of transformers' own) must have strides that are multiples of head_dim."""
    from inflight import LLM, SamplingParams

    seen = []
    write, attend = ops.write_kv_cache, ops.paged_attention

    def record(*tensors):
        seen.extend((tuple(t.shape), t.stride()) for t in tensors)

    def write_kv_cache(key, value, key_cache, value_cache, slot_mapping, impl=None):
        record(key, value, key_cache, value_cache)
        return write(key, value, key_cache, value_cache, slot_mapping, impl)

    def paged_attention(query, key_cache, value_cache, *args, **kwargs):
        out = attend(query, key_cache, value_cache, *args, **kwargs)
        record(query, out)
        return out

    monkeypatch.setattr(ops, "write_kv_cache", write_kv_cache)
    monkeypatch.setattr(ops, "paged_attention", paged_attention)
    llm = LLM(tiny_models["qwen3"], num_kv_blocks=32, max_num_batched_tokens=32, max_num_seqs=4, device="cpu")
    llm.generate([[5, 6, 7, 8, 9], [10] * 40], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    head_dim = llm.runner.head_dim
    assert seen and all(shape[-1] == head_dim and strides[-1] == 1 for shape, strides in seen)
    assert all(stride % head_dim == 0 for _, strides in seen for stride in strides[:-1]), seen


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
def test_the_matmul_path_under_test(dtype):
    """Under the interpreter (CPU) every matmul runs in float32; compiled on a GPU, 16-bit inputs take
    the 16-bit tl.dot path. So the GPU run of this file is what checks that path: it must take it."""
    from inflight.ops.triton_ops import attention_meta

    _, constants = attention_meta(8, 2, 4, 2, 64, 16, dtype)
    assert constants["DOT_FP32"] is (dtype == torch.float32 or DEVICE == "cpu")
