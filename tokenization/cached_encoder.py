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
`cached_encoder`), by probes against the plain encode. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenization.base import CacheStats, Message
from tokenization.chat_carry import CarryLink, ChatCarry
from tokenization.prefix_reuse import PromptIds, ReuseEntry, WrappedIds, ids_of
from tokenization.segment_cache import SegmentCache, SegmentedEncoder, pack_ids
from tokenization.tokenizer import Tokenizer

__all__ = ["CachedEncoder", "Wrap"]

Wrap = tuple[list[int], list[int]]
"""The ids a tokenizer's encode puts before and after a text's own when adding special tokens."""

_WrapParts = tuple[tuple[tuple[int, ...], tuple[int, ...]], bytes, bytes]
"""A special-token wrap as a tuple pair, and its prefix and suffix packed."""


class CachedEncoder:
    """A tokenizer's encodings through its caches (see the module docstring): every method gives the
    ids `tokenizer.encode` (or its chat rendering then encode) gives."""

    def __init__(self, tokenizer: Tokenizer, segments: SegmentedEncoder, wrap: Wrap | None) -> None:
        """`segments`: the tokenizer's segmented encoding (its segment cache, and prefix reuse when it
        holds); `wrap`: what the tokenizer adds around a text with special tokens (None: unknown, so
        such texts are encoded plainly)."""
        self.tokenizer = tokenizer
        self.segments = segments
        self.carry = ChatCarry(segments.reuse) if segments.reuse is not None else None
        """Chats' previous turns (tokenization.chat_carry), when the encoder has prefix reuse."""
        self._wrap = wrap
        self._context = tokenizer.special_tokens.template_context()
        self._last_wrap: tuple[Wrap, _WrapParts] | None = None

    @property
    def cache(self) -> SegmentCache:
        """The segment cache (size and hit/miss counters for metrics)."""
        return self.segments.cache

    def special_wrap(self, add_special_tokens: bool) -> Wrap | None:
        """The ids ``encode`` puts before and after the text's own, or None when not known."""
        return self._wrap if add_special_tokens else ([], [])

    def stats(self) -> CacheStats:
        """The prefix-reuse, chat-skeleton and chat-carry counters so far (zeros where one is off)."""
        reuse, carry = self.segments.reuse, self.carry
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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`Tokenizer.encode`'s ids, computed per special-token segment through the segment cache."""
        if not add_special_tokens:
            return self.segments.encode(text)
        if self._wrap is None:
            return self.tokenizer.encode(text, add_special_tokens=True)
        prefix, suffix = self._wrap
        return prefix + self.segments.encode(text) + suffix

    def encode_packed(self, text: str, add_special_tokens: bool = True) -> tuple[tuple[int, ...], bytes]:
        """``encode`` as a tuple, with its ids packed (`pack_ids`), mostly joined from the cache."""
        wrap = self.special_wrap(add_special_tokens)
        if wrap is None:
            ids = tuple(self.encode(text, add_special_tokens))
            return ids, pack_ids(ids)
        ids, packed = self.segments.encode_packed(text)
        prefix, suffix = wrap
        if prefix or suffix:
            return (*prefix, *ids, *suffix), pack_ids(prefix) + packed + pack_ids(suffix)
        return ids, packed

    def encode_linked(
        self, text: str, add_special_tokens: bool = True
    ) -> tuple[PromptIds, bytes, CarryLink | None]:
        """`encode_packed`, with the ids' link to the recent text prefix reuse copied them from (its
        block keys are kept on its entry, per special-token wrap), or None without prefix reuse. With
        prefix reuse the ids are given unjoined (`WrappedIds`, or the entry), joined when read."""
        wrap = self.special_wrap(add_special_tokens)
        reuse = self.segments.reuse
        if wrap is None or reuse is None or not self.segments.segmenter.enabled:
            return (*self.encode_packed(text, add_special_tokens), None)
        entry, prior, copied = reuse.encode_from(text, self.segments.encode_segments, text.encode("utf-8"))
        group, packed_prefix, packed_suffix = self._wrap_parts(wrap)
        own = entry.derived.setdefault(group, {})
        # The wrapped ids start with the prefix, then the copied ids: both equal the prior text's.
        shared, prior_keys = (len(group[0]) + copied, prior.derived.get(group, {})) if prior else (0, {})
        link = CarryLink(shared, prior_keys, own)
        if packed_prefix or packed_suffix:
            packed = b"".join((packed_prefix, entry.packed, packed_suffix))
            return WrappedIds(group[0], entry, group[1]), packed, link
        return entry, entry.packed, link

    def _wrap_parts(self, wrap: Wrap) -> _WrapParts:
        """A special-token wrap as `encode_linked` uses it: as a tuple pair (its derived values' key),
        and its prefix and suffix packed; the last wrap's are kept (a tokenizer has one or two)."""
        kept = self._last_wrap
        if kept is None or kept[0] != wrap:
            prefix, suffix = wrap
            parts = ((tuple(prefix), tuple(suffix)), pack_ids(prefix), pack_ids(suffix))
            kept = self._last_wrap = ((list(prefix), list(suffix)), parts)
        return kept[1]

    def chat_tokens(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """vLLM's chat prompt ids: the rendered text encoded with ``add_special_tokens`` (default False)."""
        add_special = bool(kwargs.pop("add_special_tokens", False))
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt, tools, **kwargs)
        return self.encode(text, add_special_tokens=add_special)

    def chat_packed(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None,
        add_special_tokens: bool,
        template_kwargs: Mapping[str, Any],
    ) -> tuple[tuple[int, ...], bytes, CarryLink | None]:
        """`chat_tokens` as `encode_packed` gives them, with their link to the conversation's previous
        turn when it was carried (`ChatCarry`; only without special tokens around the text).
        ``template_kwargs`` are `apply_chat_template`'s keyword arguments."""
        ids, packed, link = self.chat_prompt(
            messages, add_generation_prompt, tools, add_special_tokens, template_kwargs
        )
        if packed is None:
            assert isinstance(ids, ReuseEntry), "only an entry's packed ids are left to it"
            packed = ids.packed
        return ids_of(ids), packed, link

    def chat_prompt(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None,
        add_special_tokens: bool,
        template_kwargs: Mapping[str, Any],
    ) -> tuple[tuple[int, ...] | ReuseEntry, bytes | None, CarryLink | None]:
        """`chat_packed` with a carried chat's ids as its entry (`ReuseEntry.ids` joins them when read)
        and no packed ids (None: the entry's, joined when read): a caller that keys from the packed
        ids never builds the tuple, nor joins them when it reads only their end
        (`ReuseEntry.packed_from`)."""
        carry, kwargs, templates = self.carry, template_kwargs, self.tokenizer.templates
        if carry is not None and self.special_wrap(add_special_tokens) == ([], []):
            rendered = templates.render_chat_pieces(
                messages, add_generation_prompt, tools, self._context, kwargs
            )
            if rendered is not None:
                pieces, key = rendered
                entry, link = carry.encode_entry(key, pieces, self.segments.encode_segments)
                return entry, None, link
        text = templates.render_chat(messages, add_generation_prompt, tools, self._context, kwargs)
        return (*self.encode_packed(text, add_special_tokens), None)
