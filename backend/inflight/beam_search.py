"""Beam search over the engine's sequences, step for step the algorithm of HF transformers'
`generate(num_beams=...)` (the tests hold its output equal, token for token).

A request with beam_width W keeps W beams, each a Sequence on KV blocks it shares with the others: a
beam that continues another's text takes over a seat whose beam was dropped and forks the other's
blocks (copied on write, as n completions' are). Each step, every beam's last row gives its most
likely next tokens (`measure`, on the device, read with the step; log probabilities after the
request's token controls, penalties, n-gram and bad-word bans, where HF applies its logits
processors); once every beam of the search has its row, `advance` ranks the continuations by total
log probability as HF does: those that end (an end token, a stop string, or the length limit) among
the W best become finished hypotheses, scored by log probability / generated length ** length_penalty;
the W best others are the next beams. The search stops when no running beam can beat the finished ones
(HF's early_stopping rules), and its n best hypotheses are the request's completions. Nothing streams
before that.

Stop strings end a beam as HF's StopStringCriteria does: a continuation whose token completes one in
the beam's text ends there (each beam keeps its text and detokenizer; each ranked continuation tries
its token on a fork of them), its text cut at the stop string as a sampled completion's is.
"""

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from .block_manager import BlockManager
from .detokenizer import IncrementalDetokenizer, find_stop_string
from .outputs import Logprob, RequestDelta, TokenLogprobs
from .sampler import apply_logits_processors
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence, SequenceStatus
from .token_history import TokenHistory


def measure(logits: torch.Tensor, k: int, beams: list[Sequence], grammars=None,
            history: TokenHistory | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each beam's row's k most likely tokens: (log probabilities, ids), most likely first, after the
    request's token controls, penalties and bans, and its grammar's mask (`grammars`, a
    StructuredOutputs, for beams with a matcher): as HF's beam search applies its logits processors, to
    the log probabilities (penalties find the beams' tokens in `history`, where it holds them). Copied
    to the host without waiting for the device (read once the step's copy event has passed)."""
    scores = torch.log_softmax(logits.float(), dim=-1)
    apply_logits_processors(scores, beams, history=history)
    if grammars is not None:
        grammars.apply(scores, [beam.matcher for beam in beams])
    values, ids = scores.topk(min(k, logits.shape[-1]), dim=-1)
    if values.device.type == "cpu":
        return values, ids
    return values.to("cpu", non_blocking=True), ids.to("cpu", non_blocking=True)


@dataclass
class TokenStep:
    """A beam's token, for its logprobs: its log probability and rank, and its row's likeliest tokens;
    and for its generation logits, the raw row it was chosen from."""

    token: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]
    logits: np.ndarray | None = None


@dataclass
class Continuation:
    parent: int  # the seat of the beam it extends
    token: int
    score: np.float32  # the log probability of the beam's generated tokens, summed as HF sums it
    step: TokenStep
    # Where stop strings are watched: the beam's text with the token (cut where a stop string ended it)
    # and the detokenizer that made it
    text: str | None = None
    decoder: IncrementalDetokenizer | None = None
    stopped: bool = False  # a stop string ended it


@dataclass
class Hypothesis:
    token_ids: list[int]
    score: float  # for ranking: log probability / generated length ** length_penalty
    cumulative_logprob: float
    ended: bool  # with an end token or a stop string ("stop"), else at the length limit ("length")
    steps: list[TokenStep]
    text: str | None = None  # cut at the stop string that ended it; None: decoded from its tokens


@dataclass(eq=False)
class BeamSearch:
    params: SamplingParams
    max_new_tokens: int  # max_tokens, or less where max_model_len comes first
    end_tokens: frozenset[int]  # EOS (unless ignore_eos) and stop_token_ids
    vocab_size: int
    seats: list[Sequence] = field(default_factory=list)  # seat 0: the request's first sequence
    scores: list[np.float32] = field(default_factory=lambda: [np.float32(0.0)])
    steps: list[list[TokenStep]] = field(default_factory=lambda: [[]])  # per seat, when logprobs or logits are asked
    # seat -> its measured row (log probabilities, ids) and its raw logits where generation logits are asked
    rows: dict[int, tuple[list[float], list[int], np.ndarray | None]] = field(default_factory=dict)
    finished: list[Hypothesis] = field(default_factory=list)  # the best, at most beam_width, best first
    # Per seat, where the request has stop strings: the beam's text and its detokenizer
    texts: list[str] | None = None
    decoders: list[IncrementalDetokenizer] | None = None
    resting: set[int] = field(default_factory=set)  # seats without a continuation this step (reseat)
    improvable: bool = True  # HF's early-stop heuristic: a running beam may still beat a finished one
    done: bool = False

    @property
    def width(self) -> int:
        return self.params.beam_width

    @property
    def kept(self) -> int:
        """Continuations ranked each step (HF's beams_to_keep): enough that W of them do not end."""
        return max(2, 1 + len(self.end_tokens)) * self.width

    @property
    def row_size(self) -> int:
        """Tokens measured per row: the ranked ones even after min_tokens drops the end tokens, and the
        logprobs asked for."""
        return max(self.kept + len(self.end_tokens), self.params.logprobs or 0)

    @property
    def logged(self) -> bool:
        """Whether each beam keeps its tokens' steps: for logprobs or generation logits."""
        return self.params.logprobs is not None or self.params.return_generation_logits

    def add_row(self, seq: Sequence, values: list[float], ids: list[int], logits: np.ndarray | None = None) -> bool:
        """A beam's measured row (and its raw logits); True once every beam has its row for this step."""
        self.rows[self.seats.index(seq)] = (values, ids, logits)
        return len(self.rows) == len(self.seats) - len(self.resting)

    def has_row(self, seq: Sequence) -> bool:
        return self.seats.index(seq) in self.rows

    def advance(self) -> list[Continuation]:
        """Rank this step's continuations; return the next beams (none once the search is done)."""
        num_out = len(self.seats[0].output_token_ids)
        length = num_out + 1  # generated tokens, the new one included
        at_limit = length >= self.max_new_tokens
        ends_masked = num_out < self.params.min_tokens  # HF's min_new_tokens: end tokens at -inf
        ranked = []
        for seat, (values, ids, _) in self.rows.items():
            for rank, (logprob, token) in enumerate(zip(values, ids), start=1):
                if not (ends_masked and token in self.end_tokens):
                    score = np.float32(logprob) + self.scores[seat]
                    ranked.append((-score, seat * self.vocab_size + token, seat, token, logprob, rank))
        ranked.sort()  # best first; among equal scores, HF's flattened (beam, token) order
        k = self.params.logprobs or 0
        tops = {seat: list(zip(ids[:k], values[:k])) for seat, (values, ids, _) in self.rows.items()}
        logits = {seat: row for seat, (_, _, row) in self.rows.items()}
        self.rows.clear()
        continuations, ended = [], []
        for position, (negated, _, seat, token, logprob, rank) in enumerate(ranked[:self.kept]):
            c = Continuation(seat, token, -negated, TokenStep(token, logprob, rank, tops[seat], logits[seat]))
            if self.texts is not None:
                self._read_stop_strings(c, length)
            if at_limit or token in self.end_tokens or c.stopped:
                if position < self.width:  # only the W best may finish (HF's top_num_beam_mask)
                    ended.append(c)
            elif len(continuations) < self.width:
                continuations.append(c)
        self._finish(ended, length)
        if len(self.finished) == self.width and continuations:
            best_length = self.max_new_tokens if (self.params.early_stopping == "never"
                                                  and self.params.length_penalty > 0) else length
            best_possible = continuations[0].score / np.float32(best_length ** self.params.length_penalty)
            self.improvable = self.improvable and bool(best_possible > self.finished[-1].score)
        full_and_stopping = len(self.finished) == self.width and self.params.early_stopping is True
        self.done = at_limit or not continuations or not self.improvable or full_and_stopping
        return [] if self.done else continuations

    def _read_stop_strings(self, c: Continuation, length: int) -> None:
        """The continuation's text, and whether its token completes a stop string (once min_tokens are
        out, as for sampled completions)."""
        p, before = self.params, self.texts[c.parent]
        c.decoder = self.decoders[c.parent].fork()
        c.text = before + c.decoder.add_tokens([c.token])
        found = find_stop_string(c.text, p.stop, len(before)) if length >= p.min_tokens else None
        if found is not None:
            c.text = c.text[:found[1] if p.include_stop_str_in_output else found[0]]
            c.stopped = True

    def _finish(self, ended: list[Continuation], length: int) -> None:
        if not ended or (self.params.early_stopping is True and len(self.finished) == self.width):
            return  # (HF: once full, early stopping takes no more)
        divisor = np.float32(length ** self.params.length_penalty)
        for c in ended:
            tokens = self.seats[c.parent].output_token_ids + [c.token]
            steps = self.steps[c.parent] + [c.step] if self.logged else []
            self.finished.append(Hypothesis(tokens, float(c.score / divisor), float(c.score),
                                            c.token in self.end_tokens or c.stopped, steps,
                                            c.text if c.stopped else None))
        self.finished.sort(key=lambda h: -h.score)  # stable: among equals, the earlier finished first
        del self.finished[self.width:]

    def best(self) -> list[Hypothesis]:
        """The request's completions: its n best hypotheses, best first."""
        return self.finished[:self.params.n]

    def reseat(self, continuations: list[Continuation], block_manager: BlockManager, scheduler: Scheduler,
               new_seat: Callable[[int], Sequence]) -> None:
        """Make `continuations` the beams: a beam continued keeps its seat for its first continuation;
        its others take the seats of beams continued by none (or new seats, on the first step), with a
        fork of its blocks and tokens. Seats left over (fewer continuations than beams: stop strings can
        end more of the ranked ones than the end tokens the ranking makes room for) rest, out of the
        scheduler's queues and their blocks freed, until a later step has a continuation for them; HF's
        search runs such beams on with a score of -inf, which no continuation of theirs can win with."""
        kept: dict[int, Continuation] = {}
        moved: list[Continuation] = []
        for c in continuations:
            if c.parent in kept:
                moved.append(c)
            else:
                kept[c.parent] = c
        free = [seat for seat in range(len(self.seats)) if seat not in kept]
        new = set()
        while len(free) < len(moved):  # (the first step: the seats reserved when the request was admitted)
            free.append(len(self.seats))
            new.add(len(self.seats))
            self.seats.append(new_seat(len(self.seats)))
            self.scores.append(np.float32(0.0))
            self.steps.append([])
            if self.texts is not None:
                self.texts.append("")
                self.decoders.append(None)
        logged = self.logged
        for seat, c in zip(free, moved):  # (free seats are no beam's parent: nothing read below changes)
            seq, parent = self.seats[seat], self.seats[c.parent]
            block_manager.free(seq)
            seq.output_token_ids = parent.output_token_ids + [c.token]
            seq.forget_token_array()
            if parent.matcher is not None:  # the parent's grammar state, then its token
                seq.matcher = parent.matcher.fork()
                seq.matcher.accept_token(c.token)
            # It runs on a fork of the parent's blocks if both run (a preempted seat waits to be admitted
            # again, which keeps max_num_seqs), else waits to be computed from the prefix cache.
            runs = bool(parent.block_table) and (seat in new or seq.status is SequenceStatus.RUNNING)
            if runs:
                block_manager.fork(parent, seq)
            scheduler.requeue(seq, running=runs)
            self.scores[seat] = c.score
            self.steps[seat] = self.steps[c.parent] + [c.step] if logged else []
            self._take_text(seat, c)
        for seat, c in kept.items():
            self.seats[seat].append_token(c.token)
            if self.seats[seat].matcher is not None:
                self.seats[seat].matcher.accept_token(c.token)
            self.scores[seat] = c.score
            if logged:
                self.steps[seat].append(c.step)
            self._take_text(seat, c)
        self.resting = set(free[len(moved):])
        for seat in self.resting:
            scheduler.set_aside(self.seats[seat])
        for seq in self.seats:
            seq.num_tokens_sent = len(seq.output_token_ids)  # beams hand out nothing before the end

    def _take_text(self, seat: int, c: Continuation) -> None:
        if self.texts is not None:
            self.texts[seat], self.decoders[seat] = c.text, c.decoder

    def outputs(self, detokenizer: Callable[[], IncrementalDetokenizer], decode: Callable[[int], str]
                ) -> list[RequestDelta]:
        """The request's completions once the search is done: its n best hypotheses, best first, each a
        final delta (the last one the request's), with text from a fresh `detokenizer()`."""
        leader, p = self.seats[0], self.params
        best = self.best()
        deltas = []
        for index, hypothesis in enumerate(best):
            text = hypothesis.text if p.detokenize else ""
            if text is None:
                decoder = detokenizer()
                text = decoder.add_tokens(hypothesis.token_ids) + decoder.flush()
            last = index == len(best) - 1
            deltas.append(RequestDelta(
                request_id=leader.request_id, new_token_ids=hypothesis.token_ids, new_text=text, finished=last,
                finish_reason="stop" if hypothesis.ended else "length", num_prompt_tokens=leader.num_prompt_tokens,
                num_output_tokens=len(hypothesis.token_ids), index=index,
                new_logprobs=None if p.logprobs is None else self._logprobs(hypothesis, p.logprobs, decode),
                cumulative_logprob=hypothesis.cumulative_logprob, metrics=leader.metrics if last else None,
                prompt_logprobs=(leader.prompt_logprobs or [None]) if p.prompt_logprobs is not None and not index
                else None,
                context_logits=np.stack(leader.context_logits) if p.return_context_logits and not index else None,
                new_generation_logits=[s.logits for s in hypothesis.steps] if p.return_generation_logits else None))
        return deltas

    @staticmethod
    def _logprobs(hypothesis: Hypothesis, k: int, decode: Callable[[int], str]) -> list[TokenLogprobs]:
        """The hypothesis's tokens' entries, as logprobs.entries builds them for sampled tokens."""
        rows = []
        for step in hypothesis.steps:
            entry = {step.token: Logprob(step.logprob, step.rank, decode(step.token))}
            for rank, (token, value) in enumerate(step.top[:k], start=1):
                entry.setdefault(token, Logprob(value, rank, decode(token)))
            rows.append(entry)
        return rows
