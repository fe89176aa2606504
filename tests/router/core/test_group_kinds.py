"""The registry of KV-cache group kinds: each vLLM spelling maps to its one class; unknown kinds never hit."""

from __future__ import annotations

import pytest

from router.core.group_kinds import (
    ChunkedLocal,
    FullAttention,
    GroupKind,
    HitQuery,
    Mamba,
    NeverHits,
    SlidingWindow,
    group_kind,
)
from router.core.kv_layout import GroupSpec
from router.settings.group_rules import ANY_KIND, CHUNKED_LOCAL, SLIDING_WINDOW, group_rule

SPELLINGS: dict[str, type[GroupKind]] = {
    "full_attention": FullAttention,
    "mla_attention": FullAttention,
    "sink_full_attention": FullAttention,
    "sliding_window": SlidingWindow,
    "sliding_window_mla": SlidingWindow,
    "mamba": Mamba,
    "chunked_local_attention": ChunkedLocal,
    "cross_attention": NeverHits,
    "encoder_only_attention": NeverHits,
}


@pytest.mark.parametrize(("spelling", "cls"), SPELLINGS.items())
def test_each_vllm_spelling_maps_to_its_kind_class(spelling: str, cls: type[GroupKind]) -> None:
    kind = group_kind(spelling)
    assert type(kind) is cls
    assert kind.cacheable is (cls is not NeverHits)
    assert kind.sparse_stores is (cls in (SlidingWindow, Mamba))
    assert kind.full_attention is (cls is FullAttention)
    # The config checks a group by the same rule the kind carries (router.settings.group_rules).
    assert group_rule(spelling) is kind.rule
    assert kind.rule is {SlidingWindow: SLIDING_WINDOW, ChunkedLocal: CHUNKED_LOCAL}.get(cls, ANY_KIND)


def test_a_kind_that_never_hits_finds_nothing() -> None:
    query = HitQuery(
        keys=[1, 2, 3], hash_block=16, cached=lambda key: True, max_tokens=47, align=16, eagle_drop=False
    )
    assert group_kind("cross_attention").find(GroupSpec(kind="cross_attention"), query) == 0
    assert group_kind("full_attention").find(GroupSpec(), query) == 32  # capped at max_tokens // 16 blocks


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"kind": "sliding_window"}, "a sliding-window group needs sliding_window"),
        ({"kind": "chunked_local_attention"}, "a chunked-local group needs chunk_size"),
    ],
)
def test_a_group_without_its_kinds_parameter_is_refused(spec: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GroupSpec(**spec)  # type: ignore[arg-type]
