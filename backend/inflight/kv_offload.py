"""A second tier of the prefix cache in host memory (`kv_offload_memory`): TensorRT-LLM's secondary KV
cache, vLLM's KV offloading, SGLang's hierarchical cache, in their simplest form.

A cached block the pool hands to another sequence (block_manager.py: least recently freed first) would
lose its contents; with a host tier its keys and values (and its tokens' ids: token_history.py) are
copied to a slot of host memory first and its identity kept here. A later prompt whose prefix runs on
past the pool's cached blocks finds the rest here: each block found is copied back into a free block of
the pool and taken as the pool's own were, its tokens not computed again. A block lives in one place at
a time (moved, not copied, between the tiers); the host tier forgets its least recently stored block
when full.

The copies are the block manager's pending copies (`BlockCopy`, in the order it asked for them), made
by the model runner before the step's forward pass on the step's own stream: a block's contents are read
after every step already launched wrote them and before any later step overwrites them, and a host slot
is read before it is written again, with no wait for the device. On a GPU the host tier is pinned memory
(asynchronous copies); on a CPU the pool and the tier are the same memory, so the tier only lets the
prefix cache hold more than the pool.

Under tensor parallelism every rank holds its own KV heads of each slot; the scheduler's copies reach
the other ranks with the step's inputs.
"""

import itertools
import mmap
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

ON_DEVICE, TO_HOST, FROM_HOST = "device", "to_host", "from_host"
# Blocks staged on the device at once by a copy to or from the host (a block of a Llama-3-8B shape in
# bfloat16 is 2 MiB: a 32k-token prompt's 2,000 blocks whole would be 4 GiB beside the pool).
STAGED_BLOCKS = 64


class BlockCopy(NamedTuple):
    """One copy before a step: pool block to pool block (copy-on-write), pool block to a host slot, or a
    host slot to a pool block."""

    source: int
    destination: int
    kind: str = ON_DEVICE


@dataclass(eq=False)
class HostBlock:
    """What the prefix cache knows of a block kept in a host slot (block_manager.Block's identity)."""

    slot: int
    token_ids: tuple
    lora_id: int
    registration: int
    parent_registration: int


class HostTier:
    """The host slots' bookkeeping, on the scheduler's side: which cached block each slot holds."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free_slots = list(range(num_slots - 1, -1, -1))  # (popped from the end: slot 0 first)
        # key (a block's hash; a hybrid model's windowed block's key) -> block, least recently stored first
        self._blocks: OrderedDict[object, HostBlock] = OrderedDict()
        self.stored = 0  # blocks copied to the host since start-up
        self.loaded = 0  # blocks copied back (found by a prompt)

    @property
    def num_used_slots(self) -> int:
        return len(self._blocks)

    def store(self, key, block: HostBlock) -> int | None:
        """Keep `block` (its slot is set here) under `key`, forgetting the least recently stored block
        if no slot is free (or the one held under the same key); returns the slot (None: every slot is held
        by a block on its way back to the pool, and `block` is not kept)."""
        self.discard(key)
        if not self._free_slots:
            if not self._blocks:
                return None
            _, oldest = self._blocks.popitem(last=False)
            self._free_slots.append(oldest.slot)
        block.slot = self._free_slots.pop()
        self._blocks[key] = block
        self.stored += 1
        return block.slot

    def find(self, key, token_ids: tuple, lora_id: int, parent_registration: int) -> HostBlock | None:
        """The block kept under `key` if it holds these tokens after the block registered as
        `parent_registration` (0: first in its sequence) for this adapter; contents compared, not hashes
        alone, so a collision never hands out wrong KV."""
        block = self._blocks.get(key)
        if block is None or block.token_ids != token_ids or block.lora_id != lora_id \
                or block.parent_registration != parent_registration:
            return None
        return block

    def holds(self, key) -> bool:
        return key in self._blocks  # (a windowed block's key names exactly its tokens: hybrid_blocks.py)

    def take(self, key) -> HostBlock:
        """Forget the block kept under `key` (find's) as it goes back to the pool; its slot stays
        held until its copy back is asked for (free_slot)."""
        self.loaded += 1
        return self._blocks.pop(key)

    def free_slot(self, slot: int) -> None:
        """A slot whose copy back is asked for: free for the copies after it (they are made in order)."""
        self._free_slots.append(slot)

    def forget_slot(self, slot: int) -> None:
        """Forget the block kept in `slot`, if any (its copy there may not have been made)."""
        key = next((key for key, block in self._blocks.items() if block.slot == slot), None)
        if key is not None:
            self.discard(key)

    def discard(self, key) -> None:
        """Forget the block under `key`, if any (the pool holds those tokens again)."""
        block = self._blocks.pop(key, None)
        if block is not None:
            self._free_slots.append(block.slot)


class HostKVStore:
    """The host slots' contents, on each rank's model runner: keys and values of every layer of a block,
    and its tokens' ids, per slot."""

    def __init__(self, num_slots: int, pool: torch.Tensor, token_ids: torch.Tensor):
        """`pool`: the runner's KV pool as bytes, [layer, key/value, block, ...]; `token_ids`: its tokens' ids,
        [block, block_size] (token_history.py)."""
        self.pool, self.token_ids = pool, token_ids
        pinned = pool.device.type == "cuda"
        block_shape = (pool.shape[0], pool.shape[1], *pool.shape[3:])
        self.kv = _host_tensor((num_slots, *block_shape), pool.dtype, pinned)
        self.ids = _host_tensor((num_slots, token_ids.shape[1]), token_ids.dtype, pinned)

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + self.ids.nbytes

    def store(self, blocks: torch.Tensor, slots: list[int]) -> None:
        """Copy pool `blocks` (on the device) into host `slots`, in order."""
        for start in range(0, len(slots), STAGED_BLOCKS):
            chunk = blocks[start:start + STAGED_BLOCKS]
            kv = self.pool[:, :, chunk].movedim(2, 0).contiguous()
            ids = self.token_ids[chunk]
            for at, first, n in _consecutive_runs(slots[start:start + STAGED_BLOCKS]):
                self.kv[first:first + n].copy_(kv[at:at + n], non_blocking=True)
                self.ids[first:first + n].copy_(ids[at:at + n], non_blocking=True)

    def load(self, slots: list[int], blocks: torch.Tensor) -> None:
        """Copy host `slots` into pool `blocks` (on the device)."""
        for start in range(0, len(slots), STAGED_BLOCKS):
            chunk = slots[start:start + STAGED_BLOCKS]
            kv = torch.empty((len(chunk), *self.kv.shape[1:]), dtype=self.kv.dtype, device=self.pool.device)
            ids = torch.empty((len(chunk), self.ids.shape[1]), dtype=self.ids.dtype, device=self.pool.device)
            for at, first, n in _consecutive_runs(chunk):
                kv[at:at + n].copy_(self.kv[first:first + n], non_blocking=True)
                ids[at:at + n].copy_(self.ids[first:first + n], non_blocking=True)
            destinations = blocks[start:start + STAGED_BLOCKS]
            self.pool[:, :, destinations] = kv.movedim(0, 2)
            self.token_ids[destinations] = ids


def _host_tensor(shape: tuple, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """An empty host tensor; `pinned`: page-aligned and registered with the CUDA driver at its exact size
    (torch's pinned allocator rounds a block up to a power of two: a tier of 40 GiB would pin 64)."""
    if not pinned:
        return torch.empty(shape, dtype=dtype)
    nbytes = dtype.itemsize * int(np.prod(shape))
    tensor = page_aligned(nbytes).view(dtype).view(shape)
    error = int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0))
    if error:
        raise RuntimeError(f"kv_offload_memory: pinning {nbytes} bytes of host memory failed (CUDA error {error}); "
                           "lower it")
    weakref.finalize(tensor, torch.cuda.cudart().cudaHostUnregister, tensor.data_ptr())
    return tensor


def page_aligned(nbytes: int) -> torch.Tensor:
    """`nbytes` bytes of host memory that begin on a page (what the driver pins whole)."""
    raw = torch.empty(nbytes + mmap.PAGESIZE, dtype=torch.uint8)
    offset = -raw.data_ptr() % mmap.PAGESIZE
    return raw[offset:offset + nbytes]


def _consecutive_runs(slots: list[int]):
    """(index into `slots`, first slot, length) of each run of consecutive slots, in order."""
    slots = np.asarray(slots)
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(slots)]])
    return [(int(s), int(slots[s]), int(e - s)) for s, e in zip(starts, ends)]


def runs_of_kind(copies: list[BlockCopy]):
    """The copies in runs of one kind, in order: (kind, sources, destinations). A run's copies are made
    together (a slot stored twice keeps the later block); across runs order matters: a pool block is stored
    to the host before another is loaded over it, a slot loaded before another block is stored over it."""
    for kind, run in itertools.groupby(copies, key=lambda copy: copy.kind):
        sources, destinations, _ = zip(*run)
        yield kind, list(sources), list(destinations)
