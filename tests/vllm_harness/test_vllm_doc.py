"""docs/vllm.md shows the engine command, config and install steps the real-engine harness uses."""

from __future__ import annotations

import shlex
from pathlib import Path

import msgspec

from router.settings.config import decode_config
from tests.vllm.doc_blocks import code_blocks, shell_words
from tests.vllm.engine_command import EXAMPLE, shell_command
from tests.vllm.engine_launcher import VllmEngine
from tests.vllm.engine_pair import MODEL_GROUPS, EnginePair
from tests.vllm.vllm_venv import install_commands

SECOND = msgspec.structs.replace(EXAMPLE, port=8101, events_port=5559, replay_port=5560, core=1)


def example_pair() -> EnginePair:
    """The two engines the doc configures (nothing is started)."""
    engines = [VllmEngine(spec, Path("/dev/null")) for spec in (EXAMPLE, SECOND)]
    return EnginePair("tiny-llama", engines, Path("/models/tiny-llama/chat.jinja"), [])


def test_the_engine_command_is_the_harness_command() -> None:
    assert shell_words(code_blocks("sh")[0]) == [shlex.split(shell_command(EXAMPLE))]


def test_the_config_is_the_one_the_tests_route_with() -> None:
    config = decode_config(code_blocks("toml")[0], "docs/vllm.md")
    pair = example_pair()
    assert config.engines == pair.engine_configs()
    assert config.models == [pair.model_config("router")]


def test_the_hybrid_groups_are_the_gemma2_models() -> None:
    config = decode_config("\n".join(code_blocks("toml")[:2]), "docs/vllm.md")
    assert config.models[0].groups == MODEL_GROUPS["gemma2-swa"]


def test_the_install_steps_are_the_ones_make_test_vllm_runs() -> None:
    assert shell_words(code_blocks("sh")[-1]) == [argv for _, argv in install_commands(Path("V"))]
