"""Torch implementations of the paged-attention operations: what serves on CPU, and the reference
that the Triton kernels are tested against.

Shapes: query [T, Hq, D] ragged over sequences by cu_seqlens_q [S+1]; key_cache/value_cache
[num_blocks, block_size, Hkv, D]; seq_lens [S] counts each sequence's context plus its new tokens;
block_tables [S, max_blocks].

One-token queries (decodes) are computed together: on a CPU in float32 all at once straight from the
cache (sparse sampled matmul for the scores, embedding_bag for the weighted sum of values: nothing is
gathered), elsewhere in groups of similar context length whose keys and values are gathered first.
Longer queries (prefill chunks) run one sequence at a time through SDPA. Which cache rows each of them reads is
planned once per step: every layer gets the same metadata tensors, so the plan is reused until they change.
"""

from dataclasses import dataclass

import warnings

import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")


_last_kept: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (slot_mapping, its rows to write or None)


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Scatter each token's key and value into its cache slot; slot -1 means no write."""
    global _last_kept
    num_kv_heads, head_dim = key_cache.shape[2:]
    if _last_kept is None or _last_kept[0] is not slot_mapping:  # once a step, not once a layer
        keep = slot_mapping >= 0
        _last_kept = (slot_mapping, None if bool(keep.all()) else keep)
    keep = _last_kept[1]
    if keep is not None:
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
class _RaggedDecodes:
    """Every decode of the step as one sparse pattern: row (token, query head) lists the cache rows
    (slot * Hkv + KV head, of the cache viewed as [slots * Hkv, D]) of the keys that query sees."""

    token_rows: torch.Tensor  # [n] rows of the query
    pattern: torch.Tensor  # sparse CSR [n * Hq, slots * Hkv], zero values
    offsets: torch.Tensor  # [n * Hq] where each row's entries start
    cache_rows: torch.Tensor  # [E] every row's entries, in order
    padded_at: torch.Tensor  # [E] each entry's place in a dense [n * Hq, max_len] score matrix
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
    ragged_decodes: _RaggedDecodes | None
    prefills: list[_Prefill]


_last_plan: _Plan | None = None

# A decode group grows while its longest context is at most this factor of its shortest (plus a block):
# more groups compute less padding but cost more launches.
_GROUP_SPREAD = 1.5
# ... and while its gathered keys stay under this many bytes: below the size glibc serves from the heap
# (cpu_runtime.py), so that no step faults the pages of a fresh mapping in.
_GROUP_BYTES = 16 << 20


def _slots(block_tables: torch.Tensor, seqs, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot of each position of sequence `seqs` (an index or a tensor broadcast with `positions`)."""
    blocks = block_tables[seqs, torch.div(positions, block_size, rounding_mode="floor")]
    return blocks * block_size + positions % block_size


def _ragged_decodes(seqs, cu_seqlens_q, seq_lens, block_tables, block_size, num_heads, num_kv_heads,
                    cache_rows_total, sliding_window) -> _RaggedDecodes:
    seqs = torch.tensor(seqs, device=seq_lens.device)
    lens = seq_lens[seqs]
    visible = lens if sliding_window is None else lens.clamp(max=sliding_window)
    row_lens = visible.repeat_interleave(num_heads)  # rows are (sequence, query head)
    offsets = F.pad(torch.cumsum(row_lens, 0), (1, 0))
    row_of = torch.arange(len(row_lens), device=seqs.device).repeat_interleave(row_lens)
    within = torch.arange(len(row_of), device=seqs.device) - offsets[row_of]
    seq = row_of // num_heads
    positions = within + (lens - visible)[seq]
    slots = _slots(block_tables, seqs[seq], positions, block_size)
    kv_head = (row_of % num_heads) // (num_heads // num_kv_heads)
    cache_rows = slots * num_kv_heads + kv_head
    pattern = torch.sparse_csr_tensor(offsets, cache_rows, torch.zeros(len(cache_rows), device=seqs.device),
                                      size=(len(row_lens), cache_rows_total), check_invariants=False)
    max_len = int(visible.max())
    return _RaggedDecodes(cu_seqlens_q[seqs], pattern, offsets[:-1], cache_rows, row_of * max_len + within, max_len)


def _make_plan(cu_seqlens_q, seq_lens, block_tables, block_size, num_heads, num_kv_heads, token_bytes,
               cache_rows_total, ragged, sliding_window) -> _Plan:
    """`token_bytes`: the key bytes of one token, all its KV heads; `ragged`: decodes as one sparse pattern."""
    device = seq_lens.device
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    decodes = sorted((lens[i], i) for i in range(len(lens)) if cu[i + 1] - cu[i] == 1)
    ragged_decodes = None
    if ragged and decodes:
        ragged_decodes = _ragged_decodes([i for _, i in decodes], cu_seqlens_q, seq_lens, block_tables, block_size,
                                         num_heads, num_kv_heads, cache_rows_total, sliding_window)
        decodes = []
    groups = []
    start = 0
    while start < len(decodes):
        end = start + 1
        limit = decodes[start][0] * _GROUP_SPREAD + block_size
        while (end < len(decodes) and decodes[end][0] <= limit
               and (end + 1 - start) * decodes[end][0] * token_bytes <= _GROUP_BYTES):
            end += 1
        seqs = torch.tensor([i for _, i in decodes[start:end]], device=device)
        max_len = decodes[end - 1][0]
        group_lens = seq_lens[seqs]
        positions = torch.arange(max_len, device=device)[None, :].expand(len(seqs), max_len)
        valid = positions < group_lens[:, None]
        if sliding_window is not None:
            valid &= (group_lens[:, None] - 1) - positions < sliding_window
        # Padding reads slot 0 of a real block; its scores are masked out.
        slots = _slots(block_tables, seqs[:, None], torch.where(valid, positions, 0), block_size)
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
        slots = _slots(block_tables, i, positions, block_size)
        context = seq_len - q_len
        mask = None
        if context or sliding_window is not None:
            q_pos = torch.arange(context, seq_len, device=device)[:, None]
            mask = positions[None, :] <= q_pos
            if sliding_window is not None:
                mask &= q_pos - positions[None, :] < sliding_window
        prefills.append(_Prefill(cu[i], q_len, slots, mask))
    return _Plan((cu_seqlens_q, seq_lens, block_tables, sliding_window, ragged), groups, ragged_decodes, prefills)


def _plan_for(query, key_cache, cu_seqlens_q, seq_lens, block_tables, sliding_window) -> _Plan:
    global _last_plan
    # sampled_addmm takes float32 and float64 only; elsewhere the keys are gathered and upcast.
    ragged = query.device.type == "cpu" and query.dtype == key_cache.dtype == torch.float32
    plan = _last_plan
    if plan is None or not (plan.inputs[0] is cu_seqlens_q and plan.inputs[1] is seq_lens
                            and plan.inputs[2] is block_tables and plan.inputs[3:] == (sliding_window, ragged)):
        num_heads, head_dim = query.shape[1:]
        num_blocks, block_size, num_kv_heads = key_cache.shape[:3]
        token_bytes = num_kv_heads * head_dim * key_cache.element_size()
        plan = _last_plan = _make_plan(cu_seqlens_q, seq_lens, block_tables, block_size, num_heads, num_kv_heads,
                                       token_bytes, num_blocks * block_size * num_kv_heads, ragged, sliding_window)
    return plan


def _attend_ragged(d: _RaggedDecodes, query, flat_k, flat_v, scale, out) -> None:
    rows, head_dim = d.pattern.shape[0], query.shape[-1]
    q = query[d.token_rows].reshape(rows, head_dim)
    scores = torch.sparse.sampled_addmm(d.pattern, q, flat_k.t(), beta=0.0, alpha=scale).values()
    # Softmax per row over a dense padded copy of the scores (a few MB): faster than segment reductions.
    padded = torch.full((rows * d.max_len,), float("-inf"), device=q.device)
    padded[d.padded_at] = scores
    probs = torch.softmax(padded.view(rows, d.max_len), dim=-1).view(-1)[d.padded_at]
    weighted = F.embedding_bag(d.cache_rows, flat_v, d.offsets, mode="sum", per_sample_weights=probs)
    out[d.token_rows] = weighted.view(len(d.token_rows), -1, head_dim).to(out.dtype)


def paged_attention(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                    sliding_window=None, out=None):
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1:3]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    plan = _plan_for(query, key_cache, cu_seqlens_q, seq_lens, block_tables, sliding_window)

    flat_k, flat_v = key_cache.view(-1, head_dim), value_cache.view(-1, head_dim)
    if plan.ragged_decodes is not None:
        _attend_ragged(plan.ragged_decodes, query, flat_k, flat_v, scale, out)
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
