"""What the router must reproduce per engine: tokenizer, KV-cache layout and hashing (a `Variant`).

A model's variant comes from its `ModelConfig` (or defaults: built-in tokenizer, one full-attention
group of 16 tokens, router hashing). An engine may override the tokenizer, block size or groups; it
then gets a variant of its own, and its replicas are looked up with that variant's keys. Pure: tokenizers are
loaded in `router.prepare.served_models`.
"""

from __future__ import annotations

import hashlib

import msgspec

from router.core.kv_layout import GroupSpec, HashingMode, ModelSpec
from router.core.variant import Variant, VariantId
from router.settings.config import EngineConfig, GroupConfig, ModelConfig, RouterConfig

__all__ = ["DEFAULT_MODEL", "engine_model", "model_configs", "resolve_variant"]

DEFAULT_MODEL = "default"
"""The model name used for engines that name none when no model is configured."""


def model_configs(config: RouterConfig) -> dict[str, ModelConfig]:
    """The configured models, plus a default one per engine model name nobody configured."""
    out = {m.name: m for m in config.models}
    for engine in config.engines:
        name = engine_model(config, engine)
        if name not in out:
            out[name] = ModelConfig(name=name, block_size=engine.block_size or 16)
    if not out:
        out[config.embedded.model] = ModelConfig(
            name=config.embedded.model,
            tokenizer=config.embedded.tokenizer,
            block_size=config.embedded.block_size,
        )
    return out


def engine_model(config: RouterConfig, engine: EngineConfig) -> str:
    """The model an engine serves: its own setting, else the only configured model, else the default."""
    if engine.model:
        return engine.model
    if len(config.models) == 1:
        return config.models[0].name
    return DEFAULT_MODEL


def _groups(groups: list[GroupConfig], block_size: int) -> tuple[GroupSpec, ...]:
    if not groups:
        return (GroupSpec(block_size=block_size),)
    return tuple(
        GroupSpec(
            kind=g.kind,
            block_size=g.block_size or block_size,
            sliding_window=g.sliding_window,
            chunk_size=g.chunk_size,
            eagle=g.eagle,
        )
        for g in groups
    )


def _spec(model: ModelConfig, groups: list[GroupConfig], block_size: int) -> ModelSpec:
    hashing = HashingMode.ENGINE if model.hashing == "vllm" else HashingMode.ROUTER
    if model.vllm_version == "0.32" and model.lookahead_tokens:
        raise ValueError(
            f"model {model.name!r}: vLLM 0.32 has no lookahead block hashes; "
            "its EAGLE engines drop the last block: set eagle_block_drop = true, lookahead_tokens = 0"
        )
    try:
        return ModelSpec(
            groups=_groups(groups, block_size),
            hashing=hashing,
            hash_algo=model.hash_algo,
            hash_seed=model.hash_seed,
            eagle_block_drop=model.eagle_block_drop,
            lookahead_tokens=model.lookahead_tokens,
        )
    except ValueError as exc:
        raise ValueError(f"model {model.name!r}: {exc}") from exc


def resolve_variant(model: ModelConfig, engine: EngineConfig | None = None) -> Variant:
    """The variant of `model`, or of `engine` serving it (its overrides applied)."""
    tokenizer, groups, block_size = model.tokenizer, model.groups, model.block_size
    if engine is not None:
        tokenizer = engine.tokenizer or tokenizer
        block_size = engine.block_size or block_size
        groups = engine.groups or groups
    spec = _spec(model, groups, block_size)
    base = _spec(model, model.groups, model.block_size)
    same = tokenizer == model.tokenizer and spec == base
    # The model's revision pins its own repo; an engine naming another repo reads that repo's `main`.
    revision = model.tokenizer_revision if tokenizer == model.tokenizer else None
    vid = model.name if same else f"{model.name}@{_digest(tokenizer, spec)}"
    return Variant(VariantId(vid), model.name, tokenizer, model.chat_template, spec, revision)


def _digest(tokenizer: str | None, spec: ModelSpec) -> str:
    data = msgspec.msgpack.encode((tokenizer, spec))
    return hashlib.blake2b(data, digest_size=4).hexdigest()
