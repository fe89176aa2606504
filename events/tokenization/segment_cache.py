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
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import TypeAlias

import msgspec

__all__ = ["AddedToken", "SegmentCache", "SegmentedEncoder", "Segmenter"]

Segment = str | int
"""A text piece to encode, or the id of an added token matched in place."""


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


def _compile(tokens: Sequence[AddedToken]) -> re.Pattern[str] | None:
    words = [t.content for t in tokens if t.content]
    return re.compile(_trie_pattern(words)) if words else None


def _split(pattern: re.Pattern[str] | None, ids: dict[str, int], text: str) -> list[Segment]:
    if pattern is None:
        return [text] if text else []
    out: list[Segment] = []
    start = 0
    for match in pattern.finditer(text):
        if match.start() > start:
            out.append(text[start : match.start()])
        out.append(ids[match.group()])
        start = match.end()
    if start < len(text):
        out.append(text[start:])
    return out


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
        for seg in _split(self._raw, self._ids, text):
            if isinstance(seg, str):
                out.extend(_split(self._normalized, self._ids, seg))
            else:
                out.append(seg)
        return out


class SegmentCache:
    """A bounded LRU map from piece text to its token ids, with hit/miss counters."""

    def __init__(self, max_entries: int = 8192) -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, got {max_entries}")
        self.max_entries = max_entries
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[str, tuple[int, ...]] = OrderedDict()

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
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        """Forget every entry (the counters are kept)."""
        self._entries.clear()


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
