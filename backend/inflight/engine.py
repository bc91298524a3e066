"""The engine: add_request / step / abort / stats. Knows nothing of Triton.

`add_request` and `abort` may be called from any thread while another thread runs `step()`: they
only validate and post to an inbox, which `step()` drains under a lock before scheduling.

Every request admitted gets exactly one final delta, whatever fails. A step that raises ends the
requests of its batch with finish_reason "error" (every request, when the failure left the engine's
own state in doubt), frees their blocks, and the engine serves on. After
`max_consecutive_failed_steps` failed steps with no tokens delivered between them the engine is dead:
every request ends with an error and `add_request` raises EngineDeadError. (A step that only prefills
proves nothing of the stages after the forward pass, so it does not count between failures.)
"""

import bisect
import itertools
import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass

import numpy as np
import torch
from transformers import GenerationConfig

from . import beam_search, images, lora_tasks, prompt_embeds, prompt_logprobs, raw_logits
from .beam_search import BeamSearch
from .block_manager import BlockManager
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer, find_stop_string
from .draft_model import DraftModel
from .encoders import Encoders, copy_or_load
from .hybrid_blocks import HybridBlockManager
from .input_buffers import to_device
from .kv_offload import BlockCopy
from .logprobs import MeasuredLogprobs, entries, measure
from .lora_tasks import LoRATask, TaskRefused, TaskSlots, TaskWeights
from .model_runner import ModelRunner
from .outputs import RequestDelta, TokenLogprobs
from .parallel import RanksFailedError, TensorParallelRunner
from .prompt_embeds import PromptEmbeddings
from .prompt_logprobs import MeasuredPrompts
from .sampler import compile_kernels as compile_sampling_kernels, needs_of, sample
from .sampling_params import (BAD_WORDS, LOGPROBS, NO_REPEAT_NGRAMS, PROMPT_LOGITS, RAW_LOGITS, STRUCTURED,
                              TOKEN_CONTROLS, SamplingParams)
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence, SequenceStatus
from .speculative import NgramProposer, accepted_tokens, draft_distributions, verify
from .structured_output import StructuredOutputs
from .tokenizer_cache import load_tokenizer

logger = logging.getLogger(__name__)
FINISHED = SequenceStatus.FINISHED
# Bounds of the histograms of a step's token count and of its time (the engine counts its steps in them:
# stats()).
STEP_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
STEP_SECONDS_BUCKETS = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0]

# An abort may overtake its request (a client that cancels at once): it waits this long for it.
EARLY_ABORT_MEMORY_S = 60.0
# The error of a request whose constraints banned every token (its row sampled a banned one anyway).
NO_TOKEN_LEFT = ("no token can follow: the request's constraints together (structured_outputs, "
                 "allowed_token_ids, bad_words, min_tokens) allow none at this point of its output")
# What a delta may carry besides tokens and text (logprobs, raw logits, prompt logprobs): none, the quick way.
_DELTA_EXTRAS = LOGPROBS | RAW_LOGITS | PROMPT_LOGITS


class EngineDeadError(RuntimeError):
    """The engine failed persistently and takes no more requests."""


@dataclass
class _InFlight:
    """A step launched whose tokens the host has not read yet."""

    batch: ScheduledBatch
    sampling: list[Sequence]  # the sequences that sample, in the order of `tokens`
    tokens: torch.Tensor | None  # on the device
    host: torch.Tensor | None  # where they are copied to (pinned), or `tokens` itself on a CPU
    copied: "torch.cuda.Event | None"  # recorded after the copy
    logprobs: MeasuredLogprobs | None = None  # of the sequences that asked for them, copied like `host`
    prompt_logprobs: MeasuredPrompts | None = None  # copied like `host`
    beams: list[Sequence] | None = None  # the beams (beam search) whose rows the step measured
    beam_rows: tuple | None = None  # beam_search.measure's (and the raw rows, where asked), copied like `host`
    sampled_logits: tuple[list[int], torch.Tensor] | None = None  # raw rows kept (raw_logits.py), copied like `host`
    speculated: "_Speculated | None" = None  # the sequences that judged drafts (speculative decoding)
    needs: int = 0  # sampler.needs_of(sampling)
    # Some sequence of the batch gets no token read here (a prompt's chunk short of its end, a beam): its
    # full blocks are registered for the prefix cache apart.
    unsampled: bool = True


@dataclass
class _Speculated:
    """The sequences of a step that judged drafts, and what their rows gave (copied like `host`)."""

    seqs: list[Sequence]
    drafts: list[list[int]]  # each one's drafts, in order
    tokens: torch.Tensor  # [rows]: a row per draft and one after the last, sequence after sequence
    logprobs: MeasuredLogprobs | None  # of the rows of sequences that asked for them, in their order

    @staticmethod
    def rows(seqs: list[Sequence], drafts: list[list[int]]) -> list[Sequence]:
        """Each row's sequence: a row per draft and one after the last, sequence after sequence."""
        return [seq for seq, seq_drafts in zip(seqs, drafts) for _ in range(len(seq_drafts) + 1)]


class LLMEngine:
    def __init__(self, model: str, **settings):
        self.config = EngineConfig(model=model, **settings)
        # The engine decodes its outputs with a tokenizer of its own; requests are encoded on the callers'
        # threads with others (a HF fast tokenizer must not be used by two threads at once), so a huge
        # prompt holds up neither the streams' text nor the encoding of a short prompt beside it. Those are
        # copies of the engine's, made when first needed (encoders.py). _token_bytes: the detokenizer's byte
        # table (None: decode through the tokenizer).
        self.tokenizer, self._token_bytes = load_tokenizer(self.config.model, self.config.trust_remote_code)
        self._decode_lock = threading.Lock()
        self._encoders = Encoders(self._copy_tokenizer)
        spec = self.config.speculative_config
        drafter = spec is not None and spec.method == "draft_model"
        beside = DraftModel.footprint(self.config) if drafter else (0, 0)  # (the pool leaves room for it)
        self.runner = ModelRunner(self.config, beside=beside) if self.config.tensor_parallel_size == 1 else \
            TensorParallelRunner(self.config, beside)
        self.eos_token_ids = self._eos_token_ids(model)
        compile_sampling_kernels(self.runner.device, self.runner.hf_config.vocab_size)
        self.max_model_len = self.runner.max_model_len
        if self.runner.window_groups:  # (windowed layers beside full ones: block tables of their own)
            self.block_manager = HybridBlockManager(self.runner.num_blocks, self.config.block_size,
                                                    self.config.enable_prefix_caching, self.runner.hybrid_window,
                                                    self.runner.window_groups, host_slots=self.runner.host_slots)
        else:
            self.block_manager = BlockManager(self.runner.num_blocks, self.config.block_size,
                                              self.config.enable_prefix_caching, self.runner.sliding_window,
                                              host_slots=self.runner.host_slots)
        self._grammars: StructuredOutputs | None = None  # built with the first constrained request
        self._grammars_lock = threading.Lock()
        # TensorRT-LLM's LoRA tasks: which slot of the LoRA layers holds which (lora_tasks.py)
        self.lora_tasks = TaskSlots(self.config.lora_task_slots, 1 + len(self.config.lora_modules or {})) \
            if self.config.lora_task_slots else None
        # Speculative decoding's drafts: looked up in each sequence's tokens, or from a draft model
        self.draft_model = DraftModel(self.config, self.runner, self.tokenizer) if drafter else None
        self.scheduler = Scheduler(self.config, self.block_manager, self.max_model_len,
                                   self.draft_model or (NgramProposer(spec) if spec is not None else None),
                                   self.runner.chunk_view)
        self._in_flight: _InFlight | None = None  # under async scheduling: the step launched, unread
        # Pinned buffers for async scheduling's sampled tokens (two: the previous step's may be unread).
        self._token_buffers = [torch.empty(self.config.max_num_seqs, dtype=torch.long, pin_memory=True)
                               for _ in range(2)] if self.runner.device.type == "cuda" else []
        self._lock = threading.Lock()
        self._inbox: deque[Sequence] = deque()
        self._abort_inbox: deque[str] = deque()
        self._early_aborts: dict[str, float] = {}  # aborted ids not seen yet -> when the abort came
        self._requests: dict[str, list[Sequence]] = {}  # every unfinished request's sequences (n of them)
        self._arrivals = itertools.count()
        self.dead_reason: str | None = None  # set once the engine has stopped for good
        self._failures_since_tokens = 0
        self._unmade_copies: list[BlockCopy] = []  # the launching step's block copies, until made
        self.num_steps = 0  # counters since start
        self.num_failed_steps = 0
        self.num_pipelined_steps = 0  # steps launched while the one before was still running
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.num_computed_tokens = 0  # tokens run through the model (prompts, recomputes, decodes)
        self.steps_by_tokens = [0] * (len(STEP_TOKEN_BUCKETS) + 1)  # steps by their tokens' bucket (last: more)
        self.steps_by_seconds = [0] * (len(STEP_SECONDS_BUCKETS) + 1)  # ... and by their time's
        self.step_seconds_total = 0.0
        self.num_aborted = 0
        self.num_failed_requests = 0
        self.num_drafts = 0  # speculative decoding: sequence steps with drafts, drafts judged, drafts kept
        self.num_draft_tokens = 0
        self.num_accepted_draft_tokens = 0
        self.accepted_by_position: list[int] = []  # drafts kept at each position after a sequence's last token
        self.num_lora_requests = [0] * (1 + len(self.config.lora_modules or {}))  # admitted, by adapter id

    def _copy_tokenizer(self):
        with self._decode_lock:  # not while a step decodes with it
            return copy_or_load(self.tokenizer, lambda: load_tokenizer(self.config.model,
                                                                       self.config.trust_remote_code)[0])

    def _eos_token_ids(self, model: str) -> list[int]:
        ids: set[int] = set()
        try:
            gen = GenerationConfig.from_pretrained(model)
            eos = gen.eos_token_id
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        except OSError:
            pass
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return sorted(ids)

    # -- requests --------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None,
               limit_name: str = "max_tokens") -> list[int]:
        """Token ids; with `max_tokens`, PromptTooLong (a ValueError) for a longer text, found without
        encoding all of a huge one (encoders.py)."""
        return self._encoders.encode(text, add_special_tokens, max_tokens, limit_name)

    def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                    priority: int = 0, lora_name: str | None = None, final_only: bool = False,
                    lora_task: LoRATask | None = None, max_prompt_tokens: int | None = None) -> list[int]:
        """Validate and queue a request. `prompt`: text, token ids, or a dict of prompt embeddings
        ({"prompt_embeds": [n, hidden]}, or {"prompt_token_ids": ids, "prompt_embedding_table": [rows,
        hidden]} where ids from vocab_size up read the table: prompt_embeds.py). A lower `priority` is
        served earlier; `lora_name`: one of the adapters of `lora_modules` (none: the base model), or
        `lora_task`: TensorRT-LLM's adapter sent with the request, or named by its task id once sent
        (lora_tasks.py; with lora_task_slots).
        `final_only` (vLLM's FINAL_ONLY output kind): each completion comes in one delta, when it ends,
        where nothing needs its text before (no stop strings); its text is then decoded once, at the end.
        `max_prompt_tokens`: a server's limit on the prompt's tokens, each image's tokens counted.
        Returns the prompt's token ids as queued. Raises ValueError naming the problem (EngineDeadError
        once the engine has stopped); nothing is queued then."""
        params = params or SamplingParams()
        lora_id = self.lora_id(lora_name)
        task = self._read_lora_task(lora_task, lora_name) if lora_task is not None else None
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) >= 2**31:
            raise ValueError(f"priority must be a 32-bit integer, got {priority!r}")
        self._check_alive()
        vocab = self.runner.hf_config.vocab_size
        params.check_token_ids(vocab)
        if (params.allowed_token_ids is not None and params.min_tokens
                and params.allowed_set <= {*self.eos_token_ids, *params.stop_token_ids}):
            raise ValueError("allowed_token_ids holds only end tokens (EOS or stop_token_ids), which min_tokens "
                             "forbids before its count: nothing could be generated")
        embeds = None  # the vectors of its virtual tokens, for a prompt given as embeddings
        with_images = isinstance(prompt, dict) and "multi_modal_data" in prompt
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            # (a prompt to truncate is encoded whole: its length is no reason to refuse it)
            limit = None if params.truncate_prompt_tokens else self.max_model_len
            token_ids = self.encode(prompt, max_tokens=limit, limit_name="max_model_len")
            if token_ids and max(token_ids) >= vocab:  # (a tokenizer with tokens the model does not have)
                raise ValueError(f"the tokenizer encoded the prompt into token id {max(token_ids)}, beyond the "
                                 f"model's vocab_size ({vocab})")
        elif isinstance(prompt, dict):
            if params.prompt_logprobs is not None:
                raise ValueError("prompt_logprobs cannot be measured for a prompt given as embeddings or images")
            if with_images:
                if params.truncate_prompt_tokens:
                    raise ValueError("truncate_prompt_tokens would cut a prompt's images: not taken with images")
                prompt = self._image_prompt(prompt, vocab,
                                            lambda n: self._check_prompt_length(n, max_prompt_tokens, True))
            hf_config = self.runner.hf_config
            token_ids, embeds = prompt_embeds.resolve(prompt, vocab, hf_config.hidden_size, self.runner.dtype,
                                                      self.max_model_len)
            if with_images and self.runner.image_encoder.spans:
                self._spans_see_themselves(embeds, token_ids, self.runner.image_encoder.spans)
        else:
            token_ids = list(prompt)
            if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in token_ids):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        encoder = self.runner.image_encoder
        if encoder is not None and embeds is None and encoder.image_token_id in token_ids:
            raise ValueError(f"the prompt holds the image placeholder ({encoder.placeholder}) but no image: send "
                             "an image for each placeholder with it (multi_modal_data; served, the `image` input)")
        if encoder is not None and encoder.spans == "prompt" and not with_images:
            raise ValueError("this model reads each prompt whole together with its images, as its processor "
                             f"makes it: send at least one image, with a placeholder ({encoder.placeholder}) where "
                             "each goes (multi_modal_data; served, the `image` input)")
        token_ids = params.truncated(token_ids, self.max_model_len)
        if not token_ids:
            raise ValueError("prompt must not be empty")
        self._check_prompt_length(len(token_ids), max_prompt_tokens, with_images)
        raw_logits.check_size(params, len(token_ids), vocab)
        width, what = (params.beam_width, "beam_width") if params.beam_search else (params.n, "n")
        if width > self.config.max_num_seqs:
            raise ValueError(f"{what} ({width}) exceeds max_num_seqs ({self.config.max_num_seqs}): its sequences "
                             "run at once")
        seq = self._new_sequence(request_id, token_ids, params, self._bad_words_ids(params.bad_words), priority,
                                 lora_id=lora_id, prompt_embeds=embeds)
        seq.delta_at_end = final_only and not params.stop and not params.beam_search  # (a search's come at its end)
        seq.lora_task = task
        seq.forks_left = width - 1  # (a beam search's other beams: seats kept for them at admission)
        if params.beam_search:
            self._start_beam_search(seq, vocab)
        with self._lock:
            self._check_alive()
            seq.arrival = next(self._arrivals)
            if request_id in self._requests or any(s.request_id == request_id for s in self._inbox):
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._inbox.append(seq)
            self.num_lora_requests[lora_id] += 1  # (a task's requests are counted in stats' lora_task_loads)
        return token_ids

    def _check_prompt_length(self, num_tokens: int, max_prompt_tokens: int | None, with_images: bool) -> None:
        images = " (its images' tokens included)" if with_images else ""
        if num_tokens > self.max_model_len:
            raise ValueError(f"prompt has {num_tokens} tokens{images}, more than max_model_len ({self.max_model_len})")
        if max_prompt_tokens is not None and num_tokens > max_prompt_tokens:
            raise ValueError(f"the prompt has {num_tokens} tokens{images}; this server accepts at most "
                             f"{max_prompt_tokens}")

    def _image_prompt(self, prompt: dict, vocab_size: int, check_length) -> dict:
        """vLLM's {"prompt": text, "multi_modal_data": {"image": images}} as a prompt of embeddings: the
        image tokens read the vectors the model's vision tower made of them (images.py); `check_length` is
        handed the prompt's tokens, its images' included, before the tower runs."""
        if self.runner.image_encoder is None:
            raise ValueError(f"this model ({self.runner.hf_config.model_type}) takes no images: inflight serves "
                             f"images with the model types {', '.join(images.IMAGE_MODEL_TYPES)}")
        if set(prompt) != {"prompt", "multi_modal_data"}:
            raise ValueError("a prompt with images is {'prompt': text, 'multi_modal_data': {'image': images}}, got "
                             f"the keys {sorted(prompt)}")
        data = prompt["multi_modal_data"]
        if not isinstance(data, dict) or set(data) != {"image"}:
            raise ValueError("multi_modal_data takes images alone: {'image': an image or a list of images}")
        return self.runner.image_encoder.prompt(prompt["prompt"], data["image"], vocab_size, check_length)

    def _spans_see_themselves(self, embeds: PromptEmbeddings, token_ids: list[int], spans: str) -> None:
        """Each image's tokens a span that sees itself (Gemma 3: `spans` "images"), or the whole prompt
        (PaliGemma: "prompt"), computed in one step: refused where a span has more tokens than a step's budget."""
        if spans == "images":
            embeds.attend_within_runs(token_ids)
        else:
            embeds.attend_within_prompt(token_ids)
        longest = max(end - start for start, end in embeds.spans)
        if longest > self.config.max_num_batched_tokens:
            what = "an image" if spans == "images" else "a prompt (its images' tokens included)"
            raise ValueError(f"{what} of {longest} tokens, which see each other, is computed in one step: more "
                             f"than max_num_batched_tokens ({self.config.max_num_batched_tokens})")

    def _start_beam_search(self, seq: Sequence, vocab_size: int) -> None:
        p = seq.params
        ends = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else frozenset(self.eos_token_ids))
        seq.beam = BeamSearch(p, max(1, min(p.max_tokens, self.max_model_len - seq.num_prompt_tokens)), ends,
                              vocab_size, seats=[seq])
        if p.stop:  # each beam's text is read for them
            seq.beam.texts = [""]
            seq.beam.decoders = [self._detokenizer(seq.prompt_token_ids, p, seq.prompt_embeds)]

    def lora_id(self, lora_name: str | None) -> int:
        """The adapter's id in the step inputs (0: the base model); ValueError for a name not served."""
        if lora_name is None:
            return 0
        names = list(self.config.lora_modules or {})
        if lora_name not in names:
            served = f"this server has {', '.join(map(repr, names))}" if names else "this server has none"
            raise ValueError(f"unknown LoRA adapter {lora_name!r}: {served} (lora_modules)")
        return names.index(lora_name) + 1

    def _read_lora_task(self, task: LoRATask, lora_name: str | None) -> TaskWeights:
        """A request's TensorRT-LLM adapter, checked (ValueError); its slot is found between steps."""
        if not isinstance(task, LoRATask):
            raise ValueError("lora_task must be a LoRATask")
        if self.lora_tasks is None:
            raise ValueError("this server takes no LoRA adapters with requests (lora_task_id, lora_weights, "
                             "lora_config): its lora_task_slots is 0")
        if lora_name is not None:
            raise ValueError("a request names its LoRA adapter by lora_name or by lora_task_id, not both")
        lora = self.runner.lora
        weights = lora_tasks.read_task(task, lora.parts, lora.max_rank, lora.dtype)
        if weights.matrices is None and not self.lora_tasks.holds(weights.task_id):
            raise ValueError(f"LoRA task {weights.task_id} is not in the cache: send its lora_weights and "
                             "lora_config with it")
        return weights

    def _place_lora_task(self, seq: Sequence) -> None:
        """Between steps: the slot of a request's task, loaded if it must be (TaskRefused if none can be)."""
        task, seq.lora_task = seq.lora_task, None
        in_use = lambda: {s.lora_id for seqs in self._requests.values() for s in seqs}  # noqa: E731
        slot, seq.lora_id, load = self.lora_tasks.place(task, in_use)
        if load:
            self.runner.load_lora_slot(slot, seq.lora_id, task.matrices)
            logger.info("LoRA task %d loaded into slot %d", task.task_id, slot)

    def _new_sequence(self, request_id: str, token_ids: list[int], params: SamplingParams,
                      bad_words_ids: list[list[int]], priority: int, index: int = 0, lora_id: int = 0,
                      prompt_embeds: PromptEmbeddings | None = None) -> Sequence:
        """Completion `index` of a request: its own detokenizer, grammar matcher, and generator (seeded
        with seed + index)."""
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.runner.device).manual_seed((params.seed + index) % 2**64)
        return Sequence(
            request_id=request_id,
            prompt_token_ids=token_ids,
            params=params,
            detokenizer=self._detokenizer(token_ids, params, prompt_embeds),
            generator=generator,
            bad_words_ids=bad_words_ids,
            matcher=self.grammars().matcher(params.structured_outputs) if params.structured_outputs else None,
            priority=priority,
            index=index,
            lora_id=lora_id,
            prompt_embeds=prompt_embeds,
        )

    def _detokenizer(self, prompt_token_ids: list[int], params: SamplingParams,
                     embeds: PromptEmbeddings | None) -> IncrementalDetokenizer:
        """A completion's detokenizer, which reads the prompt's real tokens before it."""
        if embeds is not None:
            prompt_token_ids = [t for t in prompt_token_ids if t < embeds.first_id]
        return IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens, self._decode_lock,
                                      self._token_bytes)

    def grammars(self) -> StructuredOutputs:
        """The structured-output compiler (its tokenizer info is built once, on first use)."""
        with self._grammars_lock:
            if self._grammars is None:
                with self._encoders.borrow() as tokenizer:  # one thread at a time, like every tokenizer here
                    self._grammars = StructuredOutputs(tokenizer, self.runner.hf_config.vocab_size,
                                                       self.eos_token_ids)
            return self._grammars

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine has stopped and takes no requests: {self.dead_reason}")

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as it would be tokenized alone and after a space."""
        variants = set()
        for word in words:
            for text in (word, " " + word.lstrip()):
                ids = self.encode(text, add_special_tokens=False)
                if ids:
                    variants.add(tuple(ids))
        return [list(v) for v in sorted(variants)]

    def abort(self, request_id: str) -> None:
        """Cancel a request; its final delta (finish_reason "abort") comes from the next step(). An
        abort that arrives before its request is kept for EARLY_ABORT_MEMORY_S."""
        with self._lock:
            self._abort_inbox.append(request_id)

    def unfinished_request_ids(self) -> list[str]:
        with self._lock:
            return [*self._requests, *(s.request_id for s in self._inbox)]

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._inbox or self._abort_inbox or self._requests)

    # -- the step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """Schedule, run one forward pass, sample, and return what each touched request gained.
        Never raises for a failure of the step itself: see the module's docstring."""
        started, steps_before = time.perf_counter(), self.num_steps
        deltas: list[RequestDelta] = []
        touched = None  # the sequences a failure now would end; None: all, nothing is known good
        try:
            self._drain_inbox(deltas)
            if self._in_flight is not None and (self._in_flight.beams or self._in_flight.speculated
                                                or self.scheduler.drafts_await_tokens()):
                # the beams it ranks, or the drafts it judges, decide what the next step computes; n-gram
                # drafts are proposed from each sequence's latest token
                touched = self._in_flight.batch.seqs
                self._complete_in_flight(deltas)
                touched = None
            if self.dead_reason is None:
                batch = self.scheduler.schedule()
                touched = batch.seqs + (self._in_flight.batch.seqs if self._in_flight is not None else [])
                launched = self._launch(batch, deltas)
                self._complete_in_flight(deltas)
                if self.config.async_scheduling:
                    self._in_flight = launched
                else:
                    self._complete(launched, deltas)
        except Exception as e:
            logger.exception("engine step failed")
            self._in_flight = None  # (its tokens are lost: its sequences are among those touched)
            self._fail_step(e, touched, deltas)
        if self.num_steps != steps_before:  # (a batch ran; under async scheduling, the step before was read)
            seconds = time.perf_counter() - started
            self.steps_by_seconds[bisect.bisect_left(STEP_SECONDS_BUCKETS, seconds)] += 1
            self.step_seconds_total += seconds
        return deltas

    # -- async scheduling ------------------------------------------------------------------------
    # Step N+1 is scheduled and launched before step N's sampled tokens are read: the host's work for
    # step N (reading its tokens, stop checks, detokenizing, deltas) then runs while the GPU computes
    # step N+1. A decoding sequence's token from step N is still on the GPU when step N+1 is launched,
    # so the forward pass reads it there (the runner copies it into the step's input ids); the host
    # counts it as pending (Sequence.num_pending) until step N completes. A sequence that finishes in
    # step N has its row of step N+1 thrown away. Penalties count a pending token where it is (the
    # sampler reads it from the step in flight), min_tokens counts pending tokens, and logprobs (of
    # sampled and of prompt tokens) are measured on the device and read with the tokens. A grammar or
    # a bad word needs the previous token's value to mask the next: when a step samples such a sequence
    # with a token pending, step N completes after step N+1's forward is launched and before it samples
    # (the forward still runs while the host works). A step that ranks beams or judges drafts, and one
    # after which sequences would get n-gram drafts (proposed from their latest token), is read before
    # the next is scheduled. Without async scheduling a step completes at once.

    def _launch(self, batch: ScheduledBatch, deltas: list[RequestDelta]) -> "_InFlight | None":
        """Run `batch` and sample, without waiting for the GPU (unless a sequence's sampling needs the
        step in flight read first: its deltas go to `deltas`)."""
        if not batch.seqs:
            return None
        # The block manager's copies (copy-on-write of blocks shared by a prompt's completions; blocks to and from
        # the host tier): made by the runner before the forward (those on the device in the draft model's pool
        # too, before it drafts).
        copies = self.block_manager.take_pending_copies()
        self._unmade_copies = copies  # (until the runner has made them: a failed step forgets what they fill)
        if self.draft_model is not None:  # (its drafts proposed now: the scheduler placed them)
            self.draft_model.fill(batch, copies)
        self.num_steps += 1
        num_tokens = sum(batch.num_tokens)
        self.num_computed_tokens += num_tokens
        self.steps_by_tokens[bisect.bisect_left(STEP_TOKEN_BUCKETS, num_tokens)] += 1
        # Sequences whose last scheduled token is their last token sample a next token; those that asked
        # for prompt logprobs also need logits at their prompt positions.
        sampling, logits_at, pending_at, pending_rows, prompt_positions = [], [], [], [], []
        speculating, draft_rows_at = [], []  # sequences with drafts: a row at each draft and after the last
        chunks = False  # (a prompt's chunk short of its end)
        start = 0
        for step_row, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            seq.step_row = step_row
            reaches_end = seq.num_computed_tokens + n == seq.num_tokens  # its last scheduled token is its last
            if seq.num_pending and reaches_end:  # its last token is in the step in flight
                pending_at.append(start + n - 1)
                pending_rows.append(seq.pending_row)
            if seq.drafts:
                speculating.append(seq)
                draft_rows_at += range(start + n - 1 - len(seq.drafts), start + n)
            elif reaches_end:
                sampling.append(seq)
                logits_at.append(start + n - 1)
            else:
                chunks = True
            if seq.params.needs & PROMPT_LOGITS and seq.index == 0:
                prompt_positions += prompt_logprobs.positions(seq, n, start)
            start += n
        pending = (self._in_flight.tokens, pending_at, pending_rows) if pending_at else None
        logits = self._forward(batch, logits_at + draft_rows_at + [p.row for p in prompt_positions], copies, pending)
        self._unmade_copies = []
        self.num_pipelined_steps += self._in_flight is not None
        judged = len(sampling) + len(draft_rows_at)
        measured_prompts = prompt_logprobs.measure(logits[judged:], prompt_positions)
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += n  # (drafts included: the verification takes back those it rejects)
        speculated = self._verify(logits[len(sampling):judged], speculating) if speculating else None
        logits, sampling, beams, beam_rows = self._measure_beams(logits[:len(sampling)], sampling)
        if not sampling:  # (a step of prompt chunks waits for its copies only, when it made some)
            copied = self._copy_event(logits) if measured_prompts is not None or beams or speculated else None
            return _InFlight(batch, [], None, None, copied, prompt_logprobs=measured_prompts, beams=beams,
                             beam_rows=beam_rows, speculated=speculated)
        # A prompt with n completions is computed once: its other completions fork from it here and
        # draw their first tokens from the same logits.
        rows = list(range(len(sampling)))
        for row, seq in enumerate(list(sampling)):
            for child in self._fork(seq):
                child.step_row = seq.step_row  # (its tokens are its parent's: the prompt)
                sampling.append(child)
                rows.append(row)
        logits = logits[to_device(rows, logits.device)] if len(rows) > len(logits) else logits
        needs = needs_of(sampling)
        kept = [row for row, seq in enumerate(sampling) if raw_logits.wants_sampled_row(seq)] \
            if needs & RAW_LOGITS else []
        sampled_logits = (kept, raw_logits.to_host(logits[to_device(kept, logits.device)])) if kept else None
        if needs & (STRUCTURED | BAD_WORDS | NO_REPEAT_NGRAMS) and any(
                (s.matcher is not None or s.bad_words_ids or s.params.no_repeat_ngram_size) and s.num_pending
                for s in sampling):
            self._complete_in_flight(deltas)  # their masks follow from the tokens in flight
        tokens, logprobs = self._sample(logits, sampling,
                                        self._in_flight.tokens if self._in_flight is not None else None, needs)
        for row, seq in enumerate(sampling):
            seq.num_pending += 1
            seq.pending_row = row
        host = tokens
        logprobs = logprobs.to_host() if logprobs is not None else None
        if tokens.device.type == "cuda":
            host = self._token_buffers[self.num_steps % 2][:len(sampling)]
            host.copy_(tokens, non_blocking=True)
        return _InFlight(batch, sampling, tokens, host, self._copy_event(tokens), logprobs, measured_prompts,
                         beams, beam_rows, sampled_logits, speculated, needs, chunks or bool(beams))

    @staticmethod
    def _copy_event(like: torch.Tensor) -> "torch.cuda.Event | None":
        """On a GPU, an event recorded after the step's copies to the host (what _complete waits for)."""
        if like.device.type != "cuda":
            return None
        copied = torch.cuda.Event()
        copied.record()
        return copied

    def _verify(self, logits: torch.Tensor, seqs: list[Sequence]) -> _Speculated:
        """Each drafting sequence's rows judged (speculative.py), with the logprobs of those that asked
        for them; copied to the host without waiting."""
        drafts = [list(seq.drafts) for seq in seqs]
        rows = _Speculated.rows(seqs, drafts)
        judged = [draft for seq_drafts in drafts for draft in (*seq_drafts, -1)]
        wanting = [i for i, seq in enumerate(rows) if seq.params.logprobs is not None]
        at = to_device(wanting, logits.device) if wanting else None
        raw = logits[at] if wanting else None  # a copy: verify changes `logits`
        if any(seq.matcher is not None for seq in seqs):  # each row to what its grammar allows after the drafts
            self.grammars().apply_drafts(logits, [seq.matcher for seq in seqs], drafts)
        tokens = verify(logits, rows, judged, [q for seq in seqs for q in draft_distributions(seq)])
        logprobs = None
        if wanting:
            logprobs = measure(raw, tokens[at], max(rows[i].params.logprobs for i in wanting)).to_host()
        host = tokens if tokens.device.type == "cpu" else tokens.to("cpu", non_blocking=True)
        return _Speculated(seqs, drafts, host, logprobs)

    def _measure_beams(self, logits: torch.Tensor, sampling: list[Sequence]):
        """Take the beams (beam search) out of the sampling rows: their rows' likeliest tokens are
        measured instead. Returns the other rows' logits and sequences, the beams and what was measured."""
        beam_rows = [row for row, seq in enumerate(sampling) if seq.beam is not None]
        if not beam_rows:
            return logits, sampling, None, None
        beams = [sampling[row] for row in beam_rows]
        rows = logits[to_device(beam_rows, logits.device)]
        grammars = self._grammars if any(seq.matcher is not None for seq in beams) else None
        measured = beam_search.measure(rows, max(seq.beam.row_size for seq in beams), beams, grammars,
                                       self.runner.token_history)
        if any(raw_logits.wants_sampled_row(seq) for seq in beams):  # (as the model gave them: measure works on a copy)
            measured = (*measured, raw_logits.to_host(rows))
        rest = [row for row, seq in enumerate(sampling) if seq.beam is None]
        return logits[to_device(rest, logits.device)], [sampling[row] for row in rest], beams, measured

    def _complete_in_flight(self, deltas: list[RequestDelta]) -> None:
        if self._in_flight is not None:
            self._complete(self._in_flight, deltas)
            self._in_flight = None

    def _complete(self, step: "_InFlight | None", deltas: list[RequestDelta]) -> None:
        """Read a launched step's tokens and do its host work."""
        if step is None:
            return
        if step.copied is not None:
            step.copied.synchronize()
        if step.prompt_logprobs is not None:
            prompt_logprobs.record(step.prompt_logprobs, self._decode_one)
        tokens = step.host.tolist() if step.sampling else []
        logprobs = self._logprob_entries(step.sampling, tokens, step.logprobs)
        kept_rows = dict(zip(*step.sampled_logits)) if step.sampled_logits is not None else {}
        constrained = step.needs & (TOKEN_CONTROLS | STRUCTURED)  # (no call a row when none is)
        now = time.time_ns()  # (when the step's tokens became known: the same for all)
        block_manager = self.block_manager
        caching, block_size = block_manager.enable_prefix_caching, block_manager.block_size
        for row, (seq, token, entry) in enumerate(zip(step.sampling, tokens, logprobs)):
            seq.num_pending -= 1
            if seq.status is FINISHED:  # ended while the step ran (aborted, or finished the step before)
                continue
            if constrained and not self._possible(seq, token):  # its constraints left no token: it alone ends
                self._fail_constrained(seq, deltas)
                continue
            if entry is not None:
                self._record_logprobs(seq, token, entry)
            if kept_rows and row in kept_rows:
                raw_logits.record_sampled(seq, kept_rows[row])
            seq.append_token(token, now)
            self.num_generated_tokens += 1
            # Its computed tokens are known now (registered before a finish frees them). A block fills one
            # token in block_size: cache_full_blocks' own first checks, inline, spare a call each token.
            if caching and seq.num_computed_tokens >= (len(seq.block_hashes) + 1) * block_size:
                block_manager.cache_full_blocks(seq)
            self._check_finished(seq, token)
            if not seq.delta_at_end or seq.status is FINISHED:
                deltas.append(self._delta(seq))
        if step.speculated is not None:  # (first: their computed tokens count drafts until judged)
            self._accept_drafts(step.speculated, deltas)
        for seq in step.batch.seqs if step.unsampled else ():
            if not seq.is_finished:
                self.block_manager.cache_full_blocks(seq)  # (a chunk of a prompt, which did not sample)
        if step.beams:
            self._advance_beams(step.beams, *step.beam_rows, deltas=deltas)
        if step.sampling or step.beams or step.speculated:  # tokens sampled and handled: every stage works
            self._failures_since_tokens = 0

    def _accept_drafts(self, spec: _Speculated, deltas: list[RequestDelta]) -> None:
        """Each drafting sequence gains its tokens up to and with the first that differs from its draft;
        the KV of the drafts after it is taken back (it stays in the blocks, to be overwritten)."""
        tokens = spec.tokens.tolist()
        entries = self._logprob_entries(_Speculated.rows(spec.seqs, spec.drafts), tokens, spec.logprobs)
        start = 0
        for seq, drafts in zip(spec.seqs, spec.drafts):
            rows = slice(start, start + len(drafts) + 1)
            start = rows.stop
            if seq.is_finished:
                continue
            kept = accepted_tokens(tokens[rows], drafts)
            seq.num_computed_tokens -= len(drafts) - (len(kept) - 1)
            self.block_manager.cache_full_blocks(seq)  # (the kept drafts are still there for it to read)
            seq.drafts = []
            self.num_drafts += 1
            self.num_draft_tokens += len(drafts)
            self.num_accepted_draft_tokens += len(kept) - 1
            self._count_accepted_by_position(len(kept) - 1)
            seq.metrics.num_draft_tokens += len(drafts)
            seq.metrics.num_accepted_draft_tokens += len(kept) - 1
            failed = False
            for token, entry in zip(kept, entries[rows]):
                if not self._possible(seq, token):  # (its rows were masked: only constraints leaving none)
                    self._fail_constrained(seq, deltas)
                    failed = True
                    break
                self._record_logprobs(seq, token, entry)
                seq.append_token(token)
                self.num_generated_tokens += 1
                self._check_finished(seq, token)
                if seq.is_finished:
                    break
            if not failed and (not seq.delta_at_end or seq.is_finished):
                deltas.append(self._delta(seq))

    def _count_accepted_by_position(self, kept: int) -> None:
        """A sequence kept its first `kept` drafts: one more kept at each of those positions."""
        counts = self.accepted_by_position
        counts.extend([0] * (kept - len(counts)))
        for position in range(kept):
            counts[position] += 1

    # -- beam search (beam_search.py) ------------------------------------------------------------
    def _advance_beams(self, beams: list[Sequence], values: torch.Tensor, ids: torch.Tensor,
                       raw: torch.Tensor | None = None, *, deltas: list[RequestDelta]) -> None:
        """Give each search its beams' rows (and raw logits, where a beam's request asks for them);
        advance those that have them all."""
        ready: dict[BeamSearch, None] = {}  # (a search once, if a recomputed beam brought its row again)
        for i, (seq, row_values, row_ids) in enumerate(zip(beams, values.tolist(), ids.tolist())):
            if seq.is_finished:
                continue
            row = raw_logits.own_row(raw[i]) if raw is not None and raw_logits.wants_sampled_row(seq) else None
            if row is not None:
                raw_logits.record_prompts_last(seq, row)
            generation = row if seq.params.return_generation_logits else None
            if seq.beam.add_row(seq, row_values, row_ids, generation):
                ready[seq.beam] = None
        for search in ready:
            continuations = search.advance()
            leader = search.seats[0]
            leader.forks_left = 0
            leader.metrics.token_known()  # (the request's times are its first beam's)
            if search.done:
                deltas.extend(self._beam_outputs(search))
                continue
            # (a forked beam takes its parent's block hashes: nothing to cache that the step did not)
            search.reseat(continuations, self.block_manager, self.scheduler,
                          lambda seat: self._new_beam(search, seat))
            self.num_generated_tokens += len(continuations)

    def _new_beam(self, search: BeamSearch, seat: int) -> Sequence:
        """A sequence for a search's new seat (its first step): the request's prompt, adapter and place."""
        leader = search.seats[0]
        seq = self._new_sequence(leader.request_id, leader.prompt_token_ids, leader.params, leader.bad_words_ids,
                                 leader.priority, seat, leader.lora_id, leader.prompt_embeds)
        seq.arrival, seq.beam = leader.arrival, search
        return seq

    def _beam_outputs(self, search: BeamSearch) -> list[RequestDelta]:
        """A finished search's completions; every beam's blocks back."""
        leader = search.seats[0]
        for seq in search.seats:
            self.scheduler.finish(seq, "stop")
        self._requests.pop(leader.request_id, None)
        return search.outputs(lambda: self._detokenizer(leader.prompt_token_ids, leader.params, leader.prompt_embeds),
                              self._decode_one)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        children = []
        while parent.forks_left:
            index = parent.params.n - parent.forks_left
            parent.forks_left -= 1
            child = self._new_sequence(parent.request_id, parent.prompt_token_ids, parent.params,
                                       parent.bad_words_ids, parent.priority, index, parent.lora_id,
                                       parent.prompt_embeds)
            child.arrival, child.delta_at_end = parent.arrival, parent.delta_at_end
            self.block_manager.fork(parent, child)
            self.scheduler.add_running(child)
            self._requests[parent.request_id].append(child)
            children.append(child)
        return children

    # The three stages of a step that run outside the engine's bookkeeping (faults.py wraps them).
    def _forward(self, batch: ScheduledBatch, logits_at: list[int], block_copies: list[BlockCopy],
                 pending: tuple[torch.Tensor, list[int], list[int]] | None = None) -> torch.Tensor:
        return self.runner.execute(batch, logits_at, block_copies, pending)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], in_flight: torch.Tensor | None, needs: int
                ) -> tuple[torch.Tensor, MeasuredLogprobs | None]:
        """The next tokens, on the logits' device, and the logprobs of the sequences that asked for them
        (measured there, in their order); `in_flight`: the tokens of the step still running; `needs`:
        needs_of(seqs)."""
        wanting = [i for i, s in enumerate(seqs) if s.params.logprobs is not None] if needs & LOGPROBS else []
        rows = to_device(wanting, logits.device) if wanting else None
        raw = logits[rows] if wanting else None  # a copy: sampling changes `logits` in place
        constrained = self._grammars if needs & STRUCTURED else None
        tokens = sample(logits, seqs, self.eos_token_ids, constrained, in_flight, needs, self.runner.token_history)
        if not wanting:
            return tokens, None
        return tokens, measure(raw, tokens[rows], max(seqs[i].params.logprobs for i in wanting))

    def _logprob_entries(self, seqs: list[Sequence], tokens: list[int],
                         measured: MeasuredLogprobs | None) -> list[TokenLogprobs | None]:
        """Each sequence's entry, None where it asked for none (`measured`, in their order, read here)."""
        if measured is None:
            return [None] * len(seqs)
        wanting = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
        rows = iter(entries(measured, [tokens[i] for i in wanting], [seqs[i].params.logprobs for i in wanting],
                            self._decode_one))
        return [next(rows) if seq.params.logprobs is not None else None for seq in seqs]

    @staticmethod
    def _record_logprobs(seq: Sequence, token: int, entry: TokenLogprobs | None) -> None:
        if entry is not None:
            seq.output_logprobs.append(entry)
            seq.cumulative_logprob += entry[token].logprob

    def _decode_one(self, token_id: int) -> str:
        with self._decode_lock:
            return self.tokenizer.decode([token_id])

    def _detokenize(self, seq: Sequence, token_ids: list[int]) -> str:
        return seq.detokenizer.add_tokens(token_ids)

    def _drain_inbox(self, deltas: list[RequestDelta]) -> None:
        with self._lock:
            arrived, self._inbox = list(self._inbox), deque()
            aborts, self._abort_inbox = list(self._abort_inbox), deque()
        now = time.monotonic()
        for seq in arrived:
            self._requests[seq.request_id] = [seq]
            self.num_prompt_tokens += seq.num_prompt_tokens
            if self.dead_reason is not None:
                deltas.append(self._fail(seq, self.dead_reason))
            elif self._early_aborts.pop(seq.request_id, None) is not None:
                deltas.append(self._abort(seq))
            else:
                if seq.lora_task is not None:
                    try:
                        self._place_lora_task(seq)
                    except TaskRefused as refused:
                        deltas.append(self._fail(seq, str(refused), refused.kind))
                        continue
                self.scheduler.add(seq)
        for request_id in aborts:
            seqs = self._requests.get(request_id)
            if seqs is None:
                self._early_aborts[request_id] = now
            for seq in seqs or []:
                if not seq.is_finished:
                    deltas.append(self._abort(seq))
        for request_id, when in list(self._early_aborts.items()):
            if now - when > EARLY_ABORT_MEMORY_S:
                del self._early_aborts[request_id]

    def _abort(self, seq: Sequence) -> RequestDelta:
        seq.forks_left = 0
        self._end(seq, "abort")
        self.num_aborted += 1
        return self._delta(seq)

    # -- failures ----------------------------------------------------------------------------------
    def _fail_step(self, error: Exception, touched: list[Sequence] | None, deltas: list[RequestDelta]) -> None:
        """End the requests of what a failed step touched: its batch and the step in flight, under
        async scheduling, whose tokens are lost (every request, for None). The deltas already built
        stay: a request that finished earlier in the step keeps its normal end."""
        self.num_failed_steps += 1
        self._failures_since_tokens += 1
        message = f"the engine failed: {type(error).__name__}: {error}"
        if isinstance(error, RanksFailedError):  # the ranks can no longer step together
            self._die(message)
        elif self._failures_since_tokens >= self.config.max_consecutive_failed_steps:
            self._die(f"{self._failures_since_tokens} steps failed with no tokens delivered between them; the "
                      f"last: {message}")
        if touched is None or self.dead_reason is not None:
            failed = list(self._requests)
        else:
            failed = list(dict.fromkeys(seq.request_id for seq in touched))
        for request_id in failed:  # every completion of a failed request
            for seq in list(self._requests.get(request_id, [])):
                if not seq.is_finished:
                    deltas.append(self._fail(seq, self.dead_reason or message))
        if self._unmade_copies:  # (the blocks they were to fill hold what they held before)
            self.block_manager.forget_copies(self._unmade_copies)
            self._unmade_copies = []

    def _fail_constrained(self, seq: Sequence, deltas: list[RequestDelta]) -> None:
        """Its constraints left no token: its request alone ends, with an error."""
        for s in self._requests.get(seq.request_id, [seq]):
            if not s.is_finished:
                deltas.append(self._fail(s, NO_TOKEN_LEFT, "invalid"))

    def _fail(self, seq: Sequence, message: str, kind: str | None = None) -> RequestDelta:
        """End `seq` with an error (`kind`: see RequestDelta.error_kind)."""
        seq.forks_left = 0
        try:
            self._end(seq, "error")
        except Exception:  # the block pool itself is broken: nothing can be trusted any more
            logger.exception("could not free the blocks of %s", seq.request_id)
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "error"
            self._die(f"the KV block pool is inconsistent after: {message}")
        self.num_failed_requests += 1
        delta = self._delta(seq)
        delta.error, delta.error_kind = message, kind
        return delta

    def _end(self, seq: Sequence, reason: str) -> None:
        """Take `seq` out for good; under beam search, every beam of its search (its only sequence in
        _requests is the first beam, which alone makes the request's final delta)."""
        for s in seq.beam.seats if seq.beam is not None else [seq]:
            if not s.is_finished:
                self.scheduler.finish(s, reason)

    def _die(self, reason: str) -> None:
        with self._lock:
            if self.dead_reason is None:
                self.dead_reason = reason
                logger.error("the engine has stopped: %s", reason)

    def close(self) -> None:
        """Release the model's processes (the tensor-parallel workers); the engine steps no more.
        Requests still held get no final delta: call shut_down() first to end them."""
        with self._lock:
            self.dead_reason = self.dead_reason or "the engine was closed"
        self.runner.close()

    def shut_down(self, reason: str) -> list[RequestDelta]:
        """Stop for good (from outside, e.g. when the thread that steps the engine failed): every
        request ends with an error; later add_request calls raise EngineDeadError."""
        self._die(reason)
        deltas: list[RequestDelta] = []
        self._drain_inbox(deltas)
        for seqs in list(self._requests.values()):
            for seq in list(seqs):
                if not seq.is_finished:
                    deltas.append(self._fail(seq, self.dead_reason))
        return deltas

    # -- stop conditions and deltas -----------------------------------------------------------------
    @staticmethod
    def _possible(seq: Sequence, token: int) -> bool:
        """Whether `token` is one the sequence's constraints allow (its grammar then takes it): a row
        whose constraints together ban every token samples one of them anyway."""
        allowed = seq.params.allowed_token_ids
        if allowed is not None and token not in seq.params.allowed_set:
            return False
        return seq.matcher is None or seq.matcher.accept_token(token)

    def _check_finished(self, seq: Sequence, token: int) -> None:
        p = seq.params
        text_before = len(seq.text_tail)
        if p.detokenize and not seq.delta_at_end:  # (else no text, or decoded when it ends: _delta)
            seq.text_tail += self._detokenize(seq, [token])
        num_out = len(seq.output_token_ids)
        reason = None
        if seq.matcher is not None and seq.matcher.is_terminated():
            reason = "stop"  # the grammar ended (with EOS, which it allows only where it can end)
        elif num_out >= p.min_tokens and ((token in self.eos_token_ids and not p.ignore_eos)
                                          or token in p.stop_token_ids):
            reason = "stop"
        elif num_out >= p.max_tokens or len(seq.prompt_token_ids) + num_out >= self.max_model_len:
            reason = "length"
        if reason is not None:
            seq.text_tail += seq.detokenizer.flush()  # text held back for an incomplete character
        if p.stop and num_out >= p.min_tokens:
            found = find_stop_string(seq.text_tail, p.stop, text_before)
            if found is not None:  # all after the stop string goes, and the string too unless asked for
                seq.text_tail = seq.text_tail[:found[1] if p.include_stop_str_in_output else found[0]]
                reason = "stop"
        if reason is not None:
            self.scheduler.finish(seq, reason)

    def _decode_at_end(self, seq: Sequence) -> str | None:
        """The text of a finished delta_at_end sequence, decoded at once; the error that ends it instead
        if that fails (it alone: its blocks are back already, and its delta must still go out)."""
        seq.delta_at_end = False
        if not seq.params.detokenize:
            return None
        try:
            seq.text_tail += self._detokenize(seq, seq.output_token_ids) + seq.detokenizer.flush()
        except Exception as e:
            logger.exception("decoding the text of %s failed", seq.request_id)
            if seq.finish_reason != "error":  # (one that failed already is counted by _fail)
                seq.finish_reason = "error"
                self.num_failed_requests += 1
            return f"the engine failed: {type(e).__name__}: {e}"
        return None

    def _delta(self, seq: Sequence) -> RequestDelta:
        """What `seq` gained since its last delta. While it runs, text that could be the start of a
        stop string is held back."""
        p = seq.params
        if not (p.needs & _DELTA_EXTRAS or p.stop or seq.status is FINISHED):
            # A running sequence's tokens and text, nothing else (most deltas): its whole text tail is
            # new, as nothing is held back for a stop string.
            tokens = seq.output_token_ids
            delta = RequestDelta(seq.request_id, tokens[seq.num_tokens_sent:], seq.text_tail, False, None,
                                 seq.num_prompt_tokens, len(tokens), index=seq.index)
            seq.num_tokens_sent, seq.text_tail = len(tokens), ""
            return delta
        request_finished, metrics, failure = False, None, None
        if seq.is_finished:
            if seq.delta_at_end:
                failure = self._decode_at_end(seq)
            text_end = len(seq.text_tail)
            seqs = self._requests.get(seq.request_id, [seq])
            request_finished = all(s.is_finished and not s.forks_left for s in seqs)
            if request_finished:
                self._requests.pop(seq.request_id, None)
                metrics = next((s.metrics for s in seqs if s.index == 0), seq.metrics)
        else:
            text_end = max(seq.num_text_sent, len(seq.text_tail) - p.stop_hold_back)
        # (The fields a delta always has, in their order: by keyword, a delta a sequence a step cost twice.)
        delta = RequestDelta(seq.request_id, seq.output_token_ids[seq.num_tokens_sent:],
                             seq.text_tail[seq.num_text_sent:text_end], request_finished, seq.finish_reason,
                             seq.num_prompt_tokens, len(seq.output_token_ids), index=seq.index, metrics=metrics)
        if p.logprobs is not None:
            delta.new_logprobs = seq.output_logprobs[seq.num_tokens_sent:]
            delta.cumulative_logprob = seq.cumulative_logprob
        first = seq.index == 0 and seq.num_tokens_sent == 0 and seq.output_token_ids
        if p.prompt_logprobs is not None and first:
            delta.prompt_logprobs = seq.prompt_logprobs or [None]  # with the first generated token
        if p.return_context_logits and first:
            delta.context_logits = np.stack(seq.context_logits)
        if p.return_generation_logits:
            delta.new_generation_logits = seq.generation_logits[seq.num_tokens_sent:]
        if failure is not None:
            delta.error = failure
        seq.num_tokens_sent = len(seq.output_token_ids)
        seq.num_text_sent = text_end
        behind = text_end - p.stop_reach_back  # sent characters no stop string can start at any more
        if behind > 0:
            seq.text_tail = seq.text_tail[behind:]
            seq.num_text_sent -= behind
        return delta

    # -- introspection ---------------------------------------------------------------------------
    def stats(self) -> dict:
        bm, sched = self.block_manager, self.scheduler
        return {
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_used": bm.num_used_blocks,
            "num_running": len(sched.running),
            "num_waiting": len(sched.waiting) + len(self._inbox),
            "num_preemptions": sched.num_preemptions,
            "prefix_cache_queried_tokens": sched.prefix_queried_tokens,
            "prefix_cache_hit_tokens": sched.prefix_hit_tokens,
            "prompt_tokens_total": self.num_prompt_tokens,
            "generation_tokens_total": self.num_generated_tokens,
            "computed_tokens_total": self.num_computed_tokens,
            "steps_by_tokens": list(self.steps_by_tokens),
            "steps_by_seconds": list(self.steps_by_seconds),
            "step_seconds_total": self.step_seconds_total,
            "requests_aborted_total": self.num_aborted,
            "requests_failed_total": self.num_failed_requests,
            "failed_steps_total": self.num_failed_steps,
            **({"kv_offload_blocks_used": bm.host.num_used_slots, "kv_offload_blocks_total": bm.host.num_slots,
                "kv_offload_stored_blocks_total": bm.host.stored, "kv_offload_loaded_blocks_total": bm.host.loaded}
               if bm.host is not None else {}),
            **({"lora_requests": self._lora_requests()} if self.config.lora_modules else {}),
            **({"lora_task_loads": self.lora_tasks.loads} if self.lora_tasks is not None else {}),
            **({"images_encoded_total": self.runner.image_encoder.images_encoded,
                "images_cached_total": self.runner.image_encoder.images_cached}
               if self.runner.image_encoder is not None else {}),
            **({"spec_decode_drafts_total": self.num_drafts, "spec_decode_draft_tokens_total": self.num_draft_tokens,
                "spec_decode_accepted_tokens_total": self.num_accepted_draft_tokens,
                "spec_decode_accepted_tokens_per_pos": list(self.accepted_by_position)}
               if self.config.speculative_config is not None or self.num_drafts else {}),
        }

    def _lora_requests(self) -> dict[str, tuple[int, int, int]]:
        """Each adapter's requests: (running: some sequence of it runs, waiting: none runs but some waits,
        admitted since start). A request counts once, however many completions or beams it has."""
        with self._lock:  # (add_request appends to the inbox from other threads)
            arrived = list(self._inbox)
        running = {seq.request_id: seq.lora_id for seq in self.scheduler.running}
        waiting = {seq.request_id: seq.lora_id for seq in (*self.scheduler.waiting, *arrived)
                   if seq.request_id not in running}
        running_by, waiting_by = Counter(running.values()), Counter(waiting.values())
        return {name: (running_by[i], waiting_by[i], self.num_lora_requests[i])
                for i, name in enumerate(self.config.lora_modules, start=1)}
