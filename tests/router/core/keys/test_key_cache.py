"""PrefixKeyCache: reused keys are exactly the hasher's keys; the cache is bounded, LRU and unshared."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from events.block_hash import MultiModalItem, RequestExtras
from router.core.keys.block_key import KeyHasher, pack_tokens
from router.core.keys.recent_prompts import PrefixKeyCache
from router.core.keys.request import spec_keys
from router.core.kv_layout import ModelSpec
from router.prepare.served_models import Models
from router.settings.config import ModelConfig, RouterConfig
from tokenization.openai_request import Endpoint

HASHER = KeyHasher(b"test-key-cache")
ROOT = HASHER.root()


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 50_000 for i in range(n)]


def cached(cache: PrefixKeyCache, toks: list[int], bs: int = 4, root: int = ROOT) -> list[int]:
    return list(cache.keys(root, pack_tokens(toks), bs))


def test_the_next_turn_reuses_every_shared_block_and_computes_the_rest() -> None:
    cache = PrefixKeyCache()
    first = tokens(1, 40)
    assert cached(cache, first) == HASHER.request_keys(first, 4)
    assert (cache.reused_blocks, cache.computed_blocks) == (0, 10)
    longer = first[:37] + tokens(2, 20)  # shares 9 full blocks (36 tokens) and one token more
    assert cached(cache, longer) == HASHER.request_keys(longer, 4)
    assert (cache.reused_blocks, cache.computed_blocks) == (9, 10 + 5)


def test_the_best_of_several_stored_prompts_is_found() -> None:
    cache = PrefixKeyCache()
    system = tokens(3, 12)
    convs = [system + tokens(10 + i, 30) for i in range(20)]
    for conv in convs:
        cached(cache, conv)
    reused = cache.reused_blocks
    turn = convs[7] + tokens(99, 8)
    assert cached(cache, turn) == HASHER.request_keys(turn, 4)
    assert cache.reused_blocks - reused == len(convs[7]) // 4  # its own conversation, not a sibling


def test_roots_and_block_sizes_never_share_keys() -> None:
    cache = PrefixKeyCache()
    toks = tokens(4, 32)
    cached(cache, toks)
    salted = RequestExtras(cache_salt="tenant")
    root = HASHER.root(salted.lora_name, salted.cache_salt)
    assert cached(cache, toks, root=root) == HASHER.request_keys(toks, 4, salted)
    assert cached(cache, toks, bs=8) == HASHER.request_keys(toks, 8)
    assert cache.reused_blocks == 0


def test_bounded_by_tokens_oldest_evicted_first() -> None:
    cache = PrefixKeyCache(max_tokens=100)
    for seed in range(5):
        cached(cache, tokens(seed, 40))
        assert cache.tokens <= 100
    assert len(cache) == 2 and cache.tokens == 80
    reused = cache.reused_blocks
    cached(cache, tokens(0, 40))  # evicted long ago: computed again
    cached(cache, tokens(4, 40))  # the newest: reused whole
    assert cache.reused_blocks - reused == 10
    cached(cache, tokens(9, 400))  # longer than the bound: keyed, never stored
    assert cache.tokens <= 100 and len(cache) == 2


def test_a_repeated_prompt_is_stored_once_and_refreshed() -> None:
    cache = PrefixKeyCache(max_tokens=80)
    a, b = tokens(1, 40), tokens(2, 40)
    cached(cache, a)
    cached(cache, b)
    cached(cache, a)  # refreshes a: b is now the oldest
    assert len(cache) == 2
    cached(cache, tokens(3, 40))
    reused = cache.reused_blocks
    cached(cache, a)
    assert cache.reused_blocks - reused == 10


def test_returned_keys_are_the_callers_own() -> None:
    cache = PrefixKeyCache()
    toks = tokens(5, 40)
    first = cached(cache, toks)
    first[:] = [0] * len(first)
    assert cached(cache, toks) == HASHER.request_keys(toks, 4)


def test_zero_capacity_caches_nothing_and_a_bad_bound_is_refused() -> None:
    cache = PrefixKeyCache(max_tokens=0)
    toks = tokens(6, 40)
    assert cached(cache, toks) == cached(cache, toks) == HASHER.request_keys(toks, 4)
    assert len(cache) == 0 and cache.reused_blocks == 0
    try:
        PrefixKeyCache(max_tokens=-1)
    except ValueError:
        return
    raise AssertionError("a negative bound must be refused")


def test_multimodal_and_lookahead_prompts_bypass_the_cache() -> None:
    cache = PrefixKeyCache()
    toks = tuple(tokens(7, 40))
    mm = RequestExtras(mm_items=(MultiModalItem("img", offset=5, length=6),))
    assert spec_keys(ModelSpec(), HASHER, toks, mm, cache=cache) == HASHER.request_keys(toks, 16, mm)
    la = ModelSpec(lookahead_tokens=3)
    want = HASHER.request_keys(toks, 16, RequestExtras(), 3)
    assert spec_keys(la, HASHER, toks, RequestExtras(), cache=cache) == want
    assert len(cache) == 0


# A conversation is a sequence of prompts, each a random earlier prompt's prefix plus new tokens.
STEPS = st.lists(
    st.tuples(st.integers(0, 30), st.integers(0, 200), st.lists(st.integers(0, 3), max_size=40)),
    min_size=1,
    max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(steps=STEPS, bs=st.sampled_from([1, 4, 16]), bound=st.sampled_from([0, 60, 500, 100_000]))
def test_cached_keys_equal_uncached_keys(
    steps: list[tuple[int, int, list[int]]], bs: int, bound: int
) -> None:
    cache = PrefixKeyCache(max_tokens=bound)
    prompts: list[list[int]] = [[]]
    roots = [HASHER.root(), HASHER.root("lora"), HASHER.root(None, "salt")]
    for pick, cut, new in steps:
        base = prompts[pick % len(prompts)]
        prompt = base[:cut] + new
        root = roots[pick % 3]
        assert list(cache.keys(root, pack_tokens(prompt), bs)) == HASHER.chain(
            root, prompt, bs, len(prompt) // bs
        )
        prompts.append(prompt)
        assert cache.tokens <= bound


WORDS = st.sampled_from(["alpha ", "beta ", "gamma\n", "delta. ", "<|user|>", "epsilon "])
TURN = st.lists(WORDS, min_size=1, max_size=30).map("".join)


@settings(max_examples=40, deadline=None)
@given(turns=st.lists(TURN, min_size=1, max_size=8), salt=st.sampled_from([None, "s"]))
def test_models_prepare_with_and_without_the_cache_agree(turns: list[str], salt: str | None) -> None:
    config = RouterConfig(models=[ModelConfig(name="m", block_size=4)])
    warm = Models(config, HASHER)
    cold = Models(config, HASHER, key_cache=PrefixKeyCache(0))
    roles = ["user", "assistant"]
    for n in range(1, len(turns) + 1):
        messages = [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns[:n])]
        raw = msgspec.json.encode({"model": "m", "messages": messages, "cache_salt": salt})
        got, want = warm.prepare(raw, Endpoint.CHAT), cold.prepare(raw, Endpoint.CHAT)
        assert (got.keys, got.prompt_tokens, got.session_key) == (
            want.keys,
            want.prompt_tokens,
            want.session_key,
        )
    assert warm.key_cache.reused_blocks > 0 or len(turns) == 1  # a later turn shares the first's blocks


def test_one_packed_object_keyed_under_two_roots_keeps_both_entries() -> None:
    # The tokenizer hands back the same bytes object for a text it saw before (a carried or reused
    # prompt), and a request may key it under another chain root (a cache salt): each root's entry must
    # keep its own keys, or a later prompt under the first root copies the second root's keys.
    cache = PrefixKeyCache()
    salted = HASHER.root(cache_salt="s")
    packed = pack_tokens(tokens(1, 40))
    assert list(cache.keys(ROOT, packed, 4)) == HASHER.request_keys(tokens(1, 40), 4)
    cache.keys(salted, packed, 4)
    longer = tokens(1, 40) + tokens(2, 8)
    assert cached(cache, longer) == HASHER.request_keys(longer, 4)
    assert cached(cache, longer, root=salted) == HASHER.request_keys(longer, 4, RequestExtras(cache_salt="s"))


def test_one_packed_object_keyed_at_two_block_sizes_keeps_both_entries() -> None:
    # `Models.prepare` keys one request's packed ids for every variant of its model: two variants with
    # different hash block sizes store the same bytes object in two groups.
    cache = PrefixKeyCache()
    packed = pack_tokens(tokens(1, 48))
    cache.keys(ROOT, packed, 4)
    cache.keys(ROOT, packed, 8)
    longer = tokens(1, 48) + tokens(2, 8)
    assert cached(cache, longer, bs=4) == HASHER.request_keys(longer, 4)
    assert cached(cache, longer, bs=8) == HASHER.request_keys(longer, 8)
