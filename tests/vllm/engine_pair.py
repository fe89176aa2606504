"""Two real vLLM engines serving one tiny model, one per CPU core, and the gateway config in front of them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import msgspec

from router.settings.config import EngineConfig, GroupConfig, ModelConfig
from tests.vllm.engine_command import EngineSpec
from tests.vllm.engine_launcher import VllmEngine
from tests.vllm.free_ports import free_ports
from tests.vllm.tiny_models import model_dir

__all__ = ["MODEL_GROUPS", "EnginePair", "Pool", "engine_pair"]

BLOCK = 32
MODEL_GROUPS: dict[str, list[GroupConfig]] = {
    "llama-fa": [],
    "gemma2-swa": [
        GroupConfig(kind="sliding_window", block_size=BLOCK, sliding_window=128),
        GroupConfig(kind="full_attention", block_size=BLOCK),
    ],
}
"""Each tiny model's KV-cache groups as vLLM 0.32.0 builds them (Gemma-2 numbers its window group 0)."""
NUM_GPU_BLOCKS = {"llama-fa": 40, "gemma2-swa": 72}
"""Small enough that the tests' traffic evicts; one 1024-token request needs 32 blocks of full attention,
and the hybrid 72 (its window group takes blocks from the same pool)."""


class Pool(msgspec.Struct, frozen=True, kw_only=True):
    """Each engine's KV pool (`--num-gpu-blocks-override`, of `BLOCK` tokens) and longest prompt."""

    num_gpu_blocks: int
    max_model_len: int = 1024


class EnginePair:
    """Two engines of one model and what the gateway needs to route to them."""

    def __init__(
        self, model: str, engines: list[VllmEngine], chat_template: Path, groups: list[GroupConfig]
    ) -> None:
        self.model = model
        self.engines = engines
        self.chat_template = chat_template
        self.groups = groups

    def engine_configs(self, report_mode: str = "incremental") -> list[EngineConfig]:
        """The `[[engines]]` tables for the pair (events and replay endpoints, one DP rank each)."""
        return [
            EngineConfig(
                name=f"vllm-{i}", url=e.url, model=self.model, events=[e.events], replay=[e.replay],
                report_mode="full" if report_mode == "full" else "incremental",
            )
            for i, e in enumerate(self.engines)
        ]  # fmt: skip

    def model_config(self, hashing: str) -> ModelConfig:
        """The `[[models]]` table: the tokenizer, the chat template, the groups, `hashing`."""
        return ModelConfig(
            name=self.model,
            tokenizer=str(Path(self.engines[0].spec.model_dir) / "tokenizer.json"),
            chat_template=str(self.chat_template),
            block_size=self.engines[0].spec.block_size,
            groups=self.groups,
            hashing="vllm" if hashing == "vllm" else "router",
        )

    def reset_caches(self) -> None:
        """Empty both engines' prefix caches, then send each a 1-token request so the engine publishes
        the AllBlocksCleared event (vLLM queues it until its next step)."""
        with httpx.Client(timeout=60.0) as client:
            for i, e in enumerate(self.engines):
                done = client.post(f"{e.url}/reset_prefix_cache")
                assert done.status_code == 200, done.text
                flush = {"model": self.model, "prompt": [7 + i], "max_tokens": 1}
                assert client.post(f"{e.url}/v1/completions", json=flush).status_code == 200


def _chat_template(model: str, out: Path) -> Path:
    """The model's chat template (from its committed tokenizer_config.json) as a Jinja file for the router."""
    config = json.loads((model_dir(model) / "tokenizer_config.json").read_text())
    out.write_text(config["chat_template"])
    return out


@contextmanager
def engine_pair(model: str, python: Path, work: Path, pool: Pool | None = None) -> Iterator[EnginePair]:
    """Start two engines of `model` (cores 0 and 1, free ports) with `pool` (default: the small one
    the exactness tests evict, `NUM_GPU_BLOCKS`), wait until both are healthy; stop both."""
    pool = pool or Pool(num_gpu_blocks=NUM_GPU_BLOCKS[model])
    engines = []
    ports = free_ports(6)  # one run for both engines: two runs picked apart could overlap
    for core in (0, 1):
        port, events, replay = ports[3 * core : 3 * core + 3]
        spec = EngineSpec(
            model_dir=str(model_dir(model)), served_name=model, port=port, events_port=events,
            replay_port=replay, core=core, block_size=BLOCK, num_gpu_blocks=pool.num_gpu_blocks,
            max_model_len=pool.max_model_len, python=str(python),
        )  # fmt: skip
        engines.append(VllmEngine(spec, work / f"{model}-{core}.log"))
    try:
        for e in engines:
            e.start()
        for e in engines:
            e.wait_ready()
        yield EnginePair(model, engines, _chat_template(model, work / f"{model}.jinja"), MODEL_GROUPS[model])
    finally:
        for e in engines:
            e.stop()
