"""Loads the model, holds the paged KV cache, and runs one ragged forward pass per step."""

import logging

import psutil
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from . import ops
from .attention import ATTN_IMPLEMENTATION, AttentionContext
from .config import EngineConfig
from .scheduler import ScheduledBatch

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        hf_config = AutoConfig.from_pretrained(config.model, trust_remote_code=config.trust_remote_code)
        hf_config = getattr(hf_config, "text_config", hf_config)
        dtype = _DTYPES.get(config.dtype) or getattr(hf_config, "dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = _DTYPES[dtype]
        self.dtype = dtype
        self.model = AutoModelForCausalLM.from_pretrained(
            config.model, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION,
            trust_remote_code=config.trust_remote_code,
        ).to(self.device).eval()
        self.hf_config = hf_config
        self.num_layers = hf_config.num_hidden_layers
        self.num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
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

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, logits_at: list[int]) -> torch.Tensor:
        """Run the scheduled tokens; return logits [len(logits_at), vocab] at those positions of the
        ragged batch (a sequence's last scheduled token where it samples; prompt positions where
        prompt logprobs are asked for)."""
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

        def tensor(values):
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        context = AttentionContext(
            kv_caches=self.kv_caches,
            slot_mapping=tensor(slot_mapping),
            cu_seqlens_q=tensor(cu_seqlens),
            seq_lens=tensor(seq_lens),
            block_tables=tensor(tables),
            impl=self.attention_impl,
        )
        output = self.model(
            input_ids=tensor(input_ids)[None],
            position_ids=tensor(positions)[None],
            use_cache=False,
            logits_to_keep=tensor(logits_at),
            inflight_context=context,
        )
        return output.logits[0].float()
