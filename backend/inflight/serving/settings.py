"""Settings of the Triton model, from model_repository/llm/1/model.json: the engine's own knobs (the
names of `LLM(...)`) plus the serving settings: admission and input-size limits, cancellation polling,
and whether responses are sent while the next step runs."""

import json
import os
from dataclasses import dataclass, fields

from ..config import EngineConfig, resolve_device
from ..sampling_params import SamplingParams


@dataclass
class ServingSettings:
    max_queued_requests: int = 1024  # waiting requests past which new ones are refused (UNAVAILABLE)
    max_tokens_limit: int = 4096  # the largest max_tokens a request may ask for
    max_prompt_tokens: int | None = None  # the longest prompt accepted (max_model_len applies anyway)
    default_max_tokens: int = 16  # max_tokens of a request that does not say
    # Input sizes, checked before any tokenization (the engine's own ceilings: SamplingParams).
    max_input_bytes: int = 1 << 20  # each text input (the prompt, sampling_parameters, each word)
    max_words: int = SamplingParams.MAX_STOP_STRINGS  # stop, bad and embedding bias words, each per request
    max_word_chars: int = SamplingParams.MAX_STOP_LENGTH  # characters in one stop, bad or embedding bias word
    max_image_bytes: int = 1 << 24  # each image of the `image` input, base64-encoded (a vision-language model's)
    # Asking Triton whether a request was cancelled is a message per request: at most this often.
    cancel_poll_interval_s: float = 0.2
    # The engine's metrics go to the server at most this often while it steps: each update is a message
    # to the server and its reply, with the interpreter lock held (measured: about 1.3 ms on 2 busy cores).
    metrics_interval_s: float = 1.0
    # Also export where the serving process spends its time (serving/profile.py), as
    # inflight_serving_*_total{part=...} counters: about 20 more messages each metrics_interval_s.
    serving_profile: bool = False
    # Send a step's responses while the next step runs (null: unless the engine runs on CPU on a thread
    # of the model's process; see engine_thread.py).
    overlap_sending: bool | None = None
    # Run the engine in a process of its own (engine_process.py), so that building and sending responses
    # here never waits for the engine's host work; false: on a thread of the Triton model's process.
    engine_process: bool = True
    # An engine step that has not ended after this many seconds while requests wait on it (a hung GPU, a
    # kernel that never returns) stops the engine process: its requests end with UNAVAILABLE and the model
    # reports not-ready, for an orchestrator to restart it. Null: never. (An engine on a thread of the
    # model's process cannot be stopped so: it has no such watch.)
    step_timeout_s: float | None = 300.0
    # Threads sending responses at once, each for its share of the requests (null: 1 on CPU, 4 on a GPU).
    sender_threads: int | None = None
    # vllm_backend's convention: the LoRA adapters come from multi_lora.json beside model.json
    # ({name: folder}) instead of lora_modules. Also "true" / "false" as vllm_backend writes it.
    enable_lora: bool = False

    def __post_init__(self) -> None:
        if self.enable_lora in ("true", "false"):
            self.enable_lora = self.enable_lora == "true"
        if self.overlap_sending is not None and not isinstance(self.overlap_sending, bool):
            raise ValueError(f"overlap_sending must be true, false or null, got {self.overlap_sending!r}")
        for name in ("cancel_poll_interval_s", "metrics_interval_s"):
            interval = getattr(self, name)
            if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0 <= interval <= 10:
                raise ValueError(f"{name} must be a number of seconds in [0, 10], got {interval!r}")
        timeout = self.step_timeout_s
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not 0 < timeout <= 86400):
            raise ValueError(f"step_timeout_s must be a number of seconds in (0, 86400] or null, got {timeout!r}")
        for name in ("serving_profile", "engine_process", "enable_lora"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        threads = self.sender_threads
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                    or not 1 <= threads <= 64):
            raise ValueError(f"sender_threads must be an integer in [1, 64] or null, got {threads!r}")
        for name in ("max_queued_requests", "max_tokens_limit", "max_prompt_tokens", "default_max_tokens",
                     "max_input_bytes", "max_words", "max_word_chars", "max_image_bytes"):
            value = getattr(self, name)
            if value is None and name == "max_prompt_tokens":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name, ceiling in (("max_words", SamplingParams.MAX_STOP_STRINGS),
                              ("max_word_chars", SamplingParams.MAX_STOP_LENGTH)):
            if getattr(self, name) > ceiling:
                raise ValueError(f"{name} must be at most {ceiling} (the engine's limit), got {getattr(self, name)}")


def split_settings(settings: dict) -> tuple[dict, ServingSettings]:
    """Engine settings (validated later by EngineConfig) and serving settings; unknown keys are an error."""
    engine_keys = {f.name for f in fields(EngineConfig)}
    serving_keys = {f.name for f in fields(ServingSettings)}
    unknown = sorted(set(settings) - engine_keys - serving_keys)
    if unknown:
        raise ValueError(f"unknown setting(s) in model.json: {', '.join(unknown)}")
    serving = ServingSettings(**{k: v for k, v in settings.items() if k in serving_keys})
    return {k: v for k, v in settings.items() if k in engine_keys}, serving


def resolve_lora_modules(lora_modules, enable_lora: bool, settings_dir: str, root: str):
    """The LoRA adapters to serve: model.json's lora_modules or, with enable_lora, multi_lora.json's
    (in the folder of model.json); a relative folder is taken from the project root, as `model` is.
    Anything but a mapping of names to folders is left for EngineConfig to refuse."""
    if enable_lora:
        if lora_modules is not None:
            raise ValueError("enable_lora reads the adapters from multi_lora.json: leave lora_modules out of "
                             "model.json (or leave enable_lora out)")
        path = os.path.join(settings_dir, "multi_lora.json")
        try:
            with open(path) as f:
                lora_modules = json.load(f)
        except OSError as e:
            raise ValueError(f"enable_lora is set, but {path} could not be read: {e.strerror}") from None
        except ValueError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(lora_modules, dict):
        return lora_modules
    return {name: _from_root(folder, root) for name, folder in lora_modules.items()}


def resolve_draft_model(speculative_config, root: str):
    """speculative_config with its draft model's folder, a relative one taken from the project root (as
    `model` is); anything else is left for EngineConfig to refuse."""
    if not isinstance(speculative_config, dict) or "model" not in speculative_config:
        return speculative_config
    return {**speculative_config, "model": _from_root(speculative_config["model"], root)}


def _from_root(folder, root: str):
    return os.path.join(root, folder) if isinstance(folder, str) and folder and not os.path.isabs(folder) else folder


def place_instance(engine_settings: dict, instance_kind: str, device_id: int, instance_count: int) -> dict:
    """The engine settings of one Triton model instance, with its GPUs. KIND_GPU: Triton gives each
    instance a GPU (one per entry of instance_group's `gpus`); rank 0 runs there and further
    tensor-parallel ranks on the GPUs after it. KIND_MODEL / KIND_CPU: model.json's device and
    gpu_device_ids apply as written, so several such instances on GPUs would share them: refused."""
    settings = dict(engine_settings)
    if instance_kind == "GPU":
        if settings.get("gpu_device_ids") is not None:
            raise ValueError("with instance_group kind KIND_GPU, Triton places each instance on a GPU of its "
                             "`gpus` list: leave gpu_device_ids out of model.json")
        settings["device"] = f"cuda:{device_id}"
    elif instance_count > 1 and resolve_device(str(settings.get("device", "auto"))).startswith("cuda"):
        raise ValueError(f"{instance_count} model instances of kind {instance_kind} would all run on the same GPUs; "
                         "use instance_group [ { kind: KIND_GPU, gpus: [...] } ] with one GPU per instance "
                         "(for tensor parallelism: each instance's first GPU)")
    return settings
