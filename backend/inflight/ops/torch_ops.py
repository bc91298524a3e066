"""Torch implementations of the paged-attention operations: what serves on CPU, and the reference
that the Triton kernels are tested against.

Shapes: query [T, Hq, D] ragged over sequences by cu_seqlens_q [S+1]; key_cache/value_cache
[num_blocks, block_size, Hkv, D]; seq_lens [S] counts each sequence's context plus its new tokens;
block_tables [S, max_blocks].

The cache's dtype may differ from the query's (`kv_cache_dtype`): keys and values are stored rounded to
it (fp8 saturated: `stored`) and computed with in float32.

Two options of some models' attention: `softcap` (Gemma 2) bounds each scaled score to (-softcap,
softcap) by softcap * tanh(score / softcap); `sinks` (gpt-oss), one logit per query head, take a share of
each softmax's denominator as a key whose value is zero would.

Decodes (one generated token a sequence: the batch's first `num_decodes` sequences, or where that is
not given every one-token query) are computed together: on a CPU with a float32, bfloat16 or fp8 cache
(head_dim up to 256) all at once straight from the cache by a C kernel (`cpu_kernels.py`: nothing
gathered, every cached row read once), elsewhere (a float16 cache, CUDA tensors, no C compiler) in
groups of similar context length whose keys and values are gathered first.
The others (prefill chunks, a prompt's last token computed alone among them, so that its result does
not depend on how the engine cut the prompt): on a CPU likewise all at once by the C prefill kernel,
which gives a token the bits the decode kernel gives it (cpu_attention_tiles.h), elsewhere one sequence
at a time through SDPA. Which cache rows each of them reads is planned once per step: every layer gets
the same metadata tensors, so the plan is reused until they change.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import cpu_kernels


_last_kept: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (slot_mapping, its rows to write or None)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def stored(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Keys or values as the cache holds them: rounded to its dtype; to fp8 saturated at its largest
    finite value (torch's conversion gives NaN for e4m3 or infinity for e5m2 beyond it, depending on the
    version and device), unscaled, as vLLM's fp8 caches with their default scale of 1."""
    if cache_dtype in FP8_DTYPES:
        largest = torch.finfo(cache_dtype).max
        return x.clamp(-largest, largest).to(cache_dtype)
    return x.to(cache_dtype)


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
    for new, cache in ((key, key_cache), (value, value_cache)):
        new = stored(new, cache.dtype)
        if cache.dtype in FP8_DTYPES:  # (torch has no index_copy_ for them: as bytes)
            new, cache = new.view(torch.uint8), cache.view(torch.uint8)
        cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, new)


@dataclass
class _DecodeGroup:
    token_rows: torch.Tensor  # [n] rows of the query
    cache_rows: torch.Tensor  # [n * Hkv * L] rows of the cache viewed as [slots * Hkv, D]
    valid: torch.Tensor  # [n, 1, 1, L] which of the L gathered keys each query may see
    max_len: int


@dataclass
class _KernelDecodes:
    """Every decode of the step for the C kernel: decode i is query row token_rows[i], block-table row
    table_rows[i], visible positions [starts[i], ends[i])."""

    token_rows: torch.Tensor
    table_rows: torch.Tensor
    starts: torch.Tensor
    ends: torch.Tensor
    block_tables: torch.Tensor  # int64, unit column stride


@dataclass
class _KernelPrefills:
    """Every prefill chunk of the step for the C kernel: chunk i is query rows [q_starts[i], q_starts[i] +
    q_lens[i]), the last of its seq_lens[i] positions, block-table row table_rows[i]."""

    table_rows: torch.Tensor
    q_starts: torch.Tensor
    q_lens: torch.Tensor
    seq_lens: torch.Tensor
    token_rows: torch.Tensor  # every query row of the chunks
    block_tables: torch.Tensor  # int64, unit column stride


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
    kernel_decodes: _KernelDecodes | None
    prefills: list[_Prefill]
    kernel_prefills: _KernelPrefills | None


_last_plan: _Plan | None = None  # the latest call's
# A few recent plans, the newest last: within a step, the layers of a hybrid model read their own group's
# block tables (hybrid_blocks.py) and alternating layers their own window, each a plan of its own, which
# layers in turn find again here instead of making it anew (Gemma 3: five switches a step of 30 layers).
_recent_plans: list[_Plan] = []
_RECENT_PLANS = 8

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


def _int64_tables(block_tables: torch.Tensor) -> torch.Tensor:
    if block_tables.dtype != torch.int64 or block_tables.stride(-1) != 1:
        return block_tables.to(torch.int64).contiguous()
    return block_tables


def _kernel_decodes(seqs, cu_seqlens_q, seq_lens, block_tables, sliding_window) -> _KernelDecodes:
    seqs = torch.tensor(seqs, device=seq_lens.device)
    ends = seq_lens[seqs].long()
    visible = ends if sliding_window is None else ends.clamp(max=sliding_window)
    return _KernelDecodes(cu_seqlens_q[seqs].long(), seqs, ends - visible, ends, _int64_tables(block_tables))


def _kernel_prefills(seqs: list[int], cu: list[int], lens: list[int], block_tables) -> _KernelPrefills:
    q_starts = [cu[i] for i in seqs]
    q_lens = [cu[i + 1] - cu[i] for i in seqs]
    token_rows = torch.cat([torch.arange(start, start + n) for start, n in zip(q_starts, q_lens)])
    return _KernelPrefills(torch.tensor(seqs), torch.tensor(q_starts), torch.tensor(q_lens),
                           torch.tensor([lens[i] for i in seqs]), token_rows, _int64_tables(block_tables))


def _make_plan(cu_seqlens_q, seq_lens, block_tables, block_size, num_heads, num_kv_heads, token_bytes,
               decode_kernel, prefill_kernel, sliding_window, num_decodes) -> _Plan:
    """`token_bytes`: the key bytes of one token, all its KV heads; `decode_kernel`, `prefill_kernel`:
    decodes, prefill chunks through the C kernels; `num_decodes`: paged_attention's."""
    device = seq_lens.device
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    is_decode = [cu[i + 1] - cu[i] == 1 and (num_decodes is None or i < num_decodes) for i in range(len(lens))]
    decodes = sorted((lens[i], i) for i in range(len(lens)) if is_decode[i])
    kernel_decodes = None
    if decode_kernel and decodes:
        kernel_decodes = _kernel_decodes([i for _, i in decodes], cu_seqlens_q, seq_lens, block_tables, sliding_window)
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
    chunks = [i for i in range(len(lens)) if not is_decode[i]]
    if prefill_kernel and chunks:
        kernel_prefills, chunks = _kernel_prefills(chunks, cu, lens, block_tables), []
    else:
        kernel_prefills = None
    for i in chunks:
        seq_len, q_len = lens[i], cu[i + 1] - cu[i]
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
    return _Plan((cu_seqlens_q, seq_lens, block_tables, sliding_window, decode_kernel, prefill_kernel, num_decodes),
                 groups, kernel_decodes, prefills, kernel_prefills)


def _plan_for(query, key_cache, cu_seqlens_q, seq_lens, block_tables, sliding_window, num_decodes) -> _Plan:
    global _last_plan
    num_heads, head_dim = query.shape[1:]
    c_kernels = (query.device.type == "cpu" and key_cache.dtype in cpu_kernels.CACHE_DTYPES
                 and head_dim <= cpu_kernels.MAX_HEAD_DIM)
    decode_kernel = c_kernels and cpu_kernels.decode_attention() is not None
    prefill_kernel = c_kernels and cpu_kernels.prefill_attention() is not None
    options = (sliding_window, decode_kernel, prefill_kernel, num_decodes)
    for plan in reversed(_recent_plans):
        if (plan.inputs[0] is cu_seqlens_q and plan.inputs[1] is seq_lens and plan.inputs[2] is block_tables
                and plan.inputs[3:] == options):
            break
    else:
        block_size, num_kv_heads = key_cache.shape[1:3]
        token_bytes = num_kv_heads * head_dim * key_cache.element_size()
        plan = _make_plan(cu_seqlens_q, seq_lens, block_tables, block_size, num_heads, num_kv_heads, token_bytes,
                          decode_kernel, prefill_kernel, sliding_window, num_decodes)
        _recent_plans.append(plan)
        del _recent_plans[:-_RECENT_PLANS]
    _last_plan = plan
    return plan


def _probabilities(scores: torch.Tensor, visible: torch.Tensor | None, softcap: float | None,
                   sinks: torch.Tensor | None) -> torch.Tensor:
    """The softmax over the last axis of float32 `scores` (scaled) with the model's softcap and sinks (shaped
    to broadcast with one column of `scores`); `visible`: where keys may be seen, broadcast likewise."""
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def paged_attention(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                    sliding_window=None, softcap=None, sinks=None, out=None, num_decodes=None):
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1:3]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    plan = _plan_for(query, key_cache, cu_seqlens_q, seq_lens, block_tables, sliding_window, num_decodes)

    flat_k, flat_v = key_cache.view(-1, head_dim), value_cache.view(-1, head_dim)
    if plan.kernel_decodes is not None:
        d = plan.kernel_decodes
        cpu_kernels.run_decode_attention(cpu_kernels.decode_attention(), query.contiguous(), d.token_rows,
                                         key_cache.contiguous(), value_cache.contiguous(), d.block_tables,
                                         d.table_rows, d.starts, d.ends, scale, softcap, sinks, out)
    for g in plan.decode_groups:
        n = len(g.token_rows)
        k = flat_k.index_select(0, g.cache_rows).view(n * num_kv_heads, g.max_len, head_dim).float()
        v = flat_v.index_select(0, g.cache_rows).view(n * num_kv_heads, g.max_len, head_dim).float()
        q = query[g.token_rows].float().view(n * num_kv_heads, group, head_dim)
        scores = torch.bmm(q, k.transpose(1, 2)).mul_(scale).view(n, num_kv_heads, group, g.max_len)
        group_sinks = None if sinks is None else sinks.view(1, num_kv_heads, group, 1)
        probs = _probabilities(scores, g.valid, softcap, group_sinks).view(n * num_kv_heads, group, g.max_len)
        out[g.token_rows] = torch.bmm(probs, v).view(n, num_heads, head_dim).to(out.dtype)

    if plan.kernel_prefills is not None:
        p = plan.kernel_prefills
        cpu_kernels.run_prefill_attention(cpu_kernels.prefill_attention(), query, key_cache.contiguous(),
                                          value_cache.contiguous(), p.block_tables, p.table_rows, p.q_starts,
                                          p.q_lens, p.seq_lens, p.token_rows, sliding_window, scale, softcap, sinks,
                                          out)
    for p in plan.prefills:
        _attend_rows(out, query, p.start, p.q_len, key_cache, value_cache, p.slots, p.mask, scale, softcap, sinks)
    return out


def _attend_rows(out, query, start: int, q_len: int, key_cache, value_cache, slots, mask, scale, softcap, sinks):
    """Rows [start, start + q_len) of `out`: those query rows over the keys and values of the cache's `slots`,
    where `mask` [q_len, len(slots)] lets them see (None: causal, the rows being the slots' last ones)."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    # Batched 4-D inputs: on a CPU, SDPA takes its fused (flash) kernel only for those; 3-D ones go to the
    # math path, which materializes every score (2-3x slower for a 512-token chunk).
    k, v = (cache.view(-1, num_kv_heads, head_dim)[slots].transpose(0, 1)[None].float()  # [1, Hkv, L, D]
            for cache in (key_cache, value_cache))
    q = query[start:start + q_len].transpose(0, 1)[None].float()  # [1, Hq, q_len, D]
    if softcap is None and sinks is None:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                           enable_gqa=num_heads != num_kv_heads)
    else:  # SDPA has neither: every score materialized
        k, v = (x.repeat_interleave(num_heads // num_kv_heads, dim=1) for x in (k, v))
        visible = mask if mask is not None else torch.ones(q_len, q_len, dtype=torch.bool, device=q.device).tril()
        head_sinks = None if sinks is None else sinks.view(1, num_heads, 1, 1)
        o = _probabilities(q @ k.transpose(-1, -2) * scale, visible, softcap, head_sinks) @ v
    out[start:start + q_len] = o[0].transpose(0, 1).to(out.dtype)


def attend_within_spans(out, query, key_cache, value_cache, block_tables, spans, scale, sliding_window=None,
                        softcap=None, sinks=None, past_window=False) -> None:
    """The rows of `out` of spans of tokens that see each other (a Gemma 3 image's, a PaliGemma prompt),
    computed again after the causal attention: each token sees the keys before it and every key of its span,
    those after it too. A sliding window bounds what it sees back from it (Gemma 3, HF's mask AND(window,
    OR(causal, span))), or only what it sees before its span (`past_window`: PaliGemma, OR(AND(window,
    causal), span)). `spans` [N, 4]: (block-table row, the query row of the span's first token, its first and
    end positions), each span's keys already in the cache. On any device (the kernels know no spans): a few
    images' worth a step at most, through SDPA with the span's mask."""
    block_size = key_cache.shape[1]
    for seq, row, start, end in spans.tolist():
        first = 0 if sliding_window is None else max(0, start - sliding_window + 1)
        positions = torch.arange(first, end, device=query.device)
        q_pos = positions[start - first:, None]
        causal = positions <= q_pos
        if sliding_window is not None:
            causal &= positions > q_pos - sliding_window
        visible = causal | (positions >= start)
        if sliding_window is not None and not past_window:
            visible &= positions > q_pos - sliding_window
        _attend_rows(out, query, row, end - start, key_cache, value_cache,
                     _slots(block_tables, seq, positions, block_size), visible, scale, softcap, sinks)
