"""Segment-cached encoding: the same ids as a plain encode, at a fraction of the cost on repeated text.

HF tokenizers cut the input at added tokens before normalization, pre-tokenization and BPE run, and
process every piece on its own. So when each added token is "plain" (no lstrip/rstrip/single_word),
``encode(a + T + b) == encode(a) + [id(T)] + encode(b)``, and the pieces of a rendered chat (mostly one
per message) can be encoded once and cached. The split reproduces the library's matching exactly:
leftmost-longest over the non-normalized tokens first, then (only under an identity normalizer) over
the normalized ones inside each piece. docs/tokenization.md gives the full argument. Pure: no I/O.
"""

from __future__ import annotations

import re
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import TypeAlias

import msgspec

__all__ = ["TOKEN_BYTES", "AddedToken", "SegmentCache", "SegmentedEncoder", "Segmenter", "pack_ids"]

Segment = str | int
"""A text piece to encode, or the id of an added token matched in place."""

TOKEN_BYTES = 4
"""Bytes per token id in packed form: native unsigned 32-bit ints (``array("I")``)."""
assert array("I").itemsize == TOKEN_BYTES


def pack_ids(ids: Sequence[int]) -> bytes:
    """Token ids as packed native unsigned 32-bit ints (OverflowError/TypeError on a bad id)."""
    return array("I", ids).tobytes()


class AddedToken(msgspec.Struct, frozen=True):
    """One entry of tokenizer.json's ``added_tokens`` (the HF file format; unknown fields ignored)."""

    id: int
    content: str
    single_word: bool = False
    lstrip: bool = False
    rstrip: bool = False
    normalized: bool = True
    special: bool = False

    @property
    def plain(self) -> bool:
        """Matches its exact text only, so splitting around it cannot move a neighbouring character."""
        return not (self.single_word or self.lstrip or self.rstrip)


_Trie: TypeAlias = dict[str, "_Trie"]
"""A character trie; the key "" marks the end of a word."""


def _trie_pattern(words: Iterable[str]) -> str:
    """A regex matching the longest of ``words`` at a position: a character trie, deeper branches first."""
    trie: _Trie = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}
    return _node_pattern(trie)


def _node_pattern(node: _Trie) -> str:
    branches = [re.escape(ch) + _node_pattern(child) for ch, child in node.items() if ch]
    if not branches:
        return ""
    body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
    # A word may end here: try the longer continuations first, then accept the shorter match.
    return f"(?:{body})?" if "" in node else body


class _Finder:
    """Leftmost-longest matches of a word set: `str.find` for the words' first characters, then a trie
    regex anchored there. A scan by `re` tests every position (~1 ns/char) where `str.find` runs at
    memchr speed, and rendered chats are long with few added tokens."""

    def __init__(self, words: Sequence[str]) -> None:
        by_first: dict[str, list[str]] = {}
        for word in words:
            by_first.setdefault(word[0], []).append(word)
        self._patterns = {ch: re.compile(_trie_pattern(ws)) for ch, ws in by_first.items()}

    def occurs(self, text: str, pos: int, end: int) -> bool:
        """Whether a first character of some word occurs in ``text[pos:end]`` (else nothing matches)."""
        for ch in self._patterns:
            if text.find(ch, pos, end) >= 0:
                return True
        return False

    def spans(self, text: str, pos: int, end: int) -> list[tuple[int, int]]:
        """The (start, end) of every match inside ``text[pos:end]``, left to right, none overlapping."""
        if len(self._patterns) == 1:
            return self._spans_one(text, pos, end)
        patterns = self._patterns
        starts = sorted(i for ch in patterns for i in _positions(text, ch, pos, end))
        out: list[tuple[int, int]] = []
        for i in starts:
            if i < pos:  # inside the previous match
                continue
            match = patterns[text[i]].match(text, i, end)
            if match is not None:
                pos = match.end()
                out.append((i, pos))
        return out

    def _spans_one(self, text: str, pos: int, end: int) -> list[tuple[int, int]]:
        """`spans` when every word starts with one character (the common case: ``<``)."""
        ((ch, pattern),) = self._patterns.items()
        out: list[tuple[int, int]] = []
        find, match = text.find, pattern.match
        i = find(ch, pos, end)
        while i >= 0:
            m = match(text, i, end)
            if m is None:
                i = find(ch, i + 1, end)
            else:
                j = m.end()
                out.append((i, j))
                i = find(ch, j, end)
        return out


def _positions(text: str, ch: str, pos: int, end: int) -> list[int]:
    """Every index of ``ch`` in ``text[pos:end]``."""
    out: list[int] = []
    i = text.find(ch, pos, end)
    while i >= 0:
        out.append(i)
        i = text.find(ch, i + 1, end)
    return out


def _compile(tokens: Sequence[AddedToken]) -> _Finder | None:
    words = [t.content for t in tokens if t.content]
    return _Finder(words) if words else None


class Segmenter:
    """Cuts text into pieces and added-token ids exactly where HF tokenizers' added vocabulary cuts it."""

    def __init__(self, tokens: Sequence[AddedToken], identity_normalizer: bool) -> None:
        # Any non-plain token makes boundaries depend on neighbours: then we do not split at all.
        self.enabled = all(t.plain for t in tokens)
        raw = [t for t in tokens if not t.normalized]
        normalized = [t for t in tokens if t.normalized] if identity_normalizer else []
        self._ids = {t.content: t.id for t in normalized} | {t.content: t.id for t in raw}
        self._raw = _compile(raw) if self.enabled else None
        self._normalized = _compile(normalized) if self.enabled else None

    def split(self, text: str) -> list[Segment]:
        """The pieces of ``text`` in order; concatenating their encodings gives the whole text's encoding."""
        out: list[Segment] = []
        start = 0
        for a, b in self._raw.spans(text, 0, len(text)) if self._raw is not None else ():
            if a > start:
                self._split_piece(out, text, start, a)
            out.append(self._ids[text[a:b]])
            start = b
        if start < len(text):
            self._split_piece(out, text, start, len(text))
        return out

    def _split_piece(self, out: list[Segment], text: str, pos: int, end: int) -> None:
        """Split ``text[pos:end]``, a piece between raw matches, on the normalized tokens."""
        finder = self._normalized
        if finder is None or not finder.occurs(text, pos, end):
            out.append(text[pos:end])
            return
        start = pos
        for a, b in finder.spans(text, pos, end):
            if a > start:
                out.append(text[start:a])
            out.append(self._ids[text[a:b]])
            start = b
        if start < end:
            out.append(text[start:end])


class SegmentCache:
    """A bounded LRU map from piece text to its token ids, with hit/miss counters."""

    def __init__(self, max_entries: int = 8192) -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, got {max_entries}")
        self.max_entries = max_entries
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._packed: dict[str, bytes] = {}  # the packed form of each entry's ids, made once

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, piece: str) -> tuple[int, ...] | None:
        """The cached ids of ``piece`` (refreshing its recency), or None; counts the hit or miss."""
        ids = self._entries.get(piece)
        if ids is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(piece)
        return ids

    def put(self, piece: str, ids: tuple[int, ...]) -> None:
        """Store ``ids`` for ``piece``, evicting the least recently used entries beyond the bound."""
        if self.max_entries == 0:
            return
        self._entries[piece] = ids
        self._entries.move_to_end(piece)
        self._packed.pop(piece, None)
        while len(self._entries) > self.max_entries:
            self._packed.pop(self._entries.popitem(last=False)[0], None)

    def packed(self, piece: str, ids: tuple[int, ...]) -> bytes:
        """``pack_ids(ids)`` for a piece whose ids are ``ids``, kept with its entry while it is cached."""
        out = self._packed.get(piece)
        if out is None:
            out = pack_ids(ids)
            if piece in self._entries:
                self._packed[piece] = out
        return out

    def clear(self) -> None:
        """Forget every entry (the counters are kept)."""
        self._entries.clear()
        self._packed.clear()


EncodeBatch = Callable[[list[str]], list[list[int]]]
"""Encodes pieces that contain no splittable added token, without adding special tokens."""


class SegmentedEncoder:
    """``encode(text)`` through a Segmenter and a SegmentCache; only pieces not seen before are encoded."""

    def __init__(self, segmenter: Segmenter, encode_batch: EncodeBatch, cache: SegmentCache) -> None:
        self.segmenter = segmenter
        self.cache = cache
        self._encode_batch = encode_batch

    def encode(self, text: str) -> list[int]:
        """The ids of ``text`` without special tokens added; equal to the tokenizer's plain encode."""
        if not self.segmenter.enabled:
            return self._encode_batch([text])[0] if text else []
        segments = self.segmenter.split(text)
        known = self._lookup(segments)
        out: list[int] = []
        for seg in segments:
            if isinstance(seg, int):
                out.append(seg)
            else:
                out.extend(known[seg])
        return out

    def encode_packed(self, text: str) -> tuple[tuple[int, ...], bytes]:
        """``encode(text)`` as a tuple, with its packed bytes (`pack_ids`) joined from cached pieces."""
        if not self.segmenter.enabled:
            whole = tuple(self._encode_batch([text])[0]) if text else ()
            return whole, pack_ids(whole)
        segments = self.segmenter.split(text)
        known = self._lookup(segments)
        ids: list[int] = []
        blobs: list[bytes] = []
        for seg in segments:
            if isinstance(seg, str):
                part = known[seg]
                ids += part
                blobs.append(self.cache.packed(seg, part))
            else:
                ids.append(seg)
                blobs.append(_packed_id(seg))
        return tuple(ids), b"".join(blobs)

    def _lookup(self, segments: list[Segment]) -> dict[str, tuple[int, ...]]:
        # A local map as well as the cache: a text with more pieces than the bound must still resolve.
        known: dict[str, tuple[int, ...]] = {}
        missing: list[str] = []
        for seg in segments:
            if isinstance(seg, str) and seg not in known:
                ids = self.cache.get(seg)
                if ids is None:
                    missing.append(seg)
                    known[seg] = ()
                else:
                    known[seg] = ids
        if missing:
            for piece, ids_list in zip(missing, self._encode_batch(missing), strict=True):
                known[piece] = tuple(ids_list)
                self.cache.put(piece, known[piece])
        return known


_ID_BYTES: dict[int, bytes] = {}


def _packed_id(token: int) -> bytes:
    """One added token's id packed (memoized: there are few added tokens)."""
    out = _ID_BYTES.get(token)
    if out is None:
        out = _ID_BYTES[token] = pack_ids((token,))
    return out
