"""Loads the model, holds the paged KV cache, and runs one ragged forward pass per step.

Under tensor parallelism every rank has a ModelRunner holding its shard of the weights and the KV cache
of its own KV heads; rank 0 builds each step's StepInputs, which the other ranks receive (parallel.py).
"""

import logging
from dataclasses import dataclass, field

import numpy as np
import psutil
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from . import ops
from .attention import ATTN_IMPLEMENTATION, AttentionContext
from .config import EngineConfig
from .scheduler import ScheduledBatch

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class StepInputs:
    """One step's model inputs over the ragged batch; all that another rank needs to run it."""

    input_ids: np.ndarray  # [T] every scheduled token of every sequence
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T] cache slot of each token
    cu_seqlens: np.ndarray  # [S+1] offsets of each sequence's tokens
    seq_lens: np.ndarray  # [S] context + new tokens
    block_tables: np.ndarray  # [S, max_blocks], padded with block 0
    logits_at: np.ndarray  # flat positions whose logits are returned
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination), done first


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0):
        self.config = config
        self.rank = rank
        self.world_size = config.tensor_parallel_size
        self.device = torch.device(config.rank_devices()[rank])
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        hf_config = AutoConfig.from_pretrained(config.model, trust_remote_code=config.trust_remote_code)
        hf_config = getattr(hf_config, "text_config", hf_config)
        dtype = _DTYPES.get(config.dtype) or getattr(hf_config, "dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = _DTYPES[dtype]
        self.dtype = dtype
        sharding = {}
        if self.world_size > 1:  # transformers' own tensor-parallel plan over the process group
            from transformers.distributed import DistributedConfig
            sharding["distributed_config"] = DistributedConfig(tp_size=self.world_size, tp_plan="auto")
        self.model = AutoModelForCausalLM.from_pretrained(
            config.model, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION,
            trust_remote_code=config.trust_remote_code, **sharding,
        ).to(self.device).eval()
        self.hf_config = hf_config
        self.num_layers = hf_config.num_hidden_layers
        # This rank's KV heads: the attention layers see 1/N of them under tensor parallelism.
        self.num_kv_heads = (getattr(hf_config, "num_key_value_heads", None)
                             or hf_config.num_attention_heads) // self.world_size
        self.head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        self.block_size = config.block_size
        self.attention_impl = ops.resolve_impl(None, self.device.type)
        self.num_blocks = self._pool_size()
        # One tensor for the whole pool: [layer, key/value, block, slot, kv head, head dim].
        self.kv_cache = torch.zeros(self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads,
                                    self.head_dim, dtype=dtype, device=self.device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(self.num_layers)]

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

    def _pool_size(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        budget = cfg.kv_cache_memory
        if budget is None:
            fraction = cfg.kv_cache_memory_fraction or cfg.DEFAULT_MEMORY_FRACTION[self.device.type]
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
            else:
                free = psutil.virtual_memory().available
            budget = int(free * fraction)
        blocks = budget // self.bytes_per_block
        if self.world_size > 1:  # every rank holds the same block ids: the smallest pool wins
            smallest = torch.tensor([blocks], device=self.device)
            dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
            blocks = int(smallest.item())
        if blocks < 1:
            raise ValueError(f"the KV cache budget of {budget} bytes holds no block of {self.bytes_per_block} bytes")
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", blocks, self.block_size,
                    blocks * self.bytes_per_block / 2**30)
        return blocks

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy the KV of each (source, destination) block pair, in every layer."""
        if pairs:
            src, dst = (torch.tensor(ids, device=self.device) for ids in zip(*pairs))
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def prepare(self, batch: ScheduledBatch, logits_at: list[int],
                block_copies: list[tuple[int, int]] | None = None) -> StepInputs:
        """The flat inputs of a step: its scheduled tokens, their positions and cache slots, and the
        attention metadata; logits are returned at the flat positions `logits_at` (a sequence's last
        scheduled token where it samples; prompt positions where prompt logprobs are asked for)."""
        bs = self.block_size
        input_ids, positions, slot_mapping = [], [], []
        cu_seqlens, seq_lens = [0], []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            tokens = seq.token_ids
            input_ids.extend(tokens[start:start + n])
            positions.extend(range(start, start + n))
            table = seq.block_table
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            cu_seqlens.append(cu_seqlens[-1] + n)
            seq_lens.append(start + n)
        max_blocks = max(len(seq.block_table) for seq in batch.seqs)
        tables = [seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq in batch.seqs]
        ints = lambda values: np.asarray(values, dtype=np.int64)  # noqa: E731
        return StepInputs(ints(input_ids), ints(positions), ints(slot_mapping), ints(cu_seqlens), ints(seq_lens),
                          ints(tables), ints(logits_at), list(block_copies or []))

    def execute(self, batch: ScheduledBatch, logits_at: list[int],
                block_copies: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """Copy the blocks asked for, run the scheduled tokens; logits [len(logits_at), vocab]."""
        return self.run(self.prepare(batch, logits_at, block_copies))

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor:
        self.copy_blocks(inputs.block_copies)

        def tensor(values: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(values).to(self.device)

        context = AttentionContext(
            kv_caches=self.kv_caches,
            slot_mapping=tensor(inputs.slot_mapping),
            cu_seqlens_q=tensor(inputs.cu_seqlens),
            seq_lens=tensor(inputs.seq_lens),
            block_tables=tensor(inputs.block_tables),
            impl=self.attention_impl,
        )
        output = self.model(
            input_ids=tensor(inputs.input_ids)[None],
            position_ids=tensor(inputs.positions)[None],
            use_cache=False,
            logits_to_keep=tensor(inputs.logits_at),
            inflight_context=context,
        )
        return output.logits[0].float()

    def close(self) -> None:
        """Nothing to release in-process; the tensor-parallel runner stops its workers."""
