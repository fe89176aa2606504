"""What a KV-cache group needs by its kind: the rules the config checks a group table against.

A sliding-window group needs its window, a chunked-local-attention group its chunk size, and vLLM
has no EAGLE block drop for chunked local attention. These rules, with the vLLM spellings of the two
kinds that have them, are defined here, at the config's level, so that the config checks a group
when it is loaded (router.settings.config) and the core's group kinds (router.core.group_kinds,
above it) take the same rules as theirs: one definition, and no import up from the config into the
core. Every other kind needs nothing (`ANY_KIND`). Pure.
"""

from __future__ import annotations

from typing import Final, NamedTuple

__all__ = ["ANY_KIND", "CHUNKED_LOCAL", "SLIDING_WINDOW", "GroupRule", "Required", "group_rule"]


class Required(NamedTuple):
    """The parameter a group of a kind needs."""

    field: str
    """The group's field (`GroupConfig`'s, `router.core.kv_layout.GroupSpec`'s)."""
    label: str
    """The kind as the error messages call it ("sliding-window")."""
    what: str
    """What the config's error calls the parameter ("its window")."""


class GroupRule(NamedTuple):
    """The rules of one group kind: its vLLM spellings, its required parameter, its EAGLE drop."""

    spec_kinds: frozenset[str]
    """The `kv_cache_spec_kind` spellings the rule is for."""
    required: Required | None = None
    eagle_allowed: bool = True
    """vLLM has an EAGLE block drop for this kind (the config rejects the drop otherwise)."""

    def missing(self, group: object) -> str | None:
        """The required field `group` (the config's group table or a `GroupSpec`) lacks: unset or 0;
        None when it has what its kind needs."""
        if self.required is None or getattr(group, self.required.field):
            return None
        return self.required.field


SLIDING_WINDOW: Final = GroupRule(
    frozenset({"sliding_window", "sliding_window_mla"}),
    required=Required("sliding_window", "sliding-window", "its window"),
)
CHUNKED_LOCAL: Final = GroupRule(
    frozenset({"chunked_local_attention"}),
    required=Required("chunk_size", "chunked-local", "it"),
    eagle_allowed=False,
)
ANY_KIND: Final = GroupRule(frozenset())
"""The rule of every other kind: nothing required, the EAGLE drop allowed."""
_BY_SPELLING: Final = {s: rule for rule in (SLIDING_WINDOW, CHUNKED_LOCAL) for s in rule.spec_kinds}


def group_rule(spec_kind: str) -> GroupRule:
    """The rule of the group kind vLLM spells `spec_kind`."""
    return _BY_SPELLING.get(spec_kind, ANY_KIND)
