"""The gateway settles the garbage collector once it has started."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from router.edge.asgi_app import GC_GEN0_THRESHOLD, settle_gc


@pytest.fixture
def restored_gc() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_the_start_up_heap_is_frozen_and_young_collections_are_rarer(restored_gc: None) -> None:
    gc.unfreeze()
    settle_gc()
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold()[0] == GC_GEN0_THRESHOLD
