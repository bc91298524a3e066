"""What the model needs to run fast on a CPU: linear layers through oneDNN with packed weights, and an
allocator that keeps the memory it frees.

Linear layers: torch's CPU matmul calls MKL, whose fast paths are chosen by processor vendor: on the
AMD EPYC of our CI machines (2 cores, AVX-512) it read weights at 7-8 GB/s in decode steps, a sixth of
the memory bandwidth. oneDNN, with each weight reordered into its blocked layout (what inductor's
`freezing` does for compiled models), reads the weights at memory speed and computes prefill chunks
twice as fast. Measured there, the 210 linear layers of the default model, float32 (ms per forward):

    tokens in the step         1      4     16     64    256    512
    nn.Linear (MKL)         25.6   36.6   49.5  100.1  295.7  532.1
    oneDNN, packed weights   9.7   10.5   16.3   40.2  118.2  229.9

The layers keep their modules, so hooks on them still run; the forward is replaced, and the dense weight
is released unless another module shares it (tied embeddings). oneDNN builds and caches a kernel for
each row count it sees, about half a MB each, up to 1,024 of them: left alone, the process grew by
hundreds of MB over the first minutes of serving (the soak test caught it). So the rows are padded to
a bucket (exact up to 16, then multiples of 8 up to 64, then of 32), and every bucket is built at
start-up (about 110 MB and 1 s for the default model). The output head's buckets are built only up to
the rows a step samples (one a sequence): over the default model's 49,152-token vocabulary, building it
for every bucket up to a budget of 2,048 tokens took 20 s of start-up. Prompt logprobs, which ask for
more rows, build their buckets when they first meet them.

The allocator: glibc hands large freed blocks back to the system (above a threshold that adapts up to
32 MB, and the heap's free top above twice that), so the next step's allocation of the same size faults
its pages in again, one by one. Gathering keys and values for attention allocates such blocks every
layer: with the defaults, the gathered decode attention of 64 sequences of ~430 tokens took 15.5 ms a
layer on the CI machine, 4.3-4.8 ms with freed memory kept in the process (as a GPU's caching allocator
keeps it). The thresholds are process-wide; an engine on a CPU owns its process's hot path.

The KV pool: a fifth of the host's free memory by default, which torch.zeros wrote at start-up (5.8 s
for the 4 GB pool of a test model on the CI machine, seconds of every test's engine). Taken from calloc
instead, its pages are mapped as blocks are first written; the block manager uses a freed block again
before a fresh one, so the memory follows the blocks in use and the prefix cache's.
"""

import ctypes
import logging
from collections import Counter
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
from transformers.pytorch_utils import Conv1D

from .shared_matmul import SharedMatmul, sibling_projections, stack_weights

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
_MMAP_THRESHOLD_MAX = 32 << 20  # the largest glibc accepts on 64-bit systems


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory for reuse; False where the C library is not glibc."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    kept = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1 and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    if kept:
        logger.info("allocator: freed memory up to %d MB a block stays in the process", _MMAP_THRESHOLD_MAX >> 20)
    return kept


def zeros_mapped_when_written(shape: tuple[int, ...]) -> torch.Tensor:
    """Bytes of zeros whose pages the system maps as they are first written (calloc, numpy's zeros), where
    torch.zeros writes every byte at once: the KV pool of a CPU engine, a fifth of the host's free memory
    by default, took seconds of start-up to fill (5.8 s for 4 GB on the CI machine)."""
    return torch.from_numpy(np.zeros(shape, dtype=np.uint8))


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def packable_dtypes() -> tuple[torch.dtype, ...]:
    """oneDNN packs bfloat16 weights only where the processor has bfloat16 instructions (AVX-512 BW/VL/DQ
    or AVX-NE-CONVERT): on an AVX2-only host it raised, and those layers stay as they are."""
    return (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)


def padded_rows(rows: int) -> int:
    """The bucket a call of `rows` rows runs at."""
    if rows <= 16:
        return rows
    step = 8 if rows <= 64 else 32
    return -(-rows // step) * step


def _packed_forward(weight: torch.Tensor, bias: torch.Tensor | None, one_row_as: int, x: torch.Tensor) -> torch.Tensor:
    """`one_row_as`: the rows a call of one row runs at (_one_row_as)."""
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1])
    padded = one_row_as if rows == 1 else padded_rows(rows)
    if padded != rows:  # (F.pad zero-fills the whole copy first: a quarter slower)
        flat = torch.cat((flat, flat.new_zeros(padded - rows, flat.shape[-1])))
    out = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")
    return out[:rows].view(*x.shape[:-1], out.shape[-1])


def _one_row_as(packed: torch.Tensor, bias: torch.Tensor | None, features: int, dtype: torch.dtype) -> int:
    """2 where oneDNN computes a row alone otherwise than among others (another kernel for one row: here,
    layers reading more than ~1,000 features), else 1. A row then gets the same bits whatever the step
    holds beside it, so that a request's output does not depend on the batch; a lone row costs as much."""
    x = torch.randn(2, features, generator=torch.Generator().manual_seed(0)).to(dtype)
    alone, among = (torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "") for rows in (x[:1], x))
    return 1 if torch.equal(alone[0], among[0]) else 2


def packed_matmul(weight: torch.Tensor, bias: torch.Tensor | None, tokens_hint: int) -> Callable:
    """x @ weight.T (+ bias) through oneDNN, `weight` ([out, in]) reordered into its blocked layout: a row's
    bits the same whatever rows share the call."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), tokens_hint)
    bias = None if bias is None else bias.detach()
    return partial(_packed_forward, packed, bias, _one_row_as(packed, bias, weight.shape[1], weight.dtype))


def release_parameter(module: torch.nn.Module, name: str) -> None:
    """A packed weight's dense copy let go: the parameter becomes one element of memory, its shape and dtype
    kept for whoever asks (nothing reads its values now)."""
    weight = getattr(module, name)
    setattr(module, name, torch.nn.Parameter(weight.new_zeros(()).expand(weight.shape), requires_grad=False))


def build_kernels(warm_up: dict[tuple, tuple[Callable, int]]) -> None:
    """oneDNN's kernels for every bucket of rows, at start-up: `warm_up` maps a weight's (shape, no bias,
    dtype) to a packed_matmul of that shape and the most rows it will get (the kernels are shared by
    shape). Not through the modules: no hook sees these calls."""
    for (weight_shape, _, dtype), (matmul, most_rows) in warm_up.items():
        for rows in sorted({padded_rows(n) for n in range(1, most_rows + 1)}):
            matmul(torch.zeros(rows, weight_shape[1], dtype=dtype))


@torch.no_grad()
def pack_linear_layers(model: torch.nn.Module, tokens_hint: int, max_rows: int, head_rows: int | None = None,
                       merge_siblings: bool = False) -> int:
    """Pack every CPU nn.Linear of the model (and GPT-2's Conv1D, a linear layer whose weight is stored
    transposed) for oneDNN and build its kernels for every bucket up to `max_rows` rows, the output head's
    up to `head_rows` if given; `tokens_hint`, the rows a typical call has, picks the blocked layout.
    `merge_siblings`: the projections that read one input (queries, keys and values; gate and up) are
    packed as one weight and computed as one matmul. Returns how many layers were packed."""
    dtypes = packable_dtypes()
    # (not layers whose forward is another's: a compressed-tensors layer rounds its input first, quantization.py)
    linears = [m for m in model.modules() if type(m) in (torch.nn.Linear, Conv1D) and "forward" not in vars(m)
               and m.weight.device.type == "cpu" and m.weight.dtype in dtypes]
    packable = {id(m) for m in linears}
    groups = [group for group in sibling_projections(model) if all(id(m) in packable for m in group)] \
        if merge_siblings else []
    grouped = {id(m) for group in groups for m in group}
    units = groups + [[m] for m in linears if id(m) not in grouped]
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    warm_up: dict[tuple, tuple[Callable, int]] = {}  # one matmul per shape, and the most rows it needs
    for unit in units:
        weight, bias = stack_weights(unit) if len(unit) > 1 else (unit[0].weight, unit[0].bias)
        if type(unit[0]) is Conv1D:  # ([in, out]: its addmm through MKL gave a row other bits among more rows)
            weight = weight.t()
        matmul = packed_matmul(weight, bias, tokens_hint)
        if len(unit) > 1:
            SharedMatmul(unit, matmul)
        else:
            unit[0].forward = matmul
        for module in unit:
            if uses[id(module.weight)] == 1:
                release_parameter(module, "weight")
        rows = head_rows if head_rows and unit[0] is head else max_rows  # the head is never merged
        shape = (weight.shape, bias is None, weight.dtype)
        warm_up[shape] = (matmul, max(rows, warm_up.get(shape, (None, 0))[1]))
    build_kernels(warm_up)
    logger.info("packed the weights of %d linear layers for oneDNN (%d groups merged)", len(linears), len(groups))
    return len(linears)


def _contiguous_outputs(forward: Callable, *args, **kwargs):
    out = forward(*args, **kwargs)
    return tuple(t.contiguous() for t in out) if isinstance(out, tuple) else out.contiguous()


def contiguous_rotary_embeddings(model: torch.nn.Module) -> None:
    """Each rotary embedding module's outputs made contiguous. torch rounds a complex product over a
    strided operand otherwise than over a contiguous one (its loops differ), and Llama 4's rotary embedding
    hands a step's angles transposed ([1, tokens, d], unit stride along the tokens), contiguous only for a
    step of one token: a decode's queries and keys had other bits alone than beside other tokens.
    (Elsewhere the outputs are contiguous already, and contiguous() hands them back as they are.)"""
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            module.forward = partial(_contiguous_outputs, module.forward)
