"""ASCII text encoded word by word: a pre-tokenizer reproduced by one pattern, each word's ids kept.

A byte-level BPE tokenizer cuts a piece (text holding no added token) into words with its
pre-tokenizer, and the BPE model encodes every word on its own: the piece's ids are its words' ids,
concatenated. For ASCII text some pre-tokenizers are one `re` pattern, registered with its proof in
tokenization.fast_paths (`FastPath.ascii_words`: DeepSeek-V3's). Each word's ids come from a bounded
map; a word not in it is encoded by the model alone (`tokenizers.models.Model.tokenize` on its
byte-level characters), the step the library runs on each word. A call to the library's full
pipeline costs tens of microseconds on any text, so a short new tail is encoded for about a tenth
of that. Non-ASCII text is left to the library. Pure.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from itertools import chain

__all__ = ["WordEncoder", "byte_level"]


def byte_level() -> dict[int, str]:
    """GPT-2's byte-level alphabet for the ASCII bytes (`str.translate`'s table): printable ones
    stand for themselves, the others for characters from U+0100 on, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    table: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in printable:
            char = chr(b)
        else:
            char, extra = chr(256 + extra), extra + 1
        if b < 0x80:
            table[b] = char
    return table


TokenizeWord = Callable[[str], list[int]]
"""The BPE model's ids for one word given in byte-level characters."""


class WordEncoder:
    """``encode(piece)``: the ids of an ASCII piece holding no added token, word by word (``words``:
    the pre-tokenizer's pattern) from a bounded map of words seen (cleared when full: no per-hit
    bookkeeping), or None for other text."""

    def __init__(self, tokenize: TokenizeWord, words: re.Pattern[str], max_words: int = 1 << 16) -> None:
        if max_words < 0:
            raise ValueError(f"max_words must be >= 0, got {max_words}")
        self.max_words = max_words
        self.misses = 0
        """Words encoded by the model (not found in the map)."""
        self._tokenize = tokenize
        self._split = words.findall
        self._words: dict[str, tuple[int, ...]] = {}
        self._table = byte_level()

    def __len__(self) -> int:
        return len(self._words)

    def encode(self, piece: str) -> list[int] | None:
        """The piece's ids as the full pipeline gives them, or None when it is not ASCII."""
        if not piece.isascii():
            return None
        words = self._split(piece)
        found = list(map(self._words.get, words))
        if None in found:
            found = [ids if ids is not None else self._miss(w) for w, ids in zip(words, found, strict=True)]
        return list(chain.from_iterable(found))  # type: ignore[arg-type]

    def _miss(self, word: str) -> tuple[int, ...]:
        self.misses += 1
        ids = tuple(self._tokenize(word.translate(self._table)))
        if len(self._words) >= self.max_words:
            self._words.clear()
        if self.max_words:
            self._words[word] = ids
        return ids
