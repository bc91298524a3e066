"""LoRA adapters served beside the base model, any mix of them (and none) in one step.

Every adapter named in `lora_modules` is loaded at start-up (peft reads its config and weights) and
attached to the base model's linear layers as a forward hook: the layer's own output, then the delta
of each token's adapter. For a layer, the A matrices of every adapter that targets it are stacked
([sum of ranks, in]) and so are the B matrices ([out, sum of ranks]); a step computes

    delta = ((x @ A_all.T) * mask) @ B_all.T

where `mask[t, c]` is the scaling (lora_alpha / r, or / sqrt(r) for rsLoRA) of column c where that
column belongs to token t's adapter, else 0. So tokens of different adapters share two matmuls a
layer, with no per-adapter Python and nothing read on the host: the adapter of each token comes from
the step's input buffers (`lora_ids`, 0 for the base model), which a CUDA graph reads as it reads
token ids. The masks are built once a step, one per distinct column layout (most layers share one).
The cost grows with the sum of the adapters' ranks, every token of a step with an adapter paying for
every adapter loaded: meant for a handful of adapters (eight of rank 16 add 128 columns to layers
thousands wide). A step without any adapter computes nothing more than the base model (with CUDA
graphs, each graph is captured twice: with its LoRA layers and without).

With `lora_task_slots`, every projection a TensorRT-LLM task can adapt also carries that many slots of
`max_lora_rank` columns after the adapters' own (owner -1, empty, until `load_slot` fills one with a
task sent by a request and gives its columns that load's adapter id; lora_tasks.py decides which).

The hooks run on whatever computes the layer (transformers' nn.Linear, the CPU's packed layers); layers
with hooks are not merged by fused_layers, which keeps each projection's own output for its hook.

Under tensor parallelism each rank holds its share of the matrices, as transformers' plan shards the
layer: a column-parallel layer (q, k, v, gate, up: each rank computes some of the outputs) takes A whole
and the rows of B for its outputs; a row-parallel one (o, down: each rank reads some of the inputs, its
partial output summed over the ranks) takes the columns of A for its inputs and B whole, and sums the
small `x @ A.T` over the ranks ([tokens, ranks' columns]) before B, since its hook sees the summed output.
"""

import logging
import math
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .lora_tasks import projection_parts

logger = logging.getLogger(__name__)

# peft options whose adapters compute more than B @ A: refused by name rather than served wrong.
_UNSUPPORTED_OPTIONS = ("use_dora", "modules_to_save", "trainable_token_indices", "alora_invocation_tokens",
                        "use_qalora", "layer_replication", "lora_bias", "target_parameters", "use_bdlora",
                        "arrow_config", "kasa_config", "velora_config", "monteclora_config", "fan_in_fan_out")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")


@dataclass
class _LayerAdapter:
    """One adapter's matrices for one linear layer."""

    adapter_id: int  # 1, 2, ... in the order of lora_modules
    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out, rank]
    scale: float


def _check_config(name: str, config) -> None:
    if str(getattr(config, "peft_type", "")).split(".")[-1] != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: a {config.peft_type} adapter, not LoRA")
    asked = [option for option in _UNSUPPORTED_OPTIONS if getattr(config, option, None)]
    if getattr(config, "bias", "none") != "none":
        asked.append(f"bias={config.bias!r}")
    if asked:
        raise ValueError(f"LoRA adapter {name!r} uses {', '.join(asked)}, which this engine does not serve")


def load_adapter(name: str, path: str, model: torch.nn.Module, adapter_id: int) -> dict[str, _LayerAdapter]:
    """The adapter's matrices by the name of the model's linear layer they apply to. A ValueError names
    whatever cannot be served exactly (an option, a layer that is not linear, the output head)."""
    from peft import PeftConfig
    from peft.utils import load_peft_weights
    from peft.utils.other import get_pattern_key

    try:
        config = PeftConfig.from_pretrained(path)
        weights = load_peft_weights(path, device="cpu")
    except (OSError, ValueError) as e:
        raise ValueError(f"LoRA adapter {name!r} could not be read from {path}: {e}") from None
    _check_config(name, config)
    modules = {**getattr(model, "checkpoint_module_names", {}), **dict(model.named_modules())}
    canonical = {id(module): module_name for module_name, module in model.named_modules()}
    head = model.get_output_embeddings()
    head_name = next((n for n, m in modules.items() if m is head), None) if head is not None else None
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        match = _KEY.match(key)
        if head_name and key.removeprefix("base_model.model.").startswith(head_name + "."):
            raise ValueError(f"LoRA adapter {name!r} targets {head_name!r}: the output head")
        if match is None:
            raise ValueError(f"LoRA adapter {name!r} holds {key!r}, which is not a LoRA matrix of a linear layer")
        parts.setdefault(match["module"], {})[match["part"]] = tensor
    layers = {}
    for module_name, pair in parts.items():
        module = modules.get(module_name)
        if not isinstance(module, torch.nn.Linear):
            raise ValueError(f"LoRA adapter {name!r} targets {module_name!r}: not a linear layer of this model")
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise ValueError(f"LoRA adapter {name!r} lacks {missing} of {module_name!r}")
        a, b = pair["A"], pair["B"]
        rank = a.shape[0]
        if a.shape != (rank, module.in_features) or b.shape != (module.out_features, rank):
            raise ValueError(f"LoRA adapter {name!r}: the matrices of {module_name!r} ({list(a.shape)}, "
                             f"{list(b.shape)}) do not fit the layer ({module.in_features} -> {module.out_features})")
        alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), module_name), config.lora_alpha)
        scale = alpha / math.sqrt(rank) if config.use_rslora else alpha / rank
        layers[canonical[id(module)]] = _LayerAdapter(adapter_id, a, b, scale)
    if not layers:
        raise ValueError(f"LoRA adapter {name!r} at {path} holds no LoRA matrices")
    return layers


def _rank_share(layer: torch.nn.Linear) -> tuple[slice, slice, object]:
    """The rows of B and the columns of A this rank holds for `layer` (all of both without tensor
    parallelism), and the process group its shrunk product is summed over (a row-parallel layer's)."""
    from torch.distributed.tensor import DTensor, Shard

    weight = layer.weight
    everything = slice(None)
    if not isinstance(weight, DTensor) or not isinstance(weight.placements[0], Shard):
        return everything, everything, None
    dim = weight.placements[0].dim % 2  # 0: the layer's outputs are split (column-parallel); 1: its inputs
    size = weight.shape[dim]
    chunk = -(-size // weight.device_mesh.size())  # (torch.chunk's split: as DTensor shards)
    start = min(size, weight.device_mesh.get_local_rank() * chunk)
    share = slice(start, min(size, start + chunk))
    if dim == 0:
        return share, everything, None
    return everything, share, weight.device_mesh.get_group()


class LoRAAdapters:
    """The adapters, attached to the model's layers; `begin_step` gives each token its adapter. With
    `task_slots`, every projection a TensorRT-LLM task can adapt (lora_tasks.py) also holds that many
    slots of `max_rank` columns after the adapters' own, empty until `load_slot` fills one."""

    def __init__(self, model: torch.nn.Module, lora_modules: dict[str, str], dtype: torch.dtype,
                 device: torch.device, task_slots: int = 0, max_rank: int = 0):
        self.names = list(lora_modules)
        self.max_rank, self.dtype = max_rank, dtype
        by_layer: dict[str, list[_LayerAdapter]] = {}
        for adapter_id, (name, path) in enumerate(lora_modules.items(), start=1):
            for module_name, adapter in load_adapter(name, path, model, adapter_id).items():
                by_layer.setdefault(module_name, []).append(adapter)
        self.parts = projection_parts(model) if task_slots else {}
        if task_slots and not self.parts:
            raise ValueError(f"lora_task_slots: {type(model).__name__} has no attention or MLP projection a "
                             "LoRA task can adapt (q_proj, ..., down_proj in its decoder layers)")
        with_slots = {part.module for part in self.parts.values()}
        for module_name in sorted(with_slots - set(by_layer)):
            by_layer[module_name] = []
        slot_columns = task_slots * max_rank
        layouts: dict[tuple, int] = {}  # (adapter id, rank, scale) of each adapter of a layer, slots -> layout index
        self._layouts: list[tuple[torch.Tensor, torch.Tensor]] = []  # each column's adapter id, its scale
        self._slot_owners: list[torch.Tensor] = []  # the slots' columns of each layout's owners
        # a layer's slots' A and B columns, and this rank's share of B's rows and A's columns (_rank_share)
        self._slot_matrices: dict[str, tuple[torch.Tensor, torch.Tensor, slice, slice]] = {}
        self._masks: list[torch.Tensor] | None = None  # this step's, one per layout; None: no adapter in it
        modules = dict(model.named_modules())
        for module_name, adapters in by_layer.items():
            slots = slot_columns if module_name in with_slots else 0
            key = (tuple((x.adapter_id, x.a.shape[0], x.scale) for x in adapters), slots)
            if key not in layouts:
                layouts[key] = len(self._layouts)
                owners = [x.adapter_id for x in adapters for _ in range(x.a.shape[0])] + [-1] * slots  # -1: empty
                scales = [x.scale for x in adapters for _ in range(x.a.shape[0])] + [1.0] * slots  # (B holds it)
                self._layouts.append((torch.tensor(owners, device=device),
                                      torch.tensor(scales, dtype=dtype, device=device)))
                if slots:
                    self._slot_owners.append(self._layouts[-1][0][len(owners) - slots:])
            layer = modules[module_name]
            a = torch.cat([x.a for x in adapters] + [torch.zeros(slots, layer.in_features)]).to(device, dtype)
            b = torch.cat([x.b for x in adapters] + [torch.zeros(layer.out_features, slots)], dim=1).to(device, dtype)
            outputs, inputs, summed_over = _rank_share(layer)
            a, b = a[:, inputs].contiguous(), b[outputs].contiguous()
            if slots:
                self._slot_matrices[module_name] = (a[len(a) - slots:], b[:, b.shape[1] - slots:], outputs, inputs)
            layer.register_forward_hook(self._hook(layouts[key], a, b, summed_over))
        logger.info("LoRA: %d adapter(s) (%s)%s on %d layers", len(self.names), ", ".join(self.names),
                    f", {task_slots} slot(s) of rank {max_rank} for LoRA tasks" if task_slots else "", len(by_layer))

    def load_slot(self, slot: int, lora_id: int, matrices: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Fill a slot's columns with a task's A and B (each layer's; zeros where the task has none), and
        give them to adapter `lora_id`. Between steps: a step in flight on the GPU reads them before the
        copies run (one stream), and the slot held no adapter of a request still running."""
        columns = slice(slot * self.max_rank, (slot + 1) * self.max_rank)
        for module_name, (slot_a, slot_b, outputs, inputs) in self._slot_matrices.items():
            a, b = slot_a[columns], slot_b[:, columns]
            a.zero_()
            b.zero_()
            if module_name in matrices:
                task_a, task_b = matrices[module_name]  # (whole: this rank's share taken here)
                a[:len(task_a)].copy_(task_a[:, inputs], non_blocking=True)
                b[:, :len(task_a)].copy_(task_b[outputs], non_blocking=True)
        for owners in self._slot_owners:
            owners[columns].fill_(lora_id)

    def _hook(self, layout: int, a: torch.Tensor, b: torch.Tensor, summed_over=None):
        def add_delta(module, args, output):
            if self._masks is None:
                return None  # the layer's own output
            x = args[0].reshape(-1, a.shape[1])
            shrunk = x @ a.t()
            if summed_over is not None:  # (a row-parallel layer's share of the inputs: see the module's doc)
                dist.all_reduce(shrunk, group=summed_over)
            shrunk.mul_(self._masks[layout])
            return torch.addmm(output.reshape(-1, b.shape[0]), shrunk, b.t()).view(output.shape)
        return add_delta

    @property
    def active(self) -> bool:
        """The last step computed the adapters' layers (some token of it had an adapter)."""
        return self._masks is not None

    def begin_step(self, lora_ids: torch.Tensor | None) -> None:
        """This step's masks from each token's adapter id ([tokens], on the device; 0: none). None: no
        token of the step has an adapter, and the layers compute nothing more."""
        if lora_ids is None:
            self._masks = None
            return
        ids = lora_ids[:, None]
        self._masks = [torch.where(owners == ids, scales, 0) for owners, scales in self._layouts]
