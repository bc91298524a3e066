"""Loads the model, holds the paged KV cache, and runs one ragged forward pass per step.

Under tensor parallelism every rank has a ModelRunner holding its shard of the weights and the KV cache
of its own KV heads; rank 0 builds each step's StepInputs, which the other ranks receive (parallel.py).
"""

import logging
import time

import numpy as np
import psutil
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from . import images, ops, quantization
from .attention import ATTN_IMPLEMENTATION, ATTN_IMPLEMENTATION_COMPILED, AttentionContext
from .config import EngineConfig
from .cpu_experts import pack_experts
from .cpu_runtime import (contiguous_rotary_embeddings, keep_freed_memory, pack_linear_layers, packing_available,
                          zeros_mapped_when_written)
from .compile_warmup import compile_shape_classes
from .cuda_graphs import StepGraphs
from .fused_layers import FUSED_MODEL_TYPES, FusedLayers, warm_up_fused_layers
from .hybrid_blocks import blocks_a_window_holds
from .input_buffers import (BlockTableRows, InputBuffers, StepInputs, StepTensors, build_step_inputs, chunk_tables,
                            empty_prefill, to_device)
from .kernel_warmup import compile_attention_kernels
from .kv_offload import FROM_HOST, ON_DEVICE, TO_HOST, BlockCopy, HostKVStore, runs_of_kind
from .lora import LoRAAdapters
from .model_support import (UnsupportedModel, attention_chunk, check_attention_calls, chunked_layers,
                            common_sliding_window, fix_rotary_frequencies, kv_heads_and_head_dim, refuse,
                            take_over_query_scaling, windowed_layers)
from .prompt_embeds import embed
from .scheduler import ScheduledBatch
from .step_memory import largest_step, peak_bytes, run_largest_step
from .token_history import TokenHistory

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_KV_DTYPES = {**_DTYPES, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_cache_dtype(setting: str, model_dtype: torch.dtype, device_type: str,
                   capability: tuple[int, int] | None = None) -> torch.dtype:
    """The KV cache's dtype: the setting's, or the model's for "auto". On a GPU the attention kernels
    compute in the model's dtype (or the cache's, when narrower), so a wider cache would only cost
    memory (and a float32 cache under 16-bit queries takes more registers than sm_80 has): refused. An
    fp8 e4m3 cache needs a GPU that converts it (compute capability `capability` 8.9 on)."""
    chosen = model_dtype if setting == "auto" else _KV_DTYPES[setting]
    if device_type == "cuda" and chosen == torch.float8_e4m3fn and capability is not None and capability < (8, 9):
        raise ValueError(f"kv_cache_dtype {setting} (e4m3) needs a GPU of compute capability 8.9 or more (Ada, "
                         f"Hopper); this one's is {capability[0]}.{capability[1]}: fp8_e5m2 works there")
    if device_type == "cuda" and chosen.itemsize > model_dtype.itemsize:
        model = str(model_dtype).removeprefix("torch.")
        raise ValueError(f"kv_cache_dtype {setting} is wider than the model's {model}: on a GPU attention "
                         "computes in the model's dtype, so it would only cost memory")
    return chosen


def compute_dtype(setting: str, full_config, device_type: str) -> torch.dtype:
    """The setting; for "auto", bfloat16 on a GPU (float16 where the checkpoint is), float32 on a CPU. (A
    vision-language checkpoint may say its dtype at the top of `full_config` only.)"""
    if setting != "auto":
        return _DTYPES[setting]
    if device_type == "cpu":
        return torch.float32
    checkpoint = getattr(getattr(full_config, "text_config", full_config), "dtype", None) or getattr(
        full_config, "dtype", None)
    return torch.float16 if str(checkpoint).removeprefix("torch.") == "float16" else torch.bfloat16


def kv_bytes_per_block(block_size: int, layers: int, kv_heads: int, head_dim: int, kv_dtype: torch.dtype) -> int:
    """A block's keys and values in `layers` layers, and its tokens' ids (token_history.py)."""
    return block_size * (2 * layers * kv_heads * head_dim * kv_dtype.itemsize + 8)


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0, beside: tuple[int, int] = (0, 0)):
        """`beside`: what another model takes from the KV pool's budget (a draft model's, draft_model.py):
        bytes for each block of the pool, and bytes in all (its weights)."""
        self.config = config
        self.beside = beside
        self.rank = rank
        self.world_size = config.tensor_parallel_size
        self.device = torch.device(config.rank_devices()[rank])
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        if self.device.type == "cpu":
            keep_freed_memory()
        full_config = AutoConfig.from_pretrained(config.model, trust_remote_code=config.trust_remote_code)
        hf_config = getattr(full_config, "text_config", full_config)
        # before loading the weights: refused at once
        self.attention_chunk = attention_chunk(hf_config, full_config.model_type in images.PROMPT_SEES_ITSELF)
        self.dtype = dtype = compute_dtype(config.dtype, full_config, self.device.type)
        loading = quantization.loading_options(full_config, self.device, config.quantization)
        if self.world_size > 1:  # transformers' own tensor-parallel plan over the process group
            from transformers.distributed import DistributedConfig
            loading["distributed_config"] = DistributedConfig(tp_size=self.world_size, tp_plan="auto")
        attn_implementation = ATTN_IMPLEMENTATION_COMPILED if config.torch_compile else ATTN_IMPLEMENTATION
        self.image_encoder = None  # a vision-language model's (images.py)
        try:
            if images.is_vision_language(full_config):
                model, self.image_encoder = images.load(config.model, dtype, attn_implementation,
                                                        config.trust_remote_code, config.max_images_per_prompt,
                                                        config.image_cache_memory, loading)
                self.image_encoder.to(self.device)
            else:
                model = AutoModelForCausalLM.from_pretrained(
                    config.model, dtype=dtype, attn_implementation=attn_implementation,
                    trust_remote_code=config.trust_remote_code, **loading)
            quantization.unwrap(model, full_config)
            self.model = model.to(self.device).eval()
        except ValueError as e:  # (transformers' message lists every model type it has: long, and not why)
            if not str(e).startswith("Unrecognized configuration class"):
                raise
            vision = (f"; inflight serves vision-language models of the types {', '.join(images.IMAGE_MODEL_TYPES)}"
                      if hasattr(full_config, "vision_config") else "")
            raise refuse(full_config.model_type, f"transformers has no causal language model for it{vision}") from None
        except KeyError as e:  # modeling code that picks attention classes by name has none for ours
            if e.args != (attn_implementation,):
                raise
            raise refuse(hf_config.model_type, "its modeling code does not use transformers' attention interface "
                                               "(AttentionInterface), where inflight's paged attention plugs in") from e
        quantization.describe(self.model, quantization.quant_method(full_config))
        self.hf_config = hf_config
        # A PaliGemma prompt sees itself whole past a sliding window (a Gemma 3 image within it)
        self.spans_past_window = self.image_encoder is not None and self.image_encoder.spans == "prompt"
        # Chunked attention over contexts beyond one chunk (max_model_len set beyond it: its default is the
        # chunk): the chunked layers read each sequence from its chunk's start (input_buffers.chunk_view)
        self.chunk_view = (self.attention_chunk if self.attention_chunk is not None
                           and (config.max_model_len or 0) > self.attention_chunk else None)
        self.chunked_layers = chunked_layers(hf_config) if self.chunk_view else None
        # (past max_position_embeddings, a padded verify step's positions: their scale is looked up clamped)
        self.query_scaling = take_over_query_scaling(self.model, getattr(hf_config, "max_position_embeddings", 0),
                                                     self.device)
        if self.chunk_view is not None and self.chunk_view % config.block_size:
            raise UnsupportedModel(f"max_model_len ({config.max_model_len}) exceeds this model's attention chunk "
                                   f"({self.chunk_view}), which is not a multiple of block_size "
                                   f"({config.block_size}): the engine reads a chunk from its first block")
        self.num_layers = hf_config.num_hidden_layers
        # This rank's KV heads: the attention layers see 1/N of them under tensor parallelism.
        kv_heads, self.head_dim = kv_heads_and_head_dim(hf_config)
        self.num_kv_heads = kv_heads // self.world_size
        self.block_size = config.block_size
        self.attention_impl = ops.resolve_impl(None, self.device.type)
        capability = torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else None
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, dtype, self.device.type, capability)
        ops.prepare(self.attention_impl, self.device.type, self.kv_dtype)
        self._model_call = self.model
        self.lora = None
        # The first forward passes (what the attention layers ask; on a GPU, the largest step's memory) run
        # over a pool of one block, into which they write nothing; then the pool is sized and allocated.
        self.layer_groups = None  # a hybrid model's: each layer's group of block tables (hybrid_blocks.py)
        self._allocate_pool(1)
        calls = self._check_attention_calls()
        self.sliding_window = common_sliding_window(calls)  # every layer's, when they share one; else None
        self.hybrid_window, self.window_groups = None, 0
        if config.hybrid_kv_cache:
            self._group_layers(*windowed_layers(calls))
            if self.chunk_view and not all(self.chunked_layers):  # (a chunked layer reads no key a chunk behind)
                self._group_layers(self.chunk_view, frozenset(i for i, chunked in enumerate(self.chunked_layers)
                                                              if chunked))
        self._allocate_pool(self._pool_size())
        self.host_kv = self._allocate_host_tier()  # (None: no host tier)
        # Before packing and fusing: the adapters' hooks keep their layers unmerged (fused_layers.py).
        self.lora = (LoRAAdapters(self.model, config.lora_modules or {}, dtype, self.device, config.lora_task_slots,
                                  config.max_lora_rank)
                     if config.lora_modules or config.lora_task_slots else None)
        self.max_model_len = self._max_model_len()
        fix_rotary_frequencies(self.model, self.max_model_len, self.device)
        # (a step verifying drafts in a CUDA graph pads a sequence's tokens to the verify length: its
        # table is read that far past max_model_len)
        self.buffers = InputBuffers(config.max_num_batched_tokens, config.max_num_seqs,
                                    -(-(self.max_model_len + self._verify_len() - 1) // self.block_size), self.device,
                                    window_groups=self.window_groups, block_size=self.block_size,
                                    chunk_width=-(-(self.chunk_view + self._verify_len() - 1) // self.block_size)
                                    if self.chunk_view else 0)
        self.table_rows = BlockTableRows()
        self.window_table_rows = [BlockTableRows() for _ in range(self.window_groups)]
        if self._use_packed_weights():
            # A step samples one row a sequence: the output head needs no more rows, prompt logprobs aside.
            pack_linear_layers(self.model, config.max_num_seqs, config.max_num_batched_tokens,
                               head_rows=config.max_num_seqs,
                               merge_siblings=self.hf_config.model_type in FUSED_MODEL_TYPES)
            pack_experts(self.model, config.max_num_seqs, config.max_num_batched_tokens)
            contiguous_rotary_embeddings(self.model)  # (with the packed layers: a row's bits whatever the batch)
        self.fused_layers = None
        if config.torch_compile:
            self._compile()
        elif self._use_fused_layers():
            self._fuse_layers()
        if self.device.type == "cuda" and self.attention_impl == "triton":
            # Every rank must run the same warm-up steps (their forwards meet in collectives).
            num_sms = self._smallest_over_ranks(torch.cuda.get_device_properties(self.device).multi_processor_count)
            compile_attention_kernels(self._forward, self.buffers, config.max_num_seqs, config.max_num_batched_tokens,
                                      self.num_kv_heads, self.block_size, num_sms)
        self.graphs = self._capture_graphs() if self._use_cuda_graphs() else None

    def _group_layers(self, window: int | None, windowed: frozenset[int]) -> None:
        """Layers within a window beside layers over their whole context, at least as many of them: groups
        of as many layers as the full ones, group 0 the full layers, 1.. the windowed ones, each group with
        block tables of its own, its layer i in the cache's slot i (hybrid_blocks.py)."""
        full = [layer for layer in range(self.num_layers) if layer not in windowed]
        if not windowed or len(windowed) < len(full):
            return  # (fewer windowed layers than full ones: one table for all, as gains little)
        self.hybrid_window = window
        self.window_groups = -(-len(windowed) // len(full))
        self.layer_groups = [0] * self.num_layers
        self._layer_slots = list(range(self.num_layers))
        for i, layer in enumerate(full):
            self._layer_slots[layer] = i
        for i, layer in enumerate(sorted(windowed)):
            self.layer_groups[layer], self._layer_slots[layer] = 1 + i // len(full), i % len(full)
        logger.info("KV cache: %d layers attend within a window of %d and %d over their whole context: "
                    "%d groups of block tables", len(windowed), window, len(full), 1 + self.window_groups)

    @property
    def _cache_slots(self) -> int:
        """Layers a block holds: every layer, or a hybrid model's group's."""
        return self.num_layers if self.layer_groups is None else max(self._layer_slots) + 1

    def _allocate_pool(self, num_blocks: int) -> None:
        """The KV pool of `num_blocks` blocks, in place of any before, and its tokens' ids (token_history.py)."""
        self.num_blocks = num_blocks
        self._kv_bytes = self.kv_cache = self.kv_caches = self.token_history = None  # (the old pool freed first)
        # One tensor for the whole pool: [layer (a hybrid model's: slot), key/value, block, slot, kv head, head dim].
        # (fp8 through bytes: torch's fills and indexed copies do not take every fp8 dtype on every device)
        shape = (self._cache_slots, 2, num_blocks, self.block_size, self.num_kv_heads,
                 self.head_dim * self.kv_dtype.itemsize)
        self._kv_bytes = zeros_mapped_when_written(shape) if self.device.type == "cpu" else \
            torch.zeros(shape, dtype=torch.uint8, device=self.device)
        self.kv_cache = self._kv_bytes.view(self.kv_dtype)
        slots = range(self.num_layers) if self.layer_groups is None else self._layer_slots
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in slots]
        self.token_history = TokenHistory(num_blocks, self.block_size, self.hf_config.vocab_size, self.device)

    @torch.inference_mode()
    def _check_attention_calls(self) -> list:
        """One forward pass of two tokens that records what each attention layer asks (model_support.py);
        returns the calls."""
        calls = []
        probe = empty_prefill(min(2, self.config.max_num_batched_tokens), self.block_size)
        step = InputBuffers(len(probe.input_ids), 1, 1, self.device).load(probe)
        try:
            self._forward(step, calls=calls)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # the modeling code broke on what our attention returns or is given
            raise refuse(self.hf_config.model_type, "its first forward pass through inflight's attention failed: "
                                                    f"{type(e).__name__}: {e}") from e
        check_attention_calls(calls, self.hf_config.model_type, self.num_layers, self.num_kv_heads, self.head_dim,
                              self.world_size)
        return calls

    def _capture_graphs(self) -> StepGraphs | None:
        """The steps' graphs; where those of steps with prompt chunks fail to capture, the others alone;
        None, with a warning, where the model cannot be captured at all (modeling code that waits for the GPU
        in its forward, as some mixtures of experts' routing does): eager steps."""
        max_tokens = self.config.cuda_graph_max_tokens
        while True:
            graphs = StepGraphs(self._forward, self.buffers, self.config.max_num_seqs, lora=self.lora is not None,
                                verify_len=self._verify_len(), verify_seqs=self._verify_seqs(), max_tokens=max_tokens)
            try:
                graphs.capture()
                return graphs
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as e:
                if not graphs.token_buckets:
                    logger.warning("CUDA graphs could not be captured for model type %s, so its steps run eagerly: "
                                   "%s", self.hf_config.model_type, e)
                    return None
                logger.warning("CUDA graphs of steps with prompt chunks could not be captured for model type %s, so "
                               "those steps run eagerly: %s", self.hf_config.model_type, e)
                max_tokens = 0

    def _verify_len(self) -> int:
        """Tokens a sequence in a step that verifies n-gram drafts: its last token and the drafts (1: none)."""
        spec = self.config.speculative_config
        return 1 if spec is None else spec.num_speculative_tokens + 1

    def _verify_seqs(self) -> int:
        """The most sequences a step that verifies drafts has: fewer than disable_by_batch_size, and each a
        verify length within the token budget."""
        spec = self.config.speculative_config
        if spec is None:
            return 0
        limit = self.config.max_num_seqs if spec.disable_by_batch_size is None else spec.disable_by_batch_size - 1
        return min(limit, self.config.max_num_seqs, self.config.max_num_batched_tokens // self._verify_len())

    def _compile(self) -> None:
        """torch.compile the model (our attention stays a graph break: attention.py), with dynamic shapes,
        and compile now, on a step of each shape class that writes no KV, rather than in a request."""
        started = time.perf_counter()
        self._model_call = torch.compile(self.model, dynamic=True)
        compile_shape_classes(self._forward, self.buffers, self.config.max_num_batched_tokens,
                              self.config.max_num_seqs, self.block_size)
        logger.info("torch.compile: compiled in %.1f s", time.perf_counter() - started)

    def _fuse_layers(self) -> None:
        """Swap in the fused functions and compile them now. Where the setting is unset and they fail to
        compile, the model keeps transformers' own layers (a warning says why)."""
        fused = None
        try:
            fused = FusedLayers(self.model, self.hf_config.model_type, getattr(self.hf_config, "hidden_act", None),
                                self.device, self.dtype)
            self._model_call = fused.wrap(self.model)
            if fused.compiles:
                warm_up_fused_layers(self._forward, self.buffers, self.config.max_num_batched_tokens, self.block_size)
        except Exception as e:
            if self.config.fused_layers:
                raise
            logger.warning("fused layers failed to compile, so transformers' own layers run: %s", e)
            if fused is not None:
                fused.remove()
            self._model_call = self.model
            return
        self.fused_layers = fused

    def _max_model_len(self) -> int:
        """Prompt plus output of one sequence: the setting, or the model's limit capped by the pool (not
        by the pool when its layers share a sliding window: a sequence holds only the window's blocks; a
        hybrid model's, by the pool less its windowed groups' blocks of one sequence)."""
        pool_tokens = self._sequence_blocks() * self.block_size
        capacity = None if self._pool_holds_window() else pool_tokens
        if self.config.max_model_len is None:
            limit = getattr(self.hf_config, "max_position_embeddings", None) or pool_tokens
            if capacity is not None:
                limit = min(limit, capacity)
            elif limit > pool_tokens:
                logger.info("max_model_len %d, beyond the KV pool's %d tokens: every layer attends within a "
                            "window of %d, and a sequence gives back the blocks behind it", limit, pool_tokens,
                            self.sliding_window)
            if self.attention_chunk is not None and limit > self.attention_chunk:
                logger.info("max_model_len %d, this model's attention chunk: set max_model_len for longer contexts "
                            "(up to %d here)", self.attention_chunk, limit)
                return self.attention_chunk
            return limit
        if capacity is not None and self.config.max_model_len > capacity:
            raise ValueError(f"max_model_len ({self.config.max_model_len}) exceeds the KV pool's "
                             f"{capacity} tokens; raise num_kv_blocks or kv_cache_memory")
        return self.config.max_model_len

    def _sequence_blocks(self) -> int:
        """The most blocks of the full layers one sequence may hold: the pool's; a hybrid model's, the pool's
        less what its windowed groups hold of it (hybrid_blocks.py): as many as its full layers' while it is
        shorter than a window, at most a window's and two blocks each."""
        if not self.window_groups:
            return self.num_blocks
        groups = 1 + self.window_groups
        if self.num_blocks < groups:
            raise ValueError(f"the KV pool's {self.num_blocks} blocks hold no sequence, which takes a block in each "
                             f"of the model's {groups} groups of layers (hybrid_kv_cache); raise num_kv_blocks or "
                             "kv_cache_memory")
        window = blocks_a_window_holds(self.hybrid_window, self.block_size)
        return max(self.num_blocks // groups, self.num_blocks - self.window_groups * window)

    def _pool_holds_window(self) -> bool:
        """Whether the layers share a sliding window and the pool holds a sequence's blocks within it plus
        the one its next token may start: then a sequence alone always goes on, however long."""
        if self.sliding_window is None:
            return False
        return self.num_blocks >= -(-(self.sliding_window - 1) // self.block_size) + 2

    def _use_packed_weights(self) -> bool:
        cfg = self.config
        if not cfg.packed_weights or self.device.type != "cpu" or self.world_size > 1 or cfg.torch_compile:
            return False
        if not packing_available():
            logger.warning("this torch has no oneDNN weight packing; linear layers run unpacked")
            return False
        return True

    def _use_fused_layers(self) -> bool:
        """The setting; unset: for the model types the fused functions cover, on a GPU, and on a CPU in
        float32 where its C kernels build (compiled functions cost more there than they save)."""
        if self.config.fused_layers is not None:
            return self.config.fused_layers
        if self.hf_config.model_type not in FUSED_MODEL_TYPES:
            return False
        return self.device.type == "cuda" or (self.dtype == torch.float32 and ops.cpu_kernels.layer_ops() is not None)

    def _use_cuda_graphs(self) -> bool:
        if not self.config.cuda_graphs or self.device.type != "cuda":
            return False
        if self.attention_impl != "triton":
            logger.warning("CUDA graphs need the Triton attention kernels; decode steps run eagerly")
            return False
        if self.world_size > 1:
            logger.warning("CUDA graphs are not used under tensor parallelism yet; decode steps run eagerly")
            return False
        return True

    @property
    def bytes_per_block(self) -> int:
        """A block's keys and values in every layer (a hybrid model's group's), and its tokens' ids
        (token_history.py)."""
        return kv_bytes_per_block(self.block_size, self._cache_slots, self.num_kv_heads, self.head_dim, self.kv_dtype)

    def _pool_size(self) -> int:
        """The pool's blocks: the setting's, or as many as its budget holds (kv_cache_memory, or a share of
        the free memory; on a GPU, less what the largest step takes beside the pool: step_memory.py)."""
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        budget, step_bytes = cfg.kv_cache_memory, 0
        if budget is None:
            fraction = cfg.kv_cache_memory_fraction or cfg.DEFAULT_MEMORY_FRACTION[self.device.type]
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                step_bytes = self._largest_step_bytes()
            else:
                free = psutil.virtual_memory().available
            budget = int(free * fraction) - step_bytes - self.beside[1]
            if step_bytes and budget < self.bytes_per_block:
                raise ValueError(
                    f"a step of max_num_batched_tokens ({cfg.max_num_batched_tokens}) tokens sampling max_num_seqs "
                    f"({cfg.max_num_seqs}) rows takes {step_bytes / 2**30:.2f} GiB beside the KV cache, which leaves "
                    f"no block of the share kv_cache_memory_fraction {fraction} of the {free / 2**30:.2f} GiB free: "
                    "lower those limits or raise the share")
        per_block = self.bytes_per_block + self.beside[0]
        blocks = self._smallest_over_ranks(budget // per_block)  # every rank holds the same block ids
        if blocks < 1:
            raise ValueError(f"the KV cache budget of {budget} bytes holds no block of {per_block} bytes")
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB, %s)%s%s", blocks, self.block_size,
                    blocks * self.bytes_per_block / 2**30, str(self.kv_dtype).removeprefix("torch."),
                    f"; {step_bytes / 2**30:.2f} GiB left for the largest step" if step_bytes else "",
                    f"; {(blocks * self.beside[0] + self.beside[1]) / 2**30:.2f} GiB left for the draft model"
                    if self.beside[0] else "")
        return blocks

    def _largest_step_bytes(self) -> int:
        """What the largest step's forward and sampling take on the GPU beside the pool (step_memory.py): run
        now over the pool of one block. A GPU too small for it says so here, not in a request."""
        step = largest_step(self.config.max_num_batched_tokens, self.config.max_num_seqs, self.block_size,
                            self.device)
        try:
            return peak_bytes(lambda: run_largest_step(self._forward, step), self.device)
        except torch.OutOfMemoryError as e:
            raise ValueError(f"a step of max_num_batched_tokens ({self.config.max_num_batched_tokens}) tokens "
                             f"sampling max_num_seqs ({self.config.max_num_seqs}) rows does not fit in this GPU's "
                             f"memory beside the weights: lower those limits ({e})") from e

    def _smallest_over_ranks(self, value: int) -> int:
        """`value` on one rank; under tensor parallelism, the smallest of every rank's."""
        if self.world_size == 1:
            return value
        smallest = torch.tensor([value], device=self.device)
        dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
        return int(smallest.item())

    def _allocate_host_tier(self) -> HostKVStore | None:
        """The host tier's slots (kv_offload.py): as many blocks as kv_offload_memory holds, split over the ranks."""
        memory = self.config.kv_offload_memory
        if not memory:
            return None
        slots = self._smallest_over_ranks(memory // self.world_size // self.bytes_per_block)
        if slots < 1:
            split = f", split over {self.world_size} ranks" if self.world_size > 1 else ""
            raise ValueError(f"kv_offload_memory ({memory} bytes{split}) holds no KV block of {self.bytes_per_block} "
                             "bytes")
        started = time.perf_counter()
        store = HostKVStore(slots, self._kv_bytes, self.token_history.by_block)
        logger.info("KV host tier: %d blocks of %d tokens (%.2f GiB%s%s), allocated in %.1f s", slots,
                    self.block_size, store.nbytes / 2**30, " pinned" if self.device.type == "cuda" else "",
                    f" on each of {self.world_size} ranks" if self.world_size > 1 else "",
                    time.perf_counter() - started)
        return store

    @property
    def host_slots(self) -> int:
        return 0 if self.host_kv is None else len(self.host_kv.kv)

    @torch.inference_mode()
    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        """Make the block manager's copies, in order: the KV of a block in every layer, and its tokens' ids,
        to another block, to a slot of the host tier or from one."""
        for kind, sources, destinations in runs_of_kind(copies):
            if kind == ON_DEVICE:
                src, dst = to_device(sources, self.device), to_device(destinations, self.device)
                self._kv_bytes[:, :, dst] = self._kv_bytes[:, :, src]
                self.token_history.copy_blocks(src, dst)
            elif kind == TO_HOST:
                self.host_kv.store(to_device(sources, self.device), destinations)
            else:
                assert kind == FROM_HOST
                self.host_kv.load(sources, to_device(destinations, self.device))

    def prepare(self, batch: ScheduledBatch, logits_at: list[int],
                block_copies: list[BlockCopy] | None = None) -> StepInputs:
        """The step's inputs; logits are returned at the flat positions `logits_at` (a sequence's last
        scheduled token where it samples; prompt positions where prompt logprobs are asked for)."""
        return build_step_inputs(batch, self.block_size, logits_at, block_copies, self.table_rows,
                                 self.window_table_rows, self.chunk_view)

    def execute(self, batch: ScheduledBatch, logits_at: list[int], block_copies: list[BlockCopy] | None = None,
                pending: tuple[torch.Tensor, list[int], list[int]] | None = None) -> torch.Tensor:
        """Copy the blocks asked for, run the scheduled tokens; logits [len(logits_at), vocab].
        `pending`: (the previous step's sampled tokens on the device, the flat positions whose token
        is one of them, its row there), under async scheduling."""
        inputs = self.prepare(batch, logits_at, block_copies)
        sampled = None
        if pending is not None:
            sampled, at, rows = pending
            inputs.pending_at, inputs.pending_rows = np.asarray(at, dtype=np.int64), np.asarray(rows, dtype=np.int64)
        return self.run(inputs, sampled)

    def load_lora_slot(self, slot: int, lora_id: int, matrices: dict) -> None:
        """Between steps: a LoRA task's A and B into a slot (lora.py)."""
        self.lora.load_slot(slot, lora_id, matrices)

    @torch.inference_mode()
    def run(self, inputs: StepInputs, sampled: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [len(logits_at), vocab], float32; valid until the next step."""
        for slot, lora_id, matrices in inputs.lora_slot_loads:  # (tensor parallelism's: parallel.py)
            self.load_lora_slot(slot, lora_id, matrices)
        self.copy_blocks(inputs.block_copies)
        self.token_history.step_ran(self.buffers.device_tables, inputs.seq_lens)
        logits = self.graphs.replay(inputs, sampled) if self.graphs is not None else None
        return logits if logits is not None else self._forward(self.buffers.load(inputs, sampled=sampled))

    def _forward(self, step: StepTensors, calls: list | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits, a row per token or per step.logits_at: a new tensor, or written into `out` (the CUDA
        graphs' one output, cuda_graphs.py)."""
        if self.lora is not None:
            self.lora.begin_step(step.lora_ids)
        self.token_history.write(step.slot_mapping, step.input_ids)
        context = AttentionContext(
            kv_caches=self.kv_caches,
            slot_mapping=step.slot_mapping,
            cu_seqlens_q=step.cu_seqlens,
            seq_lens=step.seq_lens,
            block_tables=step.block_tables,
            impl=self.attention_impl,
            num_decodes=step.num_decodes,
            query_len=step.query_len,
            calls=calls,
            layer_groups=self.layer_groups if step.window_block_tables else None,
            window_slot_mappings=step.window_slot_mappings,
            window_block_tables=step.window_block_tables,
            attend_within=step.attend_within,
            spans_past_window=self.spans_past_window,
            chunked_layers=self.chunked_layers,
            chunk_seq_lens=step.chunk_seq_lens,
            chunk_block_tables=[] if step.chunk_first_blocks is None else [
                chunk_tables(tables, step.chunk_first_blocks, step.chunk_width)
                for tables in [step.block_tables, *step.window_block_tables]],
            query_scales=None if self.query_scaling is None else self._query_scales(step.positions),
        )
        if step.embeds is None:
            tokens = dict(input_ids=step.input_ids[None])
        else:
            tokens = dict(inputs_embeds=embed(self.model, step.input_ids, step.embeds_at, step.embeds)[None])
        output = self._model_call(
            **tokens,
            position_ids=step.positions[None],
            use_cache=False,
            logits_to_keep=0 if step.logits_at is None else step.logits_at,
            inflight_context=context,
        )
        return output.logits[0].float() if out is None else out.copy_(output.logits[0])

    def _query_scales(self, positions: torch.Tensor) -> torch.Tensor:
        """Each token's query scale (model_support.take_over_query_scaling), on the device: in a CUDA graph too."""
        floor_scale, scales = self.query_scaling
        steps = ((positions + 1).float() / floor_scale).floor_().long().clamp_(max=len(scales) - 1)
        return scales[steps]

    def close(self) -> None:
        """Nothing to release in-process; the tensor-parallel runner stops its workers."""
