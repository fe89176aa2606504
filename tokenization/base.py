"""The values every tokenization module shares: a message, special tokens, errors, cache counters.

A leaf module (it imports nothing of tokenization), so the contract (tokenization.tokenizer), the
chat templates and the caches all import it and none imports another through it. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

__all__ = ["CacheStats", "Message", "SpecialTokens", "TokenizationError"]

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
    """A cached encoder's reuse counters (tokenization.cached_encoder), for metrics."""

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
