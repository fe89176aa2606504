"""Agent-shaped request bodies for the Anthropic Messages and OpenAI Responses tests, and the reading
of their named-event streams (tests/e2e/test_agent_apis.py, test_sessions.py, test_stored_responses.py)."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MODEL", "SYSTEM", "TOOLS", "messages_step", "responses_step", "sse_events"]

MODEL = "kvrouter-stub"
SYSTEM = "You are a careful coding agent working in a large repository. " * 4
TOOLS = [{"name": "bash", "description": "Run a shell command", "input_schema": {"type": "object"}}]


def messages_step(step: int, stream: bool) -> dict[str, Any]:
    """A Messages body: the session's first step, or its second (a tool call and its result added)."""
    turns: list[dict[str, Any]] = [{"role": "user", "content": "Find the failing test and fix it."}]
    if step == 2:
        use = {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"cmd": "pytest -x"}}
        result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "FAILED test_a.py::test_b"}
        turns += [
            {"role": "assistant", "content": [{"type": "text", "text": "Running the tests."}, use]},
            {"role": "user", "content": [result]},
        ]
    system = [{"type": "text", "text": SYSTEM}]
    return {
        "model": MODEL,
        "max_tokens": 4,
        "system": system,
        "tools": TOOLS,
        "messages": turns,
        "stream": stream,
    }


def responses_step(step: int, stream: bool) -> dict[str, Any]:
    """A Responses body: the session's first step, or its second (a function call and its output)."""
    items: list[dict[str, Any]] = [{"role": "user", "content": "Find the failing test and fix it."}]
    if step == 2:
        items += [
            {"type": "function_call", "call_id": "c1", "name": "bash", "arguments": '{"cmd": "pytest -x"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "FAILED test_a.py::test_b"},
        ]
    tools = [{"type": "function", "name": "bash", "parameters": {"type": "object"}}]
    fields = {"instructions": SYSTEM, "tools": tools, "input": items, "stream": stream}
    return {"model": MODEL, "max_output_tokens": 4, **fields}


def sse_events(text: str) -> list[dict[str, Any]]:
    """The JSON payloads of a named-event SSE stream, in order."""
    events = []
    for block in text.split("\n\n"):
        data = "".join(line[5:].strip() for line in block.split("\n") if line.startswith("data:"))
        if data:
            events.append(json.loads(data))
    return events
