"""Fused kernels for the small operations of transformers' decoder layers.

Eager, a layer of a Llama-family model launches some forty kernels, and most of them are tiny: an
RMSNorm is six to eight (casts, square, mean, add, rsqrt, two multiplies), the rotary embedding of
queries and keys ten (multiplies, slices, negation, concatenations, adds), the MLP's SiLU and multiply
two, beside the seven matmuls and our attention's two or three. On a GPU each launch costs a few
microseconds of GPU time however little it computes: on the H200, a graphed decode step of the default
model was 1,718 launches and 5.1 ms, some 1,300 of them these modules'.

Here each of those three is one small function compiled by torch.compile (inductor fuses each into one
kernel, or two for the rotary embedding's queries and keys), swapped into the model's own modules: the
norm's and the MLP's forward on each instance, and the modeling module's `apply_rotary_pos_emb` only
while the engine's forward runs (`active()`), so that other models in the process keep transformers'
code. Only what the functions are known to equal: the model types of `FUSED_MODEL_TYPES`, whose norm,
rotary embedding and MLP are Llama's.

On a CPU, in float32, the functions are C kernels instead (`ops/cpu_layer_ops.c`): a compiled call costs
14-50 µs of host time there, more than the eager operations it replaces, while a C call through ctypes
costs a few. In a decode step of 48 sequences of the default model (2 cores, AVX-512; 74-78 ms) the
small operations took ~8 ms eager and ~1 ms fused. Other dtypes on a CPU compile, as on a GPU.

The projections that read the same input become one matmul each: queries, keys and values (the
attention calls q_proj, k_proj and v_proj one after the other on the same tensor: the first computes all
three, the others take their slice of its output, `shared_matmul.py`), and the MLP's gate and up
projections (its forward is ours). Their weights become views of one merged weight, so memory does not
grow. Only plain nn.Linear layers without hooks are merged (not transformers' tensor-parallel shards;
packed CPU layers are merged when packed, `cpu_runtime.py`). A layer is then 4 matmuls instead of 7.

The decoder layer's two residual adds launch nothing of their own: its forward (ours, the same steps as
transformers' Llama layer) adds the attention's output to the residual stream inside the
post-attention norm's kernel, and the MLP's down projection adds its product into the stream as part
of its matmul (`addmm_` into the fresh sum; a layer with bias, hooks or shards adds after it). Our
attention launches as before.

Compiling the four functions takes seconds, not the minutes of the whole model (`torch_compile`).
Each compiles a graph the first time it meets a token count, one more when the count changes (the
count then becomes dynamic), and one for a single token (torch.compile specializes 1):
`warm_up_fused_layers` runs those steps at start-up, so that no request compiles and no graph capture does.
"""

import contextlib
import functools
import logging
import sys
import time
from collections.abc import Callable, Iterator
from types import MethodType

import torch
import torch.nn.functional as F

from .input_buffers import InputBuffers, StepTensors, empty_prefill
from .ops import cpu_kernels
from .shared_matmul import GATE_UP_NAMES, QKV_NAMES, SharedMatmul, stack_weights

logger = logging.getLogger(__name__)

FUSED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
RECOMPILE_LIMIT = 64


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: the statistics in float32, the scaling in the input's dtype."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's `apply_rotary_pos_emb`."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream after a sublayer (`x + residual`) and Llama's RMSNorm of it."""
    total = x + residual
    return total, _rms_norm(total, weight, eps)


# The compiled functions, made by the first FusedLayers that needs them (importing torch.compile's
# machinery costs most of a second, which a CPU engine need not pay), and the C kernels of a CPU.
_compiled: dict[str, Callable] = {}
_cpu_kernels: dict[str, Callable] = {}


def _compile_functions() -> None:
    import torch._dynamo

    # Every model, dtype and width in the process compiles graphs of the same four functions (a
    # benchmark builds several): past dynamo's limit per function (8) they would run eagerly.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    for name, function in (("rms_norm", _rms_norm), ("add_rms_norm", _add_rms_norm), ("rotary", _rotary),
                           ("silu_mul", _silu_mul)):
        _compiled.setdefault(name, torch.compile(function))


def _load_cpu_kernels() -> bool:
    """Fill _cpu_kernels; False where the C kernels cannot be built."""
    ops = cpu_kernels.layer_ops()
    if ops is None:
        return False

    def rotary(q, k, cos, sin, unsqueeze_dim=1):
        if unsqueeze_dim != 1 or q.shape[0] != 1:  # (not a step of the engine: one ragged sequence)
            return _rotary(q, k, cos, sin, unsqueeze_dim)
        return ops.rotary(q, k, cos, sin)

    _cpu_kernels.update(rms_norm=ops.rms_norm, add_rms_norm=ops.add_rms_norm, rotary=rotary, silu_mul=ops.silu_mul)
    return True


def _functions(x: torch.Tensor) -> dict[str, Callable]:
    """The C kernels for a float32 CPU tensor (once loaded), the compiled functions otherwise."""
    return _cpu_kernels if _cpu_kernels and x.dtype == torch.float32 and x.device.type == "cpu" else _compiled


def _fused_rotary(q, k, cos, sin, unsqueeze_dim=1):
    return _functions(q)["rotary"](q, k, cos, sin, unsqueeze_dim)


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return _functions(hidden_states)["rms_norm"](hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    return _down(self, _functions(x)["silu_mul"](self.gate_proj(x), self.up_proj(x)), residual)


def _merged_mlp_forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    gate_up = F.linear(x, *self.inflight_gate_up)
    half = gate_up.shape[-1] // 2
    return _down(self, _functions(x)["silu_mul"](gate_up[..., :half], gate_up[..., half:]), residual)


def _down(mlp: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """The MLP's down projection of `x`, plus `residual` when given: a plain layer without bias adds its
    product into `residual` in place, one matmul (`residual` is the decoder layer's own, fresh from the
    norm's kernel, contiguous as inductor lays it out); any other adds after."""
    if residual is None:
        return mlp.down_proj(x)
    if not (mlp.inflight_accumulates and residual.is_contiguous()):
        return residual + mlp.down_proj(x)
    residual.view(-1, residual.shape[-1]).addmm_(x.reshape(-1, x.shape[-1]), mlp.down_proj.weight.t())
    return residual


def _decoder_layer_forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None,
                           past_key_values=None, use_cache=False, position_embeddings=None, **kwargs) -> torch.Tensor:
    """transformers' Llama decoder layer with its two residual adds inside other kernels: the attention's
    in the post-attention norm's, the MLP's in its down projection's matmul (`_down`)."""
    attention, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
                                  position_ids=position_ids, past_key_values=past_key_values, use_cache=use_cache,
                                  position_embeddings=position_embeddings, **kwargs)
    norm = self.post_attention_layernorm
    hidden_states, normed = _functions(attention)["add_rms_norm"](attention, hidden_states, norm.weight,
                                                                  norm.variance_epsilon)
    return self.mlp(normed, residual=hidden_states)


def _mergeable(linears: list[torch.nn.Module]) -> bool:
    """Plain nn.Linear layers of one input size, biased alike, with their own forward (not packed CPU
    layers), no hooks and plain tensors as weights (not transformers' tensor-parallel shards, DTensors)."""
    return (all(type(m) is torch.nn.Linear and "forward" not in vars(m) and not m._forward_hooks
                and not m._forward_pre_hooks and type(m.weight.data) is torch.Tensor for m in linears)
            and len({m.in_features for m in linears}) == 1 and len({m.bias is None for m in linears}) == 1)


def _merge_weights(linears: list[torch.nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for `linears`, each layer's own becoming a view of it."""
    weight, bias = stack_weights(linears)
    start = 0
    for m in linears:
        end = start + m.out_features
        m.weight = torch.nn.Parameter(weight[start:end], requires_grad=False)
        if bias is not None:
            m.bias = torch.nn.Parameter(bias[start:end], requires_grad=False)
        start = end
    return weight, bias


class FusedLayers:
    """The model's norms, MLPs and decoder layers run the fused functions, and its projections merged,
    from construction on; the rotary embedding while `active()`. `compiles`: whether the functions are
    torch.compile's (to be compiled for each shape class: `warm_up_fused_layers`), not C kernels."""

    def __init__(self, model: torch.nn.Module, model_type: str, hidden_act: str, device: torch.device,
                 dtype: torch.dtype):
        if model_type not in FUSED_MODEL_TYPES:
            raise ValueError(f"fused layers cover the model types {', '.join(FUSED_MODEL_TYPES)}, not {model_type!r}")
        self.compiles = not (device.type == "cpu" and dtype == torch.float32 and _load_cpu_kernels())
        if self.compiles:
            _compile_functions()
        self.norms = self.mlps = self.merged = self.layers = 0
        self._swapped: list[torch.nn.Module] = []
        modeling_modules = set()
        fused_mlps = set()
        for module in list(model.modules()):
            name = type(module).__name__
            if name.endswith("RMSNorm"):
                self._swap(module, _norm_forward)
                self.norms += 1
            elif name.endswith("MLP") and hidden_act == "silu":
                self._fuse_mlp(module)
                fused_mlps.add(module)
            elif name.endswith("Attention"):
                modeling_modules.add(sys.modules[type(module).__module__])
                self._merge_qkv(module)
        self._modeling_modules = [m for m in modeling_modules if hasattr(m, "apply_rotary_pos_emb")]
        for module in model.modules():  # layers whose MLP takes the residual (`_down`)
            if type(module).__name__.endswith("DecoderLayer") and getattr(module, "mlp", None) in fused_mlps:
                self._swap(module, _decoder_layer_forward)
                self.layers += 1

    def _swap(self, module: torch.nn.Module, forward: Callable) -> None:
        module.forward = MethodType(forward, module)
        self._swapped.append(module)

    def _fuse_mlp(self, mlp: torch.nn.Module) -> None:
        self.mlps += 1
        mlp.inflight_accumulates = mlp.down_proj.bias is None and _mergeable([mlp.down_proj])
        gate_up = [getattr(mlp, name) for name in GATE_UP_NAMES]
        if not _mergeable(gate_up):
            self._swap(mlp, _mlp_forward)
            return
        mlp.inflight_gate_up = _merge_weights(gate_up)
        self._swap(mlp, _merged_mlp_forward)
        self.merged += 1

    def _merge_qkv(self, attention: torch.nn.Module) -> None:
        qkv = [getattr(attention, name) for name in QKV_NAMES]
        if _mergeable(qkv):
            weight, bias = _merge_weights(qkv)
            SharedMatmul(qkv, functools.partial(F.linear, weight=weight, bias=bias))
            self._swapped += qkv
            self.merged += 1

    def remove(self) -> None:
        """Give the modules back their own forward (merged weights stay merged: the same values)."""
        for module in self._swapped:
            del module.forward
        self._swapped.clear()

    def wrap(self, model_call: Callable) -> Callable:
        """`model_call` with the compiled rotary embedding in place while it runs."""
        def call(*args, **kwargs):
            with self.active():
                return model_call(*args, **kwargs)
        return call

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The modeling modules' rotary embedding is the fused one until the block ends."""
        originals = [m.apply_rotary_pos_emb for m in self._modeling_modules]
        for m in self._modeling_modules:
            m.apply_rotary_pos_emb = _fused_rotary
        try:
            yield
        finally:
            for m, original in zip(self._modeling_modules, originals):
                m.apply_rotary_pos_emb = original


@torch.inference_mode()
def warm_up_fused_layers(forward: Callable[[StepTensors], torch.Tensor], buffers: InputBuffers, max_tokens: int,
                         block_size: int) -> None:
    """Compile each function for the token counts a step can have: one of 16 tokens, then of 2 (the
    count becomes dynamic), then of 1. The steps write no KV."""
    started = time.perf_counter()
    for tokens in sorted({min(16, max_tokens), min(2, max_tokens), 1}, reverse=True):
        forward(buffers.load(empty_prefill(tokens, block_size)))
    logger.info("fused layers compiled in %.1f s", time.perf_counter() - started)
