"""Log probabilities of sampled and prompt tokens, from the model's own distribution (the logits
before temperature, penalties and filters, as vLLM reports by default), with ranks and the k most
likely tokens. Measured on the logits' device as the tokens are sampled (`measure`), read into entries
on the host later (`entries`): under async scheduling, once the step's copy to the host is done."""

from dataclasses import dataclass
from typing import Callable

import torch

from .outputs import Logprob, TokenLogprobs

MAX_LOGPROBS = 20


@dataclass
class MeasuredLogprobs:
    """Per row: the logprob and rank of its token, and the logprobs and ids of the k likeliest tokens
    (k: the most any row asked for)."""

    chosen: torch.Tensor  # [rows]
    ranks: torch.Tensor  # [rows]
    top_values: torch.Tensor | None  # [rows, k]
    top_ids: torch.Tensor | None  # [rows, k]

    def to_host(self) -> "MeasuredLogprobs":
        """Copies on the host, without waiting for the device (pinned; to be read once the step's copy
        event has passed); on a CPU, itself."""
        if self.chosen.device.type == "cpu":
            return self

        def copy(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to("cpu", non_blocking=True)

        return MeasuredLogprobs(copy(self.chosen), copy(self.ranks), copy(self.top_values), copy(self.top_ids))


def measure(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> MeasuredLogprobs:
    """`logits` [rows, vocab], `tokens` [rows] on the same device; nothing here waits for it."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, tokens[:, None])
    ranks = (logprobs > chosen).sum(dim=1) + 1
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    return MeasuredLogprobs(chosen[:, 0], ranks, top_values, top_ids)


def entries(measured: MeasuredLogprobs, tokens: list[int], ks: list[int],
            decode: Callable[[int], str]) -> list[TokenLogprobs]:
    """Each row's entry: its token's logprob and rank, and its `ks[row]` likeliest tokens'."""
    chosen, ranks = measured.chosen.tolist(), measured.ranks.tolist()
    top_values = measured.top_values.tolist() if measured.top_values is not None else None
    top_ids = measured.top_ids.tolist() if measured.top_ids is not None else None
    rows = []
    for row, (token, k) in enumerate(zip(tokens, ks)):
        entry = {token: Logprob(chosen[row], ranks[row], decode(token))}
        for rank, (value, token_id) in enumerate(zip(top_values[row][:k], top_ids[row][:k]) if k else ()):
            entry.setdefault(token_id, Logprob(value, rank + 1, decode(token_id)))
        rows.append(entry)
    return rows

