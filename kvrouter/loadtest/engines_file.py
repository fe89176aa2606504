"""`kvrouter loadtest --engines-from FILE`: the engines a user already runs, in place of stubs.

The file is a router config's `[[models]]` (exactly one) and `[[engines]]` tables, as TOML or, for a
`.json` name, JSON with the same keys: each engine's URL, event and replay endpoints and model, the
model's tokenizer and block size. Only policies that need nothing but the engines' OpenAI API run
against them: the oracles ask the stubs for their true caches, so they are refused.

Cold caches: before each policy every engine gets `POST /reset_prefix_cache` (vLLM serves it only
with `VLLM_SERVER_DEV_MODE=1`; retried while running requests still hold blocks) and then a 1-token
request, because vLLM publishes the `AllBlocksCleared` event only at its next step. An engine
without the endpoint keeps its cache; the harness says so and records the mirror's blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from kvrouter.loadtest.oracle import StubEndpoint
from router.settings.config import EngineConfig, ModelConfig

__all__ = [
    "NEEDS_STUBS",
    "EnginesFile",
    "ResetError",
    "await_cold_mirror",
    "load_engines_file",
    "mirror_blocks",
    "refuse_stub_policies",
    "reset_caches",
]

NEEDS_STUBS = ("cache_oracle", "ttft_oracle")
"""Policies that read the stubs' internals (`POST /debug/cache_hit`), so cannot run on real engines."""


class EnginesFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The engines to drive and the one model they all serve."""

    models: list[ModelConfig]
    engines: list[EngineConfig]

    @property
    def model(self) -> ModelConfig:
        """The model every engine serves."""
        return self.models[0]


class ResetError(RuntimeError):
    """An engine answered the prefix-cache reset with neither success nor "not served here"."""


def load_engines_file(path: Path) -> EnginesFile:
    """Decode and check `path`; ValueError naming the problem (one model, engines that serve it)."""
    raw = path.read_bytes()
    try:
        if path.suffix == ".json":
            parsed = msgspec.json.decode(raw, type=EnginesFile)
        else:
            parsed = msgspec.toml.decode(raw, type=EnginesFile)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(f"--engines-from {path}: {exc}") from exc
    if len(parsed.models) != 1 or not parsed.engines:
        raise ValueError(f"--engines-from {path}: give exactly one [[models]] and at least one [[engines]]")
    name = parsed.model.name
    engines = [
        msgspec.structs.replace(e, model=e.model or name, url=e.url.rstrip("/")) for e in parsed.engines
    ]
    other = sorted({e.model for e in engines} - {name})
    if other:
        raise ValueError(f"--engines-from {path}: engines serve {other}, not the model {name!r}")
    return msgspec.structs.replace(parsed, engines=engines)


def refuse_stub_policies(policies: Sequence[str]) -> None:
    """ValueError when `policies` name one that needs engine stubs."""
    bad = [p for p in policies if p in NEEDS_STUBS]
    if bad:
        raise ValueError(f"policies {bad} read engine stubs' true caches and cannot run with --engines-from")


async def reset_caches(
    session: aiohttp.ClientSession, engines: Sequence[StubEndpoint], model: str, timeout_s: float = 60.0
) -> list[str]:
    """Empty every engine's prefix cache and make it publish the clear; the names of the engines that
    do not serve `POST /reset_prefix_cache` (404/405: vLLM without VLLM_SERVER_DEV_MODE=1)."""
    unavailable = []
    async with asyncio.timeout(timeout_s):
        for engine in engines:
            if await _reset_one(session, engine.url):
                await _flush(session, engine.url, model)
            else:
                unavailable.append(engine.name)
    return unavailable


async def _reset_one(session: aiohttp.ClientSession, url: str) -> bool:
    while True:
        async with session.post(f"{url}/reset_prefix_cache") as r:
            if r.status in (404, 405):
                return False
            if r.status != 200:
                raise ResetError(f"{url}/reset_prefix_cache answered {r.status}: {await r.text()}")
            if msgspec.json.decode(await r.read(), type=dict[str, object]).get("success"):
                return True
        await asyncio.sleep(0.05)  # polling a condition (held blocks freed) under the caller's timeout


async def _flush(session: aiohttp.ClientSession, url: str, model: str) -> None:
    """A 1-token request: vLLM queues the AllBlocksCleared event until its next step."""
    body = {"model": model, "prompt": [7], "max_tokens": 1}
    async with session.post(f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        await r.read()


MIRROR_BLOCKS = "kvrouter_engine_mirror_blocks"


async def mirror_blocks(session: aiohttp.ClientSession, gateway_url: str) -> int:
    """The blocks a gateway's mirrors hold, over every engine (its `/metrics`)."""
    async with session.get(f"{gateway_url}/metrics") as r:
        r.raise_for_status()
        text = await r.text()
    families = text_string_to_metric_families(text)
    return int(sum(s.value for f in families for s in f.samples if s.name == MIRROR_BLOCKS))


async def await_cold_mirror(
    session: aiohttp.ClientSession, gateway_url: str, timeout_s: float = 30.0
) -> None:
    """Wait until the gateway applied the engines' clears (its mirrors hold no block)."""
    async with asyncio.timeout(timeout_s):
        while await mirror_blocks(session, gateway_url):
            await asyncio.sleep(0.05)  # polling a condition (the clear events applied) under the timeout
