"""The engine stub's top-level configuration: one msgspec Struct, decoded from TOML (config/engine_stub.toml).

Sections: the served model and listen address, `data_parallel_size`, the pure engine core
(`[engine.cache]`, `[engine.scheduler]`), the step cost model (`[cost]`), vLLM's `--kv-events-config`
fields (`[kv_events]`), the tokenizer (`[tokenizer]`) and fault injection (`[faults]`).
Unknown keys are rejected so a typo fails loudly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec

from engine_stub.core.engine_config import EngineCoreConfig
from engine_stub.runtime.cost_model import CostModel
from engine_stub.runtime.faults import FaultConfig
from events.config import KVEventsConfig, for_rank
from tokenization.hub_names import hub_repo
from tokenization.reasoning_effort import DisabledThinkingEffort, ReasoningEffort

__all__ = ["StubConfig", "TokenizerChoice", "load_config"]

Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class TokenizerChoice(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`path` None: the built-in byte-level tokenizer; else a tokenizer.json file, a directory holding
    one, or an HF repo id (`Org/Name`, through the hub's cache: docs/tokenization.md).

    The router's `tokenizer` setting takes the same path, so both tokenize identically.
    """

    path: str | None = None
    chat_template: str | None = None
    revision: str | None = None
    """With a repo id `path`: the branch, tag or commit to read (the router's `tokenizer_revision`)."""
    reasoning_effort_map: dict[ReasoningEffort, str] = {}
    """vLLM's `--reasoning-effort-map` (the router model's key of that name)."""
    anthropic_disabled_thinking_effort: DisabledThinkingEffort = "auto"
    """vLLM's `--anthropic-disabled-thinking-effort` (the router model's key of that name)."""

    def validate(self) -> None:
        """ValueError for a revision without a repo id to pin (as the router refuses it)."""
        if self.revision is not None and (self.path is None or hub_repo(self.path) is None):
            raise ValueError(f"tokenizer.revision {self.revision!r} needs tokenizer.path to be an HF repo id")


def _default_kv_events() -> KVEventsConfig:
    return KVEventsConfig(enable_kv_cache_events=True)


class StubConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything one stub server needs; every field has a default (see config/engine_stub.toml)."""

    model: str = "kvrouter-stub"
    host: str = "127.0.0.1"
    port: Port = 8000
    data_parallel_size: Positive = 1
    host_ip: str | None = None
    """Replaces `*` in an ephemeral `tcp://*:0` endpoint (vLLM: $VLLM_HOST_IP, else the outbound IP)."""
    enable_prompt_tokens_details: bool = True
    """Report `usage.prompt_tokens_details.cached_tokens` (vLLM's flag of that name defaults to off)."""
    default_max_tokens: Positive | None = None
    """None: vLLM's rule, max_model_len - prompt tokens."""
    engine: EngineCoreConfig = EngineCoreConfig()
    cost: CostModel = CostModel()
    kv_events: KVEventsConfig = msgspec.field(default_factory=lambda: _default_kv_events())
    """Default: events on at vLLM's default endpoint (vLLM itself defaults to off)."""
    replay_buffer_bytes: NonNegative = 32 << 20
    """Payload bytes each rank's replay buffer keeps at most, besides `kv_events.buffer_steps` batches
    (vLLM bounds only the count, so a churn of long prompts grew it to 10,000 large batches)."""
    tokenizer: TokenizerChoice = TokenizerChoice()
    faults: FaultConfig = FaultConfig()

    def validate(self) -> None:
        """Raise ValueError for settings the stub cannot run with."""
        self.engine.cache.validate()
        self.tokenizer.validate()
        if self.data_parallel_size > 1 and self.kv_events.publishes:
            for rank in range(self.data_parallel_size):
                for_rank(self.kv_events, rank)  # raises for ipc:// endpoints, as vLLM does


def load_config(path: Path | None) -> StubConfig:
    """Decode a TOML file (or the defaults when None); msgspec.ValidationError names the bad field."""
    if path is None:
        return StubConfig()
    return msgspec.toml.decode(path.read_bytes(), type=StubConfig)
