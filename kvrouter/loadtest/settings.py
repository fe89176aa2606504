"""Every `kvrouter loadtest` option, typed: the command's defaults, and what `summary.json` records. Pure.

`LoadtestSettings` is the one definition of the options' names, types and defaults: the command's
parser takes its defaults from it, and a run's settings are its parsed arguments converted to it
(a test checks that every option of the parser is a field here).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import msgspec

__all__ = ["LoadtestSettings", "parse_policies"]


class LoadtestSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The options of one load test as given (None: not given); field names are the flags' dests.

    With `engine_config`, the stubs' pool and block size come from that file, not from
    `num_gpu_blocks` and `block_size`.
    """

    engines: int = 2
    engine_config: str | None = None
    num_gpu_blocks: int = 2048
    block_size: int = 16
    workload: str = "synthetic"
    policies: list[str] = msgspec.field(
        default_factory=lambda: ["kv", "round_robin", "least_loaded", "oracle"]
    )
    router: str | None = None
    stub_base_port: int | None = None
    requests: int | None = None
    duration: float | None = None
    rate: float = 20.0
    time_scale: float = 1.0
    block_tokens: int = 512
    max_output_tokens: int | None = None
    seed: int = 0
    system_prompts: int = 4
    system_prompt_tokens: int = 1024
    users: int = 16
    turns: int = 4
    out: str | None = None

    @classmethod
    def from_args(cls, args: Mapping[str, object]) -> LoadtestSettings:
        """The settings of parsed arguments (`vars(namespace)`; keys that are not options are ignored)."""
        values = {name: args[name] for name in cls.__struct_fields__ if name in args}
        if isinstance(values.get("policies"), str):
            values["policies"] = parse_policies(str(values["policies"]))
        values = {k: str(v) if isinstance(v, Path) else v for k, v in values.items()}
        return msgspec.convert(values, cls)


def parse_policies(text: str) -> list[str]:
    """`--policies a,b` as a list (blanks dropped)."""
    return [p.strip() for p in text.split(",") if p.strip()]
