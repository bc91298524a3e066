"""The KV block pool: block tables, reference counts and automatic prefix caching.

A full block is identified by a chained hash of (its parent's hash, its token ids; a virtual prompt
token's row of vectors where a prompt has some: prompt_embeds.py); the first block's
parent is the sequence's LoRA adapter, whose KV differs from the base model's. A block whose last
user is gone keeps its contents and its hash in the free pool, so a later prompt with the same prefix
can take it back; when a fresh block is needed, blocks with no cached contents go first, then cached
ones in least-recently-freed order.

With a host tier (kv_offload.py), a cached block handed to another sequence is copied to host memory
first, and a prefix is found on from the pool's blocks into the host's, which are copied back.

When every layer attends within one sliding window, a sequence gives back each block once all its
tokens are behind the window of the next token it computes (`release_behind_window`): a long sequence
holds the window's blocks, not its whole length's.
"""

import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass

from .kv_offload import FROM_HOST, TO_HOST, BlockCopy, HostBlock, HostTier
from .sequence import Sequence


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set while the block is registered in the prefix cache
    token_ids: tuple | None = None  # its tokens as Sequence.cache_key gives them
    lora_id: int = 0  # the LoRA adapter of the sequence that filled it
    # Which registration in the prefix cache is its present one (0: none), unique over the engine's life and
    # kept by a block moved to the host tier and back: a hybrid model's windowed blocks are keyed by their
    # full block's (hybrid_blocks.py), and a block's parent is named by it
    registration: int = 0
    parent_registration: int = 0  # the block before it in the sequence that filled it (0: none)


class Blocks(dict):
    """The pool's blocks by id, each made when first asked for (iterate `values()` for those made): a CPU
    engine's pool of a small model holds hundreds of thousands, most never used (making them all took 1.6 s
    of its start-up)."""

    def __init__(self, num_blocks: int):
        super().__init__()
        self.num_blocks = num_blocks

    def __missing__(self, block_id: int) -> Block:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block {block_id} is not in the pool of {self.num_blocks}")
        block = self[block_id] = Block(block_id)
        return block


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 sliding_window: int | None = None, host_slots: int = 0):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window  # every layer's, when they share one (model_support.py)
        self.blocks = Blocks(num_blocks)
        self._free_empty: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self._cached: dict = {}  # hash (a hybrid model's windowed block's: its key, hybrid_blocks.py) -> block id
        self._registrations = itertools.count(1)
        # Copies to make before the next forward, in order: a shared block about to be written is copied
        # first (copy-on-write), as the completions of one prompt diverge; blocks go to the host tier and back.
        self.pending_copies: list[BlockCopy] = []
        self.host = HostTier(host_slots) if host_slots and enable_prefix_caching else None

    # -- pool state --------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free_empty) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_of(self, seq: Sequence):
        """Where the blocks of `seq` are kept: its block_table, num_released_blocks and block_hashes (a hybrid
        model's windowed layers' are in seq.windows: hybrid_blocks.py)."""
        return seq

    def fits(self, seq: Sequence, num_new_tokens: int, spare: int = 0) -> bool:
        """Whether `num_new_tokens` more tokens of `seq` get their blocks with `spare` blocks left free."""
        return self.blocks_needed(seq, num_new_tokens) + spare <= self.num_free_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """The free blocks `num_new_tokens` more tokens of `seq` take: new ones past its table, and one
        more when the block its next token is written to is shared (copied first; as _shared_next, inline:
        the scheduler asks this of every decoding sequence every step)."""
        computed, table, size = seq.num_computed_tokens, self.blocks_of(seq).block_table, self.block_size
        held = len(table)
        new = -(-(computed + num_new_tokens) // size) - held
        i = computed // size
        shared = i < held and self.blocks[table.at(i)].ref_count > 1
        return (new if new > 0 else 0) + shared

    def _shared_next(self, seq: Sequence) -> int | None:
        """The table index of the block the next token of `seq` is written to, when that block is shared
        with another sequence (it must be copied first); else None."""
        i, table = seq.num_computed_tokens // self.block_size, self.blocks_of(seq).block_table
        return i if i < len(table) and self.blocks[table[i]].ref_count > 1 else None

    def max_new_tokens(self, seq: Sequence) -> int:
        """How many more tokens of `seq` fit in its blocks plus the whole free pool."""
        capacity = (len(self.blocks_of(seq).block_table) + self.num_free_blocks) * self.block_size
        return capacity - seq.num_computed_tokens

    # -- allocation ----------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give `seq` blocks for `num_new_tokens` more tokens; False (and nothing taken) if the pool is short."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            return False
        table = self.blocks_of(seq).block_table
        i = self._shared_next(seq)
        if i is not None:
            shared = self.blocks[table[i]]
            shared.ref_count -= 1
            table[i] = self._take_free_block()
            self.pending_copies.append(BlockCopy(shared.block_id, table[i]))
            needed -= 1
        for _ in range(needed):
            table.append(self._take_free_block())
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent` (a shared block is copied when first written)."""
        ours, theirs = self.blocks_of(parent), self.blocks_of(child)
        for block_id in ours.block_table[ours.num_released_blocks:]:
            self.blocks[block_id].ref_count += 1
        theirs.block_table = ours.block_table.copy()
        theirs.num_released_blocks = ours.num_released_blocks
        theirs.block_hashes = list(ours.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens

    def take_pending_copies(self) -> list[BlockCopy]:
        """The copies asked for since the last call, for the next step to make first."""
        copies = list(self.pending_copies)
        self.pending_copies.clear()  # (in place: a hybrid model's groups of layers share the list)
        return copies

    def _take_free_block(self) -> int:
        if self._free_empty:
            block = self.blocks[self._free_empty.popleft()]
        else:
            block_id, _ = self._free_cached.popitem(last=False)
            block = self.blocks[block_id]
            if self.host is not None:
                self._store_on_host(block)
            self._uncache(block)
        block.ref_count = 1
        return block.block_id

    def free(self, seq: Sequence) -> None:
        """Return every block of `seq`. Tail blocks are freed first, so they are evicted before the
        shared prefix blocks that precede them; blocks it gave back behind a sliding window, which the
        cache still holds for it, move behind its tail too (a prefix is found from its first block on)."""
        held = self.blocks_of(seq)
        for block_id in reversed(held.block_table[held.num_released_blocks:]):
            self._release(block_id)
        for i in reversed(range(min(held.num_released_blocks, len(held.block_hashes)))):
            block_id = held.block_table[i]
            if block_id in self._free_cached and self.blocks[block_id].hash == held.block_hashes[i]:
                self._free_cached.move_to_end(block_id)
        held.block_table.clear()
        held.num_released_blocks = 0
        held.block_hashes.clear()
        seq.num_computed_tokens = 0

    def release_behind_window(self, seq: Sequence) -> None:
        """Give back the blocks of `seq` whose every token is behind the sliding window of its next token
        to compute (position num_computed_tokens, which sees keys after num_computed_tokens - window). The
        sequence's steps already launched read them before any later step can write them (one stream).
        Under prefix caching, only blocks already offered to the cache (cache_full_blocks): under async
        scheduling a step's blocks are registered after the next step is scheduled, and a block given back
        before may be another sequence's by then."""
        if self.sliding_window is None:
            return
        held = self.blocks_of(seq)
        behind = (seq.num_computed_tokens - self.sliding_window + 1) // self.block_size
        behind = min(max(behind, 0), len(held.block_table))
        if self.enable_prefix_caching:
            behind = min(behind, len(held.block_hashes))
        for block_id in held.block_table[held.num_released_blocks:behind]:
            self._release(block_id)
        held.num_released_blocks = max(held.num_released_blocks, behind)

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            if block.hash is None:  # (at the front: reused before blocks never written, whose pages a
                self._free_empty.appendleft(block_id)  # CPU pool maps only when first written: cpu_runtime)
            else:
                self._free_cached[block_id] = None

    # -- prefix caching ------------------------------------------------------------------------
    @staticmethod
    def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
        return hash((parent_hash, token_ids))

    @staticmethod
    def _root_hash(seq: Sequence) -> int | None:
        """The first block's parent: none for the base model, the adapter for a LoRA sequence."""
        return hash(("lora", seq.lora_id)) if seq.lora_id else None

    def match_prefix(self, seq: Sequence) -> int:
        """For a sequence without blocks: take the longest run of cached full blocks of its tokens and
        mark them computed. The last token is always left to compute, so that there is a token to sample
        from. Returns the number of tokens reused."""
        return self.take_prefix(seq, self.cached_prefix(seq))

    def cached_prefix(self, seq: Sequence) -> list[tuple[int, int | None, int]]:
        """The longest run of cached full blocks that begins the tokens of `seq` (all but its last token),
        as (hash, block id, registration), the block id None for a block in the host tier; nothing taken."""
        assert not self.blocks_of(seq).block_table
        if not self.enable_prefix_caching or seq.params.needs_prompt_logits:
            return []  # prompt logprobs and context logits need every prompt position computed
        run, parent_hash, parent_registration = [], self._root_hash(seq), 0
        known = seq.num_prompt_tokens + len(seq.output_token_ids)
        for start in range(0, known - 1 - self.block_size + 1, self.block_size):
            chunk = seq.cache_key(start, start + self.block_size)
            h = self.hash_block(parent_hash, chunk)
            block_id = self._cached.get(h)
            block = self.blocks[block_id] if block_id is not None else None
            # Compare contents, not only hashes: a collision must never hand out wrong KV.
            if block is not None and block.token_ids == chunk and block.lora_id == seq.lora_id \
                    and block.parent_registration == parent_registration:
                run.append((h, block_id, block.registration))
                parent_hash, parent_registration = h, block.registration
                continue
            kept = self.host.find(h, chunk, seq.lora_id, parent_registration) if self.host is not None else None
            if kept is None:
                break
            run.append((h, None, kept.registration))
            parent_hash, parent_registration = h, kept.registration
        while run and seq.span_split_by(len(run) * self.block_size):  # (the span is computed again whole)
            run.pop()
        return run

    def take_prefix(self, seq: Sequence, run: list[tuple[int, int | None, int]]) -> int:
        """Give `seq` (without blocks) the cached blocks of `run` (cached_prefix's, just found, or a part of it
        that begins it) and mark their tokens computed; returns how many. Blocks of the host tier are copied
        back into free blocks, as many as there are: the run ends before the first one past them."""
        run = self._loadable(run)
        self.hold_prefix(seq, self.take_cached([(h, block_id) for h, block_id, _ in run]), [h for h, _, _ in run])
        return seq.num_computed_tokens

    def hold_prefix(self, seq: Sequence, block_ids: list[int], hashes: list) -> None:
        """`seq` (without blocks) holds these cached blocks (take_cached's), their tokens computed."""
        held = self.blocks_of(seq)
        for block_id, h in zip(block_ids, hashes):
            held.block_table.append(block_id)
            held.block_hashes.append(h)
        seq.num_computed_tokens = len(block_ids) * self.block_size
        self.release_behind_window(seq)

    def take_cached(self, wanted: list[tuple[object, int | None]]) -> list[int]:
        """Take a reference to each cached block of `wanted`, (its key, its block id, None: in the host tier),
        in order; those of the host tier copied back into free blocks (loads_fit must have said there are
        enough). The host tier's are taken first, their slots held until their copies back are asked for (a
        block the loads displace may go to the host, not into one of them); then the pool's own, so that no
        load takes one; then a free block for each load."""
        from_host = {key: self.host.take(key) for key, block_id in wanted if block_id is None}
        for _, block_id in wanted:
            if block_id is not None:
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self._free_cached[block_id]
                block.ref_count += 1
        loaded = {key: self._take_free_block() for key in from_host}
        taken = []
        for key, block_id in wanted:
            if block_id is None:
                block_id = loaded[key]
                self._cache_loaded(self.blocks[block_id], key, from_host[key])
            taken.append(block_id)
        for kept in from_host.values():
            self.host.free_slot(kept.slot)
        return taken

    def loads_fit(self, wanted: list[tuple[object, int | None]]) -> bool:
        """Whether the free blocks left once the pool's blocks of `wanted` are taken hold its host tier's."""
        block_ids = [block_id for _, block_id in wanted]
        return block_ids.count(None) <= self._free_after_taking(block_ids)

    def _loadable(self, run: list[tuple[int, int | None, int]]) -> list[tuple[int, int | None, int]]:
        """`run` up to its first block in the host tier that the free blocks left after taking the pool's own
        cannot hold."""
        free = self._free_after_taking([block_id for _, block_id, _ in run])
        for i, (_, block_id, _) in enumerate(run):
            if block_id is None:
                if free == 0:
                    return run[:i]
                free -= 1
        return run

    def _free_after_taking(self, block_ids: list[int | None]) -> int:
        """The free blocks left once the pool's blocks among `block_ids` (None: the host tier's) are taken."""
        return self.num_free_blocks - sum(1 for block_id in block_ids
                                          if block_id is not None and self.blocks[block_id].ref_count == 0)

    def _store_on_host(self, block: Block) -> None:
        """Before a cached block is handed out: its contents to a host slot, its identity to the host tier."""
        kept = HostBlock(-1, block.token_ids, block.lora_id, block.registration, block.parent_registration)
        slot = self.host.store(block.hash, kept)
        if slot is not None:
            self.pending_copies.append(BlockCopy(block.block_id, slot, TO_HOST))

    def _cache_loaded(self, block: Block, key, kept: HostBlock) -> None:
        """`kept`'s contents copied back into `block`, which is cached as it was, under `key` (its hash; a
        hybrid model's windowed block's key). (The pool caches nothing under that key: a key is in one tier at
        a time.)"""
        self.pending_copies.append(BlockCopy(kept.slot, block.block_id, FROM_HOST))
        block.hash, block.token_ids, block.lora_id = key, kept.token_ids, kept.lora_id
        block.registration, block.parent_registration = kept.registration, kept.parent_registration
        self._cached[key] = block.block_id

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of `seq` that became full of computed tokens since the last call."""
        if not self.enable_prefix_caching:
            return
        held = self.blocks_of(seq)
        num_full = seq.num_computed_tokens // self.block_size
        start = len(held.block_hashes)
        if num_full <= start:
            return
        parent_hash = held.block_hashes[-1] if held.block_hashes else self._root_hash(seq)
        for i in range(start, num_full):
            chunk = seq.cache_key(i * self.block_size, (i + 1) * self.block_size)
            h = self.hash_block(parent_hash, chunk)
            block = self.blocks[held.block_table[i]]
            parent = self.blocks[held.block_table[i - 1]] if i else None
            # Only extend a chain whose parent is itself the cached block for the parent hash, so that
            # a match (which checks parents' registrations) proves the whole prefix is identical. (A parent
            # given back behind a sliding window qualifies while the cache still holds it: its hash says so.)
            parent_cached = parent is None or parent.hash == parent_hash
            if parent_cached and h not in self._cached and block.hash is None:
                block.hash, block.token_ids, block.lora_id = h, chunk, seq.lora_id
                block.registration = next(self._registrations)
                block.parent_registration = parent.registration if parent is not None else 0
                self._cached[h] = block.block_id
                if self.host is not None:
                    self.host.discard(h)  # (one place for a block: the pool's)
            held.block_hashes.append(h)
            parent_hash = h

    def _uncache(self, block: Block) -> None:
        if block.hash is not None:
            del self._cached[block.hash]
            block.hash = block.token_ids = None
            block.registration = block.parent_registration = 0

    def forget_copies(self, copies: list[BlockCopy]) -> None:
        """After a failed step, whose copies may not have been made: the host tier forgets the blocks they were
        to store and the pool the blocks they were to bring back (their holders failed with the step). A copy
        on write fills a block no cache names."""
        for copy in copies:
            if copy.kind == TO_HOST:
                self.host.forget_slot(copy.destination)
            elif copy.kind == FROM_HOST:
                block = self.blocks[copy.destination]
                if block.block_id in self._free_cached:
                    del self._free_cached[block.block_id]
                    self._free_empty.appendleft(block.block_id)
                self._uncache(block)

    def check_all_free(self) -> None:
        """Raise if any block is still referenced (used by tests and at shutdown)."""
        leaked = [b.block_id for b in self.blocks.values() if b.ref_count]
        if leaked or self.num_free_blocks != self.num_blocks:
            raise AssertionError(f"{len(leaked)} KV blocks still referenced: {leaked[:10]}")
