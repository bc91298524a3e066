"""Triton-language kernels for the paged KV cache.

`paged_attention` is one launch for a ragged mix of prefill chunks and decodes, in the manner of
vLLM's unified attention (ideas only, the code is ours): a program takes a tile of BLOCK_Q query tokens
of one sequence times the query heads that share one KV head (packed into BLOCK_M rows unpadded, so GQA
reads each key once per group), walks that sequence's keys tile by tile through its block table, and keeps
an online softmax in float32. Programs are laid out per sequence at `cu_seqlens_q[s] // BLOCK_Q + s`,
so each finds its sequence by a binary search, with no host-side work per step; in a decode batch (as
many tokens as sequences: one each) program s is sequence s's. The decodes that lead a mixed batch (the
engine schedules them first: `num_decodes`) are launched as a decode batch of their own, so that each
does not take a prefill tile of BLOCK_M rows for its few query heads. Keys before a tile's
first query (and, under a sliding window, inside its last query's window) are visible to all its rows, so
whole tiles of them run without masks; only the tiles at the causal edge and where a window begins are
masked. The block table is read once per page of keys; in the loop over unmasked tiles a tile ahead, so
that Triton's pipeliner keeps the next tiles' keys and values in flight. The softmax runs on exp2, with
log2(e) folded into the scale.

Split-KV (flash-decoding): a decode batch too small to fill the GPU with (sequence, KV head) programs
splits each context into NUM_SPLITS ranges of whole tiles, one program each (a third grid axis); each
writes its float32 partial output and log-sum-exp, and `_merge_splits_kernel` weighs them together. The
split count comes from the batch's shape alone (`decode_splits`), never from a device value, so a
captured CUDA graph stays valid as contexts grow.

New keys and values (`new_kv`, NEW_KV_FOR_PREFILL): prefill tiles may read the step's own tokens' keys and
values from the tensors the attention hook wrote into the cache, through tensor descriptors (bulk tensor
copies on Hopper) instead of gathering them back through the block table; the keys before the chunk
still come from the cache.

A model's softcap (Gemma 2) bounds each score by softcap * tanh(score / softcap) before the softmax; its
sinks (gpt-oss), a logit per query head, start each row's online softmax as a key whose value is zero
would (in the first split only).

The softmax and accumulators are float32; the matmuls take 16-bit inputs as they are on a GPU, and
float32 everywhere under the interpreter (TRITON_INTERPRET=1), which computes bfloat16 wrongly. A cache
of another dtype than the query's (`kv_cache_dtype`) is converted to the query's dtype as it loads; a
float32 query over a 16-bit cache is first rounded to the cache's dtype (its output stays float32), so
that the 16-bit kernel runs: float32 matmuls widening 16-bit tiles took more registers than the GPUs
have (scripts/compile_kernels.py); over an fp8 cache, to bfloat16. fp8 keys and values are widened to
the query's dtype as they load (stored saturated, unscaled: torch_ops.stored).
"""

import functools
import os

import torch
import triton
import triton.language as tl

from .torch_ops import FP8_DTYPES, stored

# The interpreter computes 16-bit (bfloat16 above all) arithmetic wrongly: there, everything is float32.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
LOG2_E = 1.4426950408889634  # folded into the scale: the softmax runs on exp2


# Counts that change from step to step are not specialized: Triton's JIT would otherwise compile a
# variant of a kernel for a count of 1, one for multiples of 16 and one for the rest, each the first
# time a step has one, in the middle of a request. The strides stay specialized (fixed per model).
@triton.jit(do_not_specialize=["num_tokens"])
def _write_kv_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr, num_tokens,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slots = tl.load(slot_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    cols = tl.arange(0, HEADS_PAD * DIM_PAD)
    head = cols // DIM_PAD
    dim = cols % DIM_PAD
    mask = (slots >= 0)[:, None] & ((head < NUM_KV_HEADS) & (dim < HEAD_DIM))[None, :]
    block = slots // BLOCK_SIZE
    offset = slots % BLOCK_SIZE
    t = tokens.to(tl.int64)[:, None]
    k = tl.load(key_ptr + t * stride_kt + head[None, :] * stride_kh + dim[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + head[None, :] * stride_vh + dim[None, :], mask=mask)
    kc = key_cache_ptr + block[:, None] * stride_kc_block + offset[:, None] * stride_kc_slot
    vc = value_cache_ptr + block[:, None] * stride_vc_block + offset[:, None] * stride_vc_slot
    tl.store(kc + head[None, :] * stride_kc_head + dim[None, :], k, mask=mask)
    tl.store(vc + head[None, :] * stride_vc_head + dim[None, :], v, mask=mask)


def kv_write_meta(num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int,
                  block_t: int | None = None) -> tuple[tuple[int], dict]:
    """The launch grid and compile-time constants of `_write_kv_cache_kernel`."""
    heads_pad, dim_pad = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
    # About 2048 elements a program: few registers per thread, and few programs for the interpreter.
    block_t = block_t or max(1, min(16, 2048 // (heads_pad * dim_pad)))
    constants = dict(NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
                     HEADS_PAD=heads_pad, DIM_PAD=dim_pad, BLOCK_T=block_t)
    return (triton.cdiv(num_tokens, block_t),), constants


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping, block_t: int | None = None) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key, value = stored(key, key_cache.dtype), stored(value, value_cache.dtype)
    assert key.stride(2) == 1 and value.stride(2) == 1 and key_cache.stride(3) == 1
    grid, constants = kv_write_meta(num_tokens, num_kv_heads, head_dim, key_cache.shape[1], block_t)
    _write_kv_cache_kernel[grid](
        key, value, key_cache, value_cache, slot_mapping, num_tokens,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        **constants,
    )


@triton.jit
def _tile_blocks(table, n0, kv_end, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr):
    """The blocks of the pages of the tile of TILE_N keys from n0 (0 for pages from kv_end on): the block
    table read once per page."""
    pages = n0 // BLOCK_SIZE + tl.arange(0, TILE_N // BLOCK_SIZE)
    return tl.load(table + pages, mask=pages * BLOCK_SIZE < kv_end, other=0).to(tl.int64)


@triton.jit
def _attend_tile(q, acc, m_i, l_i, n0, blocks, key_cache_ptr, value_cache_ptr, kv_head, q_pos, kv_end, dims, dim_ok,
                 stride_kc_block, stride_kc_slot, stride_kc_head, stride_vc_block, stride_vc_slot, stride_vc_head,
                 qk_scale,
                 SLIDING_WINDOW: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                 DOT_FP32: tl.constexpr, MASKED: tl.constexpr, SOFTCAP: tl.constexpr):
    """One tile of TILE_N keys from n0, read from the KV cache through its pages' `blocks`, into the online
    softmax (_softmax_step, _add_values). MASKED: the tile may hold keys past `kv_end` or after a query (causal) or
    outside the sliding window; else every key is visible to every row."""
    keys = n0 + tl.arange(0, TILE_N)
    if MASKED:
        key_ok = keys < kv_end
    else:
        key_ok = keys >= 0
    # Each key takes its page's block.
    block = tl.reshape(tl.broadcast_to(blocks[:, None], (TILE_N // BLOCK_SIZE, BLOCK_SIZE)), (TILE_N,))
    slot = keys % BLOCK_SIZE
    k = tl.load(key_cache_ptr + block[None, :] * stride_kc_block + slot[None, :] * stride_kc_slot
                + kv_head * stride_kc_head + dims[:, None],
                mask=dim_ok[:, None] & key_ok[None, :], other=0.0)  # [DIM_PAD, TILE_N]
    p, alpha, m_i, l_i = _softmax_step(q, k, m_i, l_i, keys, key_ok, q_pos, qk_scale, SLIDING_WINDOW, DOT_FP32,
                                       MASKED, SOFTCAP)
    v = tl.load(value_cache_ptr + block[:, None] * stride_vc_block + slot[:, None] * stride_vc_slot
                + kv_head * stride_vc_head + dims[None, :],
                mask=key_ok[:, None] & dim_ok[None, :], other=0.0)  # [TILE_N, DIM_PAD]
    return _add_values(acc, p, v, alpha, q.dtype, DOT_FP32), m_i, l_i


@triton.jit
def _attend_new_tile(q, acc, m_i, l_i, n0, context, q_start, new_key_desc, new_value_desc, kv_head, q_pos, kv_end,
                     qk_scale, SLIDING_WINDOW: tl.constexpr, TILE_N: tl.constexpr, DIM_PAD: tl.constexpr,
                     DOT_FP32: tl.constexpr, MASKED: tl.constexpr, SOFTCAP: tl.constexpr):
    """One tile of TILE_N keys from n0, keys of the step's own tokens (n0 >= context), read from the
    step's new keys and values through their tensor descriptors (rows from q_start, the sequence's
    first new token: on Hopper, bulk tensor copies), into the online softmax as _attend_tile's. The rows
    past the sequence's own belong to the next one: a MASKED tile drops them (keys past kv_end)."""
    keys = n0 + tl.arange(0, TILE_N)
    key_ok = keys < kv_end if MASKED else keys >= 0
    row = (q_start + n0 - context).to(tl.int32)  # (descriptors take 32-bit offsets)
    k = tl.trans(tl.reshape(new_key_desc.load([row, kv_head, 0]), (TILE_N, DIM_PAD)))  # [DIM_PAD, TILE_N]
    p, alpha, m_i, l_i = _softmax_step(q, k, m_i, l_i, keys, key_ok, q_pos, qk_scale, SLIDING_WINDOW, DOT_FP32,
                                       MASKED, SOFTCAP)
    v = tl.reshape(new_value_desc.load([row, kv_head, 0]), (TILE_N, DIM_PAD))
    return _add_values(acc, p, v, alpha, q.dtype, DOT_FP32), m_i, l_i


@triton.jit
def _softmax_step(q, k, m_i, l_i, keys, key_ok, q_pos, qk_scale, SLIDING_WINDOW: tl.constexpr,
                  DOT_FP32: tl.constexpr, MASKED: tl.constexpr, SOFTCAP: tl.constexpr):
    """A tile's keys k [DIM_PAD, TILE_N] into the online softmax (base 2): the tile's weights p, the
    factor alpha of what came before, the new running max and sum. The scores are the products times
    qk_scale: the scale and log2(e), or with a SOFTCAP (the softcap times log2(e); 0: none) the scale over
    the softcap, whose tanh then times SOFTCAP."""
    if DOT_FP32:
        s = tl.dot(q, k.to(tl.float32), input_precision="ieee") * qk_scale
    else:
        s = tl.dot(q, k.to(q.dtype)) * qk_scale  # 16-bit inputs in the query's dtype, float32 accumulation
    if SOFTCAP > 0:
        s = (2.0 * tl.sigmoid(2.0 * s) - 1.0) * SOFTCAP  # tanh(s), from what Triton has
    if MASKED:
        allowed = key_ok[None, :] & (keys[None, :] <= q_pos[:, None])
        if SLIDING_WINDOW > 0:
            allowed = allowed & (q_pos[:, None] - keys[None, :] < SLIDING_WINDOW)
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit
def _add_values(acc, p, v, alpha, dtype: tl.constexpr, DOT_FP32: tl.constexpr):
    """The accumulated output rescaled by alpha, plus the tile's weights p times its values v (16-bit
    inputs in the query's `dtype`, float32 accumulation; or float32 matmuls)."""
    acc = acc * alpha[:, None]
    if DOT_FP32:
        return tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(p.to(dtype), v.to(dtype), acc)


# The sequences' metadata is not specialized on its alignment either: the prefill tiles of a step whose
# decodes are launched apart read it from the first prefill sequence's row on, 8 bytes a row (else a
# variant for an aligned row and one for the others, the second compiled in the middle of a request).
@triton.jit(do_not_specialize=["num_seqs"],
            do_not_specialize_on_alignment=["cu_seqlens_q_ptr", "seq_lens_ptr", "block_tables_ptr"])
def _paged_attention_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr, arrivals_ptr,
    cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr, sinks_ptr, new_key_desc, new_value_desc,
    qk_scale, num_seqs, num_heads,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head,
    stride_bt,
    SLIDING_WINDOW: tl.constexpr,  # 0: none
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,  # >1: each program takes 1/NUM_SPLITS of the keys, merged after (MERGE_LAST)
    DECODE: tl.constexpr,  # every sequence has one query token (cu_seqlens_q is 0, 1, 2, ...): a program each
    DOT_FP32: tl.constexpr,  # float32 matmuls (float32 inputs, or the interpreter); else 16-bit
    SOFTCAP: tl.constexpr,  # the softcap times log2(e), 0: none (see _attend_tile); a model's constant
    HAS_SINKS: tl.constexpr,  # sinks_ptr: a logit per query head; else None (no argument more at a launch)
    NEW_KV: tl.constexpr,  # the step's own keys and values from new_key_desc / new_value_desc (else None)
    MERGE_LAST: tl.constexpr,  # split-KV: the last split of a tile to finish merges them (arrivals_ptr counts)
):
    q_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    if DECODE:  # one query token a sequence: program s is sequence s's
        seq = q_tile
        q_start = tl.load(cu_seqlens_q_ptr + seq)  # (s itself, but read: so no variant spills, compile_kernels)
        q_len = 1
        first_q = 0
    else:
        # The sequence this tile belongs to: the last s with cu_seqlens_q[s] // BLOCK_Q + s <= q_tile (a
        # chain of dependent loads before any other: a decode kernel of a few microseconds skips it).
        lo = 0
        hi = num_seqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid <= q_tile:
                lo = mid
            else:
                hi = mid - 1
        seq = lo
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        first_q = (q_tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q
        if first_q < 0 or first_q >= q_len:
            return  # a gap between two sequences' tiles, or before the first (decodes launched apart)
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    # A tile's rows: BLOCK_Q tokens' GROUP query heads each, packed (a group of 3 takes 126 rows of 128, not
    # 96 as a group padded to 4 did); the rows after the last whole token none (they would hold the next
    # tile's token, which that tile writes; a decode's one token bounds its rows already).
    rows = tl.arange(0, BLOCK_M)
    q_idx = first_q + rows // GROUP  # query token within the sequence's new tokens
    head = kv_head * GROUP + rows % GROUP
    row_ok = q_idx < q_len
    if not DECODE and BLOCK_Q * GROUP < BLOCK_M:
        row_ok = row_ok & (rows < BLOCK_Q * GROUP)
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q_tok = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + q_tok[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    q_pos = context + q_idx
    out_row = q_tok * num_heads + head  # (the row of its partial results, split-KV)

    # Keys this tile can see: causal up to its last query; a sliding window also bounds the start.
    if DECODE:  # (what the bound below gives one query, said outright: so no variant spills, compile_kernels)
        kv_end = seq_len
    else:
        kv_end = tl.minimum(seq_len, context + first_q + BLOCK_Q)
    kv_start = 0
    # Keys every row of the tile sees need no mask: from its first query on back (as far as its last query's
    # window reaches): whole tiles of them run unmasked; the tiles after (the diagonal) and before (where the
    # window begins) masked.
    unmasked_end = (context + first_q + 1) // TILE_N * TILE_N
    if SLIDING_WINDOW > 0:
        kv_start = tl.maximum(0, context + first_q - SLIDING_WINDOW + 1) // TILE_N * TILE_N
        unmasked_start = tl.cdiv(tl.maximum(0, kv_end - SLIDING_WINDOW), TILE_N) * TILE_N
    if NUM_SPLITS > 1:  # this program's share: whole tiles, in order
        chunk = tl.cdiv(tl.cdiv(kv_end - kv_start, TILE_N), NUM_SPLITS) * TILE_N
        kv_start = kv_start + split * chunk
        kv_end = tl.minimum(kv_end, kv_start + chunk)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:  # the sink as a first key of value zero, counted once: in the first split
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634  # log2(e)
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    cached_end = kv_end
    if NEW_KV:  # keys from the cache up to the step's own, which come from the new keys and values
        cached_end = tl.minimum(context, kv_end)
        unmasked_end = tl.minimum(unmasked_end, cached_end // TILE_N * TILE_N)
    unmasked_from = kv_start
    masked_from = tl.maximum(unmasked_end, kv_start)  # the diagonal's tiles
    masked_end = cached_end
    if SLIDING_WINDOW > 0:  # and the tiles where the window begins, which some rows see only in part
        unmasked_from = tl.maximum(kv_start, unmasked_start)
        unmasked_keys = tl.maximum(0, tl.minimum(unmasked_end, cached_end) - unmasked_from)
        masked_from = kv_start
        masked_end = cached_end - unmasked_keys  # (one masked loop over both, stepping over the unmasked tiles)
    # Each tile's blocks are read a tile ahead: keys and values whose addresses come from a load in the same
    # iteration were pipelined a stage short (decode tiles not at all, prefill tiles one tile ahead); so, a
    # tile more in flight (the TTGIR's async_wait). The masked loop reads them in the iteration: ahead there,
    # four variants spilled 4-8 bytes (compile_kernels.py).
    blocks = _tile_blocks(table, unmasked_from, cached_end, BLOCK_SIZE, TILE_N)
    for n0 in range(unmasked_from, tl.minimum(unmasked_end, cached_end), TILE_N):
        next_blocks = _tile_blocks(table, n0 + TILE_N, cached_end, BLOCK_SIZE, TILE_N)
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, n0, blocks, key_cache_ptr, value_cache_ptr, kv_head, q_pos,
                                     cached_end, dims, dim_ok, stride_kc_block, stride_kc_slot, stride_kc_head,
                                     stride_vc_block, stride_vc_slot, stride_vc_head, qk_scale,
                                     SLIDING_WINDOW, BLOCK_SIZE, TILE_N, DOT_FP32, False, SOFTCAP)
        blocks = next_blocks
    for n0 in range(masked_from, masked_end, TILE_N):
        tile_start = n0
        if SLIDING_WINDOW > 0:
            tile_start = tl.where(n0 < unmasked_from, n0, n0 + unmasked_keys)
        blocks = _tile_blocks(table, tile_start, cached_end, BLOCK_SIZE, TILE_N)
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, tile_start, blocks, key_cache_ptr, value_cache_ptr, kv_head,
                                     q_pos, cached_end, dims, dim_ok, stride_kc_block, stride_kc_slot, stride_kc_head,
                                     stride_vc_block, stride_vc_slot, stride_vc_head, qk_scale,
                                     SLIDING_WINDOW, BLOCK_SIZE, TILE_N, DOT_FP32, True, SOFTCAP)
    if NEW_KV:  # tiles from the first key of the step's own (or of the window) on, unmasked up to the diagonal
        new_start = tl.maximum(context, kv_start)
        new_unmasked_end = new_start
        if SLIDING_WINDOW == 0:
            new_unmasked_end = new_start + (context + first_q + 1 - new_start) // TILE_N * TILE_N
        for n0 in range(new_start, new_unmasked_end, TILE_N):
            acc, m_i, l_i = _attend_new_tile(q, acc, m_i, l_i, n0, context, q_start, new_key_desc, new_value_desc,
                                             kv_head, q_pos, kv_end, qk_scale, SLIDING_WINDOW, TILE_N, DIM_PAD,
                                             DOT_FP32, False, SOFTCAP)
        for n0 in range(new_unmasked_end, kv_end, TILE_N):
            acc, m_i, l_i = _attend_new_tile(q, acc, m_i, l_i, n0, context, q_start, new_key_desc, new_value_desc,
                                             kv_head, q_pos, kv_end, qk_scale, SLIDING_WINDOW, TILE_N, DIM_PAD,
                                             DOT_FP32, True, SOFTCAP)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if NUM_SPLITS > 1:  # the partial result and its log-sum-exp (base 2), merged by _merge_splits_kernel
        part = out_row * NUM_SPLITS + split
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)
        tl.store(part_out_ptr + part[:, None] * DIM_PAD + dims[None, :], out, mask=row_ok[:, None])
        if MERGE_LAST:  # or by this program, if it is the last of its tile's splits to get here
            # Every thread's stores are done before one thread counts the arrival (release, GPU-wide); the
            # last to arrive (acquire) then sees every split's, read past the L1 cache of its own SM.
            tl.debug_barrier()
            arrival = arrivals_ptr + q_tile * tl.num_programs(1) + kv_head
            if tl.atomic_add(arrival, 1, sem="acq_rel", scope="gpu") == NUM_SPLITS - 1:
                tl.debug_barrier()
                _merge_rows(part_out_ptr, part_lse_ptr, out_ptr, out_row, q_tok, head, row_ok, dims, dim_ok,
                            stride_ot, stride_oh, NUM_SPLITS, BLOCK_M, DIM_PAD)
                tl.atomic_xchg(arrival, 0)  # counted from zero again by the next launch
    else:
        tl.store(out_ptr + q_tok[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _merge_rows(part_out_ptr, part_lse_ptr, out_ptr, out_row, q_tok, head, row_ok, dims, dim_ok, stride_ot,
                stride_oh, NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, DIM_PAD: tl.constexpr):
    """out[q_tok, head] of a tile's rows from their NUM_SPLITS partial results, weighted by their shares of
    the softmax (as _merge_splits_kernel), split by split."""
    splits = tl.arange(0, NUM_SPLITS)
    lse = tl.load(part_lse_ptr + out_row[:, None] * NUM_SPLITS + splits[None, :], mask=row_ok[:, None],
                  other=0.0, cache_modifier=".cg")
    top = tl.max(lse, 1)
    top = tl.where(top == float("-inf"), 0.0, top)  # (every split empty: none weighs anything)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        part = out_row * NUM_SPLITS + s
        weight = tl.exp2(tl.load(part_lse_ptr + part, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
                         - top)
        acc += weight[:, None] * tl.load(part_out_ptr + part[:, None] * DIM_PAD + dims[None, :],
                                         mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
        total += weight
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(out_ptr + q_tok[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _merge_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, num_heads, stride_ot, stride_oh,
                         NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr):
    """out[token, head] from its NUM_SPLITS partial results, weighted by their shares of the softmax."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    parts = (token * num_heads + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    lse = tl.load(part_lse_ptr + parts)
    weight = tl.exp2(lse - tl.max(lse, 0))  # empty splits (-inf) weigh nothing
    dims = tl.arange(0, DIM_PAD)
    partial = tl.load(part_out_ptr + parts[:, None] * DIM_PAD + dims[None, :])
    out = tl.sum(partial * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


# Split-KV decode: a decode batch with fewer (sequence, KV head) programs than this many per SM has its
# contexts split, up to MAX_SPLITS ways, so that every SM has work.
PROGRAMS_PER_SM = 2
MAX_SPLITS = 16


def decode_splits(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Splits for a decode batch: a power of two, from its shape alone (no device value), so a captured
    CUDA graph of a batch size stays valid for every context length."""
    programs = num_seqs * num_kv_heads
    splits = 1
    while splits < MAX_SPLITS and programs * splits < PROGRAMS_PER_SM * num_sms:
        splits *= 2
    return splits


# Warps: measured on an H200 (bench_kernels.py --sweep, 2026-11-30, bfloat16, Llama-3-8B shape), 16-bit decode
# is fastest with 4 on all five decode mixes, head_dim 128 too (256 x 2k: 0.556 ms against 0.882 ms with 8; the
# other parameters as here). Compiled float32 decodes take 4 as well (with 8, ptxas on sm_80 caps them at 64
# registers and spills: scripts/compile_kernels.py). Prefill tiles take 8: with head_dim 128, in float32 and
# over an fp8 cache (with 4, a float32 model's over fp8 spilled on sm_80), Hopper's tiles of 128 rows, and
# since 2026-12-05 the 64-row tiles of heads of 64 before Hopper too (with 4, once the default model's group of
# 3 was packed unpadded, a float32 model's over a bfloat16 cache spilled 20 bytes on sm_80 under triton 3.8).
DECODE_WARPS, PREFILL_WARPS = 4, 8


def attention_meta(num_tokens: int, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                   block_size: int, dtype: torch.dtype, sliding_window: int | None = None,
                   block_m: int | None = None, tile_n: int | None = None, num_splits: int = 1,
                   num_warps: int | None = None, num_stages: int | None = None, softcap: float | None = None,
                   sinks: bool = False, cache_dtype: torch.dtype | None = None,
                   new_kv: bool = False, merge_last: bool = False,
                   arch: int | None = None) -> tuple[tuple[int, int, int], dict]:
    """The launch grid and compile-time constants (with num_warps, and num_stages when given) of
    `_paged_attention_kernel` for one batch (`dtype`: the query's; `cache_dtype`: the KV cache's, where
    another; `new_kv`: the step's own keys and values read from its new ones; `merge_last`: split-KV's
    partial results merged by each tile's last split, not by _merge_splits_kernel, for 16-bit heads of up
    to 128 from Hopper on (else some variant spilled: Gemma 2's heads of 256, the Llama-3-8B shape's 16-bit
    decode on sm_80 and float32 one on sm_90 under triton 3.6: compile_kernels.py); `arch`: the GPU's
    compute capability, as 90 for 9.0, None under the interpreter, which lays tiles out as on Hopper); the
    optional values override the defaults (bench sweeps). The constants are shared by the batches of their
    kind: not to be changed."""
    constants = _attention_constants(num_tokens == num_seqs, num_heads, num_kv_heads, head_dim, block_size, dtype,
                                     sliding_window, block_m, tile_n, num_splits, num_warps, num_stages, softcap,
                                     sinks, cache_dtype, new_kv, merge_last, arch is None or arch >= 90)
    tiles = num_seqs if constants["DECODE"] else num_tokens // constants["BLOCK_Q"] + num_seqs
    return (tiles, num_kv_heads, num_splits), constants


# Worked out once per kind of batch (decode or not, and the model's shape): an eager step launches the
# kernel in every layer, and this took 4 us a call of Python on the CI host.
@functools.lru_cache(maxsize=256)
def _attention_constants(decode: bool, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                         dtype: torch.dtype, sliding_window: int | None, block_m: int | None, tile_n: int | None,
                         num_splits: int, num_warps: int | None, num_stages: int | None, softcap: float | None,
                         sinks: bool, cache_dtype: torch.dtype | None, new_kv: bool = False,
                         merge_last: bool = False, hopper: bool = True) -> dict:
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    if new_kv and (decode or num_splits > 1):
        raise ValueError("new keys and values are read by prefill tiles only, whole (num_splits 1)")
    if tile_n is not None and (tile_n < block_size or tile_n & (tile_n - 1)):
        # (a tile reads whole pages: its block table entries are TILE_N // BLOCK_SIZE)
        raise ValueError(f"tile_n must be a power of two of at least the block size ({block_size}), got {tile_n}")
    group = num_heads // num_kv_heads
    # A decode batch (or the decodes that lead a mixed one, launched apart: paged_attention) takes 16 rows,
    # one token's query heads; prefill tiles are tall. Compiled float32 prefill tiles take twice the
    # registers: half the rows, and with heads over 64 half the keys, as float32 decodes with heads over 64
    # do (with 32 keys a tile, read two tiles ahead, a Llama-3-8B decode spilled 52-476 bytes on sm_90) (no
    # spills on sm_80/sm_90: scripts/compile_kernels.py, which the tests run, fails on one).
    wide = dtype == torch.float32 and not _INTERPRETED
    fp8_cache = cache_dtype in FP8_DTYPES
    # 16-bit prefill tiles of 128 rows by 64 keys at 8 warps on Hopper: two warpgroups of 64 rows, each a
    # 64 x 64 score matmul (64 x 32 tiles at 8 warps split theirs into 64 x 16 pieces: the PTX's wgmma; they
    # measured 3.1x SDPA's time on an H200; these are unmeasured yet). Before Hopper the query stays in
    # registers: the Llama-3-8B shape's spilled 32-84 bytes on sm_80, which keeps 64 by 32.
    tall = hopper and not decode and not wide and head_dim <= 128
    # Under a sliding window, float32 tiles of heads of 65-128 take 16 rows: with 32, since the tiles inside
    # the window run unmasked, ptxas kept the Llama-3-8B shape's to 64 registers on sm_80 (triton 3.8) and
    # spilled 8 bytes (with 16, 60-64 registers on both targets and tritons; Gemma 2's heads of 256 keep 32).
    window_wide = wide and sliding_window and 64 < head_dim <= 128
    block_m = max(block_m or (16 if decode or window_wide else 32 if wide else 128 if tall else 64),
                  triton.next_power_of_2(group), 16)
    block_q = block_m // group
    default_tile_n = 16 if wide and head_dim > 64 else 64 if tall else 32
    merge_last = merge_last and num_splits > 1 and head_dim <= 128 and hopper and not wide
    if decode and fp8_cache and head_dim <= 64:
        # Tiles of 16 fp8 keys for the default model's heads: with 32 or 64 (at 4 warps) triton 3.6 spilled
        # 8 bytes on sm_90, with 8 warps triton 3.8 spilled 4 (compile_kernels.py under each); a GPU sweep
        # should choose among the clean ones.
        default_tile_n = 16
    constants = dict(
        SLIDING_WINDOW=sliding_window or 0,
        GROUP=group, HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=tile_n or max(default_tile_n, block_size),
        NUM_SPLITS=num_splits, DECODE=decode, DOT_FP32=dtype == torch.float32 or _INTERPRETED,
        SOFTCAP=(softcap or 0.0) * LOG2_E, HAS_SINKS=sinks, NEW_KV=new_kv, MERGE_LAST=merge_last,
        num_warps=num_warps or (DECODE_WARPS if decode else PREFILL_WARPS),
    )
    if num_stages is not None:
        constants["num_stages"] = num_stages
    return constants


def _default_splits(query: torch.Tensor, num_seqs: int, num_kv_heads: int, query_len: int | None = None) -> int:
    """Decode batches split on a GPU (and steps of `query_len` tokens a sequence, verifying drafts)."""
    if query.device.type != "cuda" or (query.shape[0] != num_seqs and not query_len):
        return 1
    return decode_splits(num_seqs, num_kv_heads, _multiprocessors(query.device.index))


def verify_steps_split(query_len: int, dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether a step verifying drafts (each sequence padded to the verify length, `query_len`) whose queries
    are `dtype` has its contexts split as a decode batch's: 16-bit over a cache of their own dtype, in the
    prefill tiles as they are. Tiles sized to a sequence's query heads (16 to 64 rows) spilled in some shape
    at some size (Gemma 2's heads of 256 at 64 rows 24-108 bytes, Llama-3-8B's at 16 on sm_80 8, gpt-oss's at
    32 4-8, the default model's at 16 under triton 3.6 4-8), and float32 or fp8 ones split (Gemma 2's 80
    bytes on sm_80: compile_kernels.py)."""
    return query_len > 1 and dtype in (torch.float16, torch.bfloat16) and cache_dtype == dtype


_ARRIVALS: dict[torch.device, torch.Tensor] = {}


def _arrivals(device: torch.device, count: int) -> torch.Tensor:
    """Zeroed int32 counters, one a (query tile, KV head), that each launch leaves zeroed (its last splits
    reset them): kept per device, for launches on one stream at a time. Made at least 4,096 long, so that
    a launch inside a CUDA graph's capture finds them made (split decodes have fewer than 2 programs an SM)."""
    arrivals = _ARRIVALS.get(device)
    if arrivals is None or len(arrivals) < count:
        arrivals = _ARRIVALS[device] = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
    return arrivals


def _new_kv_readable(query, key_cache, new_key, new_value, num_seqs: int, num_splits: int) -> bool:
    """Whether the kernel can read this step's own keys and values from `new_key` and `new_value`: a batch
    of prefill tiles (not decode, not split), keys and values in the query's dtype and the cache's (so that
    they are what the cache holds), 16-bit, on a GPU that takes tensor descriptors (or the interpreter)."""
    if new_key is None or new_value is None or query.shape[0] == num_seqs or num_splits > 1:
        return False
    if not new_key.dtype == new_value.dtype == query.dtype == key_cache.dtype:
        return False
    if not all(_describable(t) for t in (new_key, new_value)):
        return False
    if _INTERPRETED:
        return True
    # 16-bit only: float32 tiles of Gemma 2's heads of 256 spilled 792 bytes (compile_kernels.py, sm_90)
    return (query.device.type == "cuda" and query.dtype in (torch.float16, torch.bfloat16)
            and _capability(query.device.index) >= (9, 0))


def _describable(t: torch.Tensor) -> bool:
    """Whether a tensor descriptor can cover `t`: 16-byte aligned, its rows too, its last dimension dense."""
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(stride * t.element_size() % 16 == 0
                                                                for stride in t.stride()[:-1])


@functools.cache
def _capability(device_index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def _arch(device: torch.device) -> int | None:
    """The GPU's compute capability as attention_meta takes it (90 for 9.0); None under the interpreter."""
    if _INTERPRETED or device.type != "cuda":
        return None
    major, minor = _capability(device.index)
    return major * 10 + minor


@functools.cache
def _multiprocessors(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Prefill tiles read the step's own keys and values from its new ones (tensor descriptors: bulk tensor
# copies on Hopper) rather than gathering them back from the cache. Off until `make bench-kernels --sweep`
# has measured it against the gathered reads on a GPU.
NEW_KV_FOR_PREFILL = False
# Split-KV decode's partial results merged by each tile's last split to finish (an atomic count a tile)
# rather than by a second kernel, whose launch a few-microsecond decode pays. Off until measured too.
MERGE_IN_LAST_SPLIT = False


def paged_attention(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                    sliding_window=None, softcap=None, sinks=None, out=None, block_m: int | None = None,
                    tile_n: int | None = None, num_splits: int | None = None, num_warps: int | None = None,
                    num_stages: int | None = None, new_key=None, new_value=None, new_kv: bool | None = None,
                    merge_last: bool | None = None, num_decodes: int | None = None, query_len: int | None = None):
    """`new_key`, `new_value` [T, Hkv, D]: the step's keys and values (also written into the cache);
    `new_kv`: whether prefill tiles read the step's own from them (None: NEW_KV_FOR_PREFILL, where it can);
    `merge_last`: whether split contexts are merged by their last split (None: MERGE_IN_LAST_SPLIT);
    `num_decodes`: how many sequences lead the batch with one query token each (the engine schedules its
    decodes first). Those are launched as a decode batch of their own (a program a sequence, its context
    split where the batch is small) and the others as prefill tiles, which would give each decode a tile
    of BLOCK_M rows with as many used as the query heads of a KV head; the launch parameters given (block_m
    to num_stages, new_kv) are the tiles'. `query_len`: every sequence has exactly that many query tokens
    (a step verifying drafts, replayed from a CUDA graph: cuda_graphs.uniform_step): its contexts are then
    split as a decode batch's are, from the batch's shape (verify_steps_split)."""
    if out is None:
        out = torch.empty_like(query)
    if query.dtype == torch.float32 and key_cache.dtype != torch.float32 and not _INTERPRETED:
        # over a 16-bit cache, the 16-bit kernel with a float32 output; over fp8, the bfloat16 one
        query = query.to(torch.bfloat16 if key_cache.dtype in FP8_DTYPES else key_cache.dtype)
    d = num_decodes if num_decodes and num_decodes < seq_lens.shape[0] else 0
    if d:
        _launch(query[:d], key_cache, value_cache, cu_seqlens_q[:d + 1], seq_lens[:d], block_tables[:d], scale,
                sliding_window, softcap, sinks, out[:d], new_kv=False, merge_last=merge_last)
        cu_seqlens_q, seq_lens, block_tables = cu_seqlens_q[d:], seq_lens[d:], block_tables[d:]
    if num_splits is None and query_len and not d and verify_steps_split(query_len, query.dtype, key_cache.dtype):
        num_splits = _default_splits(query, seq_lens.shape[0], key_cache.shape[2], query_len)
    return _launch(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_tables, scale, sliding_window,
                   softcap, sinks, out, block_m, tile_n, num_splits, num_warps, num_stages, new_key, new_value,
                   new_kv, merge_last, first_token=d)


def _launch(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_tables, scale, sliding_window, softcap,
            sinks, out, block_m=None, tile_n=None, num_splits=None, num_warps=None, num_stages=None, new_key=None,
            new_value=None, new_kv=None, merge_last=None, first_token: int = 0):
    """One launch of the kernel (and of the split merge, where it splits) over the sequences given: their
    query rows from `first_token` on (cu_seqlens_q starts there; the rows before are left alone). The query
    is in the kernel's dtype already (paged_attention rounds a float32 one over a 16-bit cache, once)."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    if num_splits is None:
        num_splits = _default_splits(query, num_seqs, num_kv_heads)
    wanted, new_kv = new_kv, NEW_KV_FOR_PREFILL if new_kv is None else new_kv
    if new_kv:
        new_kv = _new_kv_readable(query, key_cache, new_key, new_value, num_seqs, num_splits)
        if wanted and not new_kv:
            raise ValueError("new keys and values can be read by whole prefill tiles only, in the query's and "
                             "the cache's 16-bit dtype, on a GPU that takes tensor descriptors (Hopper on)")
    merge_last = MERGE_IN_LAST_SPLIT if merge_last is None else merge_last
    grid, constants = attention_meta(num_tokens, num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                                     query.dtype, sliding_window, block_m, tile_n, num_splits, num_warps, num_stages,
                                     softcap=softcap, sinks=sinks is not None, cache_dtype=key_cache.dtype,
                                     new_kv=new_kv, merge_last=merge_last, arch=_arch(query.device))
    if num_tokens == 0 or num_seqs == 0:
        return out
    assert query.stride(2) == 1 and key_cache.stride(3) == 1 and value_cache.stride(3) == 1
    dim_pad = constants["DIM_PAD"]
    # (int32 counters at every launch, read or not: one type of argument, one compiled variant)
    arrivals = _arrivals(query.device, grid[0] * grid[1] if constants["MERGE_LAST"] else 0)
    if num_splits > 1:  # float32 partial results; the merge writes `out`
        part_out = torch.empty(num_tokens, num_heads, num_splits, dim_pad, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # not written
    if sinks is not None:
        assert sinks.numel() == num_heads and sinks.is_contiguous()
    qk_scale = scale / softcap if softcap is not None else scale * LOG2_E
    new_key_desc = new_value_desc = None
    if new_kv:  # a tile of TILE_N rows of one KV head's keys (or values), padded to DIM_PAD with zeros
        from triton.tools.tensor_descriptor import TensorDescriptor

        tile = [constants["TILE_N"], 1, dim_pad]
        new_key_desc = TensorDescriptor.from_tensor(new_key, tile)
        new_value_desc = TensorDescriptor.from_tensor(new_value, tile)
    _paged_attention_kernel[grid](
        query, key_cache, value_cache, out, part_out, part_lse, arrivals, cu_seqlens_q, seq_lens, block_tables,
        sinks, new_key_desc, new_value_desc, qk_scale, num_seqs, num_heads,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        **constants,
    )
    if num_splits > 1 and not constants["MERGE_LAST"]:
        _merge_splits_kernel[(num_tokens - first_token, num_heads)](
            part_out[first_token:], part_lse[first_token:], out[first_token:], num_heads, out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, HEAD_DIM=head_dim, DIM_PAD=dim_pad)
    return out
