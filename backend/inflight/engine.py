"""The engine: add_request / step / abort / stats. Knows nothing of Triton.

`add_request` and `abort` may be called from any thread while another thread runs `step()`: they
only validate and post to an inbox, which `step()` drains under a lock before scheduling.
"""

import threading
from collections import deque

import torch
from transformers import AutoTokenizer, GenerationConfig

from .block_manager import BlockManager
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer, find_stop_string
from .model_runner import ModelRunner
from .outputs import RequestDelta
from .sampler import sample
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence


class LLMEngine:
    def __init__(self, model: str, **settings):
        self.config = EngineConfig(model=model, **settings)
        self.tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=self.config.trust_remote_code)
        self._tokenizer_lock = threading.Lock()
        self.runner = ModelRunner(self.config)
        self.eos_token_ids = self._eos_token_ids(model)
        capacity = self.runner.num_blocks * self.config.block_size
        model_limit = getattr(self.runner.hf_config, "max_position_embeddings", None) or capacity
        if self.config.max_model_len is None:
            self.max_model_len = min(model_limit, capacity)
        else:
            if self.config.max_model_len > capacity:
                raise ValueError(f"max_model_len ({self.config.max_model_len}) exceeds the KV pool's "
                                 f"{capacity} tokens; raise num_kv_blocks or kv_cache_memory")
            self.max_model_len = self.config.max_model_len
        self.block_manager = BlockManager(self.runner.num_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.config, self.block_manager)
        self._lock = threading.Lock()
        self._inbox: deque[Sequence] = deque()
        self._abort_inbox: deque[str] = deque()
        self._requests: dict[str, Sequence] = {}  # every unfinished request, by id
        self.num_prompt_tokens = 0  # counters since start
        self.num_generated_tokens = 0

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
    def encode(self, prompt: str) -> list[int]:
        with self._tokenizer_lock:
            return self.tokenizer.encode(prompt, add_special_tokens=True)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        """Validate and queue a request. Raises ValueError naming the problem; nothing is queued then."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            token_ids = self.encode(prompt)
        else:
            token_ids = list(prompt)
            vocab = self.runner.hf_config.vocab_size
            if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in token_ids):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if not token_ids:
            raise ValueError("prompt must not be empty")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than max_model_len ({self.max_model_len})")
        bad_words_ids = self._bad_words_ids(params.bad_words)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=token_ids,
            params=params,
            detokenizer=IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens,
                                               self._tokenizer_lock),
            generator=generator,
            bad_words_ids=bad_words_ids,
        )
        with self._lock:
            if request_id in self._requests or any(s.request_id == request_id for s in self._inbox):
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._inbox.append(seq)

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as it would be tokenized alone and after a space."""
        variants = set()
        with self._tokenizer_lock:
            for word in words:
                for text in (word, " " + word.lstrip()):
                    ids = self.tokenizer.encode(text, add_special_tokens=False)
                    if ids:
                        variants.add(tuple(ids))
        return [list(v) for v in sorted(variants)]

    def abort(self, request_id: str) -> None:
        """Cancel a request; its final delta (finish_reason "abort") comes from the next step()."""
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
        """Schedule, run one forward pass, sample, and return what each touched request gained."""
        deltas = self._drain_inbox()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return deltas
        # Sequences whose last scheduled token is their last known token sample a next token.
        rows = [i for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens))
                if seq.num_computed_tokens + n == seq.num_tokens]
        logits = self.runner.execute(batch, rows)
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
        sampling = [batch.seqs[i] for i in rows]
        if not sampling:
            return deltas
        for seq, token in zip(sampling, sample(logits, sampling, self.eos_token_ids)):
            seq.output_token_ids.append(token)
            self.num_generated_tokens += 1
            self._check_finished(seq, token)
            deltas.append(self._delta(seq))
        return deltas

    def _drain_inbox(self) -> list[RequestDelta]:
        deltas = []
        with self._lock:
            while self._inbox:
                seq = self._inbox.popleft()
                self._requests[seq.request_id] = seq
                self.scheduler.add(seq)
                self.num_prompt_tokens += seq.num_prompt_tokens
            while self._abort_inbox:
                seq = self._requests.get(self._abort_inbox.popleft())
                if seq is not None and not seq.is_finished:
                    self.scheduler.finish(seq, "abort")
                    deltas.append(self._delta(seq))
        return deltas

    def _check_finished(self, seq: Sequence, token: int) -> None:
        p = seq.params
        text_before = len(seq.output_text)
        seq.output_text += seq.detokenizer.add_tokens([token])
        num_out = len(seq.output_token_ids)
        reason = None
        if num_out >= p.min_tokens:
            if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
                reason = "stop"
            elif p.stop:
                cut = find_stop_string(seq.output_text, p.stop, text_before)
                if cut != -1:
                    seq.output_text = seq.output_text[:cut]  # the stop string and all after it go
                    self.scheduler.finish(seq, "stop")
                    return
        if reason is None and (num_out >= p.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            seq.output_text += seq.detokenizer.flush()
            self.scheduler.finish(seq, reason)

    def _delta(self, seq: Sequence) -> RequestDelta:
        """What `seq` gained since its last delta. While it runs, text that could be the start of a
        stop string is held back."""
        if seq.is_finished:
            text_end = len(seq.output_text)
            self._requests.pop(seq.request_id, None)
        else:
            text_end = max(seq.num_text_sent, len(seq.output_text) - max(0, seq.params.max_stop_length - 1))
        delta = RequestDelta(
            request_id=seq.request_id,
            new_token_ids=seq.output_token_ids[seq.num_tokens_sent:],
            new_text=seq.output_text[seq.num_text_sent:text_end],
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=len(seq.output_token_ids),
        )
        seq.num_tokens_sent = len(seq.output_token_ids)
        seq.num_text_sent = text_end
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
        }
