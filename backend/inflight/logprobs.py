"""Log probabilities of sampled and prompt tokens, from the model's own distribution (the logits
before temperature, penalties and filters, as vLLM reports by default), with ranks and the k most
likely tokens."""

from typing import Callable

import torch

from .outputs import Logprob, TokenLogprobs

MAX_LOGPROBS = 20


def token_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int],
                   decode: Callable[[int], str]) -> list[TokenLogprobs]:
    """For each row of `logits` [rows, vocab]: the logprob and rank of `tokens[row]` and of the
    `ks[row]` most likely tokens."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen_ids = torch.tensor(tokens, device=logprobs.device)
    chosen = logprobs.gather(1, chosen_ids[:, None])
    ranks = (logprobs > chosen).sum(dim=1) + 1
    top_values, top_ids = logprobs.topk(max(ks), dim=-1) if max(ks) else (None, None)
    chosen, ranks = chosen[:, 0].tolist(), ranks.tolist()
    entries = []
    for row, (token, k) in enumerate(zip(tokens, ks)):
        entry = {token: Logprob(chosen[row], ranks[row], decode(token))}
        if k:
            for rank, (value, token_id) in enumerate(zip(top_values[row, :k].tolist(), top_ids[row, :k].tolist())):
                entry.setdefault(token_id, Logprob(value, rank + 1, decode(token_id)))
        entries.append(entry)
    return entries
