"""Recent texts' token ids, reused up to the last safe cut inside the prefix a new text shares with one.

A completions prompt with a new suffix, or a chat rendered again with one more turn, repeats almost all
of an earlier text. The cache keeps recent texts' UTF-8 bytes sorted, so the one sharing the longest
prefix with a new text is a neighbour of its sorted position (one bisect, then memcmp); the ids up to
the last offset where both texts may be cut (`CutFinder`) are copied and only the rest is encoded.
Each entry keeps the byte offset where every token ends (computed when the entry is first reused, so
texts never reused do not pay for it), so the token count at a cut is a bisect, and a cut that does
not fall on a token end is refused. A text extending another shares that text's ends up to the cut
(`TokenEnds`: not copied, so a conversation's turns do not each copy its whole history's ends). An
entry is reused only when its tokens' bytes add up to the text's, which checks the byte-length
table on every text. Bounded LRU in entries and bytes. Pure.

What a text's own encoding reads is found first (the neighbours, the stored entry of an equal
text, which is returned); then what only later texts read is kept: the new entry filed (removing
the one it replaces, refreshing an equal one) and the token ends of an extended text.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import accumulate
from typing import Final

from tokenization.safe_cuts import CutFinder

__all__ = [
    "DEFAULT_MAX_BYTES",
    "PrefixReuse",
    "PromptIds",
    "ReuseEntry",
    "ReuseStats",
    "TokenEnds",
    "WrappedIds",
    "count_of",
    "ids_of",
    "shared_prefix",
]

DEFAULT_MAX_BYTES = 32 << 20
"""Bytes the entries of a `PrefixReuse` may hold (text, ids, packed ids, token ends): ~20 B per token."""

EncodePacked = Callable[[str], tuple[tuple[int, ...], bytes]]
"""Encodes a text without special tokens: its ids and their packed native uint32 bytes."""
Suffix = tuple[int, int, tuple[int, ...], bytes]
"""A text a new text may end with, encoded once: its UTF-8 length, the length of the edge token it
starts with (`CutFinder.token_start`), its ids and their packed bytes."""

_TOKEN_BYTES = 4
_REPLACE_SLACK = 256
"""A stored text that a new one reuses to within this many bytes of its end is replaced by the new one
(the next turn of a conversation, or the same prompt with a new suffix): it could only serve less."""
_ENTRY_BYTES_PER_TOKEN = (
    8 + _TOKEN_BYTES + 3
)  # an int64 end, a packed id, derived keys (+ a tuple slot per tail id)


class ReuseStats:
    """Counters of one `PrefixReuse` (read by the gateway's metrics)."""

    __slots__ = ("encoded_bytes", "hits", "misses", "reused_tokens", "unverified")

    def __init__(self) -> None:
        self.hits = 0
        """Texts that copied the ids of an earlier text's prefix."""
        self.misses = 0
        """Texts encoded whole: no stored text shared a prefix with a safe cut in it."""
        self.reused_tokens = 0
        self.encoded_bytes = 0
        """Bytes of text actually encoded (the new parts of hits, and every miss)."""
        self.unverified = 0
        """Stored texts dropped unused because their tokens' byte lengths did not add up to the text's."""


class TokenEnds:
    """Where each token of a text ends, in bytes: the first ``n`` of ``base`` then ``tail``. A text
    extending another shares its ``base`` (arrays are never changed once made), so extending a long
    text copies only the ends past the shared part's, never the shared part's."""

    __slots__ = ("base", "n", "tail")

    def __init__(self, base: array[int], n: int, tail: array[int]) -> None:
        self.base, self.n, self.tail = base, n, tail

    @staticmethod
    def of(lengths: Iterable[int], start: int = 0) -> TokenEnds:
        """The ends of tokens of byte lengths ``lengths`` from byte ``start`` on (all shareable)."""
        ends = array("q", accumulate(lengths, initial=start))
        del ends[0]  # the `initial` value
        return TokenEnds(ends, len(ends), _NO_ENDS)

    def __len__(self) -> int:
        return self.n + len(self.tail)

    def last(self) -> int:
        """Where the last token ends (0 for none): the text's length when the ends add up."""
        tail, n = self.tail, self.n
        return tail[-1] if tail else self.base[n - 1] if n else 0

    def tokens_before(self, cut: int) -> int:
        """How many tokens end by byte ``cut`` when one ends exactly there, else 0."""
        base, n = self.base, self.n
        if n and cut <= base[n - 1]:
            i = bisect_left(base, cut, 0, n) + 1
            return i if base[i - 1] == cut else 0
        tail = self.tail
        i = bisect_left(tail, cut) + 1
        return n + i if i <= len(tail) and tail[i - 1] == cut else 0

    def extended(self, k: int, cut: int, lengths: Iterable[int]) -> TokenEnds:
        """The ends of a text whose first ``k`` tokens are these ones' (ending at byte ``cut``),
        followed by tokens of byte lengths ``lengths``."""
        n, new = self.n, array("q", accumulate(lengths, initial=cut))
        del new[0]  # the `initial` value
        if k <= n:
            return TokenEnds(self.base, k, new)
        own = self.tail[: k - n]
        if len(own) > n:  # the part not shared is the longer: one flat array from now on (amortised)
            flat = self.base[:n]
            flat.extend(own)
            return TokenEnds(flat, k, new)
        own.extend(new)
        return TokenEnds(self.base, n, own)

    def flat(self) -> array[int]:
        """Every end, in one array (a copy)."""
        out = self.base[: self.n]
        out.extend(self.tail)
        return out


_NO_ENDS: Final = array("q")


class ReuseEntry:
    """One text's UTF-8 bytes, ids, packed ids and (once known) the byte offset where each token ends.

    The first ``copied`` ids were copied from another text and are held only packed; the ids are
    built on the first read of `ids`: a caller that needs only the packed ids and their `count` (the
    router keys a prompt from its packed ids) never builds the tuple, and a turn that extends a long
    text allocates no tuple of its ids."""

    __slots__ = ("_head", "_ids", "_packed", "copied", "count", "data", "derived", "ends", "size", "tail")

    def __init__(
        self,
        data: bytes,
        tail: tuple[int, ...],
        packed: bytes,
        ends: TokenEnds | None,
        copied: int = 0,
        head: memoryview | None = None,
    ) -> None:
        """``tail``: the ids encoded for this text; ``packed``: all its ids (the copied ones first), or
        with ``head`` (the copied ids packed: a view of another entry's) the tail's only, the two
        joined when `packed` is first read."""
        self.data, self.tail, self.copied = data, tail, copied
        self._packed, self._head = packed, head
        self._ids: tuple[int, ...] | None = None if copied else tail
        self.count = copied + len(tail)
        self.ends = ends
        """Where each token ends, in bytes; None until the entry is first reused (a text extending
        another has them at once, from that text's)."""
        self.derived: dict[object, dict[tuple[int, int], tuple[int, ...]]] = {}
        """What callers derived from the ids, by their own key (the completions path: block keys per
        special-token wrap, then per chain root and block size; tokenization.templated)."""
        self.size = len(data) + _ENTRY_BYTES_PER_TOKEN * self.count + 8 * len(tail)

    @property
    def packed(self) -> bytes:
        """All the ids, packed (joined once from the copied head's view and the tail's)."""
        head = self._head
        if head is not None:
            self._packed = b"".join((head, self._packed))
            self._head = None
        return self._packed

    def joined(self) -> bytes:
        """`packed`, as a method (for a caller that takes a function giving the bytes)."""
        return self.packed

    def packed_head(self, size: int) -> memoryview:
        """``packed[:size]`` as a view, without joining the packed ids (past the copied head, only
        what is read of the tail's is copied after it)."""
        head = self._head
        if head is None:
            return memoryview(self._packed)[:size]
        if size <= len(head):
            return head[:size]
        return memoryview(b"".join((head, memoryview(self._packed)[: size - len(head)])))

    def packed_from(self, start: int) -> bytes | memoryview:
        """``packed[start:]``, without joining the packed ids (only the part of the head after
        ``start`` is copied, with the tail's)."""
        head = self._head
        if head is None:
            return memoryview(self._packed)[start:]
        if start >= len(head):
            return memoryview(self._packed)[start - len(head) :]
        return b"".join((head[start:], self._packed))

    @property
    def ids(self) -> tuple[int, ...]:
        """The text's ids (unpacked once)."""
        ids = self._ids
        if ids is None:
            ids = self._ids = tuple(memoryview(self.packed).cast("I"))
        return ids

    def prefix(self, n: int) -> tuple[int, ...]:
        """``ids[:n]``, without building the ids."""
        if self._ids is not None:
            return self._ids[:n]
        return tuple(self.packed_head(n * _TOKEN_BYTES).cast("I"))

    def iter_ids(self) -> Iterator[int]:
        """The ids in order, without building them."""
        return iter(self._ids) if self._ids is not None else iter(memoryview(self.packed).cast("I"))


class WrappedIds:
    """An entry's ids between the ids a special-token wrap adds (``prefix``, ``suffix``: a BOS), joined
    only when read: the router keys a completions prompt from its packed ids and `count`."""

    __slots__ = ("_ids", "count", "entry", "prefix", "suffix")

    def __init__(self, prefix: tuple[int, ...], entry: ReuseEntry, suffix: tuple[int, ...]) -> None:
        self.prefix, self.entry, self.suffix = prefix, entry, suffix
        self._ids: tuple[int, ...] | None = None
        self.count = len(prefix) + entry.count + len(suffix)

    @property
    def ids(self) -> tuple[int, ...]:
        """``prefix + entry.ids + suffix``, joined once (here, not on the entry: it would hold them twice)."""
        ids = self._ids
        if ids is None:
            ids = self._ids = (*self.prefix, *self.entry.iter_ids(), *self.suffix)
        return ids


PromptIds = tuple[int, ...] | ReuseEntry | WrappedIds
"""A prompt's ids, or the prefix-reuse entry holding them (joined only when read)."""


def ids_of(prompt: PromptIds) -> tuple[int, ...]:
    """The prompt's ids (an entry's joined)."""
    return prompt if isinstance(prompt, tuple) else prompt.ids


def count_of(prompt: PromptIds) -> int:
    """How many ids the prompt has, without joining an entry's."""
    return len(prompt) if isinstance(prompt, tuple) else prompt.count


class PrefixReuse:
    """``encode_packed(text)`` equal to ``encode(text)`` in full, encoding only what no recent text shared."""

    def __init__(
        self,
        cuts: CutFinder,
        byte_lengths: Sequence[int],
        max_entries: int = 512,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError(f"max_entries and max_bytes must be >= 0, got {max_entries}, {max_bytes}")
        self.cuts = cuts
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.bytes = 0
        """Bytes held over all entries (`DEFAULT_MAX_BYTES` explains what is counted)."""
        self.stats = ReuseStats()
        self.byte_lengths = byte_lengths
        """Each token id's length in text bytes (`token_byte_lengths`)."""
        self._entries: OrderedDict[int, ReuseEntry] = OrderedDict()  # by id(entry.data)
        self._sorted: list[bytes] = []

    def __len__(self) -> int:
        return len(self._entries)

    def encode_packed(
        self, text: str, encode: EncodePacked, data: bytes | None = None
    ) -> tuple[tuple[int, ...], bytes]:
        """The ids of ``text`` (no special tokens added) and their packed bytes; ``encode`` runs on the
        part after the reused prefix only (on the whole text when nothing is reused). ``data``: the
        text's UTF-8, when the caller has it."""
        entry = self.encode_entry(text, encode, data if data is not None else text.encode("utf-8"))
        return entry.ids, entry.packed

    def encode_entry(self, text: str, encode: EncodePacked, data: bytes) -> ReuseEntry:
        """`encode_packed` as the entry it stores (shared with the caller: token ends made later by
        either are made once)."""
        return self.encode_from(text, encode, data)[0]

    def encode_from(
        self, text: str, encode: EncodePacked, data: bytes
    ) -> tuple[ReuseEntry, ReuseEntry | None, int]:
        """`encode_entry`, with the stored text its ids were copied from (None when none was) and how
        many leading ids were copied: those equal that text's."""
        at = bisect_left(self._sorted, data)
        prior, cut = self._best_cut(data, at)
        prior_ends = self.ends(prior) if prior is not None else None
        if prior is None or prior_ends is None:
            if prior is not None:  # its bytes did not add up: never reuse it
                self.stats.unverified += 1
                self._remove(prior)
                at = bisect_left(self._sorted, data)
            self.stats.misses += 1
            self.stats.encoded_bytes += len(data)
            ids, packed = encode(text)
            return self._keep(at, ReuseEntry(data, ids, packed, None)), None, 0
        entry, copied = self.extend(prior, prior_ends, data, cut, encode)
        replaced = prior if len(prior.data) - cut <= _REPLACE_SLACK and prior.data != data else None
        return self._keep(at, entry, replaced), prior, copied

    def clear(self) -> None:
        """Forget every entry (the counters are kept)."""
        self._entries.clear()
        self._sorted.clear()
        self.bytes = 0

    def _best_cut(self, data: bytes, at: int) -> tuple[ReuseEntry | None, int]:
        """The neighbour of sorted position ``at`` with the latest safe cut shared with ``data``."""
        best, best_cut = None, 0
        for other in self._sorted[max(0, at - 1) : at + 1]:
            entry = self._entries[id(other)]
            shared = shared_prefix(data, other)
            if shared <= best_cut:
                continue
            cut = self.cuts.last_cut(other, data, shared)
            if cut > best_cut:
                best, best_cut = entry, cut
        return best, best_cut

    def ends(self, entry: ReuseEntry) -> TokenEnds | None:
        """The entry's token ends (made on first use), or None when they do not add up to its text."""
        if entry.ends is None:
            ends = TokenEnds.of(map(self.byte_lengths.__getitem__, entry.iter_ids()))
            if ends.last() != len(entry.data):
                return None
            entry.ends = ends
        return entry.ends

    def extend(
        self,
        prior: ReuseEntry,
        prior_ends: TokenEnds,
        data: bytes,
        cut: int,
        encode: EncodePacked,
        suffix: Suffix | None = None,
        lazy: bool = False,
        n: int | None = None,
    ) -> tuple[ReuseEntry, int]:
        """``data``'s entry: ``prior``'s ids up to ``cut`` (a safe cut of both texts,
        `CutFinder.last_cut`) and the encoding of the rest, with token ends when made; and how many ids
        were copied. ``prior_ends`` are `ends` (prior). ``suffix``: what ``data`` ends with, whose ids
        are taken as they are when the rest may be cut before it (only the part between is encoded).
        ``lazy``: the copied ids stay a view of the prior's until the packed ids are read (never for
        an entry stored here: it would hold another's packed ids). ``n``: ``prior_ends.tokens_before(cut)``,
        when the caller has it."""
        n = prior_ends.tokens_before(cut) if n is None else n
        cut = cut if n else 0  # the cut is no token end of the prior text: reuse nothing (never expected)
        split = len(data) - suffix[0] if suffix is not None else 0
        if suffix is not None and split > cut and self.cuts.token_start(data, split, suffix[1], cut):
            tail_ids, tail_packed = encode(data[cut:split].decode("utf-8"))
            tail_ids += suffix[2]
            tail_packed += suffix[3]
        else:
            tail_ids, tail_packed = encode(data[cut:].decode("utf-8"))
        # A chat turn's keys read only its last blocks (`ReuseEntry.packed_from`): lazily, its ~35 KB
        # of packed ids are not copied per turn.
        size, kept = n * _TOKEN_BYTES, prior._head
        head: memoryview | None
        if kept is None:
            head = memoryview(prior._packed)[:size]  # (flat: `packed` without the property's call)
        else:
            head = kept[:size] if size <= len(kept) else memoryview(prior.packed)[:size]
        if not lazy:
            tail_packed, head = b"".join((head, tail_packed)), None  # one copy, not two
        self.stats.hits += n > 0
        self.stats.misses += n == 0
        self.stats.reused_tokens += n
        self.stats.encoded_bytes += len(data) - cut
        entry = ReuseEntry(data=data, tail=tail_ids, packed=tail_packed, ends=None, copied=n, head=head)
        if len(tail_ids) > n:  # mostly new text: its ends are made if it is ever reused (`ends`)
            return entry, n
        self._extend_ends(entry, prior_ends, cut)  # (only a later text reads them)
        return entry, n

    def _extend_ends(self, entry: ReuseEntry, prior_ends: TokenEnds, cut: int) -> None:
        """``entry``'s token ends from those of the text its ids up to byte ``cut`` were copied from
        (``prior_ends``, shared) and its tail's; left None when they do not add up to its text."""
        ends = prior_ends.extended(entry.copied, cut, map(self.byte_lengths.__getitem__, entry.tail))
        tail = ends.tail
        last = tail[-1] if tail else ends.last()  # (the common case without a call)
        entry.ends = ends if last == len(entry.data) else None

    def _keep(self, at: int, entry: ReuseEntry, replaced: ReuseEntry | None = None) -> ReuseEntry:
        """The entry kept for ``entry``'s text (sorted position ``at``): the stored one when its text is
        stored already, else ``entry``; filed (`_file`)."""
        data, stored = entry.data, self._sorted
        if at < len(stored) and stored[at] == data:  # (``replaced``'s text differs: not this one)
            entry = self._entries[id(stored[at])]
        self._file(entry, replaced)
        return entry

    def _file(self, entry: ReuseEntry, replaced: ReuseEntry | None) -> None:
        """Remove ``replaced`` (if still stored), then keep ``entry`` at its sorted position (only
        refreshed when its text is stored already; not kept when it is too big), evicting beyond the
        bounds."""
        if replaced is not None and self._entries.get(id(replaced.data)) is replaced:
            self._remove(replaced)
        data = entry.data
        at = bisect_left(self._sorted, data)
        if at < len(self._sorted) and self._sorted[at] == data:
            self._entries.move_to_end(id(self._sorted[at]))
            return
        if self.max_entries == 0 or entry.size > self.max_bytes or not entry.count:
            return
        self._sorted.insert(at, data)
        self._entries[id(data)] = entry
        self.bytes += entry.size
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            self._evict()

    def _evict(self) -> None:
        self._remove(next(iter(self._entries.values())))

    def _remove(self, entry: ReuseEntry) -> None:
        del self._entries[id(entry.data)]
        at = bisect_left(self._sorted, entry.data)
        assert self._sorted[at] is entry.data, "an entry's bytes are stored once"
        del self._sorted[at]
        self.bytes -= entry.size


def shared_prefix(a: bytes, b: bytes | memoryview) -> int:
    """The length of the longest common prefix of ``a`` and ``b``: memcmps on views (no copies),
    galloping back from the end (a new suffix on an old text differs near its end), then a binary
    search in the last gap, down to `_XOR_BYTES`, whose first differing byte one XOR finds."""
    limit = min(len(a), len(b))
    view = memoryview(b)
    if a.startswith(view[:limit]):
        return limit
    lo, hi, step = 0, limit, 1  # a prefix of lo bytes is shared, one of hi bytes is not
    while hi - lo > _XOR_BYTES and hi - step > lo:
        if a.startswith(view[: hi - step]):
            lo = hi - step
            break
        hi, step = hi - step, step * 2
    while hi - lo > _XOR_BYTES:
        mid = (lo + hi) // 2
        if a.startswith(view[:mid]):
            lo = mid
        else:
            hi = mid
    # a[lo:hi] and b[lo:hi] differ: as big-endian ints, their XOR's top set byte is the first difference.
    x = int.from_bytes(a[lo:hi], "big") ^ int.from_bytes(view[lo:hi], "big")
    return hi - (x.bit_length() + 7) // 8


_XOR_BYTES: Final = 256
"""A gap of at most this many bytes is searched with one XOR of two ints, not memcmps."""
