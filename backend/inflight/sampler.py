"""Batched sampling with per-request parameters.

Greedy rows take the argmax. Other rows go through penalties, temperature, top-k, top-p and min-p,
then draw by inverse CDF: one uniform number per row against the row's cumulative probabilities, a
few vectorized operations for the whole batch (an exponential race over the vocabulary, argmax of
p / Exp(1) noise, cost 0.7 ms a row on a CPU and a kernel launch a row on a GPU). A request with a seed
draws its number from its own generator, so its output does not depend on what else is batched.
"""

import numpy as np
import torch

from .input_buffers import to_device
from .sampling_params import (BAD_WORDS, GREEDY, MIN_P, MIN_TOKENS, NO_REPEAT_NGRAMS, PRESENCE_FREQUENCY_PENALTY,
                              REPETITION_PENALTY, SEEDED, TEMPERATURE, TOKEN_CONTROLS, TOP_K, TOP_P, SamplingParams)
from .sequence import Sequence
from .token_history import TokenHistory


def needs_of(seqs: list[Sequence]) -> int:
    """What the rows may ask of the sampler: their SamplingParams.needs bits, together."""
    needs = 0
    for seq in seqs:
        needs |= seq.params.needs
    return needs


def apply_token_controls(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """allowed_token_ids (every other token's logit to -inf), then logit_bias (added to the logits), for
    the rows that ask, each in a few operations for the batch; the first of the sampler's changes, as in
    vLLM. Allowed tokens keep their logits across a fill of their rows (masking whole rows took 3.7x as
    long: 128 rows of 49,152 with 1,000 allowed each, on a CPU, 16.5 ms against 4.5)."""
    device = logits.device
    allowed = [(row, seq.params.allowed_array) for row, seq in enumerate(seqs)
               if seq.params.allowed_token_ids is not None]
    if allowed:
        rows, ids = _cells(allowed, logits.shape[-1], device)
        kept = logits[rows, ids]
        logits.index_fill_(0, to_device([row for row, _ in allowed], device), float("-inf"))
        logits[rows, ids] = kept
    biased = [(row, seq.params.bias_arrays) for row, seq in enumerate(seqs) if seq.params.logit_bias]
    if biased:
        vocab = logits.shape[-1]
        rows, ids = _cells([(row, ids) for row, (ids, _) in biased], vocab, device)
        values = np.concatenate([values[ids < vocab] for _, (ids, values) in biased])
        logits[rows, ids] += to_device(values, device, torch.float32)  # (each cell once: the ids are unique)


def _cells(per_row: list[tuple[int, np.ndarray]], vocab: int,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The (row, token id) cells of each row's ids below `vocab`, as index tensors on `device`."""
    per_row = [(row, ids[ids < vocab]) for row, ids in per_row]
    rows = np.repeat([row for row, _ in per_row], [len(ids) for _, ids in per_row])
    return to_device(rows, device), to_device(np.concatenate([ids for _, ids in per_row]), device)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence], in_flight: torch.Tensor | None = None,
                    needs: int | None = None, history: TokenHistory | None = None) -> None:
    """Repetition penalty over prompt and output (as HF), presence and frequency over output (as vLLM),
    for the whole batch at once, on the logits of the tokens seen only (one row at a time, 128 rows took
    10-20 ms a step on a CPU, and as many launches on a GPU). The tokens come from `history`, the
    device's record of the step's sequences (token_history.py: the host sends row indices only), where
    it holds them all; else they are laid out on the host, where `in_flight` holds the sampled tokens of
    the step still on the GPU (async scheduling): a sequence with a pending token finds it there
    (`pending_row`), at no wait."""
    vocab, device = logits.shape[-1], logits.device
    needs = needs_of(seqs) if needs is None else needs
    if history is not None and history.covers(seqs, vocab):
        for kind in (REPETITION_PENALTY, PRESENCE_FREQUENCY_PENALTY):
            if needs & kind:
                _penalize_from_history(logits, seqs, history, kind)
        return
    params = [s.params for s in seqs]
    pending = [s.pending_row if s.num_pending and in_flight is not None else None for s in seqs]
    if needs & REPETITION_PENALTY:
        on = [p.repetition_penalty != 1.0 for p in params]
        ids, lengths = _padded_ids([s.token_array if o else _NONE for s, o in zip(seqs, on)],
                                   [row if o else None for row, o in zip(pending, on)], in_flight, vocab, device)
        _penalize(logits, ids, None, [p if n else _NO_PENALTIES for p, n in zip(params, lengths)], REPETITION_PENALTY)
    if needs & PRESENCE_FREQUENCY_PENALTY:
        ids, lengths = _padded_ids([s.output_array for s in seqs], pending, in_flight, vocab, device)
        genuine = torch.arange(ids.shape[1], device=device) < to_device(lengths, device)[:, None]
        _penalize(logits, ids, genuine, params, PRESENCE_FREQUENCY_PENALTY)


def _penalize_from_history(logits: torch.Tensor, seqs: list[Sequence], history: TokenHistory, kind: int) -> None:
    """One kind of penalty on the rows whose requests ask for it, their tokens read from `history`: the
    rows of a batch that only partly asks are taken out and put back (a row's tokens are gathered to the
    batch's widest, which the others then need not decide)."""
    rows = [row for row, seq in enumerate(seqs) if seq.params.needs & kind]
    chosen = [seqs[row] for row in rows]
    at = to_device(rows, logits.device) if len(rows) < len(seqs) else None
    some = logits if at is None else logits[at]
    starts = [seq.num_prompt_tokens for seq in chosen] if kind == PRESENCE_FREQUENCY_PENALTY else None
    ids, in_range = history.tokens([seq.step_row for seq in chosen], to_device, starts)
    if kind == REPETITION_PENALTY:  # every token seen, padded with the row's first
        ids, in_range = torch.where(in_range, ids, ids[:, :1]), None
    _penalize(some, ids, in_range, [seq.params for seq in chosen], kind)
    if at is not None:
        logits[at] = some


def _penalize(logits: torch.Tensor, ids: torch.Tensor, counted: torch.Tensor | None, params: list[SamplingParams],
              needs: int) -> None:
    """The penalties `needs` names, on the logits at `ids` [rows, width] (scattering back a value computed
    from a token's logit writes the same value for each repeat of it). The repetition penalty's ids are a
    row's tokens, padded with ids of its own; presence and frequency count the ids `counted` marks
    [rows, width], the row's output tokens, and leave the logits of the others as they were."""
    device = logits.device
    if needs & REPETITION_PENALTY:
        penalty = _per_row([p.repetition_penalty for p in params], device)
        values = logits.gather(1, ids)
        logits.scatter_(1, ids, torch.where(values > 0, values / penalty, values * penalty))
    if needs & PRESENCE_FREQUENCY_PENALTY:
        counts = torch.zeros_like(logits).scatter_add_(1, ids, counted.float()).gather(1, ids)
        frequency = _per_row([p.frequency_penalty for p in params], device)
        presence = _per_row([p.presence_penalty for p in params], device)
        # (an id seen but not counted, a prompt's, keeps its logit: less 0)
        logits.scatter_(1, ids, logits.gather(1, ids) - (counts * frequency + presence * (counts > 0)))


_NO_PENALTIES = SamplingParams()


def _per_row(values: list[float], device: torch.device) -> torch.Tensor:
    return to_device(values, device, torch.float32)[:, None]


_NONE = np.zeros(0, dtype=np.int64)


def _padded_ids(rows: list[np.ndarray], pending: list[int | None], in_flight: torch.Tensor | None, vocab: int,
                device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """Each row's token ids below `vocab` [rows, longest], padded with ids of its own (0 for a row with
    none: its penalties must then change nothing), and how many each row has. A row with a `pending`
    index has one more id after its own: that row of `in_flight`, copied on the device. Scattering back
    a value computed from a token's logit writes the same value for each repeat and each pad.
    Laid out by a few whole-array operations, not row by row (128 rows of 300-900 ids: 0.22 ms of the CI
    host against 0.28; on a GPU the host's time is the step's)."""
    flat = np.concatenate([_NO_ID, *rows])  # (after a 0 that rows without ids point to)
    if flat.max() >= vocab:  # (a prompt's ids beyond the model's logits)
        rows = [ids[ids < vocab] for ids in rows]
        flat = np.concatenate([_NO_ID, *rows])
    lengths = np.fromiter(map(len, rows), np.int64, len(rows))
    extra = np.fromiter((row is not None for row in pending), np.int64, len(rows))
    width = max(int((lengths + extra).max()), 1)
    starts = np.where(lengths > 0, np.cumsum(lengths) - lengths + 1, 0)
    last = np.maximum(lengths - 1, 0)
    # Position j of a row reads its id j, or its last one past its end.
    padded = to_device(np.take(flat, starts[:, None] + np.minimum(np.arange(width), last[:, None])), device)
    if extra.any():  # sampled tokens: always within the vocabulary
        with_pending = np.flatnonzero(extra)
        latest = in_flight[to_device([pending[i] for i in with_pending], device)]
        padded[to_device(with_pending, device), to_device(lengths[with_pending], device)] = latest
        alone = np.flatnonzero(lengths[with_pending] == 0)  # nothing known: its pads are its pending token
        if len(alone):
            padded[to_device(with_pending[alone], device)] = latest[to_device(alone, device), None]
    return padded, (lengths + extra).tolist()


_NO_ID = np.zeros(1, dtype=np.int64)


def suppress_stops(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: list[int]) -> None:
    """Before min_tokens are out, EOS and the request's stop tokens cannot be drawn (under structured
    outputs the grammar says where the output ends)."""
    _ban(logits, [(row, t) for row, seq in enumerate(seqs)
                  if seq.num_output_tokens < seq.params.min_tokens and seq.matcher is None
                  for t in (*eos_token_ids, *seq.params.stop_token_ids)])


def ban_repeated_ngrams(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """no_repeat_ngram_size n: a token that would complete an n-gram already in the sequence (prompt and
    output) is banned, as HF's NoRepeatNGramLogitsProcessor bans it."""
    banned = []
    for row, seq in enumerate(seqs):
        n = seq.params.no_repeat_ngram_size
        tokens = seq.token_array
        if not n or len(tokens) < n:  # (no n-gram complete yet)
            continue
        if n == 1:  # (no earlier tokens to match: every token seen is banned)
            banned += [(row, t) for t in np.unique(tokens).tolist()]
            continue
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n - 1)  # each n-gram's first n-1
        matches = np.flatnonzero((windows == tokens[len(tokens) - n + 1:]).all(axis=1))
        banned += [(row, t) for t in np.unique(tokens[matches + n - 1]).tolist()]
    _ban(logits, banned)


def ban_bad_words(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """A bad word's last token is banned wherever the output so far ends with the rest of it."""
    banned = []
    for row, seq in enumerate(seqs):
        tail = seq.token_array
        for ids in seq.bad_words_ids:
            prefix = ids[:-1]
            if not prefix or tail[max(0, len(tail) - len(prefix)):].tolist() == prefix:
                banned.append((row, ids[-1]))
    _ban(logits, banned)


def _ban(logits: torch.Tensor, cells: list[tuple[int, int]]) -> None:
    """-inf at each (row, token id) within the logits' vocabulary, in one operation."""
    cells = [(row, t) for row, t in cells if t < logits.shape[-1]]
    if cells:
        rows, ids = to_device(cells, logits.device).unbind(1)
        logits[rows, ids] = float("-inf")


# On a CPU, top-p looks for its cut among each row's likeliest tokens first, then among more: sorting
# 128 rows of a 49,152-token vocabulary took 207 ms on 2 threads, their top 256 11 ms, their top 4,096
# 39 ms. Only rows whose 4,096 likeliest hold less than top_p of the mass are sorted whole. A GPU finds
# the cuts otherwise (_top_p_way).
TOP_P_CANDIDATES = (256, 4096)


def filter_probs(logits: torch.Tensor, seqs: list[Sequence], needs: int | None = None) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p for the rows that sample; returns probabilities. A filter
    keeps every token whose logit equals its cut (ties are kept together). `needs`: needs_of(seqs), or
    of a batch they are rows of."""
    device = logits.device
    needs = needs_of(seqs) if needs is None else needs
    if needs & TEMPERATURE:
        logits = logits / _per_row([s.params.temperature for s in seqs], device)
    vocab = logits.shape[-1]
    top_k = [s.params.top_k if 0 < s.params.top_k < vocab else vocab for s in seqs] if needs & TOP_K else [vocab]
    if min(top_k) < vocab:
        widest = max(k for k in top_k if k < vocab)
        kth = torch.topk(logits, widest, dim=-1).values.gather(
            1, to_device([min(k, widest) - 1 for k in top_k], device)[:, None])
        without = to_device([k == vocab for k in top_k], device, torch.bool)[:, None]
        logits = logits.masked_fill(logits < kth.masked_fill(without, float("-inf")), float("-inf"))
    if needs & TOP_P:  # decided on the host: no device sync in the step
        top_p = _per_row([s.params.top_p for s in seqs], device)
        logits = logits.masked_fill(logits < _top_p_cuts(logits, top_p), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if needs & MIN_P:
        min_p = _per_row([s.params.min_p for s in seqs], device)
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def _top_p_cuts(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Each row's smallest logit that top-p keeps [rows, 1]: a token is dropped when the tokens ranked
    above it already hold top_p of the mass; -inf for rows with top_p 1, which drop nothing (their
    cumulative sums can round past 1.0 in the tail)."""
    way = _top_p_way(logits.device, len(logits))
    if way == "kernel":
        from .ops.triton_top_p import top_p_cuts  # (triton only where its kernel runs)

        return top_p_cuts(logits, top_p)
    if way == "sort":
        return sorted_top_p_cuts(logits, top_p)
    log_total = torch.logsumexp(logits, dim=-1, keepdim=True)
    cuts = torch.full_like(top_p, float("-inf"))
    rows = (top_p[:, 0] < 1.0).nonzero()[:, 0]
    for width in TOP_P_CANDIDATES:
        if not len(rows) or width >= logits.shape[-1]:
            break
        ranked = torch.topk(logits[rows], width, dim=-1).values
        cuts[rows], covered = _cuts_within(ranked, log_total[rows], top_p[rows])
        rows = rows[~covered[:, 0]]
    if len(rows):  # cuts beyond every width: those rows sorted whole
        ranked = torch.sort(logits[rows], dim=-1, descending=True).values
        cuts[rows] = _cuts_within(ranked, log_total[rows], top_p[rows])[0]
    return cuts


def sorted_top_p_cuts(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """_top_p_cuts by sorting every row whole: a GPU's way for small batches (bench-kernels times it
    against the kernel)."""
    log_total = torch.logsumexp(logits, dim=-1, keepdim=True)
    cuts = _cuts_within(torch.sort(logits, dim=-1, descending=True).values, log_total, top_p)[0]
    return cuts.masked_fill(top_p >= 1.0, float("-inf"))


def compile_kernels(device: torch.device, vocab: int) -> None:
    """Compile the sampler's Triton kernel now, where it has one, not in the first request using top-p."""
    if _top_p_way(device, TOP_P_KERNEL_MIN_ROWS) == "kernel":
        from .ops.triton_top_p import top_p_cuts

        top_p_cuts(torch.zeros(1, vocab, device=device), torch.full((1, 1), 0.5, device=device))


# On a GPU, batches of this many rows or more find top-p's cuts with the kernel, smaller ones sort their
# rows: the kernel's program a row is alone on its SM, its time about that of one row's 8 passes
# (estimated at ~0.2 ms for a 128k vocabulary), where sorting scales with the rows (1.6 ms for 128 on the
# H200, two segmented sorts). To be set from bench-kernels' top-p rows on a GPU.
TOP_P_KERNEL_MIN_ROWS = 32


def _top_p_way(device: torch.device, rows: int) -> str:
    """How top-p's cuts are found: "candidates" on a CPU (the likeliest tokens first, rows chosen to
    sort), on a GPU "kernel" (ops/triton_top_p.py) or "sort" (every row; choosing rows would wait)."""
    if device.type == "cpu":
        return "candidates"
    return "kernel" if rows >= TOP_P_KERNEL_MIN_ROWS else "sort"


def _cuts_within(ranked: torch.Tensor, log_total: torch.Tensor,
                 top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cuts of `_top_p_cuts` from each row's likeliest logits in descending order (all of them or
    the first few), and whether the row's cut is surely among them: they hold top_p of the mass."""
    probs = torch.exp(ranked - log_total)
    mass = torch.cumsum(probs, dim=-1)
    kept = mass - probs < top_p
    return ranked.masked_fill(~kept, float("inf")).amin(dim=-1, keepdim=True), mass[:, -1:] >= top_p


def apply_logits_processors(scores: torch.Tensor, seqs: list[Sequence], in_flight: torch.Tensor | None = None,
                            needs: int | None = None, history: TokenHistory | None = None) -> None:
    """The request's token controls (allowed tokens, logit bias), penalties, repeated n-grams and bad
    words, in that order (HF's), for the rows that ask: on the logits before sampling, on the log
    probabilities under beam search (where HF applies its logits processors). `in_flight`, `history`:
    where penalties find the tokens (apply_penalties)."""
    needs = needs_of(seqs) if needs is None else needs
    if needs & TOKEN_CONTROLS:
        apply_token_controls(scores, seqs)
    if needs & (REPETITION_PENALTY | PRESENCE_FREQUENCY_PENALTY):
        apply_penalties(scores, seqs, in_flight, needs, history)
    if needs & NO_REPEAT_NGRAMS:
        ban_repeated_ngrams(scores, seqs)
    if needs & BAD_WORDS:
        ban_bad_words(scores, seqs)


@torch.inference_mode()
def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: list[int], grammars=None,
           in_flight: torch.Tensor | None = None, needs: int | None = None,
           history: TokenHistory | None = None) -> torch.Tensor:
    """One next token per row of `logits` [len(seqs), vocab] (float32, modified in place), on the
    logits' device: nothing here waits for the GPU. `grammars` (a StructuredOutputs) masks the rows of
    sequences that have a grammar matcher; `in_flight`: the tokens of the step still running, which
    hold the pending tokens, and `history`, the device's record of the step's tokens (penalties count
    them: apply_penalties); `needs`: needs_of(seqs), where the caller has it."""
    needs = needs_of(seqs) if needs is None else needs
    apply_logits_processors(logits, seqs, in_flight, needs, history)
    if needs & MIN_TOKENS:
        suppress_stops(logits, seqs, eos_token_ids)
    if grammars is not None:  # (a sequence that ended since it was scheduled has a spent matcher: its row goes)
        grammars.apply(logits, [None if s.is_finished else s.matcher for s in seqs])
    # max's indices are argmax's (the first of equal values), computed 2-3x faster on a CPU (48 x 49,152: 0.6
    # against 1.5 ms). Greedy rows' tokens, and the likeliest of the rows that sample.
    tokens = logits.max(dim=-1).indices
    rows = [i for i, s in enumerate(seqs) if not s.params.greedy] if needs & GREEDY else range(len(seqs))
    if len(rows) == len(seqs):  # every row samples: no copy of the rows (25 MB for 128 of 49,152)
        return draw(filter_probs(logits, seqs, needs), [s.generator for s in seqs] if needs & SEEDED else None,
                    tokens)
    if rows:
        at = to_device(rows, logits.device)  # (a list as an index would be copied to a GPU with a wait)
        probs = filter_probs(logits[at], [seqs[i] for i in rows], needs)
        tokens[at] = draw(probs, [seqs[i].generator for i in rows] if needs & SEEDED else None, tokens[at])
    return tokens


def draw(probs: torch.Tensor, generators: list[torch.Generator | None] | None,
         likeliest: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` [rows, vocab] (rows sum to 1 or less, none all zero), each row's
    uniform number from its generator where it has one (None: no row has one); `likeliest` [rows] is each
    row's most probable token (the filters keep it), taken where rounding draws a token of no probability."""
    cdf = probs.cumsum(-1)  # float32: a tail token of probability under ~1e-7 is drawn only roughly so
    uniform = uniforms(generators, probs.device, len(probs))
    tokens = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).clamp_(max=probs.shape[1] - 1)
    # Rounding can land on a token of no probability at the very end: take the row's likeliest then
    # (given: an argmax of its own cost 8 ms a step for 128 rows of 49,152 on a CPU).
    drawn_nothing = probs.gather(1, tokens) == 0
    return torch.where(drawn_nothing, likeliest[:, None], tokens)[:, 0]


def uniforms(generators: list[torch.Generator | None] | None, device: torch.device,
             rows: int | None = None) -> torch.Tensor:
    """A uniform number in [0, 1) per row [rows, 1], each from its row's generator where it has one
    (None: `rows` rows, none with a generator)."""
    uniform = torch.rand(len(generators) if rows is None else rows, 1, device=device)
    for row, generator in enumerate(generators or ()):
        if generator is not None:
            uniform[row] = torch.rand(1, device=device, generator=generator)
    return uniform
