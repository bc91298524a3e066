"""Triton-language kernels for the paged KV cache.

`paged_attention` is one launch for a ragged mix of prefill chunks and decodes, in the manner of
vLLM's unified attention (ideas only, the code is ours): a program takes a tile of BLOCK_Q query tokens
of one sequence times the query heads that share one KV head (packed into BLOCK_M rows, so GQA reads
each key once per group), walks that sequence's keys tile by tile through its block table, and keeps
an online softmax in float32. Programs are laid out per sequence at `cu_seqlens_q[s] // BLOCK_Q + s`,
so each finds its sequence by a binary search, with no host-side work per step.

The softmax and accumulators are float32; the matmuls take 16-bit inputs as they are on a GPU, and
float32 everywhere under the interpreter (TRITON_INTERPRET=1), which computes bfloat16 wrongly.
"""

import os

import torch
import triton
import triton.language as tl

# The interpreter computes 16-bit (bfloat16 above all) arithmetic wrongly: there, everything is float32.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
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
    key = key.to(key_cache.dtype)
    value = value.to(value_cache.dtype)
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
def _paged_attention_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, out_ptr,
    cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr,
    scale, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head,
    stride_bt,
    SLIDING_WINDOW: tl.constexpr,  # 0: none
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    DOT_FP32: tl.constexpr,  # float32 matmuls (float32 inputs, or the interpreter); else 16-bit
):
    q_tile = tl.program_id(0)
    kv_head = tl.program_id(1)

    # The sequence this tile belongs to: the last s with cu_seqlens_q[s] // BLOCK_Q + s <= q_tile.
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
    if first_q >= q_len:
        return  # a gap between two sequences' tiles
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = first_q + rows // GROUP_PAD  # query token within the sequence's new tokens
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (q_idx < q_len) & (rows % GROUP_PAD < GROUP)
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q_tok = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + q_tok[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    q_pos = context + q_idx

    # Keys this tile can see: causal up to its last query; a sliding window also bounds the start.
    kv_end = tl.minimum(seq_len, context + first_q + BLOCK_Q)
    kv_start = 0
    if SLIDING_WINDOW > 0:
        kv_start = tl.maximum(0, context + first_q - SLIDING_WINDOW + 1) // TILE_N * TILE_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(kv_start, kv_end, TILE_N):
        keys = n0 + tl.arange(0, TILE_N)
        key_ok = keys < kv_end
        block = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot = keys % BLOCK_SIZE
        k = tl.load(key_cache_ptr + block[None, :] * stride_kc_block + slot[None, :] * stride_kc_slot
                    + kv_head * stride_kc_head + dims[:, None],
                    mask=dim_ok[:, None] & key_ok[None, :], other=0.0)  # [DIM_PAD, TILE_N]
        if DOT_FP32:
            s = tl.dot(q, k.to(tl.float32), input_precision="ieee") * scale
        else:
            s = tl.dot(q, k) * scale  # 16-bit inputs, float32 accumulation
        allowed = key_ok[None, :] & (keys[None, :] <= q_pos[:, None])
        if SLIDING_WINDOW > 0:
            allowed = allowed & (q_pos[:, None] - keys[None, :] < SLIDING_WINDOW)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(value_cache_ptr + block[:, None] * stride_vc_block + slot[:, None] * stride_vc_slot
                    + kv_head * stride_vc_head + dims[None, :],
                    mask=key_ok[:, None] & dim_ok[None, :], other=0.0)  # [TILE_N, DIM_PAD]
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + q_tok[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def attention_meta(num_tokens: int, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                   block_size: int, dtype: torch.dtype, sliding_window: int | None = None,
                   block_m: int | None = None, tile_n: int | None = None) -> tuple[tuple[int, int], dict]:
    """The launch grid and compile-time constants (with num_warps) of `_paged_attention_kernel` for
    one batch."""
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    # Decode-only batches waste rows on a tall tile; prefill-heavy ones want it tall. Compiled float32
    # tiles take twice the registers: they get half the rows and more warps (no spills on sm_80/sm_90,
    # scripts/compile_kernels.py shows it).
    wide = dtype == torch.float32 and not _INTERPRETED
    block_m = max(block_m or (16 if num_tokens == num_seqs else 32 if wide else 64), group_pad, 16)
    block_q = block_m // group_pad
    constants = dict(
        SLIDING_WINDOW=sliding_window or 0,
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=tile_n or max(32, block_size),
        DOT_FP32=dtype == torch.float32 or _INTERPRETED,
        num_warps=8 if head_dim > 64 or wide else 4,
    )
    return (num_tokens // block_q + num_seqs, num_kv_heads), constants


def paged_attention(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                    sliding_window=None, out=None, block_m: int | None = None, tile_n: int | None = None):
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    grid, constants = attention_meta(num_tokens, num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                                     query.dtype, sliding_window, block_m, tile_n)
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    assert query.stride(2) == 1 and key_cache.stride(3) == 1 and value_cache.stride(3) == 1
    _paged_attention_kernel[grid](
        query, key_cache, value_cache, out, cu_seqlens_q, seq_lens, block_tables,
        scale, num_seqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        **constants,
    )
    return out
