"""Every `kvrouter loadtest` option, typed: the command's defaults, and what `summary.json` records. Pure.

`LoadtestSettings` is the one definition of the options' names, types and defaults: the command's
parser takes its defaults from it, and a run's settings are its parsed arguments converted to it
(a test checks that every option of the parser is a field here).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Literal

import msgspec

__all__ = ["LoadtestSettings", "parse_policies", "parse_routers"]


class LoadtestSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The options of one load test as given (None: not given); field names are the flags' dests.

    With `engine_config`, the stubs' block size comes from that file, not from `block_size`, and so
    does their pool unless `num_gpu_blocks` is given; with neither, the pool is an H100 80 GB's for
    an 8B model (`engine_stub.runtime.cost_model.H100_8B`). `time_scale` (trace timing, default 1) and `load`
    (arrivals scaled so the stubs are that busy by their own time model, `plan.py`) exclude each other.
    """

    engines: int = 2
    engine_config: str | None = None
    engines_from: str | None = None
    num_gpu_blocks: int | None = None
    block_size: int = 16
    workload: str = "synthetic"
    policies: list[str] = msgspec.field(
        default_factory=lambda: [
            "kv",
            "round_robin",
            "least_loaded",
            "prefix_approx",
            "cache_oracle",
            "ttft_oracle",
        ]
    )
    router: list[str] | None = None
    ready_timeout: float = 60.0
    prompt_format: Literal["ids", "text"] = "ids"
    api: Literal["completions", "chat", "messages", "responses"] = "completions"
    stream: bool = True
    load: float | None = None
    stub_base_port: int | None = None
    requests: int | None = None
    duration: float | None = None
    rate: float = 20.0
    time_scale: float | None = None
    min_gap_ms: float = 10.0
    block_tokens: int = 512
    max_output_tokens: int | None = None
    seed: int = 0
    sessions: int = 48
    system_prompts: int = 4
    system_prompt_tokens: int = 1024
    users: int = 16
    user_turn_tokens: int = 128
    turns: int = 4
    out: str | None = None
    record_decisions: bool = False

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


def parse_routers(values: Sequence[str] | None, reserved: Collection[str] = ()) -> dict[str, str]:
    """Repeated `--router [NAME=]URL` as {policy name: URL}: an unnamed URL is policy `external`.
    ValueError for a name given twice, a name in `reserved` (the built-in policies) or a bad URL."""
    routers: dict[str, str] = {}
    for value in values or ():
        name, sep, url = value.partition("=")
        if not sep or "/" in name or ":" in name:
            name, url = "external", value
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--router {value!r}: give [NAME=]URL with an http:// or https:// URL")
        if name in routers or (name in reserved and name != "external"):
            raise ValueError(f"--router {value!r}: the policy name {name!r} is already taken")
        routers[name] = url
    return routers
