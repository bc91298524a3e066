"""A step's model inputs in tensors allocated once and reused every step.

On a GPU the host side is one pinned buffer and the device side one buffer of the same layout: a step
writes its values into the pinned buffer (numpy, no per-token Python) and one non-blocking copy moves
them, so a step costs one host-to-device transfer instead of a tensor per input. The device tensors
never move, which is what CUDA graphs need: a captured step reads its inputs from these addresses
(cuda_graphs.py). On a CPU the device buffer is the host buffer.

Every field has a fixed place sized for the largest step (max_num_batched_tokens tokens,
max_num_seqs sequences, a block table row long enough for max_model_len); the block tables come last,
packed to the step's width, so a step copies only what it uses, and one copy on the device spreads them
into the rows the kernels read (InputBuffers.device_tables).
"""

from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from .kv_offload import BlockCopy
from .scheduler import ScheduledBatch
from .sequence import BlockTable


@dataclass
class WindowInputs:
    """What a group of a hybrid model's windowed layers reads in place of the step's own (hybrid_blocks.py):
    its cache slots and block tables."""

    slot_mapping: np.ndarray  # [T]
    block_tables: np.ndarray  # [S, max_blocks], as wide as the step's own


@dataclass
class StepInputs:
    """One step's model inputs over the ragged batch; all that another rank needs to run it."""

    input_ids: np.ndarray  # [T] every scheduled token of every sequence
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T] cache slot of each token
    cu_seqlens: np.ndarray  # [S+1] offsets of each sequence's tokens
    seq_lens: np.ndarray  # [S] context + new tokens
    block_tables: np.ndarray  # [S, max_blocks], padded with block 0
    logits_at: np.ndarray  # flat positions whose logits are returned
    block_copies: list[BlockCopy] = field(default_factory=list)  # the block manager's, made first (kv_offload.py)
    # Under async scheduling: the flat positions whose token is still on the GPU (PENDING in input_ids),
    # and each one's row in the previous step's sampled tokens, which the runner reads it from.
    pending_at: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    pending_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    lora_ids: np.ndarray | None = None  # [T] each token's LoRA adapter (0: none); None: none at all
    # Virtual prompt tokens (prompt_embeds.py): their flat positions and their vectors [V, hidden].
    embeds_at: np.ndarray | None = None
    embeds: torch.Tensor | None = None
    # Spans of virtual tokens that see each other (a Gemma 3 image's, prompt_embeds.py), each whole in the
    # step: [N, 4] (the sequence, the flat position of its first token, its first and end positions).
    attend_within: np.ndarray | None = None
    # Under tensor parallelism: LoRA tasks loaded into slots since the last step, (slot, adapter id, each
    # layer's A and B), which every rank loads before the step (lora.py's load_slot).
    lora_slot_loads: list = field(default_factory=list)
    # The sequences that lead the batch with one generated token each (build_step_inputs: a prompt's last
    # token computed alone is not one); None: inferred from the shapes (num_decodes).
    decodes: int | None = None
    windows: list[WindowInputs] = field(default_factory=list)  # each group of a hybrid model's windowed layers'
    # Chunked attention over contexts beyond one chunk (Llama 4's): what its chunked layers read, each
    # sequence seen from the start of the chunk its step's tokens lie in (chunk_view)
    chunk_seq_lens: np.ndarray | None = None  # [S]
    chunk_first_blocks: np.ndarray | None = None  # [S] that chunk's first block, as an index into its tables

    @property
    def is_decode(self) -> bool:
        """One token for each sequence, each sampled, nothing else asked."""
        return len(self.input_ids) == len(self.seq_lens) == len(self.logits_at)

    @property
    def num_decodes(self) -> int:
        """How many sequences lead the batch with one token each (the scheduler puts its decodes first):
        the attention computes them as decodes (the Triton kernel launches them apart from the prefill
        tiles), the rest as prefill chunks."""
        if self.decodes is not None:
            return self.decodes
        seqs = len(self.seq_lens)
        if len(self.input_ids) == seqs:
            return seqs
        longer = np.flatnonzero(np.diff(self.cu_seqlens) != 1)
        return int(longer[0]) if len(longer) else seqs


class BlockTableRows:
    """A step's block tables as the rows of one matrix kept from step to step: a row is written again
    only when its table changed (a decode takes a new block every block_size tokens) or another table
    took the row, so a step of 128 decodes writes a few rows, not 128 (all 128 unchanged: 68 -> 17 us)."""

    def __init__(self) -> None:
        self._matrix = np.zeros((0, 0), dtype=np.int64)
        self._written: list[tuple[BlockTable, int, int] | None] = []  # each row's table, its version, length

    def of(self, tables: list[BlockTable]) -> np.ndarray:
        """[len(tables), the longest's length] block ids, 0 past each table's end: a view, valid until
        the next call."""
        rows, width = len(tables), max(map(len, tables))
        if rows > self._matrix.shape[0] or width > self._matrix.shape[1]:
            # In steps of 16 rows and 64 blocks, not doubled: a table may be as long as max_model_len allows.
            held_rows, held_width = self._matrix.shape
            self._matrix = np.zeros((-(-max(rows, held_rows) // 16) * 16, -(-max(width, held_width) // 64) * 64),
                                    dtype=np.int64)
            self._written = [None] * len(self._matrix)
        matrix, written = self._matrix, self._written
        for row, table in enumerate(tables):
            held = written[row]
            if held is None or held[0] is not table or held[1] != table.version:
                length = len(table)
                matrix[row, :length] = table.ids
                if held is not None and held[2] > length:
                    matrix[row, length:held[2]] = 0
                written[row] = (table, table.version, length)
        return matrix[:rows, :width]


def build_step_inputs(batch: ScheduledBatch, block_size: int, logits_at: list[int],
                      block_copies: list[BlockCopy] | None = None,
                      table_rows: BlockTableRows | None = None,
                      window_rows: list[BlockTableRows] = (), attention_chunk: int | None = None) -> StepInputs:
    """The flat inputs of a step: its scheduled tokens, their positions and cache slots, and the
    attention metadata; logits are returned at the flat positions `logits_at`. Python runs once per
    sequence; everything per token is numpy. `table_rows`: the runner's, kept from step to step (the
    step's block tables are a view of it, valid until the next step's). `window_rows`: a hybrid model's, one
    for each group of its windowed layers, which read the sequences' tables in seq.windows (hybrid_blocks.py).
    `attention_chunk`: a model's with chunked attention over contexts beyond one chunk (chunk_view)."""
    seqs = batch.seqs
    counts = np.asarray(batch.num_tokens, dtype=np.int64)
    starts = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, len(seqs))
    cu_seqlens = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(counts, out=cu_seqlens[1:])
    positions = np.arange(cu_seqlens[-1], dtype=np.int64) - np.repeat(cu_seqlens[:-1] - starts, counts)
    if len(positions) == len(seqs):  # decode: one token each
        input_ids = np.fromiter((s.token_at(s.num_computed_tokens) for s in seqs), np.int64, len(seqs))
    else:
        input_ids = np.fromiter(chain.from_iterable(s.token_slice(s.num_computed_tokens, s.num_computed_tokens + n)
                                                    for s, n in zip(seqs, batch.num_tokens)),
                                np.int64, len(positions))
    tables = (table_rows or BlockTableRows()).of([s.block_table for s in seqs])
    token_rows = np.repeat(np.arange(len(seqs)), counts)
    slot_mapping = tables[token_rows, positions // block_size] * block_size + positions % block_size
    adapters = np.fromiter((s.lora_id for s in seqs), np.int64, len(seqs))
    inputs = StepInputs(input_ids, positions, slot_mapping, cu_seqlens, starts + counts, tables,
                        np.asarray(logits_at, dtype=np.int64), list(block_copies or []),
                        lora_ids=np.repeat(adapters, counts) if adapters.any() else None,
                        decodes=_leading_decodes(batch, counts))
    for group, rows in enumerate(window_rows):
        window_tables = rows.of([s.windows[group].block_table for s in seqs])
        window_slots = window_tables[token_rows, positions // block_size] * block_size + positions % block_size
        inputs.windows.append(WindowInputs(window_slots, window_tables))
    _add_virtual_tokens(inputs, seqs)
    if attention_chunk is not None:
        chunk_view(inputs, starts, block_size, attention_chunk)
    return inputs


def chunk_view(inputs: StepInputs, starts: np.ndarray, block_size: int, chunk: int) -> None:
    """Chunked attention (Llama 4's): a token sees the keys of its own chunk of `chunk` positions up to
    itself. The scheduler keeps each sequence's tokens of a step within one chunk, so its chunked layers read
    the sequence as if it began where that chunk does: its length from there and its block tables (the
    step's, and those of the groups of chunked layers that keep a chunk's blocks alone: hybrid_blocks.py)
    from that chunk's first block (`chunk` is a multiple of block_size), which the device takes from the
    step's tables (chunk_tables). The kernels then attend as for any sequence."""
    first = starts // chunk * chunk
    inputs.chunk_seq_lens = inputs.seq_lens - first
    inputs.chunk_first_blocks = first // block_size


def chunk_tables(tables: torch.Tensor, first_blocks: torch.Tensor, width: int) -> torch.Tensor:
    """[S, width] block tables from each sequence's chunk's first block (chunk_view): its `tables` row from
    column first_blocks[s] on (the columns past the row's end repeat its last: read past no sequence's
    length). On the device, inside a CUDA graph's capture too: no value comes from the host."""
    if not tables.shape[1]:  # (no sequence holds a block)
        return tables.new_zeros(len(first_blocks), width)
    columns = first_blocks[:, None] + torch.arange(width, device=tables.device)
    return tables.gather(1, columns.clamp_(max=tables.shape[1] - 1))


def _leading_decodes(batch: ScheduledBatch, counts: np.ndarray) -> int:
    """How many sequences lead the batch each computing one generated token: the scheduler's decodes up to
    the first with drafts. A prompt's last token computed alone (a chunk cut there, or the rest of a
    prompt found in the prefix cache) is not one: the prefill path computes it, as it did when the prompt
    came in one chunk, which keeps a request's output the same whatever the batch (on a CPU, bit for bit:
    ops/cpu_prefill_attention.c)."""
    with_drafts = np.flatnonzero(counts[:batch.num_decodes] != 1)
    return int(with_drafts[0]) if len(with_drafts) else batch.num_decodes


def _add_virtual_tokens(inputs: StepInputs, seqs: list) -> None:
    """The positions and vectors of the step's virtual prompt tokens, if it has any."""
    found, spans = [], []
    for row, seq in enumerate(seqs):
        if seq.prompt_embeds is not None and seq.num_computed_tokens < seq.num_prompt_tokens:
            begin, end = inputs.cu_seqlens[row], inputs.cu_seqlens[row + 1]
            at, rows = seq.prompt_embeds.rows(inputs.input_ids[begin:end])
            if len(at):
                found.append((at + begin, rows))
            first = seq.num_computed_tokens
            spans += [(row, begin + start - first, start, stop) for start, stop in seq.prompt_embeds.spans
                      if first <= start and stop <= first + end - begin and stop - start > 1]
    if found:
        inputs.embeds_at = np.concatenate([at for at, _ in found])
        inputs.embeds = torch.cat([rows for _, rows in found])
    if spans:
        inputs.attend_within = np.asarray(spans, dtype=np.int64)


@dataclass
class StepTensors:
    """Device views of one step's inputs (valid until the next step loads its own)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]; -1: a padding token, written nowhere
    cu_seqlens: torch.Tensor  # [S+1]
    seq_lens: torch.Tensor  # [S]
    block_tables: torch.Tensor  # [S, W], rows max_blocks apart
    logits_at: torch.Tensor | None  # [L]; None: every token's logits
    lora_ids: torch.Tensor | None  # [T] each token's LoRA adapter, 0 for none; None: no token has one
    num_decodes: int  # the sequences that lead the batch with one token each (StepInputs.num_decodes)
    embeds_at: torch.Tensor | None = None  # [V] the positions of virtual prompt tokens (prompt_embeds.py)
    embeds: torch.Tensor | None = None  # [V, hidden] their vectors
    attend_within: np.ndarray | None = None  # StepInputs'
    chunk_seq_lens: torch.Tensor | None = None  # StepInputs'
    chunk_first_blocks: torch.Tensor | None = None  # StepInputs'
    chunk_width: int = 0  # the block-table columns of a chunk (InputBuffers')
    query_len: int | None = None  # every sequence's tokens, where a graph padded them alike (cuda_graphs.py)
    # each group of a hybrid model's windowed layers' (hybrid_blocks.py)
    window_slot_mappings: list[torch.Tensor] = field(default_factory=list)
    window_block_tables: list[torch.Tensor] = field(default_factory=list)


def empty_step(lora: bool = False) -> StepInputs:
    """A decode step of no sequences: loaded with padding (InputBuffers.load's pad_seqs), it is a batch
    of harmless rows, for capturing graphs and compiling. `lora`: a step whose LoRA layers compute."""
    none = np.zeros(0, dtype=np.int64)
    return StepInputs(none, none, none, np.zeros(1, dtype=np.int64), none, np.zeros((0, 0), dtype=np.int64), none,
                      lora_ids=none if lora else None)


def empty_prefill(tokens: int, block_size: int, seqs: int = 1, sampled: bool = True) -> StepInputs:
    """A prefill step of `tokens` tokens, split evenly over `seqs` sequences, that writes no KV (slot -1)
    and reads whatever block 0 holds; logits at each sequence's last token where `sampled`, else none.
    For compiling: its output is thrown away."""
    ints = lambda values: np.asarray(values, dtype=np.int64)  # noqa: E731
    each = tokens // seqs
    assert each * seqs == tokens, "the tokens must split evenly over the sequences"
    cu_seqlens = ints(range(0, tokens + 1, each))
    return StepInputs(ints([0] * tokens), ints(list(range(each)) * seqs), ints([-1] * tokens), cu_seqlens,
                      ints([each] * seqs), np.zeros((seqs, -(-each // block_size)), dtype=np.int64),
                      cu_seqlens[1:] - 1 if sampled else ints([]))


def to_device(values, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A small host list or array as a tensor on `device`; to a GPU through pinned memory, without
    waiting: a plain copy to a GPU first waits for everything queued there, and under async scheduling
    that is the step in flight (the sampler and block copies run while it does)."""
    tensor = torch.as_tensor(values, dtype=dtype)
    return tensor if device.type == "cpu" else tensor.pin_memory().to(device, non_blocking=True)


class InputBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device,
                 staged: bool | None = None, window_groups: int = 0, chunk_width: int = 0, block_size: int = 16):
        """`staged`: host and device buffers apart, a step's values copied from one to the other (None: on
        a GPU; a CPU's device buffer is its host buffer, unless a test asks). `window_groups`: sets of cache
        slots and block tables of a hybrid model's groups of windowed layers (hybrid_blocks.py).
        `chunk_width`: under chunked attention beyond one chunk, the block-table columns (of `block_size`
        tokens) a sequence's chunk may take in a step (chunk_view; 0: none)."""
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        self.window_groups, self.chunk_width, self._chunk_tokens = window_groups, chunk_width, chunk_width * block_size
        sizes = dict(input_ids=max_tokens, positions=max_tokens, slot_mapping=max_tokens, logits_at=max_tokens,
                     lora_ids=max_tokens, cu_seqlens=max_seqs + 1, seq_lens=max_seqs, pending_at=max_seqs,
                     pending_rows=max_seqs, chunk_seq_lens=max_seqs, chunk_first_blocks=max_seqs,
                     window_slot_mappings=window_groups * max_tokens,
                     block_tables=(1 + window_groups) * max_seqs * max_blocks)
        self._offsets, start = {}, 0
        for name, size in sizes.items():
            self._offsets[name] = (start, start + size)
            start += size
        on_gpu = device.type == "cuda"
        staged = on_gpu if staged is None else staged
        self.host = torch.zeros(start, dtype=torch.int64, pin_memory=on_gpu)
        self.device = torch.zeros(start, dtype=torch.int64, device=device) if staged else self.host
        self._host = self.host.numpy()
        # The block tables the kernels read: [max_seqs, max_blocks], a row for each sequence of a step. Staged,
        # a step's tables cross as its rows packed to the step's width (the longest table), then spread
        # into their rows on the device: a row as long as max_model_len allows (8,192 ids for 128k tokens)
        # would otherwise cross whole, 8 MB for 128 sequences, a step's GPU waiting for it.
        # (a hybrid model's groups of windowed layers read theirs from device_window_tables)
        self.device_tables, *self.device_window_tables = (
            torch.zeros(max_seqs, max_blocks, dtype=torch.int64, device=device) if staged
            else self.tables(self.host, group) for group in range(1 + window_groups))
        # The pinned buffer is rewritten only once the GPU has taken the last step's values from it.
        self._copied = torch.cuda.Event() if on_gpu else None

    def _field(self, buffer, name: str):
        begin, end = self._offsets[name]
        return buffer[begin:end]

    def tables(self, buffer, group: int = 0) -> torch.Tensor | np.ndarray:
        """The block tables the kernels read, unstaged: the step's (group 0) or a group of windowed layers'."""
        size = self.max_seqs * self.max_blocks
        return self._field(buffer, "block_tables")[group * size:(group + 1) * size].reshape(self.max_seqs,
                                                                                          self.max_blocks)

    def check(self, inputs: StepInputs) -> None:
        """A clear error for a step larger than the buffers (the scheduler's limits should prevent it)."""
        tokens, seqs = len(inputs.input_ids), len(inputs.seq_lens)
        width = inputs.block_tables.shape[1] if inputs.block_tables.ndim == 2 else 0
        if tokens > self.max_tokens or len(inputs.logits_at) > self.max_tokens or seqs > self.max_seqs \
                or width > self.max_blocks:
            raise ValueError(f"a step of {tokens} tokens, {seqs} sequences and {width} blocks a sequence "
                             f"exceeds the input buffers ({self.max_tokens}, {self.max_seqs}, {self.max_blocks})")

    def load(self, inputs: StepInputs, pad_seqs: int | None = None, sampled: torch.Tensor | None = None) -> StepTensors:
        """Write `inputs` into the buffers and return device views of them. `pad_seqs` (decode steps
        only: one token a sequence) pads the batch to that many sequences for a captured graph: the
        padding tokens write no KV (slot -1) and attend to one key of their own row. `sampled`: the
        previous step's tokens, on the device, that inputs.pending_at takes (inputs.pending_rows)."""
        self.check(inputs)
        if self._copied is not None:
            self._copied.synchronize()
        tokens, seqs = len(inputs.input_ids), len(inputs.seq_lens)
        given_rows, width = inputs.block_tables.shape  # (fewer rows than sequences: the others are not read)
        host = self._host
        for name in ("input_ids", "positions", "slot_mapping", "logits_at", "pending_at", "pending_rows"):
            values = getattr(inputs, name)
            begin = self._offsets[name][0]
            host[begin:begin + len(values)] = values
        # (a step built without the windowed groups' own, as the warm-up steps over block 0 are, gives them
        # the step's own)
        windows = inputs.windows or [WindowInputs(inputs.slot_mapping, inputs.block_tables)] * self.window_groups
        window_slots = self._window_slots(host)
        for group, window in enumerate(windows):
            window_slots[group, :tokens] = window.slot_mapping
        if inputs.lora_ids is not None:  # (otherwise nothing reads them: the views leave them out)
            self._field(host, "lora_ids")[:tokens] = inputs.lora_ids
        begin = self._offsets["cu_seqlens"][0]
        host[begin:begin + seqs + 1] = inputs.cu_seqlens
        begin = self._offsets["seq_lens"][0]
        host[begin:begin + seqs] = inputs.seq_lens
        if self.chunk_width:
            # (a step without a chunk view, as a warm-up step, whose output nobody reads: its sequences' first
            # chunk_width blocks, so that the attention reads no column past them)
            chunked = inputs.chunk_seq_lens is not None
            self._field(host, "chunk_seq_lens")[:seqs] = inputs.chunk_seq_lens if chunked else np.minimum(
                inputs.seq_lens, self._chunk_tokens)
            self._field(host, "chunk_first_blocks")[:seqs] = inputs.chunk_first_blocks if chunked else 0
        rows = seqs if pad_seqs is None else pad_seqs
        if rows > seqs:
            assert tokens == seqs, "only decode steps are padded"
            pad = slice(seqs, rows)
            for name, value in (("input_ids", 0), ("positions", 0), ("slot_mapping", -1), ("lora_ids", 0)):
                self._field(host, name)[pad] = value
            window_slots[:, pad] = -1
            self._field(host, "cu_seqlens")[seqs + 1:rows + 1] = np.arange(seqs + 1, rows + 1)
            self._field(host, "seq_lens")[pad] = 1
            self._field(host, "chunk_seq_lens")[pad] = 1
            self._field(host, "chunk_first_blocks")[pad] = 0
        # The tables' rows: the step's, and a padded decode step's padding sequences' (they read their row's
        # first block id: block 0).
        table_rows, table_width = max(given_rows, pad_seqs or 0), max(width, 1 if rows > seqs else 0)
        groups = [(inputs.block_tables, self.device_tables)]
        groups += [(window.block_tables, tables) for window, tables in zip(windows, self.device_window_tables)]
        packed_size = table_rows * table_width
        begin = self._offsets["block_tables"][0]
        for group, (given, _) in enumerate(groups):
            if self.device is self.host:  # the kernels read the tables where they are written
                tables = self.tables(host, group)
            else:  # packed to the step's width one group after the other, spread into their rows on the device
                start = begin + group * packed_size
                tables = host[start:start + packed_size].reshape(table_rows, table_width)
            tables[:given_rows, :width] = given
            tables[given_rows:table_rows, :table_width] = 0
        if self.device is not self.host:
            used = begin + len(groups) * packed_size
            self.device[:used].copy_(self.host[:used], non_blocking=True)
            if self._copied is not None:
                self._copied.record()
            for group, (_, device_tables) in enumerate(groups):
                packed = self.device[begin + group * packed_size:begin + (group + 1) * packed_size]
                device_tables[:table_rows, :table_width].copy_(packed.view(table_rows, table_width))
        pending = len(inputs.pending_at)
        if pending:  # tokens the previous step sampled, straight from the device
            at = self._field(self.device, "pending_at")[:pending]
            source = self._field(self.device, "pending_rows")[:pending]
            self._field(self.device, "input_ids").index_copy_(0, at, sampled.index_select(0, source))
        lora = inputs.lora_ids is not None
        if pad_seqs is None:
            step = self.views(tokens, seqs, width, len(inputs.logits_at), lora, inputs.num_decodes)
            if inputs.embeds is not None:  # (a few prompts' worth at most: not worth a persistent buffer)
                step.embeds_at = to_device(inputs.embeds_at, self.device.device)
                step.embeds = inputs.embeds.to(self.device.device, non_blocking=True)
                step.attend_within = inputs.attend_within
            return step
        return self.views(rows, rows, self.max_blocks, None, lora)  # what a captured graph reads: every row's logits

    def views(self, tokens: int, seqs: int, width: int, logits: int | None, lora: bool = False,
              num_decodes: int | None = None) -> StepTensors:
        """New view objects each call (torch_ops caches its plan by the identity of these tensors).
        `num_decodes`: StepInputs.num_decodes; None for a decode step (every sequence)."""
        field = lambda name, n: self._field(self.device, name)[:n]  # noqa: E731
        step = StepTensors(field("input_ids", tokens), field("positions", tokens), field("slot_mapping", tokens),
                           field("cu_seqlens", seqs + 1), field("seq_lens", seqs),
                           self.device_tables[:seqs, :width],
                           None if logits is None else field("logits_at", logits),
                           field("lora_ids", tokens) if lora else None, seqs if num_decodes is None else num_decodes)
        if self.window_groups:
            step.window_slot_mappings = [slots[:tokens] for slots in self._window_slots(self.device)]
            step.window_block_tables = [tables[:seqs, :width] for tables in self.device_window_tables]
        if self.chunk_width:
            step.chunk_seq_lens = field("chunk_seq_lens", seqs)
            step.chunk_first_blocks = field("chunk_first_blocks", seqs)
            step.chunk_width = self.chunk_width
        return step

    def _window_slots(self, buffer):
        """[window groups, max_tokens]: each group's cache slots."""
        return self._field(buffer, "window_slot_mappings").reshape(self.window_groups, self.max_tokens)
