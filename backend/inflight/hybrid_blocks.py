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
    blocks went to other sequences): a block registered here is keyed by its group and the registration of
    the full layers' block the same sequence held there (block_manager.py), which identifies exactly the
    tokens up to it (unique over the engine's life, kept by a block moved to the host tier and back), and no
    other tokens once that block is registered again. With a host tier, a windowed block goes there and back
    under its key as the full layers' blocks do (kv_offload.py)."""

    def __init__(self, full: BlockManager, group: int, sliding_window: int):
        self.full, self.group, self.sliding_window = full, group, sliding_window
        self.num_blocks, self.block_size, self.enable_prefix_caching = (full.num_blocks, full.block_size,
                                                                        full.enable_prefix_caching)
        self.blocks, self._free_empty, self._free_cached = full.blocks, full._free_empty, full._free_cached
        self._cached, self.pending_copies, self.host = full._cached, full.pending_copies, full.host

    def blocks_of(self, seq: Sequence) -> WindowBlocks:
        while len(seq.windows) <= self.group:
            seq.windows.append(WindowBlocks())
        return seq.windows[self.group]

    def _key(self, registration: int) -> tuple[int, int] | None:
        """The key of this group's block at the positions of the full layers' block of `registration`."""
        return (self.group, registration) if registration else None

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of `seq` that became full since the last call (after the full layers')."""
        if not self.enable_prefix_caching:
            return
        held = self.blocks_of(seq)
        for i in range(len(held.block_hashes), seq.num_computed_tokens // self.block_size):
            full_id = seq.block_table[i]
            # (a full layers' block not registered, another there holding the same tokens, keys nothing)
            full_block = self.full.blocks[full_id]
            key = self._key(full_block.registration) if full_block.hash == seq.block_hashes[i] else None
            block = self.blocks[held.block_table[i]]
            if key is not None and key not in self._cached and block.hash is None:
                block.hash = key  # (its registration is never read: a key names a full block's)
                self._cached[key] = block.block_id
                if self.host is not None:
                    self.host.discard(key)  # (one place for a block: the pool's)
            held.block_hashes.append(key)

    def first_needed(self, num_tokens: int) -> int:
        """The first block the token after `num_tokens` computed ones sees."""
        return max(0, num_tokens - self.sliding_window + 1) // self.block_size

    def cached_twins(self, full_run: list[tuple[int, int | None, int]]) -> list[tuple[tuple, int | None] | None]:
        """For each block of the full layers' run (cached_prefix's), this group's block of the same positions
        and tokens, as (its key, its block id; None: in the host tier), if the pool or the host tier still
        holds one; else None."""
        twins = []
        for _, _, registration in full_run:
            key = self._key(registration)
            block_id = self._cached.get(key)
            if block_id is not None:
                twins.append((key, block_id))
            else:
                twins.append((key, None) if self.host is not None and self.host.holds(key) else None)
        return twins

    def hold_window_prefix(self, seq: Sequence, num_blocks: int, block_ids: list[int]) -> None:
        """`seq` (without blocks here) holds `block_ids` (take_cached's), this group's blocks within the window
        of its first `num_blocks` blocks' end; those behind it count as given back (block 0 in their place,
        never read)."""
        held = self.blocks_of(seq)
        first = self.first_needed(num_blocks * self.block_size)
        for i in range(first):
            held.block_table.append(0)
            held.block_hashes.append(None)
        for block_id in block_ids:
            held.block_table.append(block_id)
            held.block_hashes.append(self.blocks[block_id].hash)
        held.num_released_blocks = first


def blocks_a_window_holds(window: int, block_size: int) -> int:
    """The most blocks a group of windowed layers holds of one sequence at the start of a step: its window's,
    the one the window starts in, and the one its next token starts."""
    return -(-(window - 1) // block_size) + 2


class HybridBlockManager:
    """The scheduler's and the engine's BlockManager over the full layers' tables and `window_groups` groups
    of windowed layers' (one pool)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, sliding_window: int,
                 window_groups: int, host_slots: int = 0):
        self.full = BlockManager(num_blocks, block_size, enable_prefix_caching, host_slots=host_slots)
        self.windows = [WindowBlockManager(self.full, group, sliding_window) for group in range(window_groups)]
        self.groups = (self.full, *self.windows)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window  # the windowed layers' (the scheduler releases behind it)
        self.host = self.full.host

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
        windowed group holds too (in the pool or the host tier, those of the host tier as many as the free
        blocks hold)."""
        full_run = self.full.cached_prefix(seq)
        twins = [group.cached_twins(full_run) for group in self.windows]
        held_since = 0  # where the run of blocks every windowed group holds, up to the prefix's end, begins
        whole = [0]  # the prefixes' lengths in blocks whose windows every group holds
        for n in range(1, len(full_run) + 1):
            if any(found[n - 1] is None for found in twins):
                held_since = n
            elif held_since <= self.windows[0].first_needed(n * self.block_size):
                whole.append(n)
        for num_blocks in reversed(whole):
            first = self.windows[0].first_needed(num_blocks * self.block_size)
            wanted = [(h, block_id) for h, block_id, _ in full_run[:num_blocks]]
            wanted += [twin for found in twins for twin in found[first:num_blocks]]
            if self.full.loads_fit(wanted):
                break
        taken = self.full.take_cached(wanted)
        self.full.hold_prefix(seq, taken[:num_blocks], [h for h, _, _ in full_run[:num_blocks]])
        within = num_blocks - first
        for g, group in enumerate(self.windows):
            group.hold_window_prefix(seq, num_blocks, taken[num_blocks + g * within:num_blocks + (g + 1) * within])
        return seq.num_computed_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        for group in self.groups:
            group.cache_full_blocks(seq)

    def forget_copies(self, copies: list[BlockCopy]) -> None:
        self.full.forget_copies(copies)  # (one pool, every group's blocks)

    def check_all_free(self) -> None:
        self.full.check_all_free()
