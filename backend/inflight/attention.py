"""Our attention inside transformers' own modeling code.

The model is called with a batch axis of 1 holding every scheduled token of every sequence, and
`use_cache=False`. Its attention layers call `paged_attention_forward` (registered with transformers'
AttentionInterface), which writes the new keys and values into the layer's paged cache and attends
over each sequence's cached context through the ragged metadata of the step.

What a model's attention layers ask beyond keys, values and a scale (a sliding window, Gemma 2's softcap,
gpt-oss's sinks) is honoured; anything else that would change the result is refused at start-up, when
`model_support.py` runs one forward pass that records each call (`AttentionContext.calls`) instead of
attending.
"""

from dataclasses import dataclass, field

import numpy as np
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
    num_decodes: int | None = None  # the sequences that lead the batch with one token each (None: unknown)
    query_len: int | None = None  # every sequence's query tokens, where they are all alike (a padded verify step)
    calls: list["AttentionCall"] | None = None  # when set, each layer's call is recorded here, nothing attended
    # A hybrid model's: each layer's group (0: the full layers', which read the step's own slots and tables;
    # g: windowed layers', which read the (g - 1)th of these), hybrid_blocks.py
    layer_groups: list[int] | None = None
    window_slot_mappings: list[torch.Tensor] = field(default_factory=list)
    window_block_tables: list[torch.Tensor] = field(default_factory=list)
    # Spans of tokens that see each other (a Gemma 3 image's, a PaliGemma prompt): StepInputs.attend_within;
    # whether a span sees itself whole past the sliding window (PaliGemma's prompt) or within it (Gemma 3's image)
    attend_within: np.ndarray | None = None
    spans_past_window: bool = False
    # Chunked attention beyond one chunk (Llama 4's): which layers are chunked, and the sequences as those
    # read them (input_buffers.chunk_view)
    chunked_layers: list[bool] | None = None
    chunk_seq_lens: torch.Tensor | None = None
    chunk_block_tables: list[torch.Tensor] = field(default_factory=list)  # the step's, each window group's
    # [T] float32: each token's query scale in layers marked `inflight_scaled_queries` (Llama 4's without
    # rotary embedding: model_support.take_over_query_scaling)
    query_scales: torch.Tensor | None = None


@dataclass
class AttentionCall:
    """What one attention layer passed: the shapes [1, heads, T, D] of its query, key and value, and every
    argument beyond them that is not None (the attention mask included)."""

    layer_idx: int | None
    query_shape: tuple[int, ...]
    key_shape: tuple[int, ...]
    value_shape: tuple[int, ...]
    arguments: dict = field(default_factory=dict)


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            inflight_context: AttentionContext | None = None, sliding_window=None, softcap=None,
                            s_aux=None, **kwargs):
    if inflight_context is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention was called without the engine's inflight_context: "
                           "this model's layers do not pass their arguments through to attention")
    ctx = inflight_context
    if ctx.calls is not None:
        arguments = dict(kwargs, attention_mask=attention_mask, dropout=dropout or None, sliding_window=sliding_window,
                         softcap=softcap, s_aux=s_aux)
        ctx.calls.append(AttentionCall(getattr(module, "layer_idx", None), tuple(query.shape), tuple(key.shape),
                                       tuple(value.shape), {k: v for k, v in arguments.items() if v is not None}))
        return query.new_zeros(*query.shape[:3], value.shape[3]).transpose(1, 2), None
    key_cache, value_cache = ctx.kv_caches[module.layer_idx]
    group = ctx.layer_groups[module.layer_idx] if ctx.layer_groups is not None else 0
    if group:
        slot_mapping, block_tables = ctx.window_slot_mappings[group - 1], ctx.window_block_tables[group - 1]
    else:
        slot_mapping, block_tables = ctx.slot_mapping, ctx.block_tables
    # [1, heads, T, D] -> [T, heads, D]
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    if ctx.query_scales is not None and getattr(module, "inflight_scaled_queries", False):  # (as transformers would)
        q = (q * ctx.query_scales[:, None, None]).to(q.dtype)
    ops.write_kv_cache(k, v, key_cache, value_cache, slot_mapping, impl=ctx.impl)
    seq_lens = ctx.seq_lens
    if ctx.chunk_seq_lens is not None and ctx.chunked_layers[module.layer_idx]:  # (from its chunk's start)
        seq_lens, block_tables = ctx.chunk_seq_lens, ctx.chunk_block_tables[group]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = ops.paged_attention(q.contiguous(), key_cache, value_cache, ctx.cu_seqlens_q, seq_lens,
                              block_tables, scale, sliding_window=sliding_window, softcap=softcap or None, sinks=s_aux,
                              impl=ctx.impl, new_key=k, new_value=v, num_decodes=ctx.num_decodes,
                              query_len=ctx.query_len)
    if ctx.attend_within is not None:  # (their rows attended causally above: computed again, seeing the span)
        ops.attend_within_spans(out, q, key_cache, value_cache, block_tables, ctx.attend_within, scale,
                                sliding_window, softcap or None, s_aux, past_window=ctx.spans_past_window)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
# Under torch_compile the model is compiled around this one: a graph break, the kernels launch as they
# are. A name of its own, since the break costs about 16 us a call in a model that is not compiled.
ATTN_IMPLEMENTATION_COMPILED = "inflight_paged_compiled"
AttentionInterface.register(ATTN_IMPLEMENTATION_COMPILED, torch.compiler.disable(paged_attention_forward))
