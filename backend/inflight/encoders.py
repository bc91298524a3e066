"""Tokenizers that encode requests on the callers' threads, and a length limit checked without
encoding all of a huge prompt.

A HF fast tokenizer must not be used by two threads at once, so each encode borrows one of a few.
The batch call runs in the tokenizers library with the interpreter lock released: other threads go on
while a long prompt is encoded."""

import copy
import queue
import threading
from contextlib import contextmanager

# As many encodes can run at once (the Triton model runs at most two: a long prompt on a thread of its
# own, short ones on the execute thread).
ENCODERS = 2
# A text checked against a limit of n tokens is first measured by its first 4 (n + 1) characters (then
# 4 times as many, while shorter than the text).
PREFIX_CHARS_PER_TOKEN = 4


class PromptTooLong(ValueError):
    """A text over its token limit, found by a prefix of it."""


def copy_or_load(tokenizer, load):
    """A tokenizer of its own: a copy (0.25-0.4 s for the default model's against 0.65-1.3 s a load on a
    CI host), or a fresh load for one that cannot be copied (remote code)."""
    try:
        return copy.deepcopy(tokenizer)
    except Exception:
        return load()


class Encoders:
    def __init__(self, make, count: int = ENCODERS, made=()):
        """`make()` returns a new tokenizer: called when every one made so far is in use, up to `count`
        (an engine given only token ids never pays for one); `made`: tokenizers to start with."""
        self._make = make
        self._count = count
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        for tokenizer in made:
            self._idle.put(tokenizer)
        self._made = len(made)
        self._lock = threading.Lock()

    @contextmanager
    def borrow(self):
        try:
            tokenizer = self._idle.get_nowait()
        except queue.Empty:
            with self._lock:
                make = self._made < self._count
                self._made += make
            tokenizer = self._make() if make else self._idle.get()
        try:
            yield tokenizer
        finally:
            self._idle.put(tokenizer)

    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None,
               limit_name: str = "max_tokens") -> list[int]:
        """The text's token ids. With `max_tokens`, a text that surely has more tokens raises
        PromptTooLong having encoded only a prefix of it: refusing 1 MiB of text costs milliseconds, not
        the seconds its whole encoding takes (more, on a slow host)."""
        with self.borrow() as tokenizer:
            def encode(part: str) -> list[int]:
                return tokenizer([part], add_special_tokens=add_special_tokens)["input_ids"][0]

            if max_tokens is not None:
                # A prefix has about as many tokens as that part of the whole text: only the word cut at
                # its end may encode otherwise, hence the margin before calling the whole too long.
                margin = 16 + max_tokens // 16
                chars = PREFIX_CHARS_PER_TOKEN * (max_tokens + 1)
                while chars < len(text):
                    count = len(encode(text[:chars]))
                    if count > max_tokens + margin:
                        raise PromptTooLong(f"prompt has over {count - margin} tokens (its first {chars:,} characters "
                                            f"alone), more than {limit_name} ({max_tokens})")
                    chars *= 4
            return encode(text)
