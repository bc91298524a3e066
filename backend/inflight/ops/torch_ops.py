"""Torch implementations of the paged-attention operations: what serves on CPU, and the reference
that the Triton kernels are tested against.

Shapes: query [T, Hq, D] ragged over sequences by cu_seqlens_q [S+1]; key_cache/value_cache
[num_blocks, block_size, Hkv, D]; seq_lens [S] counts each sequence's context plus its new tokens;
block_tables [S, max_blocks].

One-token queries (decodes) are computed together, in groups of similar context length; longer
queries (prefill chunks) one sequence at a time through SDPA. Which cache rows each of them reads is
planned once per step: every layer gets the same metadata tensors, so the plan is reused until they change.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Scatter each token's key and value into its cache slot; slot -1 means no write."""
    num_kv_heads, head_dim = key_cache.shape[2:]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


@dataclass
class _DecodeGroup:
    token_rows: torch.Tensor  # [n] rows of the query
    cache_rows: torch.Tensor  # [n * Hkv * L] rows of the cache viewed as [slots * Hkv, D]
    valid: torch.Tensor  # [n, 1, 1, L] which of the L gathered keys each query may see
    max_len: int


@dataclass
class _Prefill:
    start: int
    q_len: int
    slots: torch.Tensor  # [seq_len] cache slots of the sequence's keys, in order
    mask: torch.Tensor | None  # [q_len, seq_len], None when plain causal


@dataclass
class _Plan:
    inputs: tuple  # the metadata tensors it was made from; held so that their ids stay unique
    decode_groups: list[_DecodeGroup]
    prefills: list[_Prefill]


_last_plan: _Plan | None = None

# A decode group grows while its longest context is at most this factor of its shortest (plus a block):
# more groups compute less padding but cost more launches.
_GROUP_SPREAD = 1.5


def _slots(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot of each position; `positions` is [rows, n] and `block_tables` has one row per row."""
    blocks = torch.gather(block_tables, 1, torch.div(positions, block_size, rounding_mode="floor"))
    return blocks * block_size + positions % block_size


def _make_plan(cu_seqlens_q, seq_lens, block_tables, block_size, num_kv_heads, sliding_window) -> _Plan:
    device = seq_lens.device
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    decodes = sorted((lens[i], i) for i in range(len(lens)) if cu[i + 1] - cu[i] == 1)
    groups = []
    start = 0
    while start < len(decodes):
        end = start + 1
        limit = decodes[start][0] * _GROUP_SPREAD + block_size
        while end < len(decodes) and decodes[end][0] <= limit:
            end += 1
        seqs = torch.tensor([i for _, i in decodes[start:end]], device=device)
        max_len = decodes[end - 1][0]
        group_lens = seq_lens[seqs]
        positions = torch.arange(max_len, device=device)[None, :].expand(len(seqs), max_len)
        valid = positions < group_lens[:, None]
        if sliding_window is not None:
            valid &= (group_lens[:, None] - 1) - positions < sliding_window
        # Padding reads slot 0 of a real block; its scores are masked out.
        slots = _slots(block_tables[seqs], torch.where(valid, positions, 0), block_size)
        heads = torch.arange(num_kv_heads, device=device)[None, :, None]
        cache_rows = (slots[:, None, :] * num_kv_heads + heads).reshape(-1)
        groups.append(_DecodeGroup(cu_seqlens_q[seqs], cache_rows, valid[:, None, None, :], max_len))
        start = end
    prefills = []
    for i, seq_len in enumerate(lens):
        q_len = cu[i + 1] - cu[i]
        if q_len <= 1:
            continue
        positions = torch.arange(seq_len, device=device)
        slots = _slots(block_tables[i:i + 1], positions[None], block_size)[0]
        context = seq_len - q_len
        mask = None
        if context or sliding_window is not None:
            q_pos = torch.arange(context, seq_len, device=device)[:, None]
            mask = positions[None, :] <= q_pos
            if sliding_window is not None:
                mask &= q_pos - positions[None, :] < sliding_window
        prefills.append(_Prefill(cu[i], q_len, slots, mask))
    return _Plan((cu_seqlens_q, seq_lens, block_tables, sliding_window), groups, prefills)


def _plan_for(cu_seqlens_q, seq_lens, block_tables, block_size, num_kv_heads, sliding_window) -> _Plan:
    global _last_plan
    plan = _last_plan
    if plan is None or not (plan.inputs[0] is cu_seqlens_q and plan.inputs[1] is seq_lens
                            and plan.inputs[2] is block_tables and plan.inputs[3] == sliding_window):
        plan = _last_plan = _make_plan(cu_seqlens_q, seq_lens, block_tables, block_size, num_kv_heads,
                                       sliding_window)
    return plan


def paged_attention(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                    sliding_window=None, out=None):
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1:3]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    plan = _plan_for(cu_seqlens_q, seq_lens, block_tables, block_size, num_kv_heads, sliding_window)

    flat_k, flat_v = key_cache.view(-1, head_dim), value_cache.view(-1, head_dim)
    for g in plan.decode_groups:
        n = len(g.token_rows)
        k = flat_k.index_select(0, g.cache_rows).view(n * num_kv_heads, g.max_len, head_dim).float()
        v = flat_v.index_select(0, g.cache_rows).view(n * num_kv_heads, g.max_len, head_dim).float()
        q = query[g.token_rows].float().view(n * num_kv_heads, group, head_dim)
        scores = torch.bmm(q, k.transpose(1, 2)).mul_(scale).view(n, num_kv_heads, group, g.max_len)
        scores.masked_fill_(~g.valid, float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(n * num_kv_heads, group, g.max_len)
        out[g.token_rows] = torch.bmm(probs, v).view(n, num_heads, head_dim).to(out.dtype)

    slot_k = key_cache.view(-1, num_kv_heads, head_dim)
    slot_v = value_cache.view(-1, num_kv_heads, head_dim)
    for p in plan.prefills:
        k = slot_k[p.slots].transpose(0, 1).float()  # [Hkv, L, D]
        v = slot_v[p.slots].transpose(0, 1).float()
        q = query[p.start:p.start + p.q_len].transpose(0, 1).float()  # [Hq, q_len, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=p.mask, is_causal=p.mask is None, scale=scale,
                                           enable_gqa=num_heads != num_kv_heads)
        out[p.start:p.start + p.q_len] = o.transpose(0, 1).to(out.dtype)
    return out
