"""What every Tokenizer implementation shares: special tokens, the chat template and the segment cache.

Subclasses set `_special`, `_context` (the template's special-token variables), `templates` and
`segments`, and implement `encode`, `encode_cached`, `decode` and `name`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenization.base import CacheStats, Message, SpecialTokens
from tokenization.chat_carry import CarryLink, ChatCarry
from tokenization.chat_template import TemplateSet
from tokenization.prefix_reuse import PromptIds, ReuseEntry, WrappedIds, ids_of
from tokenization.segment_cache import SegmentCache, SegmentedEncoder, pack_ids

__all__ = ["TemplatedTokenizer"]

_WrapParts = tuple[tuple[tuple[int, ...], tuple[int, ...]], bytes, bytes]
"""A special-token wrap as a tuple pair, and its prefix and suffix packed."""


class TemplatedTokenizer:
    """Chat rendering and chat tokenization on top of a subclass's `encode_cached`."""

    _special: SpecialTokens
    _context: dict[str, str]
    templates: TemplateSet
    segments: SegmentedEncoder
    carry: ChatCarry | None = None
    """Chats' previous turns (tokenization.chat_carry), when the tokenizer has prefix reuse."""
    _last_wrap: tuple[tuple[list[int], list[int]], _WrapParts] | None = None

    @property
    def special_tokens(self) -> SpecialTokens:
        return self._special

    @property
    def cache(self) -> SegmentCache:
        """The segment cache (size and hit/miss counters for metrics)."""
        return self.segments.cache

    def cache_stats(self) -> CacheStats:
        """The prefix-reuse and chat-skeleton counters so far (zeros where a cache is off)."""
        reuse = self.segments.reuse
        templates = [t for t in (self.templates.default, self.templates.tool_use) if t is not None]
        skeletons = [t.skeletons for t in templates]
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
            carry_hits=self.carry.stats.hits if self.carry else 0,
            carry_misses=self.carry.stats.misses if self.carry else 0,
            carried_tokens=self.carry.stats.carried_tokens if self.carry else 0,
            carry_held_bytes=self.carry.bytes if self.carry else 0,
        )

    def encode_cached(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError  # pragma: no cover

    def special_wrap(self, add_special_tokens: bool) -> tuple[list[int], list[int]] | None:
        """The ids ``encode`` puts before and after the text's own, or None when not known."""
        raise NotImplementedError  # pragma: no cover

    def encode_packed(self, text: str, add_special_tokens: bool = True) -> tuple[tuple[int, ...], bytes]:
        """``encode_cached`` as a tuple, with its ids packed (`pack_ids`), mostly joined from the cache."""
        wrap = self.special_wrap(add_special_tokens)
        if wrap is None:
            ids = tuple(self.encode_cached(text, add_special_tokens))
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

    def _wrap_parts(self, wrap: tuple[list[int], list[int]]) -> _WrapParts:
        """A special-token wrap as `encode_linked` uses it: as a tuple pair (its derived values' key),
        and its prefix and suffix packed; the last wrap's are kept (a tokenizer has one or two)."""
        kept = self._last_wrap
        if kept is None or kept[0] != wrap:
            prefix, suffix = wrap
            parts = ((tuple(prefix), tuple(suffix)), pack_ids(prefix), pack_ids(suffix))
            kept = self._last_wrap = ((list(prefix), list(suffix)), parts)
        return kept[1]

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        return self.templates.render_chat(messages, add_generation_prompt, tools, self._context, kwargs)

    def chat_packed(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None,
        add_special_tokens: bool,
        template_kwargs: Mapping[str, Any],
    ) -> tuple[tuple[int, ...], bytes, CarryLink | None]:
        """`chat_tokens` as `encode_packed` gives them, with their link to the conversation's previous
        turn when it was carried (`ChatCarry`; only without special tokens around the text)."""
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
        carry, kwargs = self.carry, template_kwargs
        if carry is not None and self.special_wrap(add_special_tokens) == ([], []):
            rendered = self.templates.render_chat_pieces(
                messages, add_generation_prompt, tools, self._context, kwargs
            )
            if rendered is not None:
                pieces, key = rendered
                entry, link = carry.encode_entry(key, pieces, self.segments.encode_segments)
                return entry, None, link
        text = self.apply_chat_template(messages, add_generation_prompt, tools, **kwargs)
        return (*self.encode_packed(text, add_special_tokens), None)

    def chat_tokens(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        add_special = bool(kwargs.pop("add_special_tokens", False))
        text = self.apply_chat_template(messages, add_generation_prompt, tools, **kwargs)
        return self.encode_cached(text, add_special_tokens=add_special)
