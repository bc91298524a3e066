"""Our attention inside transformers' own modeling code.

The model is called with a batch axis of 1 holding every scheduled token of every sequence, and
`use_cache=False`. Its attention layers call `paged_attention_forward` (registered with transformers'
AttentionInterface), which writes the new keys and values into the layer's paged cache and attends
over each sequence's cached context through the ragged metadata of the step.
"""

from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from . import ops

ATTN_IMPLEMENTATION = "inflight_paged"


@dataclass
class AttentionContext:
    """Built once per step and read by every layer."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: key_cache, value_cache
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    cu_seqlens_q: torch.Tensor  # [S+1] offsets of each sequence's new tokens
    seq_lens: torch.Tensor  # [S] context + new tokens
    block_tables: torch.Tensor  # [S, max_blocks]
    impl: str  # "triton" | "torch"


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            inflight_context: AttentionContext | None = None, sliding_window=None, **kwargs):
    if inflight_context is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention needs the engine's inflight_context")
    ctx = inflight_context
    key_cache, value_cache = ctx.kv_caches[module.layer_idx]
    # [1, heads, T, D] -> [T, heads, D]
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    ops.write_kv_cache(k, v, key_cache, value_cache, ctx.slot_mapping, impl=ctx.impl)
    out = ops.paged_attention(q.contiguous(), key_cache, value_cache, ctx.cu_seqlens_q, ctx.seq_lens,
                              ctx.block_tables, scaling if scaling is not None else q.shape[-1] ** -0.5,
                              sliding_window=sliding_window, impl=ctx.impl)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
# Under torch_compile the model is compiled around this one: a graph break, the kernels launch as they
# are. A name of its own, since the break costs about 16 us a call in a model that is not compiled.
ATTN_IMPLEMENTATION_COMPILED = "inflight_paged_compiled"
AttentionInterface.register(ATTN_IMPLEMENTATION_COMPILED, torch.compiler.disable(paged_attention_forward))
