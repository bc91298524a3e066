"""An engine's tokenizer, loaded from its files once per process.

transformers takes 0.3-0.5 s to load the default model's tokenizer (on a slow CI host, more): it parses
tokenizer.json, then deep-copies what it parsed; the detokenizer's byte table takes another 0.07-0.16 s.
A process that builds several engines of one model (an application building its LLM again, the tests'
hundreds) pays that once. What is kept is the tokenizer pickled (1.5 MB for the default model's; read
back in 0.11-0.17 s), so each engine still gets a tokenizer of its own (a HF fast tokenizer must not be
used by two threads at once), and the byte table, which nothing writes. A folder's tokenizer is read
back only while the folder's files are unchanged (names, sizes, times)."""

import os
import pickle
import threading
from collections import OrderedDict
from typing import NamedTuple

from transformers import AutoTokenizer

from .detokenizer import TokenBytes

KEPT = 8  # tokenizers kept, the least recently used dropped first


class _Kept(NamedTuple):
    pickled: bytes
    token_bytes: TokenBytes | None


_kept: OrderedDict[tuple, _Kept] = OrderedDict()
_lock = threading.Lock()


def load_tokenizer(model: str, trust_remote_code: bool = False):
    """`model`'s tokenizer, an object of the caller's own, and its byte table (TokenBytes.build's:
    None where the tokenizer has none)."""
    key = _files_key(model, trust_remote_code)
    with _lock:
        kept = _kept.get(key)
        if kept is not None:
            _kept.move_to_end(key)
    if kept is not None:
        return pickle.loads(kept.pickled), kept.token_bytes
    tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
    token_bytes = TokenBytes.build(tokenizer)
    if key is not None:
        try:
            pickled = pickle.dumps(tokenizer, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # (remote code's tokenizer classes may not pickle: loaded each time)
            return tokenizer, token_bytes
        with _lock:
            _kept[key] = _Kept(pickled, token_bytes)
            while len(_kept) > KEPT:
                _kept.popitem(last=False)
    return tokenizer, token_bytes


def _files_key(model: str, trust_remote_code: bool) -> tuple | None:
    """What identifies a local folder's tokenizer: the folder and its files as they are now. None for a
    name on the Hub (its own cache keeps the files)."""
    if not os.path.isdir(model):
        return None
    folder = os.path.realpath(model)
    files = []
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_file():
                stat = entry.stat()
                files.append((entry.name, stat.st_size, stat.st_mtime_ns))
    return folder, trust_remote_code, tuple(sorted(files))
