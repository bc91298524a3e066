"""Incremental detokenization and stop strings.

Decoding one token at a time is wrong for byte-level and SentencePiece vocabularies: a character can
span several tokens, and a token's leading space depends on what precedes it. So each step decodes a
short window of recent tokens twice (without and with the new ones) and emits the difference, holding
text back while it ends in an incomplete character.

Byte-level BPE vocabularies (GPT-2's scheme: Llama 3, Qwen, SmolLM2) have a faster way: the text of any
token sequence is the UTF-8 decoding of the tokens' bytes joined, so each token's bytes are looked up
in a table and fed to an incremental UTF-8 decoder; no tokenizer call per token. The table is used only
for a tokenizer whose own decode it reproduces on a sample of sequences (TokenBytes.build). Most tokens
are whole characters: one of those after complete text is its text, looked up (a step of 128 sequences
detokenizes 128 tokens on the engine's thread).
"""

import codecs
import copy
import logging
import random
import threading

logger = logging.getLogger(__name__)

# Tokens of context kept before the first new token; enough for any merge to see its neighbours.
_CONTEXT_TOKENS = 6
_INCOMPLETE = "\ufffd"


def _byte_level_alphabet() -> dict[str, int]:
    """The character standing for each byte in byte-level BPE token strings: printable Latin-1
    characters stand for themselves, the other bytes for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return {c: b for b, c in chars.items()}


class TokenBytes:
    """The bytes of every token of a byte-level BPE tokenizer, special tokens apart."""

    SAMPLE_SEQUENCES = 512  # random token sequences the table must decode exactly as the tokenizer does

    def __init__(self, table: list[bytes], special_ids: set[int]):
        self.table = table
        self.special_ids = special_ids
        # Each token's text where its bytes are whole UTF-8 characters, else None; specials skipped: "".
        self.texts = [_whole_characters(piece) for piece in table]
        self.texts_skipping_special = list(self.texts)
        for token_id in special_ids:
            if token_id < len(table):
                self.texts_skipping_special[token_id] = ""

    def join(self, token_ids: list[int], skip_special_tokens: bool) -> bytes:
        """The tokens' bytes. An id past the tokenizer's vocabulary (a model's embedding padded beyond
        it can sample one) is nothing, as in the tokenizer's own decode."""
        table, size = self.table, len(self.table)
        skipped = self.special_ids if skip_special_tokens else ()
        return b"".join(table[t] if t < size else b"" for t in token_ids if t not in skipped)

    @classmethod
    def build(cls, tokenizer) -> "TokenBytes | None":
        """The table for `tokenizer`, or None when its decoder is not plain byte-level or the table
        does not reproduce its decode on random sequences (then the window decoding is used)."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or type(backend.decoder).__name__ != "ByteLevel":  # (a Sequence of decoders is not)
            return None
        # Each piece's characters to the Latin-1 characters of their bytes, in one call a token; a character
        # outside the alphabet becomes one Latin-1 cannot encode.
        to_bytes = {ord(c): b for c, b in _byte_level_alphabet().items()}
        to_bytes.update({c: 0xFFFF for c in range(256) if c not in to_bytes})
        added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        table = []
        for token_id in range(len(tokenizer)):
            piece = added.get(token_id)
            if piece is not None:
                table.append(piece.encode())
                continue
            piece = backend.id_to_token(token_id)
            try:
                table.append(piece.translate(to_bytes).encode("latin-1"))
            except (AttributeError, UnicodeEncodeError):  # no such id, or not a byte-level piece
                return None
        special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
        special |= set(tokenizer.all_special_ids)
        token_bytes = cls(table, special)
        return token_bytes if token_bytes._reproduces(tokenizer) else None

    def _reproduces(self, tokenizer) -> bool:
        rng = random.Random(0)
        vocab = len(self.table)
        specials = sorted(self.special_ids)
        for k in range(self.SAMPLE_SEQUENCES):
            ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
            if specials and k % 4 == 0:
                ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
            skip = k % 2 == 0
            expected = tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            if self.join(ids, skip).decode("utf-8", errors="replace") != expected:
                logger.info("detokenizing through the tokenizer: its byte table differs on %s", ids)
                return False
        return True


def _whole_characters(piece: bytes) -> str | None:
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return None


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool, lock: threading.Lock,
                 token_bytes: TokenBytes | None = None):
        self._token_bytes = token_bytes  # the fast way, for byte-level vocabularies
        self._texts = None if token_bytes is None else \
            token_bytes.texts_skipping_special if skip_special_tokens else token_bytes.texts
        self._split_character = b""  # the bytes of a character not yet complete (the fast way)
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
        if self._token_bytes is not None:
            if len(token_ids) == 1 and not self._split_character:
                token_id = token_ids[0]
                text = self._texts[token_id] if token_id < len(self._texts) else ""  # (past the vocabulary)
                if text is not None:
                    return text
            data = self._split_character + self._token_bytes.join(token_ids, self._skip_special)
            text, used = codecs.utf_8_decode(data, "replace", False)
            self._split_character = data[used:]
            return text
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

    def fork(self) -> "IncrementalDetokenizer":
        """A copy that goes on from here on its own (beam search tries each continuation's text)."""
        other = copy.copy(self)
        other._ids = list(self._ids)
        return other

    def flush(self) -> str:
        """At the end of a sequence, emit whatever was held back (an incomplete character stays as U+FFFD)."""
        if self._token_bytes is not None:
            text = codecs.utf_8_decode(self._split_character, "replace", True)[0]
            self._split_character = b""
            return text
        if self._read_offset == len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix_offset:self._read_offset])
        after = self._decode(self._ids[self._prefix_offset:])
        self._read_offset = len(self._ids)
        return after[len(before):]


def find_stop_string(text: str, stop: list[str], search_from: int) -> tuple[int, int] | None:
    """Where the earliest stop string that ends after `search_from` starts and ends (the shortest of
    those starting there), or None."""
    best = None
    for s in stop:
        i = text.find(s, max(0, search_from - len(s) + 1))
        if i != -1 and (best is None or (i, i + len(s)) < best):
            best = (i, i + len(s))
    return best
