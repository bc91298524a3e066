"""C kernels for a CPU, built on first use with the machine's C compiler and loaded with ctypes.

Decode attention (`cpu_decode_attention.c`): torch has no paged attention on a CPU, and composing one
from torch operations reads each key several times (once per query head of a group, plus gathers or
sparse bookkeeping). The kernel reads every cached row once; on the CI machine (2 cores, AVX-512) 64
decodes of ~430 tokens took 2.9 ms a layer through sparse torch operations and ~1 ms through it, the
memory's speed.

Prefill attention (`cpu_prefill_attention.c`): every prefill chunk of a step in one call, from the paged
cache, a flash attention with register-blocked products: 2.2-3.9x faster than gathering each
sequence's keys and running torch's fused CPU attention on the default model's shapes (170-250 GFLOP/s
against 60-120, 2 cores; client/bench_cpu_attention.py).

Both attention kernels run one tiled computation (`cpu_attention_tiles.h`), so that a token decoded and
the same token computed again in a prompt (preemption; another request's answer in the prefix cache)
get the same bits.

A decoder layer's small operations (`cpu_layer_ops.c`): RMSNorm, residual add and RMSNorm, the rotary
embedding, SiLU and multiply, float32, each one call where eager torch runs six to twelve operations
(fused_layers.py swaps them into transformers' modules).

Built with `-march=native`, so the library is cached per source (with cpu_kernels.h, which every source
includes), flags and processor (under INFLIGHT_CACHE_DIR, else ~/.cache/inflight, else the temporary
directory), written to a temporary name and renamed, so that processes starting together never load a
half-written file. OpenMP is linked by
its soname, libgomp.so.1, which torch has already loaded: the kernel shares torch's thread pool instead
of starting a second one whose spinning threads would compete with it. Where no compiler works the
loaders return None and the callers keep their torch paths (logged once).
"""

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_DECODE_SOURCE = Path(__file__).with_name("cpu_decode_attention.c")
_PREFILL_SOURCE = Path(__file__).with_name("cpu_prefill_attention.c")
_LAYER_OPS_SOURCE = Path(__file__).with_name("cpu_layer_ops.c")
_SHARED_HEADER = Path(__file__).with_name("cpu_kernels.h")  # included by every source above
_TILES_HEADER = Path(__file__).with_name("cpu_attention_tiles.h")  # included by both attention kernels
# Not -ffast-math: GCC before 13 links it into a shared library as a constructor that turns on
# flush-to-zero. Of what it implies, the parts the kernels need: reassociation (the layer kernels' sums
# over a row in vector lanes) and no errno (the exponentials vectorize; the source declares glibc's
# vector expf itself).
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math",
          "-fopenmp", "-fPIC", "-shared"]
# The attention kernels without reassociation, both with the same flags: their sums are written out in
# vector lanes and run in the order written. Reassociated, the compiler ordered them by how many rows or
# keys a work item holds, so a query row's result depended on the rows beside it and a prompt's keys and
# values on how its steps cut it into chunks (a few 1e-7; a seeded request sent twice, the second time
# from the prefix cache, could sample other tokens); and a decode must get the bits a prefill chunk's row
# gets (cpu_attention_tiles.h). In order, at the same speed (bench_cpu_attention.py).
_ATTENTION_FLAGS = [flag for flag in _FLAGS if flag != "-fassociative-math"]


def _processor() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), platform.processor())
    except OSError:
        return platform.processor()


def _cache_dir() -> Path:
    for candidate in (os.environ.get("INFLIGHT_CACHE_DIR"), Path.home() / ".cache" / "inflight"):
        if candidate:
            try:
                path = Path(candidate) / "cpu_kernels"
                path.mkdir(parents=True, exist_ok=True)
                if os.access(path, os.W_OK):
                    return path
            except OSError:
                pass
    return Path(tempfile.gettempdir()) / f"inflight-cpu-kernels-{os.getuid()}"


def _build(source_path: Path, flags: list[str]) -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    source = source_path.read_bytes() + _SHARED_HEADER.read_bytes() + _TILES_HEADER.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *flags, _processor()]).encode()).hexdigest()[:16]
    directory = _cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / f"{source_path.stem}-{key}.so"
    if not library.exists():
        fd, partial = tempfile.mkstemp(suffix=".so", dir=directory)
        os.close(fd)
        try:
            result = subprocess.run([compiler, *flags, "-o", partial, str(source_path), "-lm"],
                                    capture_output=True, text=True, timeout=120)
            if result.returncode:
                raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
            os.replace(partial, library)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    return library


def _load(source_path: Path, flags: list[str], what: str) -> ctypes.CDLL | None:
    """The built library (logged), or None (logged) where it cannot be built or kernels are switched off."""
    if os.environ.get("INFLIGHT_CPU_KERNELS", "1") == "0":
        return None
    try:
        library = ctypes.CDLL(str(_build(source_path, flags)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("CPU %s unavailable, using torch operations (slower): %s", what, e)
        return None
    logger.info("CPU %s: %s", what, library._name)
    return library


# Argument types: pointers pass as tensors' data_ptr().
_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64


def _attention_function(source_path: Path, flags: list[str], what: str, name: str, argtypes: list):
    """The C function `name` of the library built from `source_path`, or None where it cannot be built."""
    library = _load(source_path, flags, what)
    if library is None:
        return None
    function = getattr(library, name)
    function.restype, function.argtypes = ctypes.c_int, argtypes
    return function


@cache
def decode_attention():
    return _attention_function(
        _DECODE_SOURCE, _ATTENTION_FLAGS, "decode attention kernel", "paged_decode_attention",
        [_POINTER, _POINTER, _POINTER, _POINTER, _POINTER, _SIZE, _POINTER, _POINTER, _POINTER, _SIZE, _SIZE, _SIZE,
         _SIZE, _SIZE, ctypes.c_float, ctypes.c_float, _POINTER, _POINTER, ctypes.c_int, ctypes.c_int, ctypes.c_int])


@cache
def prefill_attention():
    return _attention_function(
        _PREFILL_SOURCE, _ATTENTION_FLAGS, "prefill attention kernel", "paged_prefill_attention",
        [_POINTER, _POINTER, _POINTER, _POINTER, _SIZE, _POINTER, _POINTER, _POINTER, _POINTER, _SIZE, _SIZE, _SIZE,
         _SIZE, _SIZE, _SIZE, ctypes.c_float, ctypes.c_float, _POINTER, _POINTER, ctypes.c_int, ctypes.c_int,
         ctypes.c_int])


# The caches' dtypes the kernels read, and where an fp8 byte's exponent goes in a float32's bits.
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
_FP8_SHIFTS = {torch.float8_e4m3fn: 20, torch.float8_e5m2: 21}
# The longest head the attention kernels take (Gemma's 256; rows padded to a power of two from 16).
MAX_HEAD_DIM = 256


def _check_attention_inputs(what: str, query, key_cache, value_cache, out, block_tables, indices) -> None:
    # The C functions trust their pointers: what they read must be what they expect (a few µs a layer).
    if not (key_cache.dtype in CACHE_DTYPES and key_cache.dtype == value_cache.dtype and query.is_floating_point()
            and query.dtype == out.dtype and out.shape == query.shape
            and key_cache.is_contiguous() and value_cache.is_contiguous()
            and block_tables.dtype == torch.int64 and block_tables.stride(-1) == 1
            and all(t.dtype == torch.int64 and t.is_contiguous() for t in indices)):
        raise ValueError(f"CPU {what} attention: contiguous float32, bfloat16 or fp8 caches, an output of the "
                         "query's dtype, int64 indices expected")


def _check_head_dim(what: str, head_dim: int) -> None:
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"CPU {what} attention: head_dim {head_dim} above {MAX_HEAD_DIM}")


def _cache_arguments(cache: torch.Tensor) -> tuple[int, int]:
    """The kernels' `cache_bytes` and `fp8_shift` for a cache."""
    return cache.element_size(), _FP8_SHIFTS.get(cache.dtype, 0)


def _sinks(sinks: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    """The sinks as the kernels read them: [num_heads] float32, contiguous on the CPU."""
    if sinks is None:
        return None
    if sinks.numel() != num_heads:
        raise ValueError(f"CPU attention: {sinks.numel()} sinks for {num_heads} query heads")
    return sinks.detach().to(torch.float32).contiguous().view(-1)


def _float32_out(out: torch.Tensor) -> torch.Tensor:
    """Where the kernel writes: `out` itself when it is float32 and contiguous, else a float32 buffer."""
    return out if out.dtype == torch.float32 and out.is_contiguous() else torch.empty(out.shape, dtype=torch.float32)


def _finish(status: int, what: str, out: torch.Tensor, target: torch.Tensor, rows: torch.Tensor) -> None:
    if status:
        raise MemoryError(f"CPU {what} attention: out of memory")
    if target is not out:
        out[rows] = target[rows].to(out.dtype)


def run_decode_attention(function, query, token_rows, key_cache, value_cache, block_tables, table_rows, starts,
                         ends, scale: float, softcap: float | None, sinks: torch.Tensor | None, out) -> None:
    """query, out: [T, Hq, D] of one floating dtype; caches [blocks, block_size, Hkv, D] contiguous, float32,
    bfloat16 or fp8 (the query's dtype or not: kv_cache_dtype); block_tables [S, W] int64 with unit column
    stride; token_rows, table_rows, starts, ends: [n] int64; softcap: None or above 0; sinks: None or [Hq];
    head_dim at most MAX_HEAD_DIM. The kernel computes in float32: a 16-bit query is widened, its output
    rounded back."""
    _check_attention_inputs("decode", query, key_cache, value_cache, out, block_tables,
                            (token_rows, table_rows, starts, ends))
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1:3]
    _check_head_dim("decode", head_dim)
    query, target, sinks = query.float().contiguous(), _float32_out(out), _sinks(sinks, num_heads)
    status = function(query.data_ptr(), token_rows.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                      block_tables.data_ptr(), block_tables.stride(0), table_rows.data_ptr(), starts.data_ptr(),
                      ends.data_ptr(), len(token_rows), num_heads, num_kv_heads, head_dim, block_size, scale,
                      softcap or 0.0, None if sinks is None else sinks.data_ptr(), target.data_ptr(),
                      torch.get_num_threads(), *_cache_arguments(key_cache))
    _finish(status, "decode", out, target, token_rows)


def run_prefill_attention(function, query, key_cache, value_cache, block_tables, table_rows, q_starts, q_lens,
                          seq_lens, token_rows, sliding_window: int | None, scale: float, softcap: float | None,
                          sinks: torch.Tensor | None, out) -> None:
    """Prefill chunk i: query rows [q_starts[i], q_starts[i] + q_lens[i]), the last q_lens[i] of its
    seq_lens[i] positions, causal, its block-table row table_rows[i]; token_rows: all those rows.
    Layouts and dtypes as run_decode_attention's."""
    _check_attention_inputs("prefill", query, key_cache, value_cache, out, block_tables,
                            (table_rows, q_starts, q_lens, seq_lens))
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1:3]
    _check_head_dim("prefill", head_dim)
    query, target, sinks = query.float().contiguous(), _float32_out(out), _sinks(sinks, num_heads)
    status = function(query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
                      block_tables.stride(0), table_rows.data_ptr(), q_starts.data_ptr(), q_lens.data_ptr(),
                      seq_lens.data_ptr(), len(q_lens), num_heads, num_kv_heads, head_dim, block_size,
                      sliding_window or 0, scale, softcap or 0.0, None if sinks is None else sinks.data_ptr(),
                      target.data_ptr(), torch.get_num_threads(), *_cache_arguments(key_cache))
    _finish(status, "prefill", out, target, token_rows)


class LayerOps:
    """The functions of cpu_layer_ops.c on float32 CPU tensors of any layout (a row layout the C code
    cannot take is copied first); each returns new tensors, as the torch operations it replaces do."""

    def __init__(self, library: ctypes.CDLL):
        pointer, size, threads = _POINTER, _SIZE, ctypes.c_int
        signatures = {
            "rms_norm": [pointer, size, pointer, pointer, size, size, ctypes.c_float, threads],
            "add_rms_norm": [pointer, size, pointer, size, pointer, pointer, pointer, size, size, ctypes.c_float,
                             threads],
            "rotary": [pointer, size, size, size, pointer, size, size, size, pointer, pointer, pointer, pointer, size,
                       size, threads],
            "silu_mul": [pointer, size, pointer, size, pointer, size, size, threads],
        }
        for name, argtypes in signatures.items():
            function = getattr(library, name)
            function.argtypes, function.restype = argtypes, None
            setattr(self, f"_{name}", function)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows, out = _rows(x), torch.empty(x.shape, dtype=torch.float32)
        self._rms_norm(rows.data_ptr(), rows.stride(0), _vector(weight, rows).data_ptr(), out.data_ptr(),
                       rows.shape[0], rows.shape[1], eps, torch.get_num_threads())
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, its RMSNorm)."""
        if residual.shape != x.shape:
            raise ValueError(f"add_rms_norm: shapes {tuple(x.shape)} and {tuple(residual.shape)} differ")
        rows, residual_rows = _rows(x), _rows(residual)
        total, out = torch.empty(x.shape, dtype=torch.float32), torch.empty(x.shape, dtype=torch.float32)
        self._add_rms_norm(rows.data_ptr(), rows.stride(0), residual_rows.data_ptr(), residual_rows.stride(0),
                           _vector(weight, rows).data_ptr(), total.data_ptr(), out.data_ptr(), rows.shape[0],
                           rows.shape[1], eps, torch.get_num_threads())
        return total, out

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Llama's rotary embedding of q [1, q heads, tokens, head_dim] and k [1, k heads, tokens, head_dim]
        by cos, sin [1, tokens, head_dim]. The results are laid out token-major ([1, tokens, heads,
        head_dim] memory, transposed), as the attention reads them."""
        (_, q_heads, tokens, head_dim), k_heads = q.shape, k.shape[1]
        if q.shape[0] != 1 or k.shape != (1, k_heads, tokens, head_dim) or cos.shape != (1, tokens, head_dim) \
                or sin.shape != cos.shape:
            raise ValueError("rotary: one sequence of queries and keys, and cos and sin for its tokens, expected")
        q, k = (_float32(t) if t.stride(-1) == 1 else _float32(t).contiguous() for t in (q, k))
        cos, sin = (_float32(t).contiguous() for t in (cos, sin))
        q_out = torch.empty(1, tokens, q_heads, head_dim, dtype=torch.float32)
        k_out = torch.empty(1, tokens, k_heads, head_dim, dtype=torch.float32)
        self._rotary(q.data_ptr(), q.stride(2), q.stride(1), q_heads, k.data_ptr(), k.stride(2), k.stride(1), k_heads,
                     cos.data_ptr(), sin.data_ptr(), q_out.data_ptr(), k_out.data_ptr(), tokens, head_dim,
                     torch.get_num_threads())
        return q_out.transpose(1, 2), k_out.transpose(1, 2)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if up.shape != gate.shape:
            raise ValueError(f"silu_mul: shapes {tuple(gate.shape)} and {tuple(up.shape)} differ")
        gate_rows, up_rows, out = _rows(gate), _rows(up), torch.empty(gate.shape, dtype=torch.float32)
        self._silu_mul(gate_rows.data_ptr(), gate_rows.stride(0), up_rows.data_ptr(), up_rows.stride(0), out.data_ptr(),
                       gate_rows.shape[0], gate_rows.shape[1], torch.get_num_threads())
        return out


def _float32(t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.float32 or t.device.type != "cpu":
        raise ValueError(f"CPU layer kernels take float32 CPU tensors, got {t.dtype} on {t.device}")
    return t


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dimension] with unit stride along it (a view where one exists)."""
    rows = _float32(x).reshape(-1, x.shape[-1])
    return rows if rows.stride(1) == 1 or rows.shape[1] == 1 else rows.contiguous()


def _vector(weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    if weight.shape != rows.shape[1:]:
        raise ValueError(f"weight of shape {tuple(weight.shape)} for rows of {rows.shape[1]}")
    return _float32(weight).contiguous()


@cache
def layer_ops() -> LayerOps | None:
    """The layer kernels, or None where they cannot be built."""
    library = _load(_LAYER_OPS_SOURCE, [*_FLAGS, "-ffp-contract=off"], "layer kernels")
    return None if library is None else LayerOps(library)
