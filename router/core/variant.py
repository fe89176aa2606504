"""`Variant`: one way of turning a request into block keys (a tokenizer source and a KV-cache layout).

A replica is looked up with its variant's keys. Variants are resolved from the config by
`router.prepare.engine_variants`; the core only holds them. Pure data.
"""

from __future__ import annotations

from typing import NewType

import msgspec

from router.core.kv_layout import ModelSpec

__all__ = ["Variant", "VariantId"]

VariantId = NewType("VariantId", str)
"""A model name, or `model@<digest>` for an engine that overrides the model's tokenizer or layout."""


class Variant(msgspec.Struct, frozen=True):
    """One way of turning a request into block keys: tokenizer source and ModelSpec."""

    id: VariantId
    model: str
    tokenizer: str | None
    chat_template: str | None
    spec: ModelSpec
    tokenizer_revision: str | None = None
    """The revision of the HF repo `tokenizer` names (None: `main`, or `tokenizer` is a path)."""

    @property
    def tokenizer_source(self) -> tuple[str | None, str | None, str | None]:
        """What decides its tokens: tokenizer, revision and chat template (variants alike share one)."""
        return (self.tokenizer, self.tokenizer_revision, self.chat_template)
