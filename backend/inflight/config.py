"""EngineConfig: every engine knob, validated once. The same names are used by `LLM(...)`,
`model_repository/llm/1/model.json`, the metrics and the README."""

from dataclasses import dataclass, fields


def auto_device() -> str:
    """What device "auto" means: the first GPU when one is visible, else the CPU."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(device: str) -> str:
    return auto_device() if device == "auto" else device


@dataclass(frozen=True)
class SpeculativeConfig:
    """`speculative_config` (vLLM's names): {"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_max": n, "prompt_lookup_min": m, "disable_by_batch_size": b}, or a draft model's
    {"method": "draft_model", "model": folder, "num_speculative_tokens": k, "disable_by_batch_size": b}
    (the method inferred from "model", as vLLM infers it)."""

    num_speculative_tokens: int
    prompt_lookup_max: int = 4  # the longest n-gram looked for (the longest match wins)
    prompt_lookup_min: int = 2  # the shortest n-gram that may propose
    # No drafts in a step with this many decoding sequences or more: a large batch is compute-bound, and
    # verifying drafts there costs more than it gains. None: always.
    disable_by_batch_size: int | None = None
    method: str = "ngram"
    model: str | None = None  # the draft model's folder (method "draft_model": draft_model.py)

    METHODS = ("ngram", "draft_model")

    @classmethod
    def from_value(cls, value: "dict | SpeculativeConfig") -> "SpeculativeConfig":
        if isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be an object, got {value!r}")
        known = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                 "disable_by_batch_size", "draft_tensor_parallel_size"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s): {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))})")
        values = dict(value)
        ranks = values.pop("draft_tensor_parallel_size", None)  # (vLLM's; one rank is all there is here)
        if ranks is not None and (isinstance(ranks, bool) or ranks != 1):
            raise ValueError(f"speculative_config draft_tensor_parallel_size must be 1, got {ranks!r}: the draft "
                             "model runs whole, on the first rank's device")
        method = values.setdefault("method", "draft_model" if values.get("model") is not None else "ngram")
        if method not in cls.METHODS:
            raise ValueError(f"speculative_config method {method!r} is not served: \"ngram\" (drafts looked up "
                             "in the sequence's own tokens) or \"draft_model\" (drafts from a smaller model of the "
                             "same tokenizer, its folder in \"model\")")
        if "num_speculative_tokens" not in values:
            raise ValueError("speculative_config needs num_speculative_tokens (drafts a step)")
        if method == "draft_model":
            cls._check_draft_model(values)
        elif values.get("model") is not None:
            raise ValueError("speculative_config model is a draft model's folder: method \"draft_model\", not "
                             "\"ngram\"")
        if "prompt_lookup_max" in values and "prompt_lookup_min" not in values:  # (one given: the other fits it)
            values["prompt_lookup_min"] = min(cls.prompt_lookup_min, values["prompt_lookup_max"])
        if "prompt_lookup_min" in values and "prompt_lookup_max" not in values:
            values["prompt_lookup_max"] = max(cls.prompt_lookup_max, values["prompt_lookup_min"])
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            v = values.get(name, 1)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"speculative_config {name} must be a positive integer, got {v!r}")
        config = cls(**values)
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({config.prompt_lookup_min}) exceeds "
                             f"prompt_lookup_max ({config.prompt_lookup_max})")
        return config

    @staticmethod
    def _check_draft_model(values: dict) -> None:
        model = values.get("model")
        if not isinstance(model, str) or not model:
            raise ValueError(f"speculative_config method \"draft_model\" needs model, the draft model's folder, "
                             f"got {model!r}")
        lookups = sorted({"prompt_lookup_max", "prompt_lookup_min"} & set(values))
        if lookups:
            raise ValueError(f"speculative_config {' and '.join(lookups)}: the \"ngram\" method's, not a draft "
                             "model's")


@dataclass
class EngineConfig:
    model: str
    # float32 | float16 | bfloat16 | auto: bfloat16 on a GPU (float16 where the checkpoint is float16),
    # float32 on a CPU
    dtype: str = "auto"
    # The KV cache's: auto (the model's dtype) | float32 | float16 | bfloat16 | fp8 (= fp8_e4m3) | fp8_e4m3 |
    # fp8_e5m2. A float32 model with a bfloat16 cache holds twice the tokens, and its decode attention reads
    # half the bytes; an fp8 cache holds twice a 16-bit one's.
    kv_cache_dtype: str = "auto"
    # fp8: an unquantized checkpoint's linear layers (not the output head) quantized to FP8 as it loads, in
    # blocks of 128 x 128 (transformers' fine-grained FP8; a GPU of compute capability 8.9 on: half the weights'
    # memory of 16 bits). None: the checkpoint's own quantization, if any (quantization.py).
    quantization: str | None = None
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # pool size as a block count ...
    kv_cache_memory: int | None = None  # ... or as bytes ...
    kv_cache_memory_fraction: float | None = None  # ... or as a share of free device memory
    # Bytes of host memory (all ranks together) for a second tier of the prefix cache: cached blocks the pool
    # hands to other sequences are kept there, and copied back when a prompt's prefix finds them
    # (kv_offload.py; TensorRT-LLM's host cache). None or 0: none.
    kv_offload_memory: int | None = None
    # Sequences running at once, and the token budget of one step (decodes + prefill chunks). None: the
    # device's default (DEFAULT_BATCH_LIMITS), the budget at least max_num_seqs.
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # prompt + output; default: the model's limit, capped by the pool
    enable_prefix_caching: bool = True
    # Models that alternate windowed and full layers (Gemma 2 and 3, gpt-oss) keep the windowed layers' blocks
    # in block tables of their own, which hold a sequence's window alone (hybrid_blocks.py); false: one table
    # for every layer (vLLM's disable_hybrid_kv_cache_manager).
    hybrid_kv_cache: bool = True
    device: str = "auto"  # auto (cuda when a GPU is visible, else cpu) | cpu | cuda | cuda:N
    # Steps replay CUDA graphs captured at start-up (cuda_graphs.py): decode steps, steps verifying drafts,
    # and steps with prompt chunks of up to cuda_graph_max_tokens tokens (0: none of those); no effect on a CPU.
    cuda_graphs: bool = True
    cuda_graph_max_tokens: int = 2048
    # On a CPU, linear layers run through oneDNN with weights packed at start-up (cpu_runtime.py);
    # no effect on a GPU, under tensor parallelism or with torch_compile (whose inductor packs its own).
    packed_weights: bool = True
    # torch.compile the model around our attention: fewer, fused kernels per layer; compiles at start-up.
    torch_compile: bool = False
    # The decoder layers' norms, rotary embedding and SiLU-and-multiply as fused kernels, and the q/k/v and
    # gate/up projections each as one matmul (fused_layers.py), for Llama-family models. None: on for a GPU
    # (unless torch_compile) and on a CPU in float32 (C kernels there), off on a CPU in other dtypes.
    fused_layers: bool | None = None
    # Schedule and launch step N+1 before reading step N's tokens, so that the host's work overlaps the
    # GPU's (engine.py). None: on for one CUDA device, off on a CPU (where nothing runs asynchronously).
    async_scheduling: bool | None = None
    # Ranks of tensor parallelism: each holds 1/N of the weights and of the KV heads (parallel.py).
    tensor_parallel_size: int = 1
    # GPU of each rank (rank r on gpu_device_ids[r]); default: cuda:K's K and the GPUs after it.
    gpu_device_ids: list[int] | None = None
    trust_remote_code: bool = False
    num_threads: int | None = None  # torch CPU threads; None leaves torch's default
    # A step that raises fails its own requests and the engine goes on; this many failed steps with no
    # tokens delivered between them (a sticky device error, say) and the engine stops: every request
    # ends with an error.
    max_consecutive_failed_steps: int = 3
    # LoRA adapters served beside the base model: name -> peft adapter folder (lora.py). A request names
    # one (`lora_name`) or none; every adapter is loaded at start-up.
    lora_modules: dict[str, str] | None = None
    # TensorRT-LLM's LoRA inputs: adapters sent with requests (lora_task_id, lora_weights, lora_config),
    # kept in this many slots, each of up to max_lora_rank (lora_tasks.py). 0: none taken.
    lora_task_slots: int = 0
    max_lora_rank: int = 16
    # Speculative decoding (speculative.py), vLLM's names: {"method": "ngram", "num_speculative_tokens": k,
    # ...} or a draft model's {"model": folder, "num_speculative_tokens": k} (draft_model.py); see
    # SpeculativeConfig. None: a token a step.
    speculative_config: SpeculativeConfig | dict | None = None
    # A vision-language model's images (images.py): at most this many in one prompt (vLLM's
    # limit_mm_per_prompt), each run through the vision tower when its request is added.
    max_images_per_prompt: int = 4
    # Bytes of recent prompts' image vectors kept (by a digest of their pixels), so that an image sent
    # again (a chat's every turn) skips the vision tower. 0: none kept.
    image_cache_memory: int = 1 << 28

    # Share of free memory given to the KV pool when neither a block count nor bytes are set.
    # A GPU holds little else; on a CPU host the rest of the machine needs its memory.
    DEFAULT_MEMORY_FRACTION = {"cuda": 0.9, "cpu": 0.2}
    # (max_num_seqs, max_num_batched_tokens) when not set. A GPU's step costs about the same for 64 or 256
    # decodes and fills up with thousands of prefill tokens (64 / 512 ran the GPU engine issue's workload at
    # half the rate of 256 / 4096); a CPU's step grows with every row.
    DEFAULT_BATCH_LIMITS = {"cuda": (256, 8192), "cpu": (64, 512)}

    def __post_init__(self) -> None:
        def positive(name: str, allow_none: bool = False) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        self.device = resolve_device(self.device)
        if not isinstance(self.device, str) or self.device_type not in self.DEFAULT_MEMORY_FRACTION:
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        default_seqs, default_tokens = self.DEFAULT_BATCH_LIMITS[self.device_type]
        if self.max_num_seqs is None:
            self.max_num_seqs = default_seqs
        if self.max_num_batched_tokens is None and isinstance(self.max_num_seqs, int):
            self.max_num_batched_tokens = max(default_tokens, self.max_num_seqs)
        if self.dtype not in ("float32", "float16", "bfloat16", "auto"):
            raise ValueError(f"dtype must be float32, float16, bfloat16 or auto, got {self.dtype!r}")
        if self.kv_cache_dtype not in ("float32", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "auto"):
            raise ValueError("kv_cache_dtype must be float32, float16, bfloat16, fp8, fp8_e4m3, fp8_e5m2 or auto, "
                             f"got {self.kv_cache_dtype!r}")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be fp8 or null (the checkpoint's own), got {self.quantization!r}")
        positive("block_size")
        if self.block_size & (self.block_size - 1) or self.block_size < 8:
            raise ValueError(f"block_size must be a power of two of at least 8, got {self.block_size}")
        positive("num_kv_blocks", allow_none=True)
        positive("kv_cache_memory", allow_none=True)
        positive("max_num_seqs")
        positive("max_num_batched_tokens")
        positive("max_model_len", allow_none=True)
        positive("num_threads", allow_none=True)
        positive("max_consecutive_failed_steps")
        positive("max_images_per_prompt")
        if isinstance(self.image_cache_memory, bool) or not isinstance(self.image_cache_memory, int) \
                or self.image_cache_memory < 0:
            raise ValueError(f"image_cache_memory must be a number of bytes (0: none), got {self.image_cache_memory!r}")
        graph_tokens = self.cuda_graph_max_tokens
        if isinstance(graph_tokens, bool) or not isinstance(graph_tokens, int) or graph_tokens < 0:
            raise ValueError(f"cuda_graph_max_tokens must be an integer of at least 0, got {graph_tokens!r}")
        positive("tensor_parallel_size")
        for name in ("cuda_graphs", "packed_weights", "torch_compile", "enable_prefix_caching", "hybrid_kv_cache",
                     "trust_remote_code"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        self._check_gpu_device_ids()
        if self.fused_layers is not None and not isinstance(self.fused_layers, bool):
            raise ValueError(f"fused_layers must be true, false or null, got {self.fused_layers!r}")
        if self.fused_layers and self.torch_compile:
            raise ValueError("fused_layers and torch_compile: set one (torch_compile fuses these layers itself)")
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.from_value(self.speculative_config)
        if self.async_scheduling is None:
            self.async_scheduling = self.device_type == "cuda" and self.tensor_parallel_size == 1
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be true, false or null, got {self.async_scheduling!r}")
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError("async_scheduling needs tensor_parallel_size 1 (the workers would need the GPU's "
                             "sampled tokens)")
        self._check_lora_modules()
        pool_sizes = [name for name in ("num_kv_blocks", "kv_cache_memory", "kv_cache_memory_fraction")
                      if getattr(self, name) is not None]
        if len(pool_sizes) > 1:
            raise ValueError(f"set one of num_kv_blocks, kv_cache_memory and kv_cache_memory_fraction, "
                             f"not {' and '.join(pool_sizes)}")
        frac = self.kv_cache_memory_fraction
        if frac is not None and (isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0.0 < frac <= 1.0):
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {frac!r}")
        offload = self.kv_offload_memory
        if isinstance(offload, bool) or not isinstance(offload, (int, type(None))) or (offload or 0) < 0:
            raise ValueError(f"kv_offload_memory must be a number of bytes (0 or null: none), got {offload!r}")
        if offload and not self.enable_prefix_caching:
            raise ValueError("kv_offload_memory keeps the prefix cache's blocks in host memory: it needs "
                             "enable_prefix_caching")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every running sequence must be able to decode in the same step.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs})"
            )

    def _check_gpu_device_ids(self) -> None:
        ids = self.gpu_device_ids
        if ids is None:
            return
        if self.device_type != "cuda":
            raise ValueError(f"gpu_device_ids needs device cuda, got device {self.device!r}")
        if (not isinstance(ids, list) or len(ids) != self.tensor_parallel_size or len(set(ids)) != len(ids)
                or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids)):
            raise ValueError(f"gpu_device_ids must list {self.tensor_parallel_size} distinct GPU indices "
                             f"(one per rank of tensor_parallel_size), got {ids!r}")

    def _check_lora_modules(self) -> None:
        modules = self.lora_modules
        if modules is not None and (
                not isinstance(modules, dict) or not modules
                or any(not isinstance(k, str) or not k or not isinstance(v, str) or not v for k, v in modules.items())):
            raise ValueError(f"lora_modules must map adapter names to adapter folders, got {modules!r}")
        for name, least in (("lora_task_slots", 0), ("max_lora_rank", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer of at least {least}, got {value!r}")
        setting = "lora_modules" if modules is not None else "lora_task_slots" if self.lora_task_slots else None
        if setting and self.torch_compile:
            raise ValueError(f"{setting} and torch_compile: set one (LoRA layers run as hooks, not compiled)")

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]

    def rank_devices(self) -> list[str]:
        """The device of each tensor-parallel rank."""
        if self.device_type == "cpu":
            return ["cpu"] * self.tensor_parallel_size
        if self.gpu_device_ids is not None:
            return [f"cuda:{i}" for i in self.gpu_device_ids]
        first = int(self.device.split(":")[1]) if ":" in self.device else 0
        return [f"cuda:{first + r}" for r in range(self.tensor_parallel_size)]

    @classmethod
    def from_dict(cls, values: dict) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown engine setting(s): {', '.join(unknown)}")
        return cls(**values)
