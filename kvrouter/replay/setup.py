"""What a replay needs to stand where the gateway stood: its config, replicas, model variants and policy.

The config comes, in order of preference, from the caller (`--config FILE`), from the recording's
header (`metadata.config`, written by `kvrouter serve --record` when it is given the config), or, for
older recordings, from the header's engine list and policy name with every other setting at its
default (`Setup.exact` is then False: model specs or policy weights may differ from the gateway's).
Replicas are registered exactly as `router.core.fleet_state.FleetState` does: one per DP rank, named `name` or
`name/dpN`, each with its engine's model variant and report mode.
"""

from __future__ import annotations

from typing import Any

import msgspec

from events.recording import FileHeader
from router.core.ids import EngineId
from router.core.keys.block_key import KeyHasher
from router.core.policy.scoring import ScorerSettings
from router.core.policy.session_key import SessionKeys
from router.core.variant import Variant
from router.prepare.served_models import Models
from router.settings.config import EngineConfig, RouterConfig

__all__ = ["ReplayConfigError", "ReplicaInfo", "Setup", "config_of"]


class ReplayConfigError(ValueError):
    """The recording says too little to rebuild the gateway, and no config was given."""


class ReplicaInfo(msgspec.Struct, frozen=True):
    """One DP rank of one engine, as the gateway's fleet registered it."""

    id: EngineId
    engine: EngineConfig
    rank: int
    variant: Variant

    @property
    def can_replay(self) -> bool:
        """Whether the gateway's subscriber had a replay endpoint for this rank."""
        return bool(self.engine.replay)


class _HeaderEngine(msgspec.Struct):
    url: str
    events: list[str] = []
    replay: list[str] = []


class _HeaderMetadata(msgspec.Struct):
    config: RouterConfig | None = None
    engines: dict[str, _HeaderEngine] = {}
    policy: str = "kv"


def config_of(header: FileHeader, given: RouterConfig | None = None) -> tuple[RouterConfig, str]:
    """The gateway's config and where it came from ("given", "recording", or "recording metadata")."""
    if given is not None:
        return given, "given"
    meta = _metadata(header.metadata)
    if meta.config is not None:
        return meta.config, "recording"
    if not meta.engines:
        raise ReplayConfigError(
            "the recording holds no config and no engine list: pass the gateway's config (--config FILE)"
        )
    engines = [{"name": name, **msgspec.to_builtins(e)} for name, e in meta.engines.items()]
    try:
        config = msgspec.convert({"engines": engines, "policy": {"name": meta.policy}}, RouterConfig)
    except msgspec.ValidationError as exc:
        raise ReplayConfigError(f"the recording's engine list or policy is not usable: {exc}") from None
    return config, "recording metadata"


def _metadata(metadata: dict[str, Any]) -> _HeaderMetadata:
    try:
        return msgspec.convert(metadata, _HeaderMetadata, strict=False)
    except msgspec.ValidationError as exc:
        raise ReplayConfigError(f"the recording's header metadata is not a gateway's: {exc}") from None


class Setup:
    """The gateway's static picture: config, models (tokenizers, keys), replicas, scorer settings."""

    def __init__(self, config: RouterConfig, source: str = "given") -> None:
        self.config = config
        self.source = source
        self.exact = source != "recording metadata"
        self.models = Models(config, KeyHasher())
        self.settings = ScorerSettings.from_config(config)
        p = config.policy
        self.session_keys = SessionKeys(p.session_header, p.session_agent_headers, p.session_body)
        self.replicas: dict[EngineId, ReplicaInfo] = {}
        for engine in config.engines:
            variant = self.models.learn(engine)
            for rank, rid in enumerate(engine.replica_ids()):
                self.replicas[rid] = ReplicaInfo(rid, engine, rank, variant)

    @classmethod
    def from_header(cls, header: FileHeader, given: RouterConfig | None = None) -> Setup:
        """The setup of the gateway that wrote a recording with this header."""
        config, source = config_of(header, given)
        return cls(config, source)

    def serving(self, model: str) -> list[EngineId]:
        """The replicas serving `model`, in registration order (the fleet's order)."""
        return [rid for rid, info in self.replicas.items() if info.variant.model == model]
