"""A conversation's last render carried to its next turn: pieces compared, ids extended, keys kept.

A new turn of a chat re-sends the whole conversation. Its skeleton render (tokenization.skeletons) is a
list of pieces: literal fragments and message texts. The last render of the same conversation (found
by `Skeletons.carry_key`: the template, the other render inputs and the first two messages) is
compared with it piece by piece (string equality, no search over the whole text); only the pieces
from the first different one on are UTF-8 encoded, and the new text's bytes are the old bytes up to
that piece plus theirs. From there it is `PrefixReuse`'s argument, on the same cut rules: the ids up
to the last safe cut inside the shared prefix are the old text's, the rest is encoded. Each turn also
keeps what callers derived from its ids (block keys per chain root and block size, `CarryLink`), so
the next turn's keys extend the old chain from the last shared full block. Bounded LRU in turns and
bytes, with hit/miss counters. Pure.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import accumulate

import msgspec

from tokenization.prefix_reuse import EncodePacked, PrefixReuse, ReuseEntry, Suffix, shared_prefix

__all__ = ["DEFAULT_MAX_BYTES", "LONG_TAIL", "CarryLink", "CarryStats", "ChatCarry"]

DEFAULT_MAX_BYTES = 32 << 20
"""Bytes the turns of a `ChatCarry` may hold (see `_Turn.size` for what is counted)."""

Derived = dict[tuple[int, int], tuple[int, ...]]
"""Values a caller computed from a turn's ids, by (chain root, block size): its block keys."""

LONG_TAIL = 1024
"""New bytes (past the prefix shared with the conversation's last turn) beyond which the text goes
through prefix reuse's search over all recent texts instead."""
_ID_BYTES = 4  # a packed token id
_PIECE_BYTES = 2  # a carried piece's str, per byte of its UTF-8 (compact strings: 1, 2 or 4 per char)
_DERIVED_BYTES_PER_TOKEN = 8  # room for keys: ~40 B per key at 16 tokens per block, two groups
_MAX_SUFFIXES = 64  # a template has a few closing fragments; more means some other text: start over
_UNKNOWN: Suffix = (-1, 0, (), b"")


class CarryLink(msgspec.Struct):
    """What a chat's ids share with its conversation's previous turn: ``shared_tokens`` leading ids
    equal to that turn's, whose derived values are ``prior``; ``own`` is this turn's, for the caller
    to fill (the next turn reads it as its ``prior``)."""

    shared_tokens: int
    prior: Derived
    own: Derived


class CarryStats:
    """Counters of one `ChatCarry` (read by the gateway's metrics)."""

    __slots__ = ("carried_tokens", "hits", "misses")

    def __init__(self) -> None:
        self.hits = 0
        """Chats that extended their conversation's previous turn."""
        self.misses = 0
        """Chats with no previous turn to extend (encoded by the caller's full path)."""
        self.carried_tokens = 0


class _Turn:
    __slots__ = ("derived", "entry", "pieces", "size", "starts")

    def __init__(self, pieces: list[str], starts: list[int], entry: ReuseEntry, derived: Derived) -> None:
        self.pieces, self.starts, self.entry, self.derived = pieces, starts, entry, derived
        """``starts[i]``: the byte offset of piece i in ``entry.data``; ``starts[-1]`` is its length."""
        size = entry.size + _PIECE_BYTES * len(entry.data) + 8 * len(starts)
        self.size = size + _DERIVED_BYTES_PER_TOKEN * entry.count


class ChatCarry:
    """``encode(key, pieces)``: the ids of ``"".join(pieces)`` (no special tokens), extended from the
    last turn stored under ``key`` when there is one."""

    def __init__(
        self, reuse: PrefixReuse, max_entries: int = 512, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError(f"max_entries and max_bytes must be >= 0, got {max_entries}, {max_bytes}")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.long_tail = LONG_TAIL
        self.bytes = 0
        self.stats = CarryStats()
        self._reuse = reuse
        self._turns: OrderedDict[bytes, _Turn] = OrderedDict()
        self._suffixes: dict[str, Suffix | None] = {}

    def __len__(self) -> int:
        return len(self._turns)

    def encode_entry(
        self, key: bytes, pieces: list[str], encode: EncodePacked
    ) -> tuple[ReuseEntry, CarryLink]:
        """The entry of the joined ``pieces`` (ids and packed ids; the ids joined only when read) and
        its link to the previous turn. ``encode`` encodes text without prefix reuse: the part after a
        carried prefix, or on a miss the part after what `PrefixReuse` finds (the whole text goes
        through it)."""
        prior = self._turns.get(key)
        carried = self._extend(prior, pieces, encode) if prior is not None else None
        if prior is not None and carried is not None:
            turn, shared = carried
            self.stats.hits += shared > 0
            self.stats.misses += shared == 0
            self.stats.carried_tokens += shared
            link = CarryLink(shared, prior.derived, turn.derived)
        else:
            self.stats.misses += 1
            text = "".join(pieces)
            data = text.encode("utf-8")
            entry = self._reuse.encode_entry(text, encode, data)
            starts = [0, *accumulate(len(p) if p.isascii() else len(p.encode("utf-8")) for p in pieces)]
            turn = _Turn(pieces, starts, entry, {})
            link = CarryLink(0, {}, turn.derived)
        self._keep(key, turn)
        return turn.entry, link

    def clear(self) -> None:
        """Forget every turn (the counters are kept)."""
        self._turns.clear()
        self.bytes = 0

    def _extend(self, prior: _Turn, pieces: list[str], encode: EncodePacked) -> tuple[_Turn, int] | None:
        """The new turn made from ``prior`` and how many ids it copied; None when nothing can be reused."""
        old = prior.pieces
        i = _shared_pieces(old, pieces)
        if i == len(old) == len(pieces):
            return prior, prior.entry.count  # the same text
        start = prior.starts[i]
        rest = [p.encode("utf-8") for p in pieces[i:]]
        new_rest = b"".join(rest)
        data = prior.entry.data
        limit = start + shared_prefix(new_rest, memoryview(data)[start:])
        new_data = b"".join((memoryview(data)[:start], new_rest))  # one copy: a slice would be a second
        starts = [*prior.starts[:i], *accumulate(map(len, rest), initial=start)]
        if len(new_data) - limit > self.long_tail:
            # Mostly new text: an older text than this conversation's last turn may share more (a branch,
            # a regenerated turn), so prefix reuse searches them all, and keeps this one for later. The
            # ids both turns start with (compared packed) are what the keys carry.
            entry = self._reuse.encode_entry("".join(pieces), encode, new_data)
            same = shared_prefix(entry.packed, memoryview(prior.entry.packed)) // _ID_BYTES
            return _Turn(pieces, starts, entry, {}), same
        cut = self._reuse.cuts.last_cut(data, new_data, limit)
        ends = self._reuse.ends(prior.entry) if cut else None
        if ends is None:
            return None
        n = ends.tokens_before(cut)
        if not n:
            return None
        last = pieces[-1]
        suffix = self._suffix(last, encode) if i < len(pieces) - 1 and last == old[-1] else None
        entry, copied = self._reuse.extend(prior.entry, ends, new_data, cut, encode, suffix, lazy=True, n=n)
        return _Turn(pieces, starts, entry, {}), copied

    def _suffix(self, fragment: str, encode: EncodePacked) -> Suffix | None:
        """``fragment`` as a `Suffix` (the template's closing text, the same every turn: its ids are
        encoded once, not with each turn's new text), or None when it starts with no edge token."""
        kept = self._suffixes.get(fragment, _UNKNOWN)
        if kept is _UNKNOWN:
            data = fragment.encode("utf-8")
            n = self._reuse.cuts.edge_length(data)
            kept = (len(data), n, *encode(fragment)) if n else None
            if len(self._suffixes) >= _MAX_SUFFIXES:
                self._suffixes.clear()
            self._suffixes[fragment] = kept
        return kept

    def _keep(self, key: bytes, turn: _Turn) -> None:
        """``turn`` as ``key``'s last turn: refreshed in the LRU when it is that already, else stored
        (the key's bytes count too: it holds two messages)."""
        old = self._turns.pop(key, None)
        if old is turn:
            self._turns[key] = turn  # to the end, as move_to_end would
            return
        key_size = len(key)  # once: an old turn under this key has it too
        if old is not None:
            self.bytes -= old.size + key_size
        size = turn.size + key_size
        if self.max_entries == 0 or size > self.max_bytes:
            return
        self._turns[key] = turn
        self.bytes += size
        while len(self._turns) > self.max_entries or self.bytes > self.max_bytes:
            evicted_key, evicted = self._turns.popitem(last=False)
            self.bytes -= evicted.size + len(evicted_key)


def _shared_pieces(old: list[str], new: list[str]) -> int:
    """How many leading pieces ``old`` and ``new`` share: list slices compared in C (a reused message's
    text is the same object, so each equal piece costs a pointer compare), all but the last two first
    (a new turn changes the end), then a binary search."""
    n = min(len(old), len(new))
    lo = max(0, n - 2)
    if old[:lo] != new[:lo]:
        hi, lo = lo, 0  # lo pieces are shared, hi are not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if old[:mid] == new[:mid]:
                lo = mid
            else:
                hi = mid
        return lo
    while lo < n and old[lo] == new[lo]:
        lo += 1
    return lo
