"""GPU benchmark of the Triton paged attention against torch's fused SDPA on the same ragged batches.

    make bench-kernels          # needs a CUDA GPU

For each mix it times: our kernel over the paged cache (one launch for the whole ragged batch), and
torch SDPA (flash/efficient backends) over the same sequences laid out contiguously and padded to a
batch, which is the best torch does without paging. Decode rows also report achieved bandwidth: KV
bytes read per second, against the measured device-copy bandwidth.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend"))

MIXES = {
    # name: list of (context_len, new_tokens)
    "decode 64 x 1k": [(1024, 1)] * 64,
    "decode 256 x 2k": [(2048, 1)] * 256,
    "decode 32 x 8k": [(8192, 1)] * 32,
    "prefill 8 x 2k": [(0, 2048)] * 8,
    "prefill 2 x 8k": [(0, 8192)] * 2,
    "mixed: 1 chunk of 2k + 128 decodes x 1k": [(0, 2048)] + [(1024, 1)] * 128,
}


def timed(fn, iters: int = 20) -> float:
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


def copy_bandwidth() -> float:
    x = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    seconds = timed(lambda: y.copy_(x))
    return 2 * x.numel() / seconds  # read + write


def build(seqs, heads, kv_heads, head_dim, block_size, dtype):
    lens = [c + q for c, q in seqs]
    blocks = [-(-n // block_size) for n in lens]
    perm = torch.randperm(sum(blocks), device="cuda")
    tables, used = [], 0
    for b in blocks:
        tables.append(perm[used:used + b])
        used += b
    width = max(blocks)
    block_tables = torch.stack([F.pad(t, (0, width - len(t))) for t in tables])
    kc = torch.randn(sum(blocks), block_size, kv_heads, head_dim, device="cuda", dtype=dtype)
    vc = torch.randn_like(kc)
    q_lens = torch.tensor([q for _, q in seqs], device="cuda")
    cu = F.pad(torch.cumsum(q_lens, 0), (1, 0))
    query = torch.randn(int(cu[-1]), heads, head_dim, device="cuda", dtype=dtype)
    return query, kc, vc, cu, torch.tensor(lens, device="cuda"), block_tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench-kernels needs a CUDA GPU; on CPU the kernels are tested under TRITON_INTERPRET=1")
    from inflight.ops import triton_ops

    dtype = getattr(torch, args.dtype)
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, {args.heads} heads / {args.kv_heads} KV heads, "
          f"head_dim {args.head_dim}, block {args.block_size}; device copy {bandwidth / 1e12:.2f} TB/s\n")
    print("| mix | inflight Triton (ms) | torch SDPA (ms) | ratio | decode KV bandwidth |\n|---|---:|---:|---:|---:|")
    scale = args.head_dim ** -0.5
    for name, seqs in MIXES.items():
        query, kc, vc, cu, seq_lens, tables = build(seqs, args.heads, args.kv_heads, args.head_dim,
                                                    args.block_size, dtype)
        out = torch.empty_like(query)
        ours = timed(lambda: triton_ops.paged_attention(query, kc, vc, cu, seq_lens, tables, scale, out=out))
        # torch: the same sequences contiguous and padded into one batch (what SDPA can take).
        max_len, max_q = int(seq_lens.max()), int((cu[1:] - cu[:-1]).max())
        k = torch.randn(len(seqs), args.kv_heads, max_len, args.head_dim, device="cuda", dtype=dtype)
        v = torch.randn_like(k)
        q = torch.randn(len(seqs), args.heads, max_q, args.head_dim, device="cuda", dtype=dtype)
        causal = all(c == 0 for c, _ in seqs)
        theirs = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True))
        kv_bytes = sum(c + n for c, n in seqs) * 2 * args.kv_heads * args.head_dim * kc.element_size()
        decode = all(n == 1 for _, n in seqs)
        bw = f"{kv_bytes / ours / 1e12:.2f} TB/s ({kv_bytes / ours / bandwidth:.0%})" if decode else "-"
        print(f"| {name} | {ours * 1e3:.3f} | {theirs * 1e3:.3f} | {ours / theirs:.2f}x | {bw} |")


if __name__ == "__main__":
    main()
