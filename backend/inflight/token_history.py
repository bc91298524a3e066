"""Every computed token's id, on the model's device, in the KV cache's slots.

Penalties read all of a sequence's tokens at every step it samples. Built on the host, that is the
whole history of every penalized row laid out and copied to the device each step (128 rows of 4,000
tokens: 4 MB, ~1 ms of the host's numpy and copies a step, growing with the outputs). Here each
forward pass writes its input ids into the slots their keys and values go to (one indexed store, inside
a captured CUDA graph too), so a sequence's tokens are found on the device through its block table:
a step's penalties gather them for their rows and the host sends only the row indices.

The ids follow the KV cache: a step's tokens are written before it samples (under async scheduling
the token in flight too, which the step's input ids hold), copied with the blocks a fork copies,
shared where the prefix cache shares blocks (same blocks, same tokens) and rewritten where a preempted
sequence recomputes. A sequence whose leading blocks went back to the pool (behind a sliding window)
no longer has them, and a prompt given as embeddings has ids beyond the logits: their batches' rows
are laid out on the host (`covers`).
"""

import numpy as np
import torch


class TokenHistory:
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int, device: torch.device):
        self.block_size, self.vocab_size = block_size, vocab_size
        # One more slot at the end: where a padding token (slot -1) writes.
        self._ids = torch.zeros(num_blocks * block_size + 1, dtype=torch.int64, device=device)
        self._blocks = self._ids[:-1].view(num_blocks, block_size)
        self._tables: torch.Tensor | None = None  # the latest step's block tables, on the device
        self._seq_lens: np.ndarray | None = None  # and its sequences' lengths, on the host

    def write(self, slot_mapping: torch.Tensor, input_ids: torch.Tensor) -> None:
        """A forward pass's tokens into their slots (no host values: a graph may capture it). A virtual
        token's id (beyond the vocabulary) is kept as the last id: whatever a slot holds indexes logits."""
        self._ids[slot_mapping] = input_ids.clamp(max=self.vocab_size - 1)

    @property
    def by_block(self) -> torch.Tensor:
        """The ids as [block, block_size] (a view: the host tier copies blocks' ids out and back, kv_offload.py)."""
        return self._blocks

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self._blocks[dst] = self._blocks[src]

    def step_ran(self, tables: torch.Tensor, seq_lens: np.ndarray) -> None:
        """The step just launched: its block tables (rows as in its batch) and each sequence's length."""
        self._tables, self._seq_lens = tables, seq_lens

    def covers(self, seqs, vocab: int) -> bool:
        """Whether every sequence's tokens are all in the cache's slots, and all ids of logits of `vocab`
        tokens (a prompt given as embeddings has virtual ids from the model's vocabulary up)."""
        return vocab >= self.vocab_size and all(not seq.num_released_blocks and seq.prompt_embeds is None
                                                for seq in seqs)

    def tokens(self, step_rows: list[int], to_device,
               starts: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens at positions [start, length) of the latest step's sequences at `step_rows` (from 0
        where `starts` is None), in the whole blocks that hold them: ids [rows, width], and a mask of
        those in the range. Outside it are the blocks' other ids (a prompt's before its outputs, stale
        ones past the end). `to_device`: how host indices reach the device without waiting
        (input_buffers.to_device)."""
        lengths = self._seq_lens[step_rows]
        device = self._ids.device
        if starts is None:  # (the repetition penalty's, every step it is asked: three launches fewer)
            blocks = -(-int(lengths.max()) // self.block_size)
            rows = to_device(np.stack([step_rows, lengths]), device)
            ids = self._blocks[self._tables[rows[0], :blocks]].flatten(1)  # [rows, blocks * block_size]
            return ids, torch.arange(ids.shape[1], device=device) < rows[1, :, None]
        first = np.asarray(starts) // self.block_size
        blocks = max(int((-(-lengths // self.block_size) - first).max()), 1)
        rows = to_device(np.stack([step_rows, lengths, starts, first]), device)
        # Each row's blocks from the one holding its start (at most the table's last column).
        columns = (rows[3, :, None] + torch.arange(blocks, device=device)).clamp_(max=self._tables.shape[1] - 1)
        ids = self._blocks[self._tables[rows[0, :, None], columns]].flatten(1)
        positions = rows[3, :, None] * self.block_size + torch.arange(ids.shape[1], device=device)
        return ids, (positions >= rows[2, :, None]) & (positions < rows[1, :, None])
