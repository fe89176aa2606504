"""Hybrid worked examples (semantics doc §9): retention masks, and junction pinning changing later hits."""

from __future__ import annotations

import pytest

from engine_stub.core.engine_config import CacheConfig, EngineCoreConfig, GroupKind, GroupSpec
from engine_stub.core.request import SubmitParams
from engine_stub.core.scheduler import Scheduler
from engine_stub.core.single_type_hits import MaskArgs, cacheable_mask
from events.wire import BlockStored
from tokenization.request_tokens import ReportMode

BS = 4
SWA = GroupSpec(GroupKind.SLIDING_WINDOW, BS, sliding_window=8)
MAMBA = GroupSpec(GroupKind.MAMBA, BS)
PROMPT = list(range(100, 113))
# A's history after prefill (samples 50000) and 3 decode steps (902, 903, 904), then a new turn.
HISTORY = [*PROMPT, 50000, 902, 903, 904]
A_EXT = [*HISTORY, 120, 121, 122]
E = [*HISTORY, 130, 131, 132]


def _engine(sparse: GroupSpec) -> Scheduler:
    groups = (GroupSpec(GroupKind.FULL_ATTENTION, BS), sparse)
    forced = {1: 902, 2: 903, 3: 904}
    return Scheduler(
        EngineCoreConfig(cache=CacheConfig(num_gpu_blocks=64, groups=groups)),
        sampler=lambda req: forced.get(req.num_output_tokens, 50000),
    )


def _run(engine: Scheduler, tokens: list[int], max_tokens: int = 1, **kw: object) -> dict[str, int]:
    """Run a request to completion; returns its admission (first lookup that admitted it)."""
    rid = engine.submit(tokens, SubmitParams(max_tokens=max_tokens, **kw))  # type: ignore[arg-type]
    admission = None
    while rid in engine.requests:
        out = engine.step()
        if rid in out.admissions and out.admissions[rid].admitted:
            admission = out.admissions[rid]
    assert admission is not None
    return {"hit": admission.hit_tokens, "boundary": admission.shared_prefix_boundary}


@pytest.mark.parametrize("sparse", [SWA, MAMBA], ids=["swa", "mamba"])
def test_pinned_junction_serves_the_next_sibling(sparse: GroupSpec) -> None:
    engine = _engine(sparse)
    assert _run(engine, PROMPT, max_tokens=4) == {"hit": 0, "boundary": 0}
    # Decode blocks are not retained by the sparse group under R=0: FA has 16, the hit is 12.
    assert _run(engine, A_EXT) == {"hit": 12, "boundary": 16}
    # A_ext kept the sparse state at its junction, so the sibling gets the full FA length.
    assert _run(engine, E) == {"hit": 16, "boundary": 0}


@pytest.mark.parametrize("sparse", [SWA, MAMBA], ids=["swa", "mamba"])
def test_without_the_pinning_request_the_sibling_stays_at_the_prompt_tail(sparse: GroupSpec) -> None:
    engine = _engine(sparse)
    _run(engine, PROMPT, max_tokens=4)
    assert _run(engine, E) == {"hit": 12, "boundary": 16}


def test_divergent_sibling_pins_its_junction_then_the_next_hits_it() -> None:
    engine = _engine(SWA)
    _run(engine, PROMPT, max_tokens=4)
    assert _run(engine, [*PROMPT[:8], 7, 7, 7, 7, 7]) == {"hit": 0, "boundary": 8}
    assert _run(engine, [*PROMPT[:8], 9, 9, 9, 9, 9]) == {"hit": 8, "boundary": 0}


def test_full_report_mode_announces_the_hit_per_group_with_null_placeholders() -> None:
    engine = _engine(SWA)
    _run(engine, PROMPT, max_tokens=4)
    _run(engine, A_EXT)
    rid = engine.submit(E, SubmitParams(max_tokens=1, report_mode=ReportMode.FULL))
    events = engine.step().events
    reports = [e for e in events if isinstance(e, BlockStored) and e.parent_block_hash is None]
    assert [(e.group_idx, len(e.block_hashes), e.kv_cache_spec_kind) for e in reports] == [
        (0, 4, "full_attention"),
        (1, 4, "sliding_window"),
    ]
    assert reports[1].kv_cache_spec_sliding_window == 8
    assert rid not in engine.requests


def test_skip_cache_read_gets_no_hit_but_still_stores() -> None:
    engine = _engine(SWA)
    _run(engine, PROMPT)
    rid = engine.submit(PROMPT, SubmitParams(max_tokens=1, skip_cache_read=True))
    out = engine.step()
    assert out.admissions[rid].hit_tokens == 0
    assert any(isinstance(e, BlockStored) and e.block_hashes for e in out.events)


def test_retention_masks_keep_periodic_and_boundary_tails() -> None:
    """§9 example 4: A of 37 tokens, R=16: SWA keeps blocks 2,3,6,7 and the replay tail 7,8."""
    swa = cacheable_mask(SWA, MaskArgs(start=0, end=9, retention=16, boundaries=[36], align=BS))
    assert swa is not None and [i for i, keep in enumerate(swa) if keep] == [2, 3, 6, 7, 8]
    mamba = cacheable_mask(MAMBA, MaskArgs(start=0, end=9, retention=16, boundaries=[36], align=BS))
    assert mamba is not None and [i for i, keep in enumerate(mamba) if keep] == [3, 7, 8]
    assert cacheable_mask(SWA, MaskArgs(start=0, end=9, retention=None, boundaries=[36], align=BS)) is None
    assert (
        cacheable_mask(GroupSpec(), MaskArgs(start=0, end=9, retention=0, boundaries=[36], align=BS)) is None
    )


def test_mamba_prompt_is_split_at_its_last_cacheable_boundary() -> None:
    engine = _engine(MAMBA)
    rid = engine.submit(PROMPT, SubmitParams(max_tokens=1))
    assert engine.step().scheduled == {rid: 12}
    assert engine.step().scheduled == {rid: 1}
