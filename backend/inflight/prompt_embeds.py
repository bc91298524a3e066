"""Prompt embeddings: prompt positions given as vectors instead of token ids (TensorRT-LLM's p-tuning
`prompt_embedding_table`, vLLM's `prompt_embeds`).

A prompt id from the model's vocab_size up is a virtual token: it stands for row (id - vocab_size) of
the request's table. A step whose tokens include virtual ones embeds its real ids with the model's own
embedding and puts the table's rows in place of the virtual ones; the model then runs on those vectors.
The prefix cache tells virtual tokens apart by a digest of their rows, so a block is reused only for the
same vectors. Sampling never sees virtual ids: they lie beyond the logits, and output tokens are real.

Some vision-language models let an image's tokens see each other (Gemma 3): each run of consecutive
virtual tokens of such a prompt is a span whose tokens attend to every token of it, before or after
(`spans`); others let the whole prompt see itself (PaliGemma, a prefix language model): the prompt is
one span. The engine computes a span whole within one chunk of the prompt (scheduler.py,
block_manager.py) and attends over it so (ops.attend_within_spans).
"""

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(eq=False)
class PromptEmbeddings:
    table: torch.Tensor  # [rows, hidden] in the model's dtype, on the CPU
    first_id: int  # the model's vocab_size: the prompt's ids from here up are rows of the table
    row_keys: dict[int, bytes]  # a digest of the row of each virtual id the prompt holds
    spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) positions seeing each other
    prompt_key: bytes | None = None  # a digest of the whole prompt, where it is one span (attend_within_prompt)

    def attend_within_runs(self, token_ids: list[int]) -> None:
        """Make each run of consecutive virtual tokens a span whose tokens see each other. A token's keys
        and values then depend on the rows after it in its span too, so its digest takes in the whole
        span's: a block is reused only where its span is the same all through."""
        at = np.flatnonzero(np.asarray(token_ids) >= self.first_id)
        breaks = np.flatnonzero(np.diff(at) != 1) + 1
        for run in np.split(at, breaks) if len(at) else []:
            start, end = int(run[0]), int(run[-1]) + 1
            ids = token_ids[start:end]
            whole = hashlib.blake2b(b"".join(self.row_keys[t] for t in ids), digest_size=16).digest()
            for t in ids:
                self.row_keys[t] = hashlib.blake2b(self.row_keys[t] + whole, digest_size=16).digest()
            self.spans.append((start, end))

    def attend_within_prompt(self, token_ids: list[int]) -> None:
        """Make the whole prompt one span, its tokens (text and images) seeing each other. Every token's keys
        and values then depend on the whole prompt, so each block of it is found again only with the same
        whole prompt (cache_key)."""
        self.prompt_key = hashlib.blake2b(repr(self.cache_key(token_ids)).encode(), digest_size=16).digest()
        self.spans.append((0, len(token_ids)))

    def span_split_by(self, position: int) -> tuple[int, int] | None:
        """The span that a chunk's boundary before `position` would split, if any."""
        for start, end in self.spans:
            if start < position < end:
                return start, end
        return None

    def cache_key(self, token_ids: list[int], start: int = 0) -> tuple:
        """The token ids from position `start` as the prefix cache compares them: a virtual id as its row's
        digest; those of a prompt that sees itself whole led by the prompt's digest."""
        first = self.first_id
        key = tuple(self.row_keys[t] if t >= first else t for t in token_ids)
        return (self.prompt_key, *key) if self.prompt_key is not None and start < self.spans[0][1] else key

    def rows(self, token_ids: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
        """The positions of the virtual ids among `token_ids` and their rows of the table."""
        at = np.flatnonzero(token_ids >= self.first_id)
        return at, self.table[torch.from_numpy(token_ids[at] - self.first_id)]


def resolve(prompt: dict, vocab_size: int, hidden_size: int, dtype: torch.dtype,
            max_model_len: int) -> tuple[list[int], PromptEmbeddings]:
    """A prompt given as {"prompt_embeds": [n, hidden]} (every position a vector, vLLM's form) or as
    {"prompt_token_ids": ids, "prompt_embedding_table": [rows, hidden]} (ids from vocab_size up read the
    table's rows, TensorRT-LLM's form): its token ids, virtual ones included, and their embeddings.
    ValueError naming the problem."""
    known = {"prompt_embeds", "prompt_token_ids", "prompt_embedding_table"}
    if set(prompt) - known:
        raise ValueError(f"a prompt dict takes {sorted(known)}, got {sorted(set(prompt) - known)}")
    if "prompt_embeds" in prompt:
        if len(prompt) > 1:
            raise ValueError("prompt_embeds is the whole prompt: give it alone")
        table = _table("prompt_embeds", prompt["prompt_embeds"], hidden_size, dtype)
        token_ids = list(range(vocab_size, vocab_size + len(table)))
    elif "prompt_embedding_table" in prompt and "prompt_token_ids" in prompt:
        table = _table("prompt_embedding_table", prompt["prompt_embedding_table"], hidden_size, dtype)
        if len(table) > max_model_len:  # (more rows than a prompt can read: memory held for nothing)
            raise ValueError(f"prompt_embedding_table has {len(table)} rows, more than a prompt can hold "
                             f"(max_model_len, {max_model_len})")
        token_ids = _token_ids(prompt["prompt_token_ids"], vocab_size + len(table))
        if all(t < vocab_size for t in token_ids):
            raise ValueError(f"a prompt_embedding_table is given, but no prompt token id reads it: ids from "
                             f"vocab_size ({vocab_size}) up stand for its rows")
    else:
        raise ValueError("a prompt dict needs 'prompt_embeds', or 'prompt_token_ids' with 'prompt_embedding_table'")
    virtual = sorted({t for t in token_ids if t >= vocab_size})
    keys = {t: hashlib.blake2b(table[t - vocab_size].view(torch.uint8).numpy().tobytes(), digest_size=16).digest()
            for t in virtual}
    return token_ids, PromptEmbeddings(table, vocab_size, keys)


def _table(name: str, values, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows, hidden] (or [1, rows, hidden]) floats as a CPU tensor of the model's dtype."""
    try:
        table = torch.as_tensor(values).detach().to("cpu")
    except (TypeError, RuntimeError, ValueError):  # (not numbers: None, a string, ragged rows)
        raise ValueError(f"{name} must be floats of shape [rows, hidden size], got {type(values).__name__}") from None
    if table.ndim == 3 and table.shape[0] == 1:
        table = table[0]
    if table.ndim != 2 or not table.dtype.is_floating_point:
        raise ValueError(f"{name} must be floats of shape [rows, hidden size], got {table.dtype} "
                         f"of shape {list(table.shape)}")
    if table.shape[1] != hidden_size or not len(table):
        raise ValueError(f"{name} must have rows of the model's hidden size ({hidden_size}), got shape "
                         f"{list(table.shape)}")
    table = table.to(dtype).contiguous()
    if not torch.isfinite(table).all():
        raise ValueError(f"{name} holds values that are not finite in the model's dtype ({dtype})")
    return table


def _token_ids(values, limit: int) -> list[int]:
    ids = values.tolist() if hasattr(values, "tolist") else list(values)  # (numpy or torch ids too)
    if not ids or any(not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= t < limit for t in ids):
        raise ValueError(f"prompt_token_ids must be integers in [0, {limit}) (vocab_size plus the table's rows), "
                         "and not empty")
    return [int(t) for t in ids]


def embed(model: torch.nn.Module, input_ids: torch.Tensor, at: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The step's input vectors [tokens, hidden]: the model's embedding of its real ids, and at the
    positions `at` (its virtual tokens) the given rows."""
    embedding = model.get_input_embeddings()
    vectors = embedding(input_ids.clamp(max=embedding.num_embeddings - 1))
    vectors[at] = rows.to(vectors.dtype)
    return vectors
