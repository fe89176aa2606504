"""Where a text may be cut so that ``encode(a + b) == encode(a) + encode(b)``, proven per tokenizer.

Two kinds of cut, both checked on the UTF-8 bytes around the cut only (docs/tokenization.md, "Prefix
reuse", gives the argument):

- after an added token that no other added-token occurrence overlaps (a normalized one only when no
  raw token can occur inside it): the library cuts there before anything else runs;
- between an ASCII letter and an ASCII non-letter that no added-token occurrence spans, for a
  pre-tokenizer proven to allow it (tokenization.fast_paths `FastPath.letter_cuts`): the regex pieces
  of that pre-tokenizer always end there, and no piece reads across it;
- for a byte-level vocabulary without merges (every byte outside an added token is its own id: the
  built-in tokenizer), before any character that no added-token occurrence spans: nothing but the
  added tokens reads across bytes.

`token_byte_lengths` gives each id's length in bytes for byte-level BPE vocabularies, so the token count
at a byte offset of an encoded text can be found (and checked). Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from tokenization.segmenter import AddedToken

__all__ = ["UNKNOWN_LENGTH", "CutFinder", "token_byte_lengths"]

UNKNOWN_LENGTH: Final = 1 << 40
"""The byte length given to an id whose bytes are unknown: no text's byte count can add up with it."""


def _byte_decoder() -> dict[str, int]:
    """The byte-level alphabet (GPT-2's): printable Latin-1 bytes stand for themselves, the other bytes
    for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def token_byte_lengths(
    vocab: Mapping[str, int], added: Iterable[AddedToken], decoder: Mapping[str, Any] | None
) -> list[int] | None:
    """Each id's length in UTF-8 bytes (`UNKNOWN_LENGTH` where it cannot be known), for a BPE model
    under a ByteLevel decoder; None for any other tokenizer."""
    if decoder is None or decoder.get("type") != "ByteLevel" or not vocab:
        return None
    in_alphabet = re.compile("[" + "".join(re.escape(c) for c in _byte_decoder()) + "]*").fullmatch
    out = [UNKNOWN_LENGTH] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        if text and in_alphabet(text):  # an empty token would make two tokens end at one offset
            out[i] = len(text)
    for token in added:
        if token.id >= len(out):
            out.extend([UNKNOWN_LENGTH] * (token.id + 1 - len(out)))
        out[token.id] = len(token.content.encode("utf-8")) or UNKNOWN_LENGTH
    return out


_FIND_FIRST_BYTES: Final = 8  # up to this many distinct first bytes, `_spanned` finds them instead of looping
_FEW_LENGTHS: Final = 2  # up to this many prefix lengths end in a byte, `_spanned` slices them instead
_ASCII_LETTERS: Final = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
_NO_BYTES: Final[frozenset[int]] = frozenset()


class CutFinder:
    """Finds the last byte offset at or before a limit where two texts may both be cut (see module doc)."""

    def __init__(
        self,
        added: Sequence[AddedToken],
        pretokenizer_rule: bool,
        search_bytes: int = 4096,
        bytes_alone: bool = False,
    ) -> None:
        """``bytes_alone``: every byte outside an added token encodes to its own id (the third kind of
        cut in the module doc); only a tokenizer that is exactly that may say so."""
        words = [t.content.encode("utf-8") for t in added if t.content]
        raw = [w for t, w in zip([t for t in added if t.content], words, strict=True) if not t.normalized]
        # A normalized token is matched only inside the pieces between raw matches: it is a cut edge when
        # no raw token can occur inside it.
        self._edges = {w for w in words if w in raw or not any(r in w for r in raw)}
        self._edge_lengths = sorted({len(w) for w in self._edges})
        self._edge_last = frozenset(w[-1] for w in self._edges)
        self._max_len = max((len(w) for w in words), default=0)
        self._prefixes = {w[:i] for w in words for i in range(1, len(w))}
        lengths: dict[int, set[int]] = {}
        for p in self._prefixes:
            lengths.setdefault(p[-1], set()).add(len(p))
        # By the byte a proper prefix ends in, its few lengths (none: an empty tuple); None for many.
        self._ending_in: list[tuple[int, ...] | None] = [
            tuple(sorted(lengths.get(b, ()))) if len(lengths.get(b, ())) <= _FEW_LENGTHS else None
            for b in range(256)
        ]
        first = sorted({w[:1] for w in words})
        self._first_bytes = first if len(first) <= _FIND_FIRST_BYTES else None
        self.pretokenizer_rule = pretokenizer_rule
        self.search_bytes = search_bytes
        self.bytes_alone = bytes_alone

    def last_cut(self, a: bytes, b: bytes, limit: int) -> int:
        """The largest offset ``q <= limit`` (searched back ``search_bytes``) safe to cut in both ``a``
        and ``b``, which must share their first ``limit`` bytes; 0 when there is none."""
        stop = max(0, limit - self.search_bytes)
        if limit > stop and self.safe(a, limit) and self.safe(b, limit):
            return limit
        # Below the limit one text answers for both: `safe(data, q)` reads only data[:q + 1], shared.
        # Without `bytes_alone`, `safe` can hold only after a letter (with the pre-tokenizer rule) or an
        # edge token's last byte: other offsets are passed over here, without a call each (a number's
        # digits, spaces); with it, any offset may hold.
        letters = _ASCII_LETTERS if self.pretokenizer_rule else _NO_BYTES
        edge_last = self._edge_last
        bytes_alone = self.bytes_alone
        for q in range(limit - 1, stop, -1):
            before = a[q - 1]
            if (bytes_alone or before in letters or before in edge_last) and self.safe(a, q):
                return q
        return 0

    def safe(self, data: bytes, q: int) -> bool:
        """Whether ``encode(data) == encode(data[:q]) + encode(data[q:])`` by one of the two rules;
        for ``0 < q < len(data)`` the answer depends on ``data[:q + 1]`` only."""
        if q >= len(data):
            return q == len(data)
        if q <= 0:
            return False
        if self.pretokenizer_rule and data[q - 1] in _ASCII_LETTERS and data[q] < 0x80:
            if data[q] not in _ASCII_LETTERS and not self._spanned(data, q):
                return True
        if self.bytes_alone and data[q] & 0xC0 != 0x80 and not self._spanned(data, q):
            return True  # (a UTF-8 continuation byte would cut a character: the text is str)
        return data[q - 1] in self._edge_last and self._after_token(data, q)

    def _after_token(self, data: bytes, q: int) -> bool:
        """An edge token (see `__init__`) ends at ``q`` and no added-token occurrence spans its start or
        ``q``: the library's leftmost-longest split then matches exactly it (a longer one would span
        ``q``), whichever pass matches it."""
        for n in self._edge_lengths:
            s = q - n
            if s >= 0 and data[s:q] in self._edges:
                return not self._spanned(data, s) and not self._spanned(data, q)
        return False

    def edge_length(self, token: bytes) -> int:
        """The length of the shortest edge token (see `__init__`) ``token`` starts with, else 0."""
        for n in self._edge_lengths:
            if token[:n] in self._edges:
                return n
        return 0

    def token_start(self, data: bytes, q: int, n: int, floor: int = 0) -> bool:
        """Whether ``t = data[floor:]`` may be cut where an edge token of ``n`` bytes starts at ``q``
        (``encode(t) == encode(t[:q - floor]) + encode(t[q - floor:])``): the `_after_token` rule,
        whose proof makes both ends of the token cuts."""
        if data[q : q + n] not in self._edges:
            return False
        return not self._spanned(data, q, floor) and not self._spanned(data, q + n, floor)

    def _spanned(self, data: bytes, q: int, floor: int = 0) -> bool:
        """Whether an added token could start before ``q`` (at ``floor`` or later) and end after it
        (conservative: a proper prefix of some token ends at ``q``); ``q`` and ``floor`` >= 0."""
        prefixes = self._prefixes
        if floor < q <= len(data):
            # A prefix ending at ``q`` ends in byte ``data[q - 1]``: most bytes end none or few.
            lengths = self._ending_in[data[q - 1]]
            if lengths is not None:
                for n in lengths:
                    if q - n >= floor and data[q - n : q] in prefixes:
                        return True
                return False
        lo = max(floor, q - self._max_len + 1)
        if self._first_bytes is None:
            return any(data[s:q] in prefixes for s in range(lo, q))
        for first in self._first_bytes:  # a token can only start where its first byte is
            s = data.find(first, lo, q)
            while s >= 0:
                if data[s:q] in prefixes:
                    return True
                s = data.find(first, s + 1, q)
        return False
