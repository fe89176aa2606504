"""The one cache layer over a tokenizer: the same ids as its plain encode, computed from what recent
texts left.

A `Tokenizer` only encodes, decodes and renders. A `CachedEncoder` wraps one and keeps what makes the
next request cheaper, each a strategy of its own that must give the plain encode's ids:

- the segment cache (tokenization.segment_cache): a text is cut at added tokens and each piece's ids
  are kept; a rendered chat's pieces (mostly one per message) are encoded once (~160x warm);
- prefix reuse (tokenization.prefix_reuse): a text sharing a prefix with a recent one copies its ids
  up to the last safe cut and encodes only the rest (8-14x on completions with a new suffix);
- the chat carry (tokenization.chat_carry, with the template's skeleton render,
  tokenization.skeletons): a conversation's new turn is compared with its last render piece by
  piece, so only the new pieces are even UTF-8 encoded, and its link to the last turn lets the
  caller extend that turn's block keys. It pays: with it, the template skeletons and the chat
  decoder off, `Models.prepare` takes 8.1x the instructions on the 8.5k-token long chat with a new
  last turn (3.45 M against 0.42 M per request) and 1.19x on a chat growing by a turn (callgrind,
  2026-12-06, bench/history/BENCHMARKS-2026-12-06-s17-tokenizer.md).

Which strategies a tokenizer can use is decided when its encoder is built (the implementation's
`cached_encoder`), by probes against the plain encode. Callers see two encodes, `encode` (a text)
and `encode_chat` (a conversation), and get an `Encoded`: a plain value whatever cache made it (the
cache types, `ReuseEntry` and the like, stay behind it). The caches stay the encoder's own: their
counters are read through `stats()` (what the router exports as metrics) and `view()` (a read-only
`CacheView`, for tests and benchmarks). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import msgspec

from tokenization.base import CacheStats, Message
from tokenization.chat_carry import CarryLink, ChatCarry
from tokenization.prefix_reuse import PromptIds, ReuseEntry, WrappedIds, count_of, ids_of
from tokenization.safe_cuts import CutFinder
from tokenization.segment_cache import SegmentedEncoder, pack_ids
from tokenization.segmenter import Segment
from tokenization.tokenizer import Tokenizer
from tokenization.word_encoder import WordEncoder

__all__ = ["CacheView", "CachedEncoder", "ChatPrompt", "Encoded", "ReuseRules", "Wrap"]

Wrap = tuple[list[int], list[int]]
"""The ids a tokenizer's encode puts before and after a text's own when adding special tokens."""

_WrapParts = tuple[tuple[tuple[int, ...], tuple[int, ...]], bytes, bytes]
"""A special-token wrap as a tuple pair, and its prefix and suffix packed."""


class Encoded:
    """A prompt's ids as a cached encoder gives them: ``count`` ids, their tuple (`ids`) and packed
    native uint32 bytes (`packed`, `pack_ids`) each made on first read, or read in part
    (`packed_from`, `packed_head`) without joining what a cache holds apart (a carried chat's ids
    are the previous turn's, then its own). ``link``: what the ids share with an earlier prompt whose
    derived values (block keys) the caller keeps in it (`CarryLink`), or None."""

    __slots__ = ("_held", "_packed", "count", "link")

    def __init__(self, ids: PromptIds, packed: bytes | None = None, link: CarryLink | None = None) -> None:
        """``ids``: the ids, or the cache entry holding them; ``packed``: their packed bytes when made."""
        self._held, self._packed, self.link = ids, packed, link
        self.count = count_of(ids)

    @property
    def ids(self) -> tuple[int, ...]:
        """The ids (joined once from a cache entry's)."""
        return ids_of(self._held)

    @property
    def packed(self) -> bytes:
        """All the ids packed (joined once from a cache entry's, or packed once from the ids)."""
        packed = self._packed
        if packed is None:
            held = self._held
            packed = self._packed = held.packed if type(held) is ReuseEntry else pack_ids(ids_of(held))
        return packed

    def packed_from(self, start: int) -> bytes | memoryview:
        """``packed[start:]``: a cache entry's read without joining its parts."""
        held = self._held
        if self._packed is None and type(held) is ReuseEntry:
            return held.packed_from(start)
        return memoryview(self.packed)[start:]

    def packed_head(self, size: int) -> bytes | memoryview:
        """``packed[:size]``: a cache entry's read without joining its parts."""
        held = self._held
        if self._packed is None and type(held) is ReuseEntry:
            return held.packed_head(size)
        return memoryview(self.packed)[:size]


class ChatPrompt(msgspec.Struct, frozen=True):
    """How a conversation becomes a prompt, besides its messages: vLLM's chat request fields."""

    add_generation_prompt: bool = True
    tools: Sequence[Mapping[str, Any]] | None = None
    add_special_tokens: bool = False
    """vLLM's default for chats: the template emits BOS itself."""
    template_kwargs: Mapping[str, Any] = msgspec.field(default_factory=dict)
    """`apply_chat_template`'s other keyword arguments (``continue_final_message``, ``documents``, ...)."""


_CHAT = ChatPrompt()


class CachedEncoder:
    """A tokenizer's encodings through its caches (see the module docstring): `encode` gives the ids
    `tokenizer.encode` gives, `encode_chat` those of its chat rendering then encode."""

    def __init__(self, tokenizer: Tokenizer, segments: SegmentedEncoder, wrap: Wrap | None) -> None:
        """`segments`: the tokenizer's segmented encoding (its segment cache, and prefix reuse when it
        holds); `wrap`: what the tokenizer adds around a text with special tokens (None: unknown, so
        such texts are encoded plainly)."""
        self.tokenizer = tokenizer
        self._segments = segments
        self._carry = ChatCarry(segments.reuse) if segments.reuse is not None else None
        self._wrap = wrap
        self._context = tokenizer.special_tokens.template_context()
        self._last_wrap: tuple[Wrap, _WrapParts] | None = None

    def view(self) -> CacheView:
        """What the segment cache, the word encoder and prefix reuse hold and count, read-only (tests
        and benchmarks observe the caches through it, never through the encoder's own fields)."""
        return CacheView(self._segments)

    def chat_carry(self) -> ChatCarry | None:
        """The chat carry, None without prefix reuse (or after `drop_chat_carry`): its counters, size
        and bounds may be read and its bounds set; only this encoder encodes through it, and what it
        holds is exact whoever reads it, so nothing a reader does changes an encoding's ids."""
        return self._carry

    def drop_chat_carry(self) -> None:
        """Encode chats without the carry from now on (benchmarks measuring what it saves)."""
        self._carry = None

    def drop_prefix_reuse(self) -> None:
        """Encode without prefix reuse from now on, and so without the chat carry, which extends
        through it (benchmarks measuring what the two save)."""
        self._segments.reuse = None
        self._carry = None

    def stats(self) -> CacheStats:
        """The prefix-reuse, chat-skeleton and chat-carry counters so far (zeros where one is off)."""
        reuse, carry = self._segments.reuse, self._carry
        templates = self.tokenizer.templates
        skeletons = [t.skeletons for t in (templates.default, templates.tool_use) if t is not None]
        st = reuse.stats if reuse is not None else None
        return CacheStats(
            reuse_hits=st.hits if st else 0,
            reuse_misses=st.misses if st else 0,
            reused_tokens=st.reused_tokens if st else 0,
            encoded_bytes=st.encoded_bytes if st else 0,
            reuse_held_bytes=reuse.bytes if reuse is not None else 0,
            skeleton_hits=sum(s.hits for s in skeletons),
            skeleton_misses=sum(s.misses for s in skeletons),
            skeleton_refused=sum(s.refused for s in skeletons),
            carry_hits=carry.stats.hits if carry else 0,
            carry_misses=carry.stats.misses if carry else 0,
            carried_tokens=carry.stats.carried_tokens if carry else 0,
            carry_held_bytes=carry.bytes if carry else 0,
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> Encoded:
        """``tokenizer.encode(text, add_special_tokens)``'s ids, through the segment cache, and with
        prefix reuse their link to the recent text they were copied from (its block keys are kept on
        its entry, per special-token wrap)."""
        wrap = self._special_wrap(add_special_tokens)
        reuse = self._segments.reuse
        if wrap is None or reuse is None or not self._segments.segmenter.enabled:
            return Encoded(*self._encode_packed(text, wrap))
        entry, prior, copied = reuse.encode_from(text, self._segments.encode_segments, text.encode("utf-8"))
        group, packed_prefix, packed_suffix = self._wrap_parts(wrap)
        own = entry.derived.setdefault(group, {})
        # The wrapped ids start with the prefix, then the copied ids: both equal the prior text's.
        shared, prior_keys = (len(group[0]) + copied, prior.derived.get(group, {})) if prior else (0, {})
        link = CarryLink(shared, prior_keys, own)
        if packed_prefix or packed_suffix:
            packed = b"".join((packed_prefix, entry.packed, packed_suffix))
            return Encoded(WrappedIds(group[0], entry, group[1]), packed, link)
        return Encoded(entry, entry.packed, link)

    def encode_chat(self, messages: Sequence[Message], prompt: ChatPrompt = _CHAT) -> Encoded:
        """vLLM's chat prompt ids: the conversation rendered with its template, the text encoded with
        ``prompt.add_special_tokens``; with the chat carry (and no special tokens around the text),
        extended from the conversation's previous turn, linked to it, and held unjoined (`Encoded`)."""
        carry, templates = self._carry, self.tokenizer.templates
        agp, tools, kwargs = prompt.add_generation_prompt, prompt.tools, prompt.template_kwargs
        wrap = self._special_wrap(prompt.add_special_tokens)
        if carry is not None and wrap == ([], []):
            rendered = templates.render_chat_pieces(messages, agp, tools, self._context, kwargs)
            if rendered is not None:
                pieces, key = rendered
                entry, link = carry.encode_entry(key, pieces, self._segments.encode_segments)
                return Encoded(entry, None, link)
        text = templates.render_chat(messages, agp, tools, self._context, kwargs)
        return Encoded(*self._encode_packed(text, wrap))

    def _special_wrap(self, add_special_tokens: bool) -> Wrap | None:
        """The ids ``encode`` puts before and after the text's own, or None when not known."""
        return self._wrap if add_special_tokens else ([], [])

    def _encode_packed(self, text: str, wrap: Wrap | None) -> tuple[tuple[int, ...], bytes]:
        """The ids of ``text`` with ``wrap`` around them (None: an unknown wrap, so the tokenizer's
        own encode with special tokens), and their packed bytes, mostly joined from the cache."""
        if wrap is None:
            ids = tuple(self.tokenizer.encode(text, add_special_tokens=True))
            return ids, pack_ids(ids)
        ids, packed = self._segments.encode_packed(text)
        prefix, suffix = wrap
        if prefix or suffix:
            return (*prefix, *ids, *suffix), pack_ids(prefix) + packed + pack_ids(suffix)
        return ids, packed

    def _wrap_parts(self, wrap: Wrap) -> _WrapParts:
        """A special-token wrap as `encode` uses it: as a tuple pair (its derived values' key), and
        its prefix and suffix packed; the last wrap's are kept (a tokenizer has one or two)."""
        kept = self._last_wrap
        if kept is None or kept[0] != wrap:
            prefix, suffix = wrap
            parts = ((tuple(prefix), tuple(suffix)), pack_ids(prefix), pack_ids(suffix))
            kept = self._last_wrap = ((list(prefix), list(suffix)), parts)
        return kept[1]


class ReuseRules(NamedTuple):
    """What a tokenizer's prefix reuse was built with (`PrefixReuse(cuts, byte_lengths)`): facts about
    the tokenizer, holding nothing of what was encoded."""

    cuts: CutFinder
    """Where two texts may both be cut (tokenization.safe_cuts)."""
    byte_lengths: Sequence[int]
    """Each token id's length in text bytes."""


class CacheView:
    """A cached encoder's caches seen from outside, read-only (`CachedEncoder.view`): what the segment
    cache, the word encoder and prefix reuse hold and count, read when asked. Tests and benchmarks
    observe the caches through this and through the encoder's behaviour, so the encoder's fields
    stay its own; the counters the router exports as metrics are `CachedEncoder.stats`, the chat
    carry's are `CachedEncoder.chat_carry`."""

    __slots__ = ("_segments",)

    def __init__(self, segments: SegmentedEncoder) -> None:
        self._segments = segments

    @property
    def splits(self) -> bool:
        """Whether texts are cut at added tokens and their pieces cached (the split's probe held)."""
        return self._segments.segmenter.enabled

    def split(self, text: str) -> list[Segment]:
        """The pieces the segment cache would key ``text`` by: texts, and added tokens' ids."""
        return self._segments.segmenter.split(text)

    @property
    def pieces(self) -> int:
        """Pieces the segment cache holds."""
        return len(self._segments.cache)

    @property
    def piece_tokens(self) -> int:
        """Token ids the segment cache holds, over all its pieces."""
        return self._segments.cache.tokens

    @property
    def max_piece_tokens(self) -> int:
        """The segment cache's bound in token ids."""
        return self._segments.cache.max_tokens

    @property
    def piece_hits(self) -> int:
        """Pieces found in the segment cache so far."""
        return self._segments.cache.hits

    @property
    def piece_misses(self) -> int:
        """Pieces looked up and not found (then encoded) so far."""
        return self._segments.cache.misses

    @property
    def words(self) -> int | None:
        """Words the word encoder holds (tokenization.word_encoder); None without one."""
        words = getattr(self._segments.encode_short, "__self__", None)  # the short encode's owner
        return len(words) if isinstance(words, WordEncoder) else None

    @property
    def reuse_texts(self) -> int | None:
        """Texts prefix reuse holds; None without prefix reuse."""
        reuse = self._segments.reuse
        return None if reuse is None else len(reuse)

    @property
    def reuse_rules(self) -> ReuseRules | None:
        """The rules prefix reuse was built with, for a test building a strategy of its own on the
        same tokenizer; None without prefix reuse."""
        reuse = self._segments.reuse
        return None if reuse is None else ReuseRules(reuse.cuts, reuse.byte_lengths)
