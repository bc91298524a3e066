"""A request's state inside the engine: its tokens, how many of them have KV in the cache, its blocks."""

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from .detokenizer import IncrementalDetokenizer
from .outputs import RequestMetrics
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .beam_search import BeamSearch
    from .lora_tasks import TaskWeights
    from .prompt_embeds import PromptEmbeddings


PENDING = -1  # the id of a token still on the GPU (its forward pass reads it from there)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # no blocks: new, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds blocks; prefilling in chunks or decoding
    FINISHED = "finished"


class BlockTable:
    """A sequence's block ids, one per KV block of its positions, kept in an int64 array that grows by
    doubling: a step copies each row with one memcpy (input_buffers.py), where a list of Python ints
    took about 3 ms a step for 128 sequences of 32k tokens to convert. Reads and writes as a list does."""

    __slots__ = ("_ids", "_len", "version")

    def __init__(self, ids=()):
        ids = np.asarray(ids, dtype=np.int64)
        self._ids = np.empty(max(16, len(ids)), dtype=np.int64)
        self._ids[:len(ids)] = ids
        self._len = len(ids)
        self.version = 0  # changes with every change of the ids (input_buffers.BlockTableRows)

    @property
    def ids(self) -> np.ndarray:
        """The ids as an array (a view: valid until the table changes)."""
        return self._ids[:self._len]

    def append(self, block_id: int) -> None:
        if self._len == len(self._ids):
            self._ids = np.concatenate([self._ids, np.empty(len(self._ids), dtype=np.int64)])
        self._ids[self._len] = block_id
        self._len += 1
        self.version += 1

    def clear(self) -> None:
        self._len = 0
        self.version += 1

    def copy(self) -> "BlockTable":
        return BlockTable(self.ids)

    def __len__(self) -> int:
        return self._len

    def _position(self, index: int) -> int:
        """Where `index` (negative from the end, as a list's) is in the array (no view made: the
        scheduler reads an entry of every decoding sequence's table each step)."""
        if not -self._len <= index < self._len:
            raise IndexError("block table index out of range")
        return index + self._len if index < 0 else index

    def at(self, index: int) -> int:
        """The id at `index`, which the caller knows to be in 0 .. len - 1 (no checks: a hot path)."""
        return int(self._ids[index])

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.ids[index].tolist()
        return int(self._ids[self._position(index)])

    def __setitem__(self, index: int, block_id: int) -> None:
        self._ids[self._position(index)] = block_id
        self.version += 1

    def __iter__(self):
        return iter(self.ids.tolist())

    def __repr__(self) -> str:
        return f"BlockTable({self.ids.tolist()})"


@dataclass
class WindowBlocks:
    """A sequence's blocks for one group of the windowed layers of a model that alternates them with layers
    attending over the whole context, as its own fields are for those (hybrid_blocks.py)."""

    block_table: BlockTable = field(default_factory=BlockTable)
    num_released_blocks: int = 0  # leading entries given back, behind the window
    block_hashes: list = field(default_factory=list)  # each full block's key in the prefix cache (None: none)


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None = None  # per-request RNG when a seed is given
    bad_words_ids: list[list[int]] = field(default_factory=list)  # token sequences never to complete
    matcher: object | None = None  # xgrammar's GrammarMatcher under structured outputs
    priority: int = 0  # lower is served earlier
    arrival: int = 0  # order of arrival, among equal priorities
    index: int = 0  # which of the request's n completions
    forks_left: int = 0  # completions still to fork from this one once its prompt is computed
    lora_id: int = 0  # its LoRA adapter (1, 2, ... in the order of lora_modules, then LoRA tasks'); 0: none
    lora_task: "TaskWeights | None" = None  # its TensorRT-LLM LoRA task, until a slot holds it (lora_tasks.py)
    beam: "BeamSearch | None" = None  # under beam search: the request's search, of which it is a beam
    prompt_embeds: "PromptEmbeddings | None" = None  # the vectors of its virtual prompt tokens (prompt_embeds.py)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.time_ns()))

    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"

    block_table: BlockTable = field(default_factory=BlockTable)
    # Leading entries of block_table given back to the pool: behind every layer's sliding window, never
    # read again (their stale ids stay, for positions; the kernels skip or mask what is out of the window).
    num_released_blocks: int = 0
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the full blocks cached so far
    # Its blocks of each group of windowed layers, where a model mixes them with full ones (hybrid_blocks.py).
    windows: list["WindowBlocks"] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    # Under async scheduling: output tokens sampled on the GPU whose values the host has not read yet.
    # They count in num_tokens (the scheduler plans with them) but not in output_token_ids.
    num_pending: int = 0
    pending_row: int = 0  # the row of the latest pending token in its step's sampled tokens
    step_row: int = 0  # its row in the latest step launched with it (penalties find its tokens by it)
    # Speculative decoding: the drafts scheduled after its last token this step (speculative.py); they
    # are computed with it, and none is a token of the sequence until its step's verification keeps it.
    drafts: list[int] = field(default_factory=list)
    # Under a draft model (draft_model.py): how many of its tokens the draft model's KV holds in its blocks,
    # and the drafts computed after them there (kept where they became its tokens); None: nothing held.
    draft_model_kv: tuple[int, list[int]] | None = None
    # Its request takes each completion in one delta, at its end, and nothing reads its text before (a
    # final-only request without stop strings, as LLM.generate's): no delta a step, no text decoded a token.
    delta_at_end: bool = False

    output_logprobs: list = field(default_factory=list)  # TokenLogprobs per output token, when asked for
    cumulative_logprob: float = 0.0
    prompt_logprobs: list = field(default_factory=list)  # None, then TokenLogprobs per prompt token
    num_prompt_logprobs_measured: int = 0  # prompt tokens whose logprobs are recorded or in a step in flight
    context_logits: list = field(default_factory=list)  # raw logits rows per prompt position, when asked for
    generation_logits: list = field(default_factory=list)  # raw logits rows per output token, when asked for

    # The end of the text decoded so far (stop strings cut): what no delta has handed out yet, and before
    # it the characters handed out that a stop string could still start at. (Not the whole text: adding
    # to a string copies it, and the text of a long output grew by copies of itself at every token.)
    text_tail: str = ""
    num_text_sent: int = 0  # characters at the start of text_tail already handed out as deltas
    num_tokens_sent: int = 0  # output tokens already handed out as deltas
    # The known tokens again, in an array with room to grow, built when first read (penalties and bad
    # words read them every step: a Python list of thousands of ints took milliseconds to convert).
    _token_array: np.ndarray | None = field(default=None, repr=False)

    def append_token(self, token: int, now_ns: int | None = None) -> None:
        """A sampled token whose value is now known (at `now_ns`, time.time_ns(), if given)."""
        self.output_token_ids.append(token)
        self.metrics.token_known(now_ns)
        if self._token_array is not None:
            known = len(self.prompt_token_ids) + len(self.output_token_ids)
            if known > len(self._token_array):
                self._token_array = np.resize(self._token_array, 2 * known)
            self._token_array[known - 1] = token

    def forget_token_array(self) -> None:
        """Its output tokens were replaced (a beam that took another's place): rebuild the array when read."""
        self._token_array = None

    @property
    def token_array(self) -> np.ndarray:
        """Prompt and known output tokens (a view, valid until the next token is appended)."""
        known = len(self.prompt_token_ids) + len(self.output_token_ids)
        if self._token_array is None:
            self._token_array = np.empty(known + 64, dtype=np.int64)
            self._token_array[:known] = self.prompt_token_ids + self.output_token_ids
        return self._token_array[:known]

    @property
    def output_array(self) -> np.ndarray:
        """Known output tokens (a view, as token_array)."""
        return self.token_array[len(self.prompt_token_ids):]

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens, pending ones included."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        """Output tokens, pending ones included."""
        return len(self.output_token_ids) + self.num_pending

    @property
    def takes_given_drafts(self) -> bool:
        """Its drafts are the request's own (draft_token_ids, drafts of its first tokens), not proposed."""
        return bool(self.params.draft_token_ids) and not self.num_output_tokens

    def is_last_token_pending(self, max_model_len: int) -> bool:
        """Its pending token is the last it may have: nothing is left to compute for it."""
        return self.num_pending > 0 and (self.num_output_tokens >= self.params.max_tokens
                                         or self.num_tokens >= max_model_len)

    @property
    def num_uncomputed_tokens(self) -> int:
        # (num_tokens, inline: the scheduler asks this of every running sequence every step)
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending - self.num_computed_tokens

    @property
    def awaits_beams(self) -> bool:
        """A beam whose next tokens are measured, waiting for the other beams of its search: it has
        nothing to compute until the search advances."""
        return self.beam is not None and self.beam.has_row(self)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        if index < n:
            return self.prompt_token_ids[index]
        return self.output_token_ids[index - n] if index - n < len(self.output_token_ids) else PENDING

    def token_slice(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building token_ids; a pending token reads PENDING."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        known = n + len(self.output_token_ids)
        tail = self._beyond_known(max(start, known) - known, end - known)
        if start >= n:
            return self.output_token_ids[start - n:end - n] + tail
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n] + tail

    def span_split_by(self, position: int) -> tuple[int, int] | None:
        """The span of prompt tokens that see each other (a Gemma 3 image's, a PaliGemma prompt: prompt_embeds.py)
        that a chunk's boundary before `position` would split, if any: each is computed whole in one chunk."""
        return None if self.prompt_embeds is None else self.prompt_embeds.span_split_by(position)

    def smallest_chunk(self) -> int:
        """The fewest tokens its next chunk may have: 1, or the whole span its tokens to compute begin with."""
        span = self.span_split_by(self.num_computed_tokens + 1)
        return 1 if span is None else span[1] - self.num_computed_tokens

    def cache_key(self, start: int, end: int) -> tuple:
        """token_ids[start:end] as the prefix cache compares them (a virtual prompt token by its vector)."""
        tokens = self.token_slice(start, end)
        if self.prompt_embeds is None or start >= len(self.prompt_token_ids):
            return tuple(tokens)
        return self.prompt_embeds.cache_key(tokens, start)

    def _beyond_known(self, start: int, end: int) -> list[int]:
        """The tokens after the known ones, [start, end) counted from the first: drafts, or PENDING."""
        drafts = self.drafts[start:end]
        return drafts + [PENDING] * (end - start - len(drafts)) if end > start else []
