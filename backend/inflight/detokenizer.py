"""Incremental detokenization and stop strings.

Decoding one token at a time is wrong for byte-level and SentencePiece vocabularies: a character can
span several tokens, and a token's leading space depends on what precedes it. So each step decodes a
short window of recent tokens twice (without and with the new ones) and emits the difference, holding
text back while it ends in an incomplete character.
"""

import threading

# Tokens of context kept before the first new token; enough for any merge to see its neighbours.
_CONTEXT_TOKENS = 6
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool, lock: threading.Lock):
        self._tokenizer = tokenizer
        self._lock = lock  # a HF fast tokenizer must not be used from two threads at once
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = len(self._ids)  # tokens before this have been emitted as text

    def _decode(self, ids: list[int]) -> str:
        with self._lock:
            return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special,
                                          clean_up_tokenization_spaces=False)

    def add_tokens(self, token_ids: list[int]) -> str:
        """Feed newly generated tokens; return the text they complete (possibly empty)."""
        self._ids.extend(token_ids)
        window = self._ids[self._prefix_offset:]
        before = self._decode(self._ids[self._prefix_offset:self._read_offset])
        after = self._decode(window)
        if len(after) <= len(before) or after.endswith(_INCOMPLETE):
            return ""  # wait for the rest of a multi-byte character
        new_text = after[len(before):]
        self._prefix_offset = max(self._read_offset, len(self._ids) - _CONTEXT_TOKENS)
        self._read_offset = len(self._ids)
        return new_text

    def flush(self) -> str:
        """At the end of a sequence, emit whatever was held back (an incomplete character stays as U+FFFD)."""
        if self._read_offset == len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix_offset:self._read_offset])
        after = self._decode(self._ids[self._prefix_offset:])
        self._read_offset = len(self._ids)
        return after[len(before):]


def find_stop_string(text: str, stop: list[str], search_from: int) -> int:
    """Index of the earliest stop string that ends after `search_from`, or -1."""
    best = -1
    for s in stop:
        i = text.find(s, max(0, search_from - len(s) + 1))
        if i != -1 and (best == -1 or i < best):
            best = i
    return best
