"""Torch implementations of the paged-attention operations: what serves on CPU, and the reference
that the Triton kernels are tested against.

Shapes: query [T, Hq, D] ragged over sequences by cu_seqlens_q [S+1]; key_cache/value_cache
[num_blocks, block_size, Hkv, D]; seq_lens [S] counts each sequence's context plus its new tokens;
block_tables [S, max_blocks].
"""

import torch
import torch.nn.functional as F


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Scatter each token's key and value into its cache slot; slot -1 means no write."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def _slots(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot of each position; `positions` is [rows, n] and `block_tables` has one row per row."""
    blocks = torch.gather(block_tables, 1, torch.div(positions, block_size, rounding_mode="floor"))
    return blocks * block_size + positions % block_size


def paged_attention(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                    sliding_window=None, out=None):
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    if out is None:
        out = torch.empty_like(query)
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    starts = cu_seqlens_q[:-1].tolist()
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    if decode:
        _decode_batch(query, key_cache, value_cache, seq_lens, block_tables, scale, sliding_window, out,
                      torch.tensor(decode, device=query.device), cu_seqlens_q)
    flat_k = key_cache.view(-1, num_kv_heads, head_dim)
    flat_v = value_cache.view(-1, num_kv_heads, head_dim)
    lens = seq_lens.tolist()
    for i, q_len in enumerate(q_lens):
        if q_len <= 1:
            continue
        seq_len, start = lens[i], starts[i]
        positions = torch.arange(seq_len, device=query.device)
        slots = _slots(block_tables[i:i + 1], positions[None], block_size)[0]
        k = flat_k[slots].transpose(0, 1)  # [Hkv, L, D]
        v = flat_v[slots].transpose(0, 1)
        q = query[start:start + q_len].transpose(0, 1)  # [Hq, q_len, D]
        context = seq_len - q_len
        if context == 0 and sliding_window is None:
            mask, causal = None, True
        else:
            q_pos = torch.arange(context, seq_len, device=query.device)[:, None]
            mask = positions[None, :] <= q_pos
            if sliding_window is not None:
                mask &= q_pos - positions[None, :] < sliding_window
            causal = False
        o = F.scaled_dot_product_attention(q.to(torch.float32), k.to(torch.float32), v.to(torch.float32),
                                           attn_mask=mask, is_causal=causal, scale=scale,
                                           enable_gqa=num_heads != num_kv_heads)
        out[start:start + q_len] = o.transpose(0, 1).to(out.dtype)
    return out


def _decode_batch(query, key_cache, value_cache, seq_lens, block_tables, scale, sliding_window, out,
                  rows, cu_seqlens_q):
    """All one-token queries at once: gather each sequence's keys into a padded [S, L, Hkv, D] tile."""
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    lens = seq_lens[rows]
    max_len = int(lens.max())
    positions = torch.arange(max_len, device=query.device)[None, :].expand(len(rows), max_len)
    valid = positions < lens[:, None]
    if sliding_window is not None:
        valid &= (lens[:, None] - 1) - positions < sliding_window
    # Padding reads slot 0 of a real block; its scores are masked out below.
    slots = _slots(block_tables[rows], torch.where(valid, positions, 0), block_size)
    k = key_cache.view(-1, num_kv_heads, head_dim)[slots].to(torch.float32)  # [S, L, Hkv, D]
    v = value_cache.view(-1, num_kv_heads, head_dim)[slots].to(torch.float32)
    token_rows = cu_seqlens_q[rows]
    q = query[token_rows].to(torch.float32).view(len(rows), num_kv_heads, group, head_dim)
    scores = torch.einsum("shgd,slhd->shgl", q, k) * scale
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    o = torch.einsum("shgl,slhd->shgd", probs, v)
    out[token_rows] = o.reshape(len(rows), num_heads, head_dim).to(out.dtype)
