"""Agent sessions as a load-test workload (`kvrouter loadtest --workload agents`). Pure.

An agent session runs on one app: the app's prefix (its system prompt and tool definitions, shared
by every session of that app; the second half stands for the tools when `--api` sends
conversations), the session's task, then steps. Each step sends the whole context so
far and gets an answer (a tool call); the answer and the tool's result join the context, and the
next step is sent once the tool has run, so every step resends the previous step's prompt and grows
it by one answer and one tool result. Apps have prefixes of several sizes (spread evenly from
`prefix_tokens_min` to `prefix_tokens_max`), sessions pick an app at random and start at Poisson
arrivals (`session_rate` per second), so many run at once and most of every prompt is a prefix seen
before (on whichever engine saw it).

Timing: arrivals are precomputed (the harness sends open loop), so a step's answer is modelled, not
awaited: step k+1 arrives at step k's arrival + its expected answer time (`answer_s_per_token` x its
output tokens, a loaded engine's decode pace) + a tool time drawn from [`tool_s_min`, `tool_s_max`].
An answer slower than expected does not delay the next step. `--load` rescales every time.

Sizes: the defaults are full size (prefixes of 6k-20k tokens); every prompt piece (prefix, task,
tool result) is scaled by `block_tokens / 512`, the trace workload's shrink knob (`--block-tokens`),
so a test runs the same shape in seconds. Output lengths are not scaled (as for traces);
`max_output_tokens` caps them, and the context carries each answer at its capped length.
Everything is drawn from one `random.Random(seed)`: the same seed gives the same requests.
"""

from __future__ import annotations

import random
from typing import Final

import msgspec

from kvrouter.loadtest.workload import MOONCAKE_BLOCK_TOKENS, RequestSpec, block_token_ids

__all__ = ["AgentWorkload", "agent_requests"]

# Block-id namespaces of the pieces (for `block_token_ids`), clear of the other workloads' and of
# each other up to 100,000 sessions.
_APP, _TASK, _ANSWER, _TOOL = 10**9, 2 * 10**9, 3 * 10**9, 4 * 10**9
_PER_SESSION: Final = 10_000  # step ids within a session's answer and tool namespaces


class AgentWorkload(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Agent sessions on shared app prefixes, growing by a tool result per step (see the module doc)."""

    sessions: int = 48
    apps: int = 6
    prefix_tokens_min: int = 6000
    prefix_tokens_max: int = 20000
    task_tokens: int = 200
    steps_min: int = 4
    steps_max: int = 28
    tool_result_tokens_min: int = 100
    tool_result_tokens_max: int = 1500
    output_tokens_min: int = 30
    output_tokens_max: int = 300
    session_rate: float = 0.5
    """Session starts per second (Poisson)."""
    tool_s_min: float = 0.5
    tool_s_max: float = 5.0
    answer_s_per_token: float = 0.02
    """Expected seconds per output token of an answer (the step's decode at a loaded engine's pace)."""
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    """Prompt pieces are scaled by block_tokens / 512 (512: full size)."""
    max_output_tokens: int | None = None
    seed: int = 0

    def validate(self) -> None:
        """ValueError naming the first setting that cannot give a workload."""
        if min(self.sessions, self.apps, self.steps_min, self.block_tokens, self.output_tokens_min) < 1:
            raise ValueError(
                "agents: sessions, apps, steps_min, block_tokens and output_tokens_min must be >= 1"
            )
        for low, high, name in (
            (self.prefix_tokens_min, self.prefix_tokens_max, "prefix_tokens"),
            (self.steps_min, self.steps_max, "steps"),
            (self.tool_result_tokens_min, self.tool_result_tokens_max, "tool_result_tokens"),
            (self.output_tokens_min, self.output_tokens_max, "output_tokens"),
            (self.tool_s_min, self.tool_s_max, "tool_s"),
        ):
            if not 0 <= low <= high:
                raise ValueError(f"agents: {name} needs 0 <= min <= max, got {low:g}..{high:g}")
        if self.session_rate <= 0 or self.answer_s_per_token < 0:
            raise ValueError("agents: session_rate must be > 0 and answer_s_per_token >= 0")

    def scaled(self, tokens: int) -> int:
        """A prompt piece's full-size length at this workload's `block_tokens` (at least 1 token)."""
        return max(1, round(tokens * self.block_tokens / MOONCAKE_BLOCK_TOKENS))

    def prefix_sizes(self) -> list[int]:
        """Each app's prefix length (scaled), spread evenly from the smallest to the largest."""
        span = self.prefix_tokens_max - self.prefix_tokens_min
        return [
            self.scaled(self.prefix_tokens_min + span * a // max(1, self.apps - 1)) for a in range(self.apps)
        ]


def agent_requests(spec: AgentWorkload) -> list[RequestSpec]:
    """Every step of every session as a request, in arrival order (session `agent-<n>`)."""
    spec.validate()
    rng = random.Random(spec.seed)
    prefixes = [block_token_ids(_APP + a, n, spec.seed) for a, n in enumerate(spec.prefix_sizes())]
    out: list[RequestSpec] = []
    start = 0.0
    for s in range(spec.sessions):
        start += rng.expovariate(spec.session_rate)
        prefix = prefixes[rng.randrange(spec.apps)]
        context = prefix + block_token_ids(_TASK + s, spec.scaled(spec.task_tokens), spec.seed)
        ends = [len(prefix)]  # the app's prefix: its system prompt, then its tools (the second half)
        arrival = start
        for step in range(rng.randint(spec.steps_min, spec.steps_max)):
            answer = rng.randint(spec.output_tokens_min, spec.output_tokens_max)
            if spec.max_output_tokens is not None:
                answer = min(answer, spec.max_output_tokens)
            turns, tools = tuple(ends), len(prefix) // 2
            request = RequestSpec(
                arrival_s=arrival,
                prompt=list(context),
                max_tokens=answer,
                session=f"agent-{s}",
                turns=turns,
                tools=tools,
            )
            out.append(request)
            tool = spec.scaled(rng.randint(spec.tool_result_tokens_min, spec.tool_result_tokens_max))
            key = s * _PER_SESSION + step
            ends.append(len(context))  # the task or the last tool result ends here
            context += block_token_ids(_ANSWER + key, answer, spec.seed)
            ends.append(len(context))  # the answer (a tool call) ends here
            context += block_token_ids(_TOOL + key, tool, spec.seed)
            arrival += answer * spec.answer_s_per_token + rng.uniform(spec.tool_s_min, spec.tool_s_max)
    return sorted(out, key=lambda r: r.arrival_s)  # stable: a session's steps keep their order
