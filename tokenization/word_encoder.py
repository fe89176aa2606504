"""ASCII text encoded word by word: DeepSeek's pre-tokenizer reproduced, each word's ids kept.

A byte-level BPE tokenizer cuts a piece (text holding no added token) into words with its
pre-tokenizer, and the BPE model encodes every word on its own: the piece's ids are its words' ids,
concatenated. For ASCII text DeepSeek-V3's pre-tokenizer (a Sequence of three isolating regex splits,
then ByteLevel without regex; `safe_cuts._DEEPSEEK_SPLITS`) is one `re` pattern: digits in runs of
1-3 first, and the third split's alternatives with its Unicode classes written out for ASCII and its
end-of-piece lookahead made to see a digit as the end of the piece it is in (the first split cut
there). Each word's ids come from a bounded map; a word not in it is encoded by the model alone
(`tokenizers.models.Model.tokenize` on its byte-level characters), the step the library runs on
each word. A call to the library's full pipeline costs tens of microseconds on any text, so a short
new tail is encoded for about a tenth of that. Non-ASCII text is left to the library. The split is
proven by `tests/tokenization/test_word_encoder.py` against the library's own pre-tokenizer. Pure.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from itertools import chain
from typing import Final

__all__ = ["WORDS", "WordEncoder", "byte_level"]

_SPACE: Final = r"\t\n\x0b\x0c\r "
"""Oniguruma's ``\\s`` in ASCII (Unicode White_Space: not \\x1c-\\x1f, which Python's ``\\s`` has)."""
_PUNCT: Final = r"!-/:-@\[-`{-~"
"""``[\\p{P}\\p{S}]`` in ASCII: every printable non-alphanumeric character (also the first class)."""
_LETTER: Final = "A-Za-z"
"""``\\p{L}`` (and ``[\\p{L}\\p{M}]``: no ASCII mark) in ASCII."""
_OTHER: Final = r"\x00-\x09\x0b\x0c\x0e-\x1f \x7f"
"""``[^\\r\\n\\p{L}\\p{P}\\p{S}]`` in ASCII without the digits, which the first split took apart."""
_CONTROL: Final = r"\x00-\x08\x0e-\x1f\x7f"
"""The characters where no alternative of the third split starts a match unless a letter follows."""

WORDS: Final = re.compile(
    "|".join(
        (
            "[0-9]{1,3}",  # \p{N}{1,3}, isolated first: digits are pieces of their own
            f"[{_PUNCT}][{_LETTER}]+",
            f"[{_OTHER}]?[{_LETTER}]+",
            f" ?[{_PUNCT}]+[\r\n]*",
            f"[{_SPACE}]*[\r\n]+",
            f"[{_SPACE}]+(?![^{_SPACE}0-9])",  # \s+(?!\S): a digit ends the piece, as its end would
            f"[{_SPACE}]+",
            f"(?:[{_CONTROL}](?![{_LETTER}]))+",  # what no alternative matches: a gap, a piece itself
        )
    )
)
"""DeepSeek-V3's pre-tokenizer on ASCII text: `findall` gives its words, which join to the text."""


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
    """``encode(piece)``: the ids of an ASCII piece holding no added token, word by word from a
    bounded map of words seen (cleared when full: no per-hit bookkeeping), or None for other text."""

    def __init__(self, tokenize: TokenizeWord, max_words: int = 1 << 16) -> None:
        if max_words < 0:
            raise ValueError(f"max_words must be >= 0, got {max_words}")
        self.max_words = max_words
        self.misses = 0
        """Words encoded by the model (not found in the map)."""
        self._tokenize = tokenize
        self._words: dict[str, tuple[int, ...]] = {}
        self._table = byte_level()

    def __len__(self) -> int:
        return len(self._words)

    def encode(self, piece: str) -> list[int] | None:
        """The piece's ids as the full pipeline gives them, or None when it is not ASCII."""
        if not piece.isascii():
            return None
        words = WORDS.findall(piece)
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
