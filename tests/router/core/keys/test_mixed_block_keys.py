"""Router keys on mixed block sizes: coarse full-attention stores, partial tails, sparse window stores.

FA 8 + SWA 4 (w 8): hashes at hb = 4, A = 8. vLLM's FA group keys every second hash unit (the view at
its blocks' last unit, kv-events §4.3), its partial-tail store names one unit (block_size = hb), and
the SWA group keeps runs of `need` = 2 blocks ending at 8-aligned edges (semantics doc §6.4).
"""

from __future__ import annotations

from typing import Any

from events.block_hash import RequestExtras, VllmHasher, wire_hash
from events.wire import BlockStored, EngineBlockHash, KVEventBatch
from router.core.ids import RequestId
from router.core.keys.block_key import KeyHasher
from router.core.keys.event_tokens import keys_from_tokens
from router.core.keys.sparse_window import RunShape, place_unknown, run_shape
from router.core.kv_layout import GroupSpec, HashingMode, ModelSpec
from router.core.mirror.full_reports import PendingReport, apply_batch
from router.core.mirror.shared_index import EngineId, Mirror
from tests.event_helpers import block_stored

E = EngineId("e")
SPEC = ModelSpec(groups=(GroupSpec(block_size=8), GroupSpec("sliding_window", 4, sliding_window=8)))
TOKENS = list(range(1, 17))
UNITS: list[EngineBlockHash] = [wire_hash(d) for d in VllmHasher().block_hashes(TOKENS, 4)]
HASHER = KeyHasher(b"m")


def stored(hashes: list[EngineBlockHash], tokens: list[int], bs: int, group: int, **kw: Any) -> BlockStored:
    return block_stored(hashes, tokens, bs, group_idx=group, **kw)  # (`parent` among `kw`)


def test_a_coarse_block_takes_the_key_of_its_last_hash_unit() -> None:
    units = HASHER.request_keys(TOKENS, 4)
    ev = stored([UNITS[1], UNITS[3]], TOKENS, 8, 0)
    assert keys_from_tokens(HASHER, ev, None, 4) == [units[1], units[3]]
    # Chained over the store's own block size (the old behaviour) the keys match no request key.
    assert not set(keys_from_tokens(HASHER, ev, None) or []) & set(units)
    salted = stored([UNITS[1]], TOKENS[:8], 8, 0, extra_keys=[("s1",)])
    assert keys_from_tokens(HASHER, salted, None, 4) == [HASHER.request_keys(TOKENS, 4, _salt("s1"))[1]]


def test_coarse_lookahead_units_take_the_tokens_after_each_unit() -> None:
    ev = stored([UNITS[1]], TOKENS[:8], 8, 0, lookahead_token_ids=[[TOKENS[8]]])
    assert keys_from_tokens(HASHER, ev, None, 4) == [HASHER.request_keys(TOKENS[:9], 4, lookahead=1)[1]]


def test_mirror_keys_fa8_blocks_partial_tail_and_sparse_window_run() -> None:
    """A 14-token prompt (maxlen 13): FA stores A.1, A.3 as two blocks of 8 and its partial tail A.2
    (one unit, parent A.1); SWA keeps blocks 0, 1 (A.0, A.1: the run ending at floor(13/8)*8 = 8),
    a sparse store over 16 tokens whose A.0 the FA group never named: placed before A.1."""
    m = Mirror(hasher=HASHER)
    m.add_engine(E, SPEC)
    m.apply(
        E,
        KVEventBatch(
            0.0,
            [
                stored([UNITS[1], UNITS[3]], TOKENS, 8, 0),
                stored([UNITS[2]], TOKENS[8:12], 4, 0, parent=UNITS[1]),
                stored([UNITS[0], UNITS[1]], TOKENS, 4, 1),
            ],
        ),
    )
    assert m.resident(E, 0, 0) == {UNITS[1]: 1, UNITS[2]: 1, UNITS[3]: 1}
    assert m.resident(E, 0, 1) == {UNITS[0]: 1, UNITS[1]: 1}
    keys = HASHER.request_keys(TOKENS, 4)
    rv = m.replica(E)
    assert rv is not None
    assert [m.count(rv, 1, k) for k in keys] == [1, 1, 0, 0]
    assert (m.stats.unmapped_sparse, m.stats.store_unknown_parent, m.stats.bad_store_shape) == (0, 0, 0)


def test_run_shape_of_a_window_group() -> None:
    assert run_shape(SPEC, 1) == RunShape(need=2, period=2, shift=0)
    assert run_shape(SPEC, 0) is None
    eagle = ModelSpec(groups=SPEC.groups, eagle_block_drop=True)
    assert run_shape(eagle, 1) == RunShape(need=3, period=2, shift=1)


def test_unknown_hashes_are_placed_only_when_the_runs_say_so() -> None:
    shape = RunShape(need=2, period=2, shift=0)
    assert place_unknown([None, 1], 0, 4, shape) == [0, 1]
    assert place_unknown([None, 3, None, 5], 0, 6, shape) == [2, 3, 4, 5]
    # The range's first block index is not on the wire: [1, 2] is a run if the range starts off-edge.
    assert place_unknown([1, None], 0, 4, shape) == [1, 2]
    assert place_unknown([0, None, 3], 0, 4, shape) is None  # 0 alone and 2, 3 fit no one offset
    assert place_unknown([None, None], 0, 4, shape) is None  # nothing to anchor on
    assert place_unknown([None, 0], 0, 4, shape) is None  # no room before block 0
    # need 3: two blocks in the middle of the range are no whole run
    assert place_unknown([None, 5], 0, 8, RunShape(need=3, period=2, shift=0)) is None
    assert place_unknown([None, None, 5], 0, 8, RunShape(need=3, period=2, shift=0)) == [3, 4, 5]


def _salt(salt: str) -> RequestExtras:
    return RequestExtras(cache_salt=salt)


def test_full_mode_reports_over_groups_of_different_block_sizes() -> None:
    """FA 4 + SWA 8 (w 16), engine keys. A full-mode request of 12 tokens hits 8 (FA A.0 A.1, SWA
    block 0 = A.1): its report is FA [A.0 A.1] and SWA [A.1], the same 8 tokens in different counts.
    Both are recognised, so FA keeps one copy of each block."""
    spec = ModelSpec(
        groups=(GroupSpec(block_size=4), GroupSpec("sliding_window", 8, sliding_window=16)),
        hashing=HashingMode.ENGINE,
    )
    m = Mirror(hasher=HASHER)
    m.add_engine(E, spec)
    a = UNITS[:3]
    m.apply(E, KVEventBatch(0.0, [stored(a[:2], TOKENS[:8], 4, 0), stored([a[1]], TOKENS[:8], 8, 1)]))
    pending = {RequestId("r"): PendingReport([int(h) for h in a], 12)}
    report = [stored(a[:2], TOKENS[:8], 4, 0), stored([a[1]], TOKENS[:8], 8, 1)]
    own = stored([a[2]], TOKENS[8:12], 4, 0, parent=a[1])
    assert apply_batch(m, E, spec, KVEventBatch(0.0, [*report, own]), pending) == 2
    assert m.resident(E, 0, 0) == {a[0]: 1, a[1]: 1, a[2]: 1}
    assert m.resident(E, 0, 1) == {a[1]: 1}
