"""One cached encoder per tokenizer object for the tests that check a tokenizer's caches across calls
(its segment cache, prefix reuse, chat carry), as the router keeps one per loaded tokenizer."""

from __future__ import annotations

from tokenization import CachedEncoder, Tokenizer
from tokenization.loading import cached_encoder

_ENCODERS: dict[int, tuple[Tokenizer, CachedEncoder]] = {}


def encoder_of(tokenizer: Tokenizer) -> CachedEncoder:
    """The cached encoder made for `tokenizer` (the same object on every call)."""
    kept = _ENCODERS.get(id(tokenizer))
    if kept is None or kept[0] is not tokenizer:
        kept = _ENCODERS[id(tokenizer)] = (tokenizer, cached_encoder(tokenizer))
    return kept[1]
