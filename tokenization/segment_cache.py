"""Segment-cached encoding: the same ids as a plain encode, at a fraction of the cost on repeated text.

HF tokenizers cut the input at added tokens before normalization, pre-tokenization and BPE run, and
process every piece on its own. So when each added token is "plain" (no lstrip/rstrip/single_word),
``encode(a + T + b) == encode(a) + [id(T)] + encode(b)``, and the pieces of a rendered chat (mostly one
per message) can be encoded once and cached. The split reproduces the library's matching exactly:
leftmost-longest over the non-normalized tokens first, then (only under an identity normalizer) over
the normalized ones inside each piece. docs/tokenization.md gives the full argument. Pure: no I/O.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from tokenization.segmenter import AddedToken, Segment, Segmenter

if TYPE_CHECKING:
    from tokenization.prefix_reuse import PrefixReuse

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "TOKEN_BYTES",
    "AddedToken",
    "SegmentCache",
    "SegmentedEncoder",
    "Segmenter",
    "pack_ids",
]

TOKEN_BYTES = 4
"""Bytes per token id in packed form: native unsigned 32-bit ints (``array("I")``)."""
assert array("I").itemsize == TOKEN_BYTES


def pack_ids(ids: Sequence[int]) -> bytes:
    """Token ids as packed native unsigned 32-bit ints (OverflowError/TypeError on a bad id)."""
    return array("I", ids).tobytes()


DEFAULT_MAX_TOKENS = 1 << 20
"""Token ids a `SegmentCache` holds at most, over all entries (about 40 MiB at worst, ~40 B per id)."""


class SegmentCache:
    """An LRU map from piece text to its token ids, bounded in entries and in token ids held, with
    hit/miss counters. A piece longer than the whole token bound is not cached."""

    def __init__(self, max_entries: int = 8192, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        if max_entries < 0 or max_tokens < 0:
            raise ValueError(f"max_entries and max_tokens must be >= 0, got {max_entries}, {max_tokens}")
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self.tokens = 0
        """Token ids held over all entries."""
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
        if self.max_entries == 0 or len(ids) > self.max_tokens:
            return
        old = self._entries.get(piece)
        self.tokens += len(ids) - (len(old) if old is not None else 0)
        self._entries[piece] = ids
        self._entries.move_to_end(piece)
        self._packed.pop(piece, None)
        while len(self._entries) > self.max_entries or self.tokens > self.max_tokens:
            evicted, evicted_ids = self._entries.popitem(last=False)
            self.tokens -= len(evicted_ids)
            self._packed.pop(evicted, None)

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
        self.tokens = 0


EncodeBatch = Callable[[list[str]], list[list[int]]]
"""Encodes pieces that contain no splittable added token, without adding special tokens."""
EncodeShort = Callable[[str], "list[int] | None"]
"""Encodes one text holding no added token without special tokens, or None when it cannot."""
SHORT_TEXT = 256
"""Texts up to this many characters skip the segment cache when the tokenizer encodes their pieces
cheaply (`SegmentedEncoder.encode_short`): the tails prefix reuse leaves, mostly new."""


class SegmentedEncoder:
    """``encode(text)`` through a Segmenter and a SegmentCache; only pieces not seen before are encoded.
    With a `PrefixReuse`, a text first reuses the ids of a recent text's prefix, and only the rest is
    split and looked up."""

    def __init__(
        self,
        segmenter: Segmenter,
        encode_batch: EncodeBatch,
        cache: SegmentCache,
        reuse: PrefixReuse | None = None,
    ) -> None:
        self.segmenter = segmenter
        self.cache = cache
        self.reuse = reuse
        self.encode_short: EncodeShort | None = None
        """Encodes a short text holding no added token more cheaply than a cache miss and put, or
        returns None (tokenization.word_encoder): set by the tokenizer when it has one."""
        self._encode_batch = encode_batch

    def encode(self, text: str) -> list[int]:
        """The ids of ``text`` without special tokens added; equal to the tokenizer's plain encode."""
        if self.reuse is not None and self.segmenter.enabled:
            return list(self.encode_packed(text)[0])
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
        if self.reuse is not None and self.segmenter.enabled:
            return self.reuse.encode_packed(text, self.encode_segments)
        return self.encode_segments(text)

    def encode_segments(self, text: str) -> tuple[tuple[int, ...], bytes]:
        """`encode_packed` without prefix reuse: split, cached pieces, the rest encoded."""
        if not self.segmenter.enabled:
            whole = tuple(self._encode_batch([text])[0]) if text else ()
            return whole, pack_ids(whole)
        # A short text is mostly a new tail, never seen again: not worth cache entries.
        short = self.encode_short if len(text) <= SHORT_TEXT else None
        if short is not None and self.segmenter.holds_none(text):
            found = short(text)  # one piece
            if found is not None:
                return tuple(found), pack_ids(found)
            short = None  # it cannot encode the piece: the cache then
        segments = self.segmenter.split(text)
        if short is not None:
            found = _short_pieces(segments, short)
            if found is not None:
                return tuple(found), pack_ids(found)
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


def _short_pieces(segments: list[Segment], short: EncodeShort) -> list[int] | None:
    """The ids of ``segments`` with each piece encoded by ``short``; None when it cannot encode one."""
    ids: list[int] = []
    for seg in segments:
        if isinstance(seg, int):
            ids.append(seg)
        else:
            found = short(seg)
            if found is None:
                return None
            ids += found
    return ids


_ID_BYTES: dict[int, bytes] = {}


def _packed_id(token: int) -> bytes:
    """One added token's id packed (memoized: there are few added tokens)."""
    out = _ID_BYTES.get(token)
    if out is None:
        out = _ID_BYTES[token] = pack_ids((token,))
    return out
