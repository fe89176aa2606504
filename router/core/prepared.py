"""`Prepared`: what routing needs of one request, computed once by `router.prepare.served_models` and never
changed.

Pure data (no tokenizer, no I/O): the routing core and the fleet's state import it without reaching
the tokenization. The stage timings routing adds (lookup, score) travel beside it
(`router.core.routing.Routed`).
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from tokenization.openai_request import Endpoint

__all__ = ["Prepared", "VariantKeys"]


class VariantKeys(msgspec.Struct, frozen=True):
    """A request's prompt length and block keys under one variant."""

    num_tokens: int
    keys: list[int]


class Prepared(msgspec.Struct, frozen=True, kw_only=True):
    """What routing needs of one request, computed once (see the router contract); immutable."""

    model: str
    endpoint: Endpoint
    stream: bool
    prompt_tokens: int
    keys: list[int]
    skip_cache: bool
    report_mode: str
    session_key: str
    timings: Mapping[str, float]
    """Seconds per preparation stage (`tokenize`, `hash`), read-only."""
    variant: str = ""
    variants: Mapping[str, VariantKeys] = {}
    lora_name: str | None = None
    cache_salt: str | None = None
    unread: bool = False
    """The prompt was not read (a policy that reads none): no tokens, no keys, nothing predicted."""
    body_session: str | None = None
    """The session key the body's ids name (router.core.policy.session_key `body_key_of`), read from
    the preparation's one decode when the gateway's policy is `session` with `session_body`; else None."""
    tokenizer: str = "local"
    """Whose tokens: `local` (the router's tokenizer), `remote` (an engine's /tokenize), `builtin` (the
    model's repo-named tokenizer could not be had and no engine answered: no hit can be predicted)."""

    def keys_for(self, variant: str) -> VariantKeys | None:
        """The keys under `variant` (None if it was not computed: routing treats that as no hit)."""
        if variant == self.variant:
            return VariantKeys(self.prompt_tokens, self.keys)
        return self.variants.get(variant)
