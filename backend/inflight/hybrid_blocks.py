"""Block tables of their own for the windowed layers of models that alternate them with layers attending
over the whole context (Gemma 2 and 3, gpt-oss; Llama 4's chunked layers, whose window is their chunk:
a chunked layer never reads a key more than a chunk behind): vLLM's hybrid KV cache manager, in its
simplest form.

A windowed layer never reads a key more than a window behind, so its blocks can go back to the pool once
every token in them is behind the window (as every layer's blocks do where all layers share a window:
block_manager.py), while the full layers keep the whole sequence. Layers are grouped by kind, each group
as many layers as the full layers count: group 0 the full layers, groups 1..k the windowed ones (Gemma 3's
five windowed layers to one full make five groups; Gemma 2's and gpt-oss's alternation one). A block of
the one pool holds its tokens for one layer of a group in each of the cache's slots (model_runner.py), and
a group's layer i reads slot i: each group has its own block table per sequence, and the groups draw on
one pool, so no share of memory is set aside for either kind. A sequence of n tokens holds n / block_size
blocks for the full layers and about window / block_size for each windowed group: Gemma 3's cache holds
several times the tokens at long contexts.

A sequence takes blocks in every group or in none, and is preempted when the pool is short; a prefix is
reused as far as the full layers' blocks hold it and each windowed group still holds the blocks within the
window of its end.
"""

from .block_manager import BlockManager
from .kv_offload import BlockCopy
from .sequence import Sequence, WindowBlocks


class WindowBlockManager(BlockManager):
    """One group of windowed layers: the full layers' pool (its blocks, free lists, prefix cache and copies,
    shared), its own tables (seq.windows[group]) and window. Under prefix caching its blocks are found by the
    full layers' block of the same positions rather than by a chain of hashes, so that a prefix needs only
    its blocks within the window of its end (a long system prompt is found again long after its first
    blocks went to other sequences): a block registered here is keyed by its group, the full layers' block
    the same sequence held there and that block's registration (block_manager.py), which identify exactly
    the tokens up to it, and no other tokens once that block is registered again."""

    def __init__(self, full: BlockManager, group: int, sliding_window: int):
        self.full, self.group, self.sliding_window = full, group, sliding_window
        self.num_blocks, self.block_size, self.enable_prefix_caching = (full.num_blocks, full.block_size,
                                                                        full.enable_prefix_caching)
        self.blocks, self._free_empty, self._free_cached = full.blocks, full._free_empty, full._free_cached
        self._cached, self.pending_copies = full._cached, full.pending_copies
        self.host = None  # (no host tier for a hybrid model: kv_offload.py)

    def blocks_of(self, seq: Sequence) -> WindowBlocks:
        while len(seq.windows) <= self.group:
            seq.windows.append(WindowBlocks())
        return seq.windows[self.group]

    def _key(self, full_block_id: int) -> tuple[int, int, int] | None:
        registration = self.full.blocks[full_block_id].registration
        return (self.group, full_block_id, registration) if registration else None

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of `seq` that became full since the last call (after the full layers')."""
        if not self.enable_prefix_caching:
            return
        held = self.blocks_of(seq)
        for i in range(len(held.block_hashes), seq.num_computed_tokens // self.block_size):
            full_id = seq.block_table[i]
            # (a full layers' block not registered, another there holding the same tokens, keys nothing)
            key = self._key(full_id) if self.full.blocks[full_id].hash == seq.block_hashes[i] else None
            block = self.blocks[held.block_table[i]]
            if key is not None and key not in self._cached and block.hash is None:
                block.hash = key  # (its registration is never read: a key names a full block's)
                self._cached[key] = block.block_id
            held.block_hashes.append(key)

    def first_needed(self, num_tokens: int) -> int:
        """The first block the token after `num_tokens` computed ones sees."""
        return max(0, num_tokens - self.sliding_window + 1) // self.block_size

    def cached_twins(self, full_run: list[tuple[int, int]]) -> list[int | None]:
        """For each block of the full layers' run (cached_prefix's), this group's block of the same
        positions and tokens, if the pool still holds one."""
        return [self._cached.get(self._key(full_id)) for _, full_id in full_run]

    def take_window_prefix(self, seq: Sequence, num_blocks: int, twins: list[int | None]) -> None:
        """Give `seq` (without blocks here) the blocks within the window of its first `num_blocks` blocks'
        end (twins' ids); those behind it count as given back (block 0 in their place, never read)."""
        held = self.blocks_of(seq)
        first = self.first_needed(num_blocks * self.block_size)
        for i in range(num_blocks):
            if i < first:
                held.block_table.append(0)
                held.block_hashes.append(None)
                continue
            block = self.blocks[twins[i]]
            if block.ref_count == 0:
                del self._free_cached[block.block_id]
            block.ref_count += 1
            held.block_table.append(block.block_id)
            held.block_hashes.append(block.hash)
        held.num_released_blocks = first


def blocks_a_window_holds(window: int, block_size: int) -> int:
    """The most blocks a group of windowed layers holds of one sequence at the start of a step: its window's,
    the one the window starts in, and the one its next token starts."""
    return -(-(window - 1) // block_size) + 2


class HybridBlockManager:
    """The scheduler's and the engine's BlockManager over the full layers' tables and `window_groups` groups
    of windowed layers' (one pool)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, sliding_window: int,
                 window_groups: int):
        self.full = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.windows = [WindowBlockManager(self.full, group, sliding_window) for group in range(window_groups)]
        self.groups = (self.full, *self.windows)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window  # the windowed layers' (the scheduler releases behind it)
        self.host = None  # (no host tier: model_runner refuses one)

    @property
    def num_blocks(self) -> int:
        return self.full.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.full.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.full.num_used_blocks

    @property
    def blocks(self):
        return self.full.blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        return sum(group.blocks_needed(seq, num_new_tokens) for group in self.groups)

    def fits(self, seq: Sequence, num_new_tokens: int, spare: int = 0) -> bool:
        """`spare`: blocks of the full layers' tables to leave free (as many of each windowed group's too)."""
        return self.blocks_needed(seq, num_new_tokens) + spare * len(self.groups) <= self.num_free_blocks

    def max_new_tokens(self, seq: Sequence) -> int:
        """Every group's table is as long as the full layers' (a block given back keeps its place)."""
        capacity = (len(seq.block_table) + self.num_free_blocks // len(self.groups)) * self.block_size
        return capacity - seq.num_computed_tokens

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        if not self.fits(seq, num_new_tokens):
            return False
        for group in self.groups:
            group.allocate(seq, num_new_tokens)
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        for group in self.groups:
            group.fork(parent, child)

    def free(self, seq: Sequence) -> None:
        for group in self.groups:
            group.free(seq)

    def release_behind_window(self, seq: Sequence) -> None:
        """(Asked of every running sequence every step: the groups are asked only when the window has moved
        past a block, which they all give back alike.)"""
        if seq.windows and self.windows[0].first_needed(seq.num_computed_tokens) > seq.windows[0].num_released_blocks:
            for group in self.windows:
                group.release_behind_window(seq)

    def take_pending_copies(self) -> list[BlockCopy]:
        return self.full.take_pending_copies()  # (every group's: one pool, one list)

    def match_prefix(self, seq: Sequence) -> int:
        """The longest prefix the full layers' blocks hold whose blocks within the window of its end every
        windowed group holds too."""
        full_run = self.full.cached_prefix(seq)
        twins = [group.cached_twins(full_run) for group in self.windows]
        held_since = 0  # where the run of blocks every windowed group holds, up to the prefix's end, begins
        num_blocks = 0
        for n in range(1, len(full_run) + 1):
            if any(found[n - 1] is None for found in twins):
                held_since = n
            elif held_since <= self.windows[0].first_needed(n * self.block_size):
                num_blocks = n
        self.full.take_prefix(seq, full_run[:num_blocks])
        for group, found in zip(self.windows, twins):
            group.take_window_prefix(seq, num_blocks, found)
        return seq.num_computed_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        for group in self.groups:
            group.cache_full_blocks(seq)

    def check_all_free(self) -> None:
        self.full.check_all_free()
