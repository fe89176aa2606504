"""The tokenizer contract shared by the router and the engine stub.

Both sides must turn a request into the same token ids (the router predicts the engine's cache hits from
them), so every implementation follows vLLM 0.33.0: completions encode the prompt with
``add_special_tokens=True``, chat renders the template and encodes the text with
``add_special_tokens=False`` (the template already emits BOS). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

if TYPE_CHECKING:
    from tokenization.chat_carry import CarryLink
    from tokenization.chat_template import TemplateSet
    from tokenization.prefix_reuse import PromptIds, ReuseEntry
    from tokenization.segment_cache import SegmentCache

__all__ = ["CacheStats", "Message", "SpecialTokens", "TokenizationError", "Tokenizer"]

Message = Mapping[str, Any]
"""One conversation message as the chat template sees it (role, content, tool_calls, ...)."""


class TokenizationError(ValueError):
    """A request cannot be turned into tokens: bad content, a template that raised, unsupported parts."""


class SpecialTokens(msgspec.Struct, frozen=True):
    """The named special tokens a chat template may reference, with their ids when known."""

    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def template_context(self) -> dict[str, str]:
        """The variables HF transformers passes to a chat template (only the tokens that are set)."""
        names = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        names |= {"pad_token": self.pad_token, "unk_token": self.unk_token}
        return {k: v for k, v in names.items() if v is not None}


class CacheStats(msgspec.Struct, frozen=True):
    """A tokenizer's reuse counters (tokenization.prefix_reuse, tokenization.skeletons), for metrics."""

    reuse_hits: int = 0
    reuse_misses: int = 0
    reused_tokens: int = 0
    encoded_bytes: int = 0
    reuse_held_bytes: int = 0
    skeleton_hits: int = 0
    skeleton_misses: int = 0
    skeleton_refused: int = 0
    carry_hits: int = 0
    carry_misses: int = 0
    carried_tokens: int = 0
    carry_held_bytes: int = 0


class Tokenizer(Protocol):
    """What the router and the stub need from a tokenizer: text <-> ids and chat rendering."""

    @property
    def templates(self) -> TemplateSet:
        """The chat templates (request preparation reads their content format and developer-role support)."""
        ...

    @property
    def cache(self) -> SegmentCache:
        """The segment cache behind ``encode_cached`` (size, hit/miss counters, ``clear``)."""
        ...

    def cache_stats(self) -> CacheStats:
        """The prefix-reuse and chat-skeleton counters so far."""
        ...

    @property
    def name(self) -> str:
        """A short description for logs and /debug (source path or ``builtin``)."""
        ...

    @property
    def special_tokens(self) -> SpecialTokens:
        """BOS/EOS/PAD/UNK strings and ids."""
        ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Plain, uncached encoding (HF ``Tokenizer.encode``); the reference the fast path must equal."""
        ...

    def encode_cached(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Same ids as ``encode``, computed per special-token segment through the segment cache."""
        ...

    def encode_packed(self, text: str, add_special_tokens: bool = True) -> tuple[tuple[int, ...], bytes]:
        """``encode_cached`` as a tuple, plus the ids packed as native uint32 (``array("I")`` bytes)."""
        ...

    def encode_linked(
        self, text: str, add_special_tokens: bool = True
    ) -> tuple[PromptIds, bytes, CarryLink | None]:
        """`encode_packed`, and the ids' link to the earlier text they were copied from, whose derived
        block keys the caller may extend (tokenization.chat_carry.CarryLink); None when not known.
        The ids may come unjoined (`ids_of` joins them)."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Ids back to text."""
        ...

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation as HF transformers' ``apply_chat_template(tokenize=False)`` does."""
        ...

    def chat_tokens(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """vLLM's chat prompt ids: the rendered text encoded with ``add_special_tokens`` (default False)."""
        ...

    def chat_packed(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None,
        add_special_tokens: bool,
        template_kwargs: Mapping[str, Any],
    ) -> tuple[tuple[int, ...], bytes, CarryLink | None]:
        """`chat_tokens` as a tuple with its packed ids, and its link to the conversation's previous
        turn when the ids were carried from it (tokenization.chat_carry), else None.
        ``template_kwargs`` are `apply_chat_template`'s keyword arguments."""
        ...

    def chat_prompt(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None,
        add_special_tokens: bool,
        template_kwargs: Mapping[str, Any],
    ) -> tuple[tuple[int, ...] | ReuseEntry, bytes | None, CarryLink | None]:
        """`chat_packed`, a carried chat's ids given as their prefix-reuse entry (joined when read) and
        its packed ids as None (the entry's, joined when read)."""
        ...
