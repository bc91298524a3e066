"""C kernels for a CPU, built on first use with the machine's C compiler and loaded with ctypes.

Decode attention is the one so far (`cpu_decode_attention.c`): torch has no paged attention on a CPU,
and composing one from torch operations reads each key several times (once per query head of a group,
plus gathers or sparse bookkeeping). The kernel reads every cached row once; on the CI machine (2
cores, AVX-512) 64 decodes of ~430 tokens took 2.9 ms a layer through sparse torch operations and
~1 ms through it, the memory's speed.

Built with `-march=native`, so the library is cached per source, flags and processor (under
INFLIGHT_CACHE_DIR, else ~/.cache/inflight, else the temporary directory), written to a temporary name
and renamed, so that processes starting together never load a half-written file. OpenMP is linked by
its soname, libgomp.so.1, which torch has already loaded: the kernel shares torch's thread pool instead
of starting a second one whose spinning threads would compete with it. Where no compiler works
`decode_attention()` returns None and the caller keeps its torch path (logged once).
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

_SOURCE = Path(__file__).with_name("cpu_decode_attention.c")
# Not -ffast-math: GCC before 13 links it into a shared library as a constructor that turns on
# flush-to-zero. Of what it implies, the parts the kernel needs: reassociation (sums over the head
# dimension in vector lanes; 1.5x faster) and no errno (the exponentials vectorize; the source declares
# glibc's vector expf itself).
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math",
          "-fopenmp", "-fPIC", "-shared"]


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


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *_FLAGS, _processor()]).encode()).hexdigest()[:16]
    directory = _cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / f"{_SOURCE.stem}-{key}.so"
    if not library.exists():
        fd, partial = tempfile.mkstemp(suffix=".so", dir=directory)
        os.close(fd)
        try:
            result = subprocess.run([compiler, *_FLAGS, "-o", partial, str(_SOURCE), "-lm"],
                                    capture_output=True, text=True, timeout=120)
            if result.returncode:
                raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
            os.replace(partial, library)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    return library


@cache
def decode_attention():
    """The C function, or None where it cannot be built."""
    if os.environ.get("INFLIGHT_CPU_KERNELS", "1") == "0":
        return None
    try:
        library = _build()
        function = ctypes.CDLL(str(library)).paged_decode_attention
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("CPU decode attention kernel unavailable, using torch operations (slower): %s", e)
        return None
    function.restype = ctypes.c_int
    pointer, size = ctypes.c_void_p, ctypes.c_int64  # pointers pass as tensors' data_ptr()
    function.argtypes = [pointer, pointer, pointer, pointer, pointer, size, pointer, pointer, pointer, size, size,
                         size, size, size, size, ctypes.c_float, pointer, ctypes.c_int, ctypes.c_int]
    logger.info("CPU decode attention kernel: %s", library)
    return function


# The caches' dtypes the kernel reads.
CACHE_DTYPES = (torch.float32, torch.bfloat16)


def run_decode_attention(function, query, token_rows, key_cache, value_cache, block_tables, table_rows, starts,
                         ends, max_len: int, scale: float, out) -> None:
    """query, out: [T, Hq, D] of the caches' dtype; caches [blocks, block_size, Hkv, D] contiguous, float32
    or bfloat16; block_tables [S, W] int64 with unit column stride; token_rows, table_rows, starts, ends:
    [n] int64. The kernel computes in float32: a bfloat16 query is widened, its output rounded back."""
    # The C function trusts its pointers: what it reads must be what it expects (a few µs a layer).
    if not (key_cache.dtype in CACHE_DTYPES and query.dtype == key_cache.dtype == value_cache.dtype == out.dtype
            and key_cache.is_contiguous() and value_cache.is_contiguous()
            and block_tables.dtype == torch.int64 and block_tables.stride(-1) == 1
            and all(t.dtype == torch.int64 and t.is_contiguous() for t in (token_rows, table_rows, starts, ends))):
        raise ValueError("CPU decode attention: float32 or bfloat16 query and contiguous caches, int64 indices "
                         "expected")
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1:3]
    query = query.float().contiguous()
    direct = out.dtype == torch.float32 and out.is_contiguous()
    target = out if direct else torch.empty(out.shape, dtype=torch.float32)
    status = function(query.data_ptr(), token_rows.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                      block_tables.data_ptr(), block_tables.stride(0), table_rows.data_ptr(), starts.data_ptr(),
                      ends.data_ptr(), len(token_rows), num_heads, num_kv_heads, head_dim, block_size, max_len, scale,
                      target.data_ptr(), torch.get_num_threads(), int(key_cache.dtype == torch.bfloat16))
    if status:
        raise MemoryError("CPU decode attention: no memory for the scores")
    if not direct:
        out[token_rows] = target[token_rows].to(out.dtype)
