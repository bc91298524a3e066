"""Paged-attention operations with two implementations: Triton kernels and torch.

`impl=None` picks Triton for CUDA tensors and torch for CPU tensors; the environment variable
INFLIGHT_ATTENTION=triton|torch forces one (the Triton interpreter, TRITON_INTERPRET=1, runs the
kernels on CPU tensors).
"""

import os

from . import cpu_kernels, torch_ops
from .torch_ops import attend_within_spans  # noqa: F401  (the same on every device: the kernels know no spans)

IMPLS = ("triton", "torch")


def resolve_impl(impl: str | None, device_type: str) -> str:
    impl = impl or os.environ.get("INFLIGHT_ATTENTION") or ("triton" if device_type == "cuda" else "torch")
    if impl not in IMPLS:
        raise ValueError(f"attention implementation must be one of {IMPLS}, got {impl!r}")
    if impl == "triton" and device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 on CPU")
    return impl


def prepare(impl: str, device_type: str, cache_dtype) -> None:
    """Build now, at start-up rather than in a request's first step, what the implementation compiles
    for this device and KV cache dtype: on a CPU with a float32, bfloat16 or fp8 cache, the C attention
    kernels (a second or two each)."""
    if impl == "torch" and device_type == "cpu" and cache_dtype in cpu_kernels.CACHE_DTYPES:
        cpu_kernels.decode_attention()
        cpu_kernels.prefill_attention()


def _module(impl: str | None, device_type: str):
    if resolve_impl(impl, device_type) == "torch":
        return torch_ops
    from . import triton_ops  # imported lazily: triton is only needed when its kernels run

    return triton_ops


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping, impl=None) -> None:
    _module(impl, key.device.type).write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                    sliding_window=None, softcap=None, sinks=None, out=None, impl=None, new_key=None, new_value=None,
                    num_decodes=None, query_len=None):
    """softcap: scores bounded by softcap * tanh(score / softcap) (Gemma 2); sinks: [Hq] logits that join
    each softmax's denominator (gpt-oss). Every sequence has at least one query token (a batch with as many
    tokens as sequences is read as a decode batch: one each). new_key, new_value [T, Hkv, D]: the step's
    keys and values, already written into the cache (the Triton kernel may read the step's own from them:
    triton_ops.NEW_KV_FOR_PREFILL). num_decodes: how many sequences lead the batch with one generated token
    each, computed as decodes (the Triton kernel launches them apart from the prefill tiles); any other
    sequence is a prefill chunk, one token long or more (None: every sequence of one token is a decode).
    query_len: every sequence has exactly that many query tokens (a padded step verifying
    drafts), whose contexts the Triton kernel splits as a decode batch's."""
    module = _module(impl, query.device.type)
    args = (query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_tables, scale, sliding_window, softcap,
            sinks, out)
    if module is torch_ops:
        return torch_ops.paged_attention(*args, num_decodes=num_decodes)
    return module.paged_attention(*args, new_key=new_key, new_value=new_value, num_decodes=num_decodes,
                                  query_len=query_len)
