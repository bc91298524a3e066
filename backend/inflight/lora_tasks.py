"""TensorRT-LLM's LoRA inputs: adapters sent with the requests themselves, kept in slots of the LoRA
layers (lora.py) for the requests that name them after.

A task is sent once with its weights (`lora_task_id`, `lora_weights`, `lora_config`) and named by its
id alone afterwards, while the engine keeps it. The format is TensorRT-LLM's (its hf_lora_convert.py
writes it from a peft adapter):

- `lora_config` [rows, 3] integers: the module id, the decoder layer, and the rank r of each row of
  `lora_weights`;
- `lora_weights` [rows, width]: a row holds A ([r, in], TensorRT-LLM's "in weights") then B ([out, r],
  its "out weights", already scaled by alpha / r), each flattened, then padding up to the width.

Module ids: 0 attn_qkv (one A; B's rows the query's, then the key's, then the value's), 1 attn_q,
2 attn_k, 3 attn_v, 4 attn_dense (o_proj), 5 mlp_h_to_4h (gate_proj), 6 mlp_4h_to_h (down_proj),
7 mlp_gate (up_proj: TensorRT-LLM's names for the gated MLP swap gate and up, as its converter maps
them). A model's projections may be separate (q_proj, k_proj, ...) or fused (Phi-3's qkv_proj and
gate_up_proj, whose halves are gate then up): a module's rows go where its part of the layer is.
Cross attention's modules and mixtures of experts' are refused by name.

Slots: `lora_task_slots` of them, each up to `max_lora_rank` columns in every projection. A new task
takes the slot used least recently among those no unfinished request uses; when every slot is in use,
the request is refused (UNAVAILABLE), as TensorRT-LLM refuses when its LoRA cache is full of tasks in
progress. Each load gets an adapter id never used before, so the prefix cache never mixes the KV of
two tasks that shared a slot (block_manager.py keys blocks by the adapter id).
"""

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

MODULE_NAMES = {0: "attn_qkv", 1: "attn_q", 2: "attn_k", 3: "attn_v", 4: "attn_dense", 5: "mlp_h_to_4h",
                6: "mlp_4h_to_h", 7: "mlp_gate"}
# What each module adapts, in the parts of a decoder layer's projections below.
MODULE_PARTS = {0: ("q", "k", "v"), 1: ("q",), 2: ("k",), 3: ("v",), 4: ("o",), 5: ("gate",), 6: ("down",),
                7: ("up",)}
_REFUSED_MODULES = {8: "cross_attn_qkv", 9: "cross_attn_q", 10: "cross_attn_k", 11: "cross_attn_v",
                    12: "cross_attn_dense", 13: "moe_h_to_4h", 14: "moe_4h_to_h", 15: "moe_gate", 16: "moe_router"}
_PROJECTION = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\."
                         r"(q_proj|k_proj|v_proj|qkv_proj|o_proj|gate_proj|up_proj|gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class Part:
    """Where a part of a decoder layer (its query, its gate, ...) is computed: rows of a linear layer."""

    module: str  # the linear layer's name in the model
    first_row: int
    rows: int
    in_features: int
    out_features: int  # the whole layer's


def projection_parts(model: torch.nn.Module) -> dict[tuple[int, str], Part]:
    """(decoder layer, part) -> where it is computed, for every projection a task can adapt."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    parts = {}
    for name, module in model.named_modules():
        match = _PROJECTION.search(name)
        if match is None or not isinstance(module, torch.nn.Linear):
            continue
        layer, kind = int(match[1]), match[2].removesuffix("_proj")
        out, width = module.out_features, module.in_features
        if kind == "qkv":
            q = heads * head_dim
            kv = (out - q) // 2
            pieces = (("q", 0, q), ("k", q, kv), ("v", q + kv, kv))
        elif kind == "gate_up":
            pieces = (("gate", 0, out // 2), ("up", out // 2, out // 2))
        else:
            pieces = ((kind, 0, out),)
        for part, first, rows in pieces:
            parts[(layer, part)] = Part(name, first, rows, width, out)
    return parts


@dataclass
class LoRATask:
    """A request's TensorRT-LLM adapter: its id, and the first time its weights and their config."""

    task_id: int
    weights: np.ndarray | None = None  # [rows, width] (or [1, rows, width])
    config: np.ndarray | None = None  # [rows, 3] (or [1, rows, 3]): module id, layer, rank


@dataclass
class TaskWeights:
    """A task's matrices by linear layer, checked against the model: (A [rank, in], B [out, rank]);
    `digest` tells one set of weights from another."""

    task_id: int
    matrices: dict[str, tuple[torch.Tensor, torch.Tensor]] | None  # None: named by its id alone
    digest: bytes = b""


def read_task(task: LoRATask, parts: dict[tuple[int, str], Part], max_rank: int, dtype: torch.dtype) -> TaskWeights:
    """Check a task's inputs and cut its weights into each linear layer's A and B (on the CPU, in
    `dtype`). A ValueError names the first thing wrong."""
    task_id = task.task_id
    if isinstance(task_id, bool) or not isinstance(task_id, (int, np.integer)) or not 0 <= task_id < 2**64:
        raise ValueError(f"lora_task_id must be an integer in [0, 2**64), got {task_id!r}")
    task_id = int(task_id)
    if task.weights is None and task.config is None:
        return TaskWeights(task_id, None)
    if task.weights is None or task.config is None:
        raise ValueError("lora_weights and lora_config come together (with lora_task_id)")
    weights, config = (np.asarray(x) for x in (task.weights, task.config))
    weights = weights[0] if weights.ndim == 3 and weights.shape[0] == 1 else weights
    config = config[0] if config.ndim == 3 and config.shape[0] == 1 else config
    if config.ndim != 2 or config.shape[1] != 3 or config.dtype.kind not in "iu" or not len(config):
        raise ValueError(f"lora_config must be integers of shape [rows, 3] (module id, layer, adapter size), got "
                         f"{config.dtype} {list(config.shape)}")
    if weights.ndim != 2 or weights.dtype.kind != "f" or weights.shape[0] != len(config):
        raise ValueError(f"lora_weights must be floats of shape [{len(config)}, width] (a row per row of "
                         f"lora_config), got {weights.dtype} {list(weights.shape)}")
    if not np.isfinite(weights).all():
        raise ValueError("lora_weights holds a NaN or an infinity")
    digest = hashlib.sha256(np.ascontiguousarray(config, np.int64).tobytes() + str(weights.dtype).encode()
                            + np.ascontiguousarray(weights).tobytes()).digest()
    by_module: dict[str, list] = {}  # linear layer -> [(first row, rows, A, B)]
    seen: dict[tuple[int, str], int] = {}
    for row, (module_id, layer, rank) in enumerate(config.tolist()):
        where = f"lora_config row {row} (module {module_id}, layer {layer}, adapter size {rank})"
        if module_id in _REFUSED_MODULES:
            raise ValueError(f"{where}: module {_REFUSED_MODULES[module_id]} is not served (this engine adapts "
                             f"{', '.join(f'{k} {v}' for k, v in MODULE_NAMES.items())})")
        if module_id not in MODULE_PARTS:
            raise ValueError(f"{where}: unknown module id (known: 0-7)")
        if not 1 <= rank <= max_rank:
            raise ValueError(f"{where}: the adapter size must be in [1, max_lora_rank = {max_rank}]")
        targets = [parts.get((layer, part)) for part in MODULE_PARTS[module_id]]
        if None in targets:
            raise ValueError(f"{where}: the model has no such projection in that layer")
        for part in MODULE_PARTS[module_id]:
            if (layer, part) in seen:
                raise ValueError(f"{where}: layer {layer}'s {part} projection is adapted already by row "
                                 f"{seen[(layer, part)]}")
            seen[(layer, part)] = row
        width, out = targets[0].in_features, sum(t.rows for t in targets)
        size = rank * width + out * rank
        if size > weights.shape[1]:
            raise ValueError(f"{where}: its A [{rank}, {width}] and B [{out}, {rank}] need {size} values, more than "
                             f"lora_weights' rows hold ({weights.shape[1]})")
        values = torch.from_numpy(np.ascontiguousarray(weights[row, :size])).to(dtype)
        a, b = values[:rank * width].view(rank, width), values[rank * width:].view(out, rank)
        offset = 0
        for target in targets:
            by_module.setdefault(target.module, []).append((target.first_row, target.rows, a,
                                                            b[offset:offset + target.rows]))
            offset += target.rows
    matrices = {}
    out_features = {p.module: p.out_features for p in parts.values()}
    for module, pieces in by_module.items():
        # Each A once (attn_qkv's serves the query, key and value parts of a fused layer), with its columns
        # of B holding the row blocks of the parts it serves.
        unique_a: list[torch.Tensor] = []
        first_column: dict[int, int] = {}  # id of an A -> its first column
        for _, _, a, _ in pieces:
            if id(a) not in first_column:
                first_column[id(a)] = sum(x.shape[0] for x in unique_a)
                unique_a.append(a)
        rank = sum(a.shape[0] for a in unique_a)
        if rank > max_rank:
            raise ValueError(f"the adapters of {module} add up to rank {rank}, more than max_lora_rank ({max_rank})")
        b = torch.zeros(out_features[module], rank, dtype=dtype)
        for first, rows, a, piece_b in pieces:
            b[first:first + rows, first_column[id(a)]:first_column[id(a)] + a.shape[0]] = piece_b
        matrices[module] = (torch.cat(unique_a), b)
    return TaskWeights(task_id, matrices, digest)


class TaskRefused(ValueError):
    """A request's task cannot be placed; `kind` is its error's ("invalid" or "unavailable")."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


@dataclass
class _Slot:
    task_id: int | None = None
    digest: bytes = b""
    lora_id: int = -1  # the adapter id its tokens carry in the step inputs (lora.py's owners of its columns)
    last_used: int = 0


@dataclass
class TaskSlots:
    """Which task each slot holds. The engine asks `place` for a request's task between steps, and
    loads the slot when told to."""

    count: int
    next_lora_id: int  # ids from here on: after the adapters of lora_modules
    slots: list[_Slot] = field(default_factory=list)
    loads: int = 0  # tasks loaded into a slot since start
    _clock: int = 0

    def __post_init__(self):
        self.slots = [_Slot() for _ in range(self.count)]

    def holds(self, task_id: int) -> bool:
        return any(s.task_id == task_id for s in self.slots)

    def place(self, task: TaskWeights, in_use: Callable[[], set[int]]) -> tuple[int, int, bool]:
        """(slot, adapter id, whether the slot must be loaded with the task's matrices) for a request of
        `task`; `in_use()`: the adapter ids of unfinished requests, asked only where a slot must be
        (re)loaded. TaskRefused when it cannot be placed."""
        self._clock += 1
        held = next((k for k, s in enumerate(self.slots) if s.task_id == task.task_id), None)
        if task.matrices is None:
            if held is None:
                raise TaskRefused(f"LoRA task {task.task_id} is not in the cache: send its lora_weights and "
                                  "lora_config with it again", "invalid")
            self.slots[held].last_used = self._clock
            return held, self.slots[held].lora_id, False
        if held is not None and self.slots[held].digest == task.digest:
            self.slots[held].last_used = self._clock
            return held, self.slots[held].lora_id, False
        busy = in_use()
        if held is not None:
            if self.slots[held].lora_id in busy:
                raise TaskRefused(f"LoRA task {task.task_id} is in use with other weights: send these again once "
                                  "its requests have finished", "unavailable")
            free = [held]
        else:
            free = sorted((k for k, s in enumerate(self.slots) if s.lora_id not in busy),
                          key=lambda k: (self.slots[k].task_id is not None, self.slots[k].last_used))
        if not free:
            raise TaskRefused(f"every one of the {self.count} LoRA task slots (lora_task_slots) holds a task of "
                              "unfinished requests: send this one again later", "unavailable")
        slot = free[0]
        self.slots[slot] = _Slot(task.task_id, task.digest, self.next_lora_id, self._clock)
        self.next_lora_id += 1
        self.loads += 1
        return slot, self.slots[slot].lora_id, True
