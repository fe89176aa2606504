"""Debugging by replay: rebuild a gateway recording's mirror, recompute and compare its decisions.

`Setup` (config, replicas, models) -> `Rebuild` (the mirror from the frames) -> `Replayer` (requests
prepared again, decisions recomputed with a fresh scorer) -> `compare` and `explain_*` (reports).
`kvrouter replay` and `kvrouter explain` (kvrouter/cmd_replay.py, cmd_explain.py) are the commands.
"""

from __future__ import annotations

from kvrouter.replay.compare import Comparison, Difference, compare, render_comparison
from kvrouter.replay.decisions import DecisionReplay, Replayer, candidates_now, predict, recorded_candidates
from kvrouter.replay.explain import NewPromptExplanation, explain_prompt, explain_request, render_decision
from kvrouter.replay.link import LinkReplay
from kvrouter.replay.rebuild import Rebuild, ReplicaReplay
from kvrouter.replay.setup import ReplayConfigError, ReplicaInfo, Setup, config_of
from kvrouter.replay.source import Cut, parse_time, records
from kvrouter.replay.state import ReplayState, ReplicaState, render_state, state_of

__all__ = [
    "Comparison",
    "Cut",
    "DecisionReplay",
    "Difference",
    "LinkReplay",
    "NewPromptExplanation",
    "Rebuild",
    "ReplayConfigError",
    "ReplayState",
    "Replayer",
    "ReplicaInfo",
    "ReplicaReplay",
    "ReplicaState",
    "Setup",
    "candidates_now",
    "compare",
    "config_of",
    "explain_prompt",
    "explain_request",
    "parse_time",
    "predict",
    "recorded_candidates",
    "records",
    "render_comparison",
    "render_decision",
    "render_state",
    "state_of",
]
