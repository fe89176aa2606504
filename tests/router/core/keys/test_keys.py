"""Router block keys: same tokens same keys, every extra input changes them, events agree with requests."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.block_hash import MultiModalItem, RequestExtras, VllmHasher, event_extra_keys, wire_hash
from events.wire import BlockStored, EngineBlockHash
from router.core.keys import block_key
from router.core.keys.block_key import KeyHasher, _block_hashes, chain_hashes
from router.core.keys.event_tokens import keys_from_tokens
from tests.event_helpers import block_stored

BS = 4
TOKENS = list(range(100, 117))  # 17 tokens: 4 full blocks
HASHER = KeyHasher(b"test-secret")


def keys(extras: RequestExtras | None = None, tokens: list[int] = TOKENS, lookahead: int = 0) -> list[int]:
    return list(HASHER.request_keys(tokens, BS, extras, lookahead))


def stored(
    tokens: list[int], extras: RequestExtras, first_block: int, parent: EngineBlockHash | None
) -> BlockStored:
    """A BlockStored as vLLM emits it for blocks [first_block, ...) of `tokens`."""
    digests = VllmHasher().block_hashes(tokens, BS, extras)
    return block_stored(
        [wire_hash(d) for d in digests[first_block:]],
        tokens[first_block * BS : len(digests) * BS],
        BS,
        parent,
        lora_name=extras.lora_name,
        extra_keys=[event_extra_keys(extras, i * BS, (i + 1) * BS) for i in range(first_block, len(digests))],
    )


def test_same_tokens_same_keys_and_chained_prefix() -> None:
    assert keys() == keys()
    assert len(keys()) == 4
    other = keys(tokens=[*TOKENS[:8], 1, 2, 3, 4, 5, 6, 7, 8])
    assert other[:2] == keys()[:2]
    assert not set(other[2:]) & set(keys())


def test_a_changed_early_block_changes_every_later_key() -> None:
    changed = keys(tokens=[999, *TOKENS[1:]])
    assert not set(changed) & set(keys())


@pytest.mark.parametrize(
    "extras",
    [
        RequestExtras(lora_name="sql"),
        RequestExtras(cache_salt="tenant-a"),
        RequestExtras(lora_name="sql", cache_salt="tenant-a"),
    ],
)
def test_lora_and_salt_change_every_key(extras: RequestExtras) -> None:
    assert not set(keys(extras)) & set(keys())


def test_multimodal_changes_keys_from_the_overlapping_block_on() -> None:
    mm = RequestExtras(mm_items=(MultiModalItem("img-1", offset=9, length=2),))
    got = keys(mm)
    assert got[:2] == keys()[:2]
    assert not set(got[2:]) & set(keys())
    other_image = keys(RequestExtras(mm_items=(MultiModalItem("img-2", offset=9, length=2),)))
    assert other_image[:2] == got[:2] and other_image[2] != got[2]


def test_secret_changes_keys() -> None:
    assert KeyHasher(b"a").request_keys(TOKENS, BS) != KeyHasher(b"b").request_keys(TOKENS, BS)


def test_token_out_of_range_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="token ids"):
        HASHER.request_keys([-1, 2, 3, 4], BS)


@pytest.mark.parametrize(
    "extras",
    [
        RequestExtras(),
        RequestExtras(lora_name="sql", lora_path="/adapters/sql"),
        RequestExtras(cache_salt="tenant-a"),
        RequestExtras(lora_name="sql", cache_salt="tenant-a"),
        RequestExtras(cache_salt="s", mm_items=(MultiModalItem("img", offset=2, length=7),)),
    ],
)
def test_keys_from_events_equal_keys_from_request_tokens(extras: RequestExtras) -> None:
    want = keys(extras)
    first = stored(TOKENS[:8], extras, 0, None)
    head = keys_from_tokens(HASHER, first, None)
    assert head == want[:2]
    rest = stored(TOKENS, extras, 2, first.block_hashes[-1])
    assert keys_from_tokens(HASHER, rest, head[-1]) == want[2:]


def test_lookahead_keys_from_events_equal_request_keys() -> None:
    want = keys(lookahead=1)
    assert len(want) == 4  # 17 tokens: block 3 needs token 16, which exists
    ev = block_stored(
        [1, 2, 3, 4], TOKENS[:16], BS, lookahead_token_ids=[[TOKENS[(i + 1) * BS]] for i in range(4)]
    )
    assert keys_from_tokens(HASHER, ev, None) == want
    assert want != keys()


def test_dense_shape_mismatch_gives_none() -> None:
    ev = stored(TOKENS[:8], RequestExtras(), 0, None)
    ev.token_ids = ev.token_ids[:7]
    assert keys_from_tokens(HASHER, ev, None) is None


@pytest.mark.parametrize("n_blocks", [0, 1, 2, 4])
def test_the_fused_chain_equals_hashing_then_chaining_block_by_block(n_blocks: int) -> None:
    """The ingest hot path (`chain` without extras, one-block stores included) against the two steps
    it fuses: per-block hashes, then the chain over them."""
    parent = HASHER.root()
    fused = HASHER.chain(parent, TOKENS, BS, n_blocks)
    assert fused == chain_hashes(parent, _block_hashes(TOKENS, BS, n_blocks))
    assert fused == HASHER.chain(parent, TOKENS, BS, n_blocks, [None] * n_blocks)  # the extras loop


@settings(max_examples=20, deadline=None)
@given(pairs=st.lists(st.tuples(st.none() | st.sampled_from(["lora", ""]), st.none() | st.text(max_size=4))))
def test_kept_roots_equal_fresh_ones(pairs: list[tuple[str | None, str | None]]) -> None:
    """`KeyHasher.root` keeps roots per (LoRA, salt): the same value as a hasher that never saw the
    pair, also once the kept roots were forgotten (`_ROOTS`)."""
    secret = b"s" * 16
    kept = KeyHasher(secret)
    for lora, salt in [*pairs, *((None, str(i)) for i in range(block_key._ROOTS + 1)), *pairs]:
        assert kept.root(lora, salt) == KeyHasher(secret).root(lora, salt)
    assert len(kept._roots) <= block_key._ROOTS
