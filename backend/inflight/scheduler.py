"""The step policy: which sequences run this step and how many tokens each.

Every step: each running sequence that is decoding gets one token, then sequences still prefilling
(running ones first, then waiting ones by priority, then arrival) get chunks of their prompts until the
token budget is spent. When the pool cannot give a decoding sequence its next block, the running
sequence of lowest priority (the newest among equals) is preempted: its blocks are freed and it goes back
to the queue in its place, to be recomputed. New sequences are admitted only while blocks stay free for
the running ones' growth, and while max_num_seqs has room for every sequence a request will run at once
(its n completions, or its beams). A lower priority value is served earlier (vLLM's convention). A beam
whose next tokens are measured waits, computing nothing, for the other beams of its search; when such
beams are all that hold the pool, they make room. Under speculative decoding a decoding sequence also
gets the drafts proposed for it, within what the budget leaves for the other decodes and without taking
a block that another decode may need; a request's own drafts ride with the chunk that ends its prompt.
When every layer attends within one sliding window, each step begins with the running sequences giving
back the blocks behind it (block_manager.py). Under chunked attention beyond one chunk (Llama 4's), a
sequence's tokens of a step, drafts included, lie within one chunk (input_buffers.chunk_view).
"""

import bisect
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .block_manager import BlockManager
from .config import EngineConfig
from .sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from .draft_model import DraftModel
    from .speculative import NgramProposer


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # new tokens computed for each sequence
    num_decodes: int = 0  # the sequences that lead it as decodes (generated tokens; drafts may ride along)
    _ids: set[int] = field(default_factory=set)  # of seqs, built when asked (only preemption asks)

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(n)

    def __contains__(self, seq: Sequence) -> bool:
        if len(self._ids) != len(self.seqs):  # (sequences only join a batch)
            self._ids = {id(s) for s in self.seqs}
        return id(seq) in self._ids

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int,
                 proposer: "NgramProposer | DraftModel | None" = None, attention_chunk: int | None = None):
        self.max_num_seqs = config.max_num_seqs
        self.attention_chunk = attention_chunk  # a step's tokens of a sequence within one chunk of these
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.proposer = proposer  # drafts for decoding sequences under speculative decoding
        self.waiting: list[Sequence] = []  # ordered by (priority, arrival)
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0
        self.prefix_queried_tokens = 0  # prompt tokens looked up in the prefix cache at admission
        self.prefix_hit_tokens = 0  # of those, found there

    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=_queue_order)

    def add_running(self, seq: Sequence) -> None:
        """A completion forked from a running sequence: it runs at once, on blocks it shares."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def requeue(self, seq: Sequence, running: bool) -> None:
        """A beam that took another's place: running when it holds blocks (a fork of a running beam's),
        else waiting to be computed."""
        if seq.status is SequenceStatus.RUNNING:
            if running:
                return
            self.running.remove(seq)
        elif seq in self.waiting:
            if not running:
                return
            self.waiting.remove(seq)
        if running:
            self.add_running(seq)
        else:
            seq.status = SequenceStatus.WAITING
            self.add(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        if self.block_manager.sliding_window is not None:  # (drafts are judged before this: no count goes back)
            for seq in self.running:
                self.block_manager.release_behind_window(seq)

        # 1. Decodes: one token for every running sequence whose prompt is fully computed (under async
        #    scheduling, not for one whose token still on the GPU is its last), and its drafts under
        #    speculative decoding where budget and free blocks allow.
        decoding, prefilling = self._decoding_and_prefilling()
        speculate = self._speculates(decoding)
        bm = self.block_manager
        for i, seq in enumerate(decoding):
            if seq.status is not SequenceStatus.RUNNING:  # (preempted for one before)
                continue
            if bm.blocks_needed(seq, 1):  # (most decodes write into a block they hold: nothing to take)
                if not self._make_room(batch, seq, 1):
                    continue
                bm.allocate(seq, 1)
            if speculate:
                left = len(decoding) - i - 1
                n = 1 + self._fit_drafts(seq, 1, budget - 1 - left, left)
            else:
                n = 1
            batch.add(seq, n)
            budget -= n
        batch.num_decodes = len(batch)

        # 2. Prefill chunks of running sequences whose prompts are not finished yet. They too may
        #    preempt newer sequences, so that two half-prefilled prompts can never block each other.
        for seq in prefilling:
            if budget == 0:
                break
            if seq.status is SequenceStatus.RUNNING:  # (not preempted for one before)
                if self._make_room(batch, seq, seq.smallest_chunk()):
                    budget -= self._schedule_chunk(batch, seq, budget)

        # 3. Admit waiting sequences while there is budget, room and memory.
        budget = self._admit(batch, budget)
        # Beams that wait for the other beams of their search hold blocks and compute nothing: when that
        # leaves nothing to run, they make room (their measured rows stay; they are computed again later).
        idle = [seq for seq in self.running if seq.awaits_beams] if not batch else []
        if idle and any(not seq.awaits_beams for seq in self.waiting):
            for seq in idle:
                self.preempt(seq)
            self._admit(batch, budget)
        return batch

    def _decoding(self) -> list[Sequence]:
        return self._decoding_and_prefilling()[0]

    def _decoding_and_prefilling(self) -> tuple[list[Sequence], list[Sequence]]:
        """The running sequences that decode (one token left to compute, unless under async scheduling
        their token still on the GPU is their last), and those whose prompts are not computed yet."""
        decoding, prefilling = [], []
        for seq in self.running:
            left = seq.num_uncomputed_tokens
            if left > 1:
                prefilling.append(seq)
            elif left == 1 and not seq.is_last_token_pending(self.max_model_len):
                decoding.append(seq)
        return decoding, prefilling

    def _speculates(self, decoding: list[Sequence]) -> bool:
        """Whether decodes get n-gram drafts this step: under speculative decoding, with fewer decoding
        sequences than disable_by_batch_size."""
        if self.proposer is None:
            return False
        limit = self.proposer.config.disable_by_batch_size
        return limit is None or len(decoding) < limit

    def drafts_await_tokens(self) -> bool:
        """Whether a decoding sequence would get n-gram drafts but for its token still in flight (async
        scheduling): reading that step first lets it propose from its latest token."""
        if self.proposer is None:
            return False
        decoding = self._decoding()
        return self._speculates(decoding) and any(self.proposer.awaits_token(seq) for seq in decoding)

    def _fit_drafts(self, seq: Sequence, scheduled: int, spare: int, blocks_kept: int) -> int:
        """After the `scheduled` tokens of `seq` just given their blocks (its decode, or its prompt's last
        chunk): its drafts (speculative.py), as many as the token budget's `spare` tokens, its max_tokens
        and max_model_len allow, taking new blocks only while `blocks_kept` stay free (one for each decode
        still to schedule); returns how many."""
        limit = min(spare, seq.params.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens - 1,
                    self._left_in_chunk(seq) - scheduled)
        drafts = self._drafts(seq, limit) if limit > 0 else []
        bm = self.block_manager
        while drafts and not bm.fits(seq, scheduled + len(drafts), spare=blocks_kept):
            drafts.pop()
        if drafts:
            bm.allocate(seq, scheduled + len(drafts))
        seq.drafts = drafts
        return len(drafts)

    def _left_in_chunk(self, seq: Sequence) -> int:
        """How many tokens `seq` may compute this step: those left in its attention chunk (any number without one)."""
        if self.attention_chunk is None:
            return self.max_model_len
        return self.attention_chunk - seq.num_computed_tokens % self.attention_chunk

    def _drafts(self, seq: Sequence, limit: int) -> list[int]:
        """The request's own drafts for its first tokens, else the proposer's."""
        if seq.takes_given_drafts:
            return seq.params.draft_token_ids[:limit]
        return self.proposer.propose(seq, limit) if self.proposer is not None else []

    def _admit(self, batch: ScheduledBatch, budget: int) -> int:
        """Admit waiting sequences in queue order (a beam waiting for its search's other beams is
        passed over) while there is budget, room and memory: memory beyond a reserve of one block for
        each running sequence that will need one (a watermark), so that a newly admitted (or
        re-admitted) sequence is not preempted again by the next step's growth. Returns the budget left."""
        if not self.waiting:
            return budget
        reserve = self._reserved_blocks()
        seats = self._seats_taken()
        while budget > 0:
            seq = next((s for s in self.waiting if not s.awaits_beams), None)
            if seq is None or seats + 1 + seq.forks_left > self.max_num_seqs:  # (its n completions too)
                break
            hit = self.block_manager.match_prefix(seq)
            wanted = min(seq.num_uncomputed_tokens, budget)
            short = not self.block_manager.fits(seq, wanted, spare=reserve)
            n = 0 if short and self.running else self._schedule_chunk(batch, seq, budget)
            if n == 0:
                self.block_manager.free(seq)  # give back the prefix blocks taken for nothing
                break
            reserve += 1
            seats += 1 + seq.forks_left
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.prefix_queried_tokens += seq.num_tokens
            self.prefix_hit_tokens += hit
            budget -= n
            if seq.metrics.first_scheduled_time_ns is None:
                seq.metrics.first_scheduled_time_ns = time.time_ns()
                seq.metrics.num_cached_tokens = hit
                seq.metrics.kv_reused_blocks = hit // self.block_manager.block_size
        return budget

    def _seats_taken(self) -> int:
        """Running sequences and the completions (or beams) they will fork: a request's sequences run at
        once, so the seats it will need are kept from its admission on."""
        return len(self.running) + sum(seq.forks_left for seq in self.running)

    def _reserved_blocks(self) -> int:
        """Running sequences whose next tokens will not fit in the blocks they hold."""
        bs = self.block_manager.block_size
        reserve = 0
        for seq in self.running:
            room = len(seq.block_table) * bs - seq.num_tokens
            if room < min(bs, seq.params.max_tokens - len(seq.output_token_ids)):
                reserve += 1
        return reserve

    def _make_room(self, batch: ScheduledBatch, seq: Sequence, num_tokens: int) -> bool:
        """Preempt unscheduled sequences, lowest priority and newest first, until `seq` can get blocks
        for `num_tokens` more tokens; when `seq` itself comes last in that order (or none is left to
        preempt), preempt `seq` and return False."""
        while not self.block_manager.fits(seq, num_tokens):
            candidates = [s for s in self.running if s is not seq and s not in batch]
            victim = max(candidates, key=_queue_order, default=None)
            if victim is None or _queue_order(victim) < _queue_order(seq):
                self.preempt(seq)
                return False
            self.preempt(victim)
        return True

    def _schedule_chunk(self, batch: ScheduledBatch, seq: Sequence, budget: int) -> int:
        """A chunk of the prompt (or of the tokens to recompute) of `seq`; the chunk that ends it also
        carries the request's own drafts (draft_token_ids) the first time. Returns its tokens."""
        n = min(seq.num_uncomputed_tokens, budget, self.block_manager.max_new_tokens(seq), self._left_in_chunk(seq))
        span = seq.span_split_by(seq.num_computed_tokens + n)
        if span is not None:  # (a span of tokens that see each other is computed whole: up to it, or not yet)
            n = max(0, span[0] - seq.num_computed_tokens)
        if n <= 0 or not self.block_manager.allocate(seq, n):
            return 0
        if n == seq.num_uncomputed_tokens and seq.takes_given_drafts:
            n += self._fit_drafts(seq, n, budget - n, len(self.running))
        batch.add(seq, n)
        return n

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the KV, keep the tokens, requeue at the front."""
        self.running.remove(seq)
        self._free(seq)
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=_queue_order)
        self.num_preemptions += 1

    def set_aside(self, seq: Sequence) -> None:
        """Take a beam that has no continuation this step out of the queues, its blocks freed: it waits,
        unqueued, until its search gives it one (requeue) or ends (finish)."""
        self._take_out(seq)
        seq.status = SequenceStatus.WAITING

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take `seq` out of the queues for good and return its blocks at once."""
        self._take_out(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _take_out(self, seq: Sequence) -> None:
        """Out of whichever queue holds it (a waiting one may be in none: never added, or set aside), its
        blocks freed."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)

    def _free(self, seq: Sequence) -> None:
        seq.metrics.kv_total_blocks = max(seq.metrics.kv_total_blocks, len(seq.block_table))
        seq.drafts, seq.draft_model_kv = [], None  # (a draft model's KV goes with the blocks)
        self.block_manager.free(seq)


def _queue_order(seq: Sequence) -> tuple[int, int]:
    return seq.priority, seq.arrival
