"""Top-p's cut on a GPU without sorting the vocabulary: a Triton kernel, one program a row.

A row's cut is the largest logit c whose tokens at or above it hold top_p of the mass: exactly the
smallest logit the sorted definition keeps (a token is dropped when those ranked above it hold top_p;
ties with the cut are kept). Sorting every row for it took two segmented radix sorts, 1.6 ms a step of
128 rows of a 128k vocabulary on an H200 (the sampler's largest kernel time). Here each program finds its
row's cut by searching the logits' order-preserving integer keys 16 ways at a time: a pass over the row
sums the mass at or above 15 pivots at once and keeps the sixteenth of the range that holds the cut, so
eight passes settle 32 bits, plus one for the row's log-sum-exp: 9 reads of the row, no sort, no sync.
"""

import torch
import triton
import triton.language as tl

# Logits a program reads at once, the ways each pass splits the range of keys, and warps: a logit a
# thread, its 16 running sums in 64 registers on sm_80 and sm_90, no spills (scripts/compile_kernels.py,
# triton 3.8; 8 warps over 512 or 1,024 logits spilled 12-16 bytes on sm_90). 16 warps, as the program
# is alone on its SM at the batches it serves (a row each; more rows than SMs queue).
LAUNCH = dict(BLOCK=512, PIVOTS=16, num_warps=16)


@triton.jit
def _keys(x):
    """float32 logits to int32 keys in the same order (negative floats' magnitude bits flipped)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _top_p_cut_kernel(logits_ptr, top_p_ptr, cut_ptr, vocab, stride_row,
                      BLOCK: tl.constexpr, PIVOTS: tl.constexpr):
    row = tl.program_id(0)
    top_p = tl.load(top_p_ptr + row)
    logits = logits_ptr + row.to(tl.int64) * stride_row
    cols = tl.arange(0, BLOCK)
    # The row's log-sum-exp (online: a running maximum, and the sum rescaled when it rises).
    row_max = tl.full([BLOCK], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        x = tl.load(logits + start + cols, mask=start + cols < vocab, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(row_max, x)
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)
        row_sum = row_sum * tl.exp(row_max - safe) + tl.exp(x - safe)
        row_max = new_max
    top = tl.max(row_max, 0)
    log_total = top + tl.log(tl.sum(row_sum * tl.exp(row_max - top), 0))
    # Invariant: the mass at or above key lo reaches top_p, the mass above hi does not.
    lo = tl.full([], -2147483648, tl.int64)
    hi = tl.full([], 2147483647, tl.int64)
    ways = tl.arange(0, PIVOTS)
    while lo < hi:
        pivots = lo + ((hi - lo + 1) * ways) // PIVOTS  # pivots[0] == lo
        pivot_keys = pivots.to(tl.int32)  # (keys compared in 32 bits: half the instructions of 64)
        partial = tl.zeros([BLOCK, PIVOTS], tl.float32)  # (summed across threads once a pass, not a chunk)
        for start in range(0, vocab, BLOCK):
            x = tl.load(logits + start + cols, mask=start + cols < vocab, other=float("-inf")).to(tl.float32)
            p = tl.exp(x - log_total)
            at_or_above = _keys(x)[:, None] >= pivot_keys[None, :]
            partial += tl.where(at_or_above, p[:, None], 0.0)
        mass = tl.sum(partial, 0)
        # The last pivot whose mass still reaches top_p (the first always does: it is lo).
        chosen = tl.max(tl.where((mass >= top_p) | (ways == 0), ways, 0), 0)
        new_lo = tl.sum(tl.where(ways == chosen, pivots, 0), 0)
        next_pivot = tl.sum(tl.where(ways == chosen + 1, pivots, 0), 0)
        hi = tl.where(chosen == PIVOTS - 1, hi, next_pivot - 1)
        lo = new_lo
    key = lo.to(tl.int32)
    cut = tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)
    tl.store(cut_ptr + row, cut)


def top_p_cuts(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Each row's smallest logit that top-p keeps [rows, 1], as the sampler's sorted definition gives
    it; `logits` [rows, vocab] float32, `top_p` [rows, 1] (rows of 1.0: -inf, they drop nothing)."""
    rows, vocab = logits.shape
    cuts = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        assert logits.dtype == torch.float32 and logits.stride(1) == 1
        _top_p_cut_kernel[(rows,)](logits, top_p.reshape(rows).to(torch.float32).contiguous(), cuts, vocab,
                                   logits.stride(0), **LAUNCH)
    return cuts[:, None].masked_fill(top_p >= 1.0, float("-inf"))
