"""Speculative decoding by n-gram lookup (vLLM's "ngram" method, HF's prompt lookup decoding).

A decoding sequence whose last few tokens appeared earlier in its prompt or output proposes the tokens
that followed them there as drafts. The step computes the sequence's last token and its drafts in one
chunk (the cost of one memory-bound decode step for several tokens) and scores every position: row i
judges draft i + 1, and the row after the last draft gives a token of its own. The host keeps the
tokens up to and with the first that differs from its draft, so every step gains at least one token.

Verification keeps the output distribution exactly the model's. A greedy row's token is its argmax.
A row that samples accepts its draft d with probability p(d) (the draft came from a lookup, not from a
distribution: its proposal probability is 1), else draws from p with d removed; the tokens kept are
distributed as if drawn one by one (the rejection sampling of Leviathan et al. and Chen et al. with a
one-hot proposal). A row's token equal to its draft means the next row's logits, computed after that
draft, are valid.

Only what a row can judge alone is speculated on: a sequence with penalties, bad words, repeated
n-gram bans, min_tokens still to come, raw generation logits or beam search decodes a token a step, as
before. A grammar (structured outputs) drafts: its matcher takes the drafts one by one to mask each
row to what may follow the drafts before it, and is rolled back; a draft it refuses is not proposed.
Drafts given with a request (SamplingParams.draft_token_ids, a draft model's) are judged the same way,
in the step that computes the prompt's end (the scheduler puts them there); with the draft model's
logits (draft_logits), a sampled row judges each draft against the distribution it was drawn from:
kept with probability min(1, p(d) / q(d)), else a token drawn from max(0, p - q).
"""

import itertools

import numpy as np
import torch

from .config import SpeculativeConfig
from .input_buffers import to_device
from .sampler import apply_token_controls, draw, filter_probs, uniforms
from .sequence import Sequence
from .structured_output import grammatical_prefix


def can_speculate(seq: Sequence) -> bool:
    """Whether each row of the sequence can be judged alone: nothing that depends on the tokens before
    it beyond the model's logits (its parameters allow it, min_tokens are out, no token is in flight),
    and, where a sequence drafts from its prompt's last token, that row is its own next token's only:
    not also its other completions' first (n forks them from it) nor the context logits' last."""
    at_prompt_end = seq.num_output_tokens == 0
    return (_rows_judged_alone(seq) and not seq.num_pending
            and not (at_prompt_end and (seq.forks_left or seq.params.return_context_logits)))


def _rows_judged_alone(seq: Sequence) -> bool:
    p = seq.params
    return p.drafts_judged_alone and seq.num_output_tokens >= p.min_tokens


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.config = config

    @staticmethod
    def awaits_token(seq: Sequence) -> bool:
        """Whether `seq` could speculate but for its token in flight (async scheduling)."""
        return seq.num_pending > 0 and _rows_judged_alone(seq)

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """Up to `limit` drafts for `seq` (at most num_speculative_tokens): the tokens that followed the
        latest earlier occurrence of its longest suffix of prompt_lookup_min..max tokens; none when no
        suffix recurs or the sequence cannot speculate."""
        limit = min(limit, self.config.num_speculative_tokens)
        if limit <= 0 or not can_speculate(seq):
            return []
        drafts = lookup(seq.token_array, self.config.prompt_lookup_min, self.config.prompt_lookup_max, limit)
        if seq.prompt_embeds is not None:  # a virtual prompt token is no token to draft (prompt_embeds.py)
            first = seq.prompt_embeds.first_id
            drafts = list(itertools.takewhile(lambda t: t < first, drafts))
        if seq.matcher is not None and drafts:  # what the grammar would refuse is never kept: not drafted
            drafts = drafts[:grammatical_prefix(seq.matcher, drafts)]
        return drafts


def lookup(tokens: np.ndarray, shortest: int, longest: int, limit: int) -> list[int]:
    """The up to `limit` tokens after the latest earlier end of the longest suffix of `tokens` that
    recurs (between `shortest` and `longest` tokens long)."""
    last = len(tokens) - 1
    if last < shortest:
        return []
    ends = np.flatnonzero(tokens[:last] == tokens[last])  # where an earlier match could end
    matched = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, min(longest, last)):  # extend every candidate one token further back at a time
        before = ends - back
        alive &= before >= 0
        alive[alive] &= tokens[before[alive]] == tokens[last - back]
        matched += alive
    good = np.flatnonzero(matched >= shortest)
    if not len(good):
        return []
    # The longest match; among equals, the latest.
    order = np.lexsort((ends[good], matched[good]))
    best = ends[good[order[-1]]]
    return tokens[best + 1:best + 1 + limit].tolist()


@torch.inference_mode()
def verify(logits: torch.Tensor, seqs: list[Sequence], drafts: list[int],
           proposals: list[np.ndarray | None] | None = None) -> torch.Tensor:
    """The token of each row of `logits` [rows, vocab] (float32, changed in place): `seqs[i]` the row's
    sequence, `drafts[i]` the draft it judges (-1: none, the row after a sequence's last draft),
    `proposals[i]` the distribution the draft was drawn from (None: one-hot, the draft itself). A greedy
    row's token is its argmax. A row that samples keeps its draft d with probability min(1, p(d) / q(d)),
    else draws from max(0, p - q) renormalized: every token comes out distributed as p (rejection
    sampling; with a one-hot q, p(d) and p without d). Nothing here waits for the device."""
    device = logits.device
    if any(s.params.allowed_token_ids is not None or s.params.logit_bias for s in seqs):
        apply_token_controls(logits, seqs)
    tokens = logits.max(dim=-1).indices
    rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if not rows:
        return tokens
    at = to_device(rows, device)
    probs = filter_probs(logits[at], [seqs[i] for i in rows])
    draft = to_device([drafts[i] for i in rows], device)
    has_draft = draft >= 0
    column = draft.clamp(min=0)[:, None]
    p_draft = probs.gather(1, column)[:, 0]
    generators = [seqs[i].generator for i in rows]
    proposal = torch.zeros_like(probs).scatter_(1, column, has_draft[:, None].to(probs.dtype))  # one-hot
    given = [(k, proposals[i]) for k, i in enumerate(rows) if proposals is not None and proposals[i] is not None]
    if given:
        proposal[to_device([k for k, _ in given], device)] = to_device(np.stack([q for _, q in given]), device,
                                                                       torch.float32)
    # probs may sum to less than 1 (min-p drops tokens without renormalizing): scale q to their total
    total = probs.sum(dim=-1)
    keep = has_draft & (uniforms(generators, device)[:, 0] * proposal.gather(1, column)[:, 0] * total < p_draft)
    rest = (probs - total[:, None] * proposal).clamp_(min=0)
    tokens[at] = torch.where(keep, draft, draw(rest, generators, tokens[at]))
    return tokens


def draft_distributions(seq: Sequence) -> list[np.ndarray | None]:
    """The distributions its scheduled drafts were drawn from, and None for the row after them: the
    request's draft_logits for its own drafts, else None (one-hot: a lookup's drafts)."""
    given = seq.params.draft_logits is not None and seq.takes_given_drafts
    return [*(seq.params.draft_probs[:len(seq.drafts)] if given else [None] * len(seq.drafts)), None]


def accepted_tokens(tokens: list[int], drafts: list[int]) -> list[int]:
    """A sequence's tokens from its rows' `tokens` (one more than its `drafts`): up to and with the first
    that differs from the draft it judged."""
    for i, draft in enumerate(drafts):
        if tokens[i] != draft:
            return tokens[:i + 1]
    return tokens
