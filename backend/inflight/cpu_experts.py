"""Mixture-of-experts layers on a CPU through oneDNN's packed matmul, as cpu_runtime.py runs the dense
linear layers.

transformers computes each expert's tokens, and each router's logits, with torch's matmul on 2-D and
3-D parameters, not nn.Linear modules: on a CPU that is MKL, which sums a row otherwise when a call holds
1-3, 5-7 or 9-11 rows than when it holds more, so a token's output depended on how many other tokens of
the step went to the same expert (every Mixtral, Qwen3-MoE and gpt-oss request of an engine-level fuzz
differed from itself alone within rounding). Here every expert's weights and every router's are packed
once, the experts run through an implementation registered with transformers' `ExpertsInterface`
(the family's own gating, `_apply_gate`, unchanged) and a router's `F.linear` through its packed weight:
a row then gets the same bits whatever the step holds beside it.

Llama 4's block (`Llama4TextMoe`) has no such interface: transformers runs every token through every
expert with `torch.bmm`, the inputs of experts a token was not routed to scaled by zero (16 or 128
experts' work for the one each token takes). Here its forward computes each token's own experts alone,
through packed weights.
"""

import logging
from functools import partial

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from .cpu_runtime import build_kernels, packable_dtypes, packed_matmul, release_parameter

logger = logging.getLogger(__name__)

IMPLEMENTATION = "inflight_packed"


def _experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' eager experts loop (each expert hit, in order, over its tokens; the outputs added
    per token in expert order) with each product through the expert's packed weights."""
    out = torch.zeros_like(hidden_states)
    for expert in torch.unique(top_k_index).tolist():
        if expert >= len(self.inflight_matmuls):  # a sentinel some routers use for no expert
            continue
        token_idx, top_k_pos = torch.where(top_k_index == expert)
        up, down = self.inflight_matmuls[expert]
        projected = up(hidden_states[token_idx])
        projected = self._apply_gate(projected) if self.has_gate else self.act_fn(projected)
        projected = down(projected) * top_k_weights[token_idx, top_k_pos, None]
        out.index_add_(0, token_idx, projected.to(out.dtype))
    return out


def _llama4_moe_forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Llama4TextMoe.forward with each token through its top-k experts only (an expert's
    input scaled by the token's score, as there), their outputs added per token in expert order, then to
    the shared expert's; the router's and the experts' products through packed weights."""
    hidden = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = self.inflight_router(hidden)
    top_values, top_index = torch.topk(router_logits, self.top_k, dim=1)
    scores = _sigmoid_in_vector_steps(top_values.float()).to(hidden.dtype)
    routed = torch.zeros_like(hidden)
    for expert in torch.unique(top_index).tolist():
        token_idx, top_k_pos = torch.where(top_index == expert)
        gate_up, down = self.experts.inflight_matmuls[expert]
        gate, up = gate_up(hidden[token_idx] * scores[token_idx, top_k_pos, None]).chunk(2, dim=-1)
        routed.index_add_(0, token_idx, down(up * self.experts.act_fn(gate)))
    out = self.shared_expert(hidden)
    out.add_(routed)
    return out, router_logits


def _sigmoid_in_vector_steps(x: torch.Tensor) -> torch.Tensor:
    """torch.sigmoid(x) computed over a copy padded to a multiple of 64 elements (a vector step is two
    vectors: 32 floats with AVX-512, 16 with AVX2). torch runs an elementwise function over a contiguous
    tensor in vector steps and the elements left over after the last one alone, which rounds otherwise:
    over a step's tokens' scores (one a token), the last tokens' scores depended on how many tokens the
    step held."""
    flat = x.reshape(-1)
    padded = torch.cat((flat, flat.new_zeros(-len(flat) % 64)))
    return torch.sigmoid(padded)[:len(flat)].view_as(x)


def _pack_llama4_moe(block: torch.nn.Module, tokens_hint: int, max_rows: int, warm_up: dict) -> None:
    experts = block.experts
    experts.inflight_matmuls = [(packed_matmul(experts.gate_up_proj[e].t(), None, tokens_hint),
                                 packed_matmul(experts.down_proj[e].t(), None, tokens_hint))
                                for e in range(experts.num_experts)]
    block.inflight_router = packed_matmul(block.router.weight, block.router.bias, tokens_hint)
    block.forward = partial(_llama4_moe_forward, block)
    for matmul, weight in [(block.inflight_router, block.router.weight),
                           *zip(experts.inflight_matmuls[0], (experts.gate_up_proj[0].t(), experts.down_proj[0].t()))]:
        warm_up.setdefault((weight.shape, True, weight.dtype), (matmul, max_rows))
    for module, name in [(experts, "gate_up_proj"), (experts, "down_proj"), (block.router, "weight")]:
        release_parameter(module, name)


def _expert_matmul(weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool, tokens_hint: int):
    """One expert's projection, its bias added after the product as transformers adds it."""
    matmul = packed_matmul(weight.t() if transposed else weight, None, tokens_hint)
    return matmul if bias is None else (lambda x: matmul(x) + bias)


class _PackedRouter(TorchFunctionMode):
    """While a router runs: its `F.linear` over its own weight through the packed matmul."""

    def __init__(self, router: torch.nn.Module, matmul):
        super().__init__()
        self.router, self.matmul = router, matmul

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2 and args[1] is self.router.weight:
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            out = self.matmul(args[0])
            return out if bias is None else out + bias
        return func(*args, **kwargs)


def _pack_router(router: torch.nn.Module, tokens_hint: int):
    matmul = packed_matmul(router.weight, None, tokens_hint)
    forward = router.forward

    def packed_forward(*args, **kwargs):
        with _PackedRouter(router, matmul):
            return forward(*args, **kwargs)

    router.forward = packed_forward
    return matmul


def _is_experts(module: torch.nn.Module) -> bool:
    """transformers' experts modules (use_experts_implementation) with the weights they stack per expert,
    of a dtype oneDNN packs."""
    down = getattr(module, "down_proj", None)
    return (hasattr(module, "has_gate") and isinstance(down, torch.nn.Parameter) and down.dim() == 3
            and down.device.type == "cpu" and down.dtype in packable_dtypes())


def _is_router(module: torch.nn.Module, experts: torch.nn.Module) -> bool:
    """A block's router: a weight of a row per expert that it passes to `F.linear` itself (an nn.Linear
    router is packed with the linear layers)."""
    weight = getattr(module, "weight", None)
    return (module is not experts and not isinstance(module, torch.nn.Linear)
            and isinstance(weight, torch.nn.Parameter) and weight.dim() == 2
            and weight.shape[0] == len(experts.inflight_matmuls) and weight.dtype in packable_dtypes())


@torch.no_grad()
def pack_experts(model: torch.nn.Module, tokens_hint: int, max_rows: int) -> int:
    """Pack every experts module's weights and its block's router (and Llama 4's blocks), build their
    kernels up to `max_rows` rows; returns how many experts modules were packed. Their stacked weights
    are released."""
    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, _experts_forward)
    warm_up = {}
    blocks = [m for m in model.modules() if any(_is_experts(c) for c in m.children())]
    for block in blocks:
        experts = next(c for c in block.children() if _is_experts(c))
        up_weights = experts.gate_up_proj if experts.has_gate else experts.up_proj
        up_bias = getattr(experts, "gate_up_proj_bias" if experts.has_gate else "up_proj_bias", None) \
            if experts.has_bias else None
        down_bias = experts.down_proj_bias if experts.has_bias else None
        experts.inflight_matmuls = [
            (_expert_matmul(up_weights[e], None if up_bias is None else up_bias[e], experts.is_transposed, tokens_hint),
             _expert_matmul(experts.down_proj[e], None if down_bias is None else down_bias[e],
                            experts.is_transposed, tokens_hint))
            for e in range(up_weights.shape[0])]
        experts.config._experts_implementation = IMPLEMENTATION
        for router in [c for c in block.children() if _is_router(c, experts)]:
            warm_up[(router.weight.shape, True, router.weight.dtype)] = (_pack_router(router, tokens_hint), max_rows)
        for (matmul, weight) in zip(experts.inflight_matmuls[0], (up_weights[0], experts.down_proj[0])):
            shape = weight.t().shape if experts.is_transposed else weight.shape  # one expert's stand for all
            warm_up.setdefault((shape, True, weight.dtype), (matmul, max_rows))
        for name in ("gate_up_proj" if experts.has_gate else "up_proj", "down_proj"):
            release_parameter(experts, name)
    # (by name: importing Llama 4's modeling module for every model would cost each start-up its time)
    llama4_blocks = [m for m in model.modules() if type(m).__name__ == "Llama4TextMoe"
                     and m.experts.down_proj.device.type == "cpu" and m.experts.down_proj.dtype in packable_dtypes()]
    for block in llama4_blocks:
        _pack_llama4_moe(block, tokens_hint, max_rows, warm_up)
    build_kernels(warm_up)
    if blocks or llama4_blocks:
        logger.info("packed the experts of %d mixture-of-experts layers for oneDNN", len(blocks) + len(llama4_blocks))
    return len(blocks) + len(llama4_blocks)
