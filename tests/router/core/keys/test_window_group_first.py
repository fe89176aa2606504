"""Router keys when the sliding-window group comes before full attention (Gemma-2, Gemma-3 layouts).

vLLM numbers a Gemma-2 hybrid's KV-cache groups sliding window first (group 0) and full attention
second (group 1), and emits a request's stores in group order, so a step's window store comes before
the full-attention store of the same blocks. The window store is sparse (R = 0 keeps the `need` blocks
ending at the replay boundary, semantics doc §6.4), so its new hashes cannot be keyed from its tokens
alone; the full-attention store right after it names them in order. Router-key mode once dropped them
(a conservative miss counted in `unmapped_sparse`): the next turn was predicted 0 cached tokens where
vLLM, and engine-exact mode, give 288.
"""

from __future__ import annotations

import pytest

from events.block_hash import RequestExtras, VllmHasher, wire_hash
from events.wire import BlockStored, EngineBlockHash, KVEventBatch
from router.core.ids import RequestId
from router.core.keys.block_key import KeyHasher
from router.core.keys.request import spec_keys
from router.core.kv_layout import GroupSpec, HashingMode, ModelSpec
from router.core.lookup.computed_blocks import LookupRequest, lookup
from router.core.mirror.full_reports import PendingReport, apply_batch
from router.core.mirror.shared_index import EngineId, Mirror
from tests.event_helpers import block_stored

BS = 32
E = EngineId("gemma2")
GROUPS = (GroupSpec("sliding_window", BS, sliding_window=128), GroupSpec("full_attention", BS))
PROMPT = [1000 + i for i in range(300)]  # 9 full blocks; maxlen 299 -> replay boundary 288
NEXT_TURN = [*PROMPT, *range(5000, 5020)]
HASHES: list[EngineBlockHash] = [wire_hash(d) for d in VllmHasher().block_hashes(PROMPT, BS)]


OTHER = [7000 + i for i in range(300)]
OTHER_HASHES: list[EngineBlockHash] = [wire_hash(d) for d in VllmHasher().block_hashes(OTHER, BS)]


def stored(
    hashes: list[EngineBlockHash], group: int, kind: str, window: int | None, tokens: list[int] = PROMPT
) -> BlockStored:
    return block_stored(
        hashes,
        tokens[: 9 * BS],
        BS,
        group_idx=group,
        kv_cache_spec_kind=kind,
        kv_cache_spec_sliding_window=window,
    )


def prefill(hashes: list[EngineBlockHash], tokens: list[int]) -> list[BlockStored]:
    """One request's prefill stores of a 300-token prompt, in vLLM's group order."""
    return [
        stored(hashes[5:9], 0, "sliding_window", 128, tokens),
        stored(hashes, 1, "full_attention", None, tokens),
    ]


def first_turn() -> KVEventBatch:
    """The prefill step of PROMPT, as vLLM 0.32 emits it: window group (blocks 5-8, the 4 = ceil(127/32)
    blocks ending at 288) first, then full attention (blocks 0-8)."""
    return KVEventBatch(0.0, [*prefill(HASHES, PROMPT)])


def predict(hashing: HashingMode, tokens: list[int]) -> tuple[Mirror, int]:
    spec = ModelSpec(groups=GROUPS, hashing=hashing)
    m = Mirror(hasher=KeyHasher(b"k"))
    m.add_engine(E, spec)
    m.apply(E, first_turn())
    keys = spec_keys(spec, m.hasher, tuple(tokens), RequestExtras())
    (result,) = lookup(m, spec, LookupRequest(keys, len(tokens))).values()
    return m, result.hit_tokens


@pytest.mark.parametrize("hashing", list(HashingMode))
def test_next_turn_hits_the_window_blocks_stored_before_full_attention(hashing: HashingMode) -> None:
    m, hit = predict(hashing, NEXT_TURN)
    assert hit == 288  # what vLLM serves: FA blocks 0-8, window blocks 5-8
    assert m.resident(E, 0, 0) == dict.fromkeys(HASHES[5:9], 1)
    assert m.resident(E, 0, 1) == dict.fromkeys(HASHES, 1)
    assert (m.stats.unmapped_sparse, m.stats.store_unknown_parent, m.stats.bad_store_shape) == (0, 0, 0)


def router_mirror() -> Mirror:
    m = Mirror(hasher=KeyHasher(b"k"))
    m.add_engine(E, ModelSpec(groups=GROUPS))
    return m


def test_two_requests_prefilled_in_one_step_key_each_window_store_from_its_own_request() -> None:
    m = router_mirror()
    m.apply(E, KVEventBatch(0.0, [*prefill(HASHES, PROMPT), *prefill(OTHER_HASHES, OTHER)]))
    assert m.resident(E, 0, 0) == dict.fromkeys([*HASHES[5:9], *OTHER_HASHES[5:9]], 1)
    rv = m.replica(E)
    assert rv is not None
    for tokens in (PROMPT, OTHER):
        keys = m.hasher.request_keys(tokens, BS)
        assert [m.count(rv, 0, k) for k in keys] == [0] * 5 + [1] * 4
    assert m.stats.unmapped_sparse == 0


def test_a_window_store_no_dense_store_follows_stays_a_counted_conservative_miss() -> None:
    """Only the (groups - 1) events after a window store are the same step's other groups of its request;
    a full-attention store further on is not looked at, and nothing is guessed."""
    m = router_mirror()
    window, full = prefill(HASHES, PROMPT)
    m.apply(E, KVEventBatch(0.0, [window, *prefill(OTHER_HASHES, OTHER), full]))
    assert m.resident(E, 0, 0) == dict.fromkeys(OTHER_HASHES[5:9], 1)
    assert m.resident(E, 0, 1) == dict.fromkeys([*HASHES, *OTHER_HASHES], 1)
    assert m.stats.unmapped_sparse == 4


def test_full_mode_report_is_told_apart_from_a_window_first_real_store() -> None:
    """A request's real prefill store starts with the sparse window store, which is not dense: the
    full-attention store after it is what shows the request has stored. Once the router took a later
    full-mode report of the same prefix for that (cache-skipping) request's first store, counting it."""
    m = router_mirror()
    spec = ModelSpec(groups=GROUPS)
    keys: list[int] = list(m.hasher.request_keys(PROMPT, BS))
    pending = {RequestId("skip"): PendingReport(keys, len(PROMPT), full=False, skip_cache=True)}
    assert apply_batch(m, E, spec, KVEventBatch(0.0, [*prefill(HASHES, PROMPT)]), pending) == 0
    pending[RequestId("full")] = PendingReport(keys, len(PROMPT))
    report = [stored(HASHES, 0, "sliding_window", 128), stored(HASHES, 1, "full_attention", None)]
    assert apply_batch(m, E, spec, KVEventBatch(0.0, [*report]), pending) == 2
    assert m.resident(E, 0, 0) == dict.fromkeys(HASHES[5:9], 1)
    assert m.resident(E, 0, 1) == dict.fromkeys(HASHES, 1)


def test_a_bad_full_attention_store_after_a_window_store_is_rejected_alone() -> None:
    """The look-ahead reads the next store's tokens; a bad token there rejects that store on its own
    turn (once), and the window store before it is a counted conservative miss, not a second rejection."""
    m = router_mirror()
    window, _ = prefill(HASHES, PROMPT)
    bad = stored(HASHES, 1, "full_attention", None, [2**32, *PROMPT[1:]])
    m.apply(E, KVEventBatch(0.0, [window, bad, *prefill(OTHER_HASHES, OTHER)]))
    rv = m.replica(E)
    assert rv is not None
    assert rv.rejected == {"token_ids": 1}
    assert m.stats.unmapped_sparse == 4
    assert m.resident(E, 0, 1) == dict.fromkeys(OTHER_HASHES, 1)  # the good request after it is applied
