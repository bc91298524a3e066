"""Which of transformers' models the engine runs exactly: checked at start-up, refused with the reason.

The engine runs transformers' own modeling code with our paged attention in place of its attention
(attention.py). That is exact for a model whose every layer attends, causally, over its own keys and
values, asking of attention only what our kernels honour: a scale, a sliding window, a softcap (Gemma 2),
sinks (gpt-oss). Anything else would run wrong, or fail in a request, so it is refused here:
- layers that keep a state per sequence (Mamba, linear attention, convolutions: Jamba, Qwen3-Next,
  LFM2, ...): the engine pages keys and values, nothing else;
- layers that read another layer's keys and values (Gemma 3n), bidirectional attention;
- key and value heads of different sizes (multi-head latent attention: DeepSeek V3);
- attention that does not go through transformers' attention interface (Falcon, GPT-J, BLOOM, MPT);
- arguments to attention that would change its result and our kernels do not take (an attention mask,
  say, carrying ALiBi biases).
Chunked attention (Llama 4: a token sees its own chunk's keys up to itself) equals full attention over
contexts of up to one chunk; beyond, its layers read each sequence from its chunk's start
(input_buffers.chunk_view): `attention_chunk` says how long a chunk is, `chunked_layers` which layers.
Llama 4's layers without rotary embedding scale their queries by position, which the engine does in
attention (`take_over_query_scaling`); rotary embeddings whose frequencies transformers chooses at each
forward by its largest position get them once, from max_model_len (`fix_rotary_frequencies`).
"""

import inspect
import logging
import types

import torch
from transformers.cache_utils import get_layer_types_and_kwargs
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .attention import AttentionCall

logger = logging.getLogger(__name__)

ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}
# Arguments to attention that the kernels honour, and those transformers' layers pass along that have no
# bearing on attention's result (the positions are already in the rotated queries and keys).
HONOURED_ARGUMENTS = {"sliding_window", "softcap", "s_aux"}
ARGUMENTS_WITHOUT_BEARING = {"position_ids", "use_cache", "output_router_logits", "output_attentions",
                             "cache_position", "position_embeddings"}


class UnsupportedModel(ValueError):
    pass


def refuse(model_type: str, why: str) -> UnsupportedModel:
    return UnsupportedModel(f"inflight cannot run model type {model_type!r}: {why}")


def attention_chunk(hf_config, prompt_sees_itself: bool = False) -> int | None:
    """The chunk of a model with chunked attention layers (the longest context it runs exactly), else None.
    Raises UnsupportedModel for a model whose layers are not all causal attention over their own KV, but
    for a prefix language model's (`prompt_sees_itself`: PaliGemma's, whose config calls its attention
    bidirectional for its prompt, which the engine runs as one span: prompt_embeds.py)."""
    model_type = hf_config.model_type
    layer_types, _ = get_layer_types_and_kwargs(hf_config)
    stateful = sorted(set(layer_types) - ATTENTION_LAYER_TYPES - {"chunked_attention"})
    if stateful:
        raise refuse(model_type, f"it has layers of type {', '.join(stateful)}, which keep a state per sequence "
                                  "that the engine does not page (only attention layers are supported)")
    if getattr(hf_config, "num_kv_shared_layers", None):
        raise refuse(model_type, f"{hf_config.num_kv_shared_layers} of its layers read another layer's keys "
                                  "and values")
    if getattr(hf_config, "use_bidirectional_attention", None) and not prompt_sees_itself:
        raise refuse(model_type, "its attention is bidirectional (use_bidirectional_attention)")
    return hf_config.attention_chunk_size if "chunked_attention" in layer_types else None


def kv_heads_and_head_dim(hf_config) -> tuple[int, int]:
    """The model's KV heads (all of them: a rank of tensor parallelism holds its share) and their size."""
    heads = hf_config.num_attention_heads
    return (getattr(hf_config, "num_key_value_heads", None) or heads,
            getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads)


def chunked_layers(hf_config) -> list[bool]:
    """Each layer's attention: chunked (Llama 4's) or not."""
    layer_types, _ = get_layer_types_and_kwargs(hf_config)
    return [kind == "chunked_attention" for kind in layer_types]


def take_over_query_scaling(model: torch.nn.Module, max_positions: int,
                            device: torch.device) -> tuple[float, torch.Tensor] | None:
    """Llama 4's layers without rotary embedding scale their queries by position (attn_temperature_tuning:
    log1p(floor((position + 1) / floor_scale)) * attn_scale + 1), which transformers computes from the
    step's row indices when no cache is passed, and the engine passes none: wrong from position 8,191 on
    (floor_scale 8,192), and for a step's rows from the 8,192nd. Here those layers' own scaling is turned
    off, each marked `inflight_scaled_queries`, and attention.py scales their queries by the tokens'
    positions. Returns floor_scale and the scales by floor((position + 1) / floor_scale) for positions
    below `max_positions`, on `device` (looked up: a token's scale the same whatever the step holds); None
    for a model without such layers."""
    layers = [m for m in model.modules()
              if getattr(m, "attn_temperature_tuning", False) and not getattr(m, "use_rope", True)]
    if not layers:
        return None
    for layer in layers:
        layer.attn_temperature_tuning = False
        layer.inflight_scaled_queries = True
    floor_scale, attn_scale = layers[0].floor_scale, layers[0].attn_scale
    steps = torch.arange(int(max_positions // floor_scale) + 2, dtype=torch.float32)
    return floor_scale, (torch.log1p(steps) * attn_scale + 1.0).to(device)


def fix_rotary_frequencies(model: torch.nn.Module, max_model_len: int, device: torch.device) -> None:
    """Rotary embeddings of transformers' dynamic kinds ("longrope": Phi-3's and Phi-3.5's 128K models,
    Phi-4-mini; "dynamic": NTK scaling) choose their frequencies at every forward from the largest position
    it holds, which in an engine's step is any of its sequences': a request's queries and keys were rotated
    by whatever else the step held, its cached keys by other frequencies than its new ones, and reading the
    largest position cost a host sync (which a CUDA graph's capture does not allow). Here each is chosen
    once, from max_model_len, as vLLM chooses longrope's: its long factors if max_model_len exceeds
    original_max_position_embeddings, else its short ones (HF's for sequences up to that length); NTK's
    frequencies for max_model_len where that exceeds the original length, else the original ones. The
    forward then runs as written, without transformers' update."""
    for module in model.modules():
        kinds = getattr(module, "rope_type", None)
        if not type(module).__name__.endswith("RotaryEmbedding") or not isinstance(kinds, (str, dict)):
            continue
        chosen = {}
        for layer_type, kind in (kinds.items() if isinstance(kinds, dict) else [(None, kinds)]):
            if kind == "longrope":
                parameters = module.config.rope_parameters
                original = (parameters[layer_type] if layer_type else parameters)["original_max_position_embeddings"]
                chosen[layer_type] = (kind, original + 1 if max_model_len > original else None)
            elif "dynamic" in kind:
                chosen[layer_type] = (kind, max_model_len if max_model_len > module.original_max_seq_len else None)
        for layer_type, (kind, seq_len) in chosen.items():
            prefix = "" if layer_type is None else f"{layer_type}_"
            if seq_len is None:  # (the start-up's forwards may have moved them)
                inv_freq = getattr(module, f"{prefix}original_inv_freq")
            else:
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](module.config, device, seq_len=seq_len,
                                                              layer_type=layer_type)
                if "dynamic" in kind:  # (as transformers' update sets it)
                    module.attention_scaling = scaling
            module.register_buffer(f"{prefix}inv_freq", inv_freq.to(device), persistent=False)
            chose = ("its original frequencies" if seq_len is None else "its long factors" if kind == "longrope"
                     else f"the frequencies for {seq_len} tokens")
            logger.info("rotary embedding (%s%s): %s for every sequence, max_model_len being %d", kind,
                        f", {layer_type}" if layer_type else "", chose, max_model_len)
        if chosen:
            module.forward = types.MethodType(inspect.unwrap(type(module).forward), module)


def check_attention_calls(calls: list[AttentionCall], model_type: str, num_layers: int, num_kv_heads: int,
                          head_dim: int, tensor_parallel_size: int = 1) -> None:
    """Raise UnsupportedModel unless a forward pass called our attention once in each layer, with heads of
    the sizes the KV cache was made for (under tensor parallelism, this rank's share) and no argument the
    kernels would ignore."""
    if not calls:
        raise refuse(model_type, "its attention does not go through transformers' attention interface "
                                  "(AttentionInterface), where inflight's paged attention plugs in")
    layers = sorted(call.layer_idx for call in calls if call.layer_idx is not None)
    if layers != list(range(num_layers)):
        raise refuse(model_type, f"one forward pass called attention in layers {layers}, where each of its "
                                  f"{num_layers} layers was expected once")
    for call in calls:
        where = f"layer {call.layer_idx}"
        sizes = {call.query_shape[3], call.key_shape[3], call.value_shape[3]}
        if len(sizes) > 1:
            raise refuse(model_type, f"{where} has query, key and value heads of sizes {call.query_shape[3]}, "
                                      f"{call.key_shape[3]} and {call.value_shape[3]} (the kernels take one size)")
        if tensor_parallel_size > 1 and call.key_shape[1] == num_kv_heads * tensor_parallel_size:
            raise refuse(model_type, f"transformers' tensor-parallel plan for it does not shard its attention "
                                      f"heads ({where} has all {call.key_shape[1]} KV heads on each rank): run it "
                                      "with tensor_parallel_size 1")
        if (call.key_shape[1], call.query_shape[3]) != (num_kv_heads, head_dim):
            raise refuse(model_type, f"{where} has {call.key_shape[1]} KV heads of size {call.query_shape[3]} where "
                                      f"its config says {num_kv_heads} of size {head_dim}")
        arguments = dict(call.arguments)
        if arguments.pop("is_causal", True) is not True:
            raise refuse(model_type, f"{where}'s attention is not causal")
        ignored = sorted(set(arguments) - HONOURED_ARGUMENTS - ARGUMENTS_WITHOUT_BEARING)
        if ignored:
            raise refuse(model_type, f"{where} passes {', '.join(ignored)} to attention, which inflight's kernels "
                                      "do not take")


def common_sliding_window(calls: list[AttentionCall]) -> int | None:
    """The sliding window every layer attends within, when they all share one (Mistral 7B v0.1, Phi-3
    mini, StarCoder2): then no layer reads a key older than that, and the KV blocks behind it can go back
    to the pool. None when a layer attends over its whole context (Gemma 2 and 3, gpt-oss alternate)."""
    windows = {call.arguments.get("sliding_window") for call in calls}
    return windows.pop() if len(windows) == 1 else None


def windowed_layers(calls: list[AttentionCall]) -> tuple[int | None, frozenset[int]]:
    """Where some layers attend within a sliding window and others over their whole context (Gemma 2 and
    3, gpt-oss, Exaone 4): the largest window and the windowed layers, whose blocks can go back behind it
    from block tables of their own (hybrid_blocks.py). Else (None, no layers)."""
    windows = {call.layer_idx: call.arguments.get("sliding_window") for call in calls}
    windowed = frozenset(layer for layer, window in windows.items() if window is not None)
    if not windowed or len(windowed) == len(windows):
        return None, frozenset()
    return max(windows[layer] for layer in windowed), windowed
