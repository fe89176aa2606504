"""Requests through the gateway to real engines, each recorded as predicted vs actual cached tokens.

Predicted is the gateway's `x-kvrouter-predicted-cached-tokens` header; actual is the engine's
`usage.prompt_tokens_details.cached_tokens` (the last SSE chunk's, when streamed with include_usage),
or for the agent APIs (JSON answers) Messages' `usage.cache_read_input_tokens` and Responses'
`usage.input_tokens_details.cached_tokens`.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

from router.core.ids import EngineId
from tests.gateway_helpers import Gateway, wait_for
from tests.vllm.engine_pair import EnginePair
from tests.vllm.replay_probe import last_published_seq

__all__ = ["Outcome", "Traffic", "caught_up"]

MAX_TOKENS = 8


@dataclass(frozen=True)
class Outcome:
    """One request: where it went, what the gateway predicted, what the engine reported, what it returned."""

    request_id: str
    kind: str
    engine: str
    predicted: int
    actual: int
    text: str
    token_ids: list[int]

    @property
    def exact(self) -> bool:
        """The prediction equals the engine's report."""
        return self.predicted == self.actual


@dataclass(frozen=True)
class Answer:
    """What the engine returned for one request: its `actual` cached tokens, the text, the token ids."""

    actual: int
    text: str
    token_ids: list[int]


@dataclass
class Traffic:
    """Sends requests through one gateway and keeps every outcome in order."""

    gw: Gateway
    model: str
    xargs: dict[str, str] = field(default_factory=dict)
    outcomes: list[Outcome] = field(default_factory=list)

    def _body(self, body: dict[str, Any], stream: bool) -> dict[str, Any]:
        body = {"model": self.model, "max_tokens": MAX_TOKENS, "temperature": 0.0, **body}
        if self.xargs:
            body["vllm_xargs"] = self.xargs
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        return body

    async def chat(self, messages: list[dict[str, str]], stream: bool = False) -> Outcome:
        """A chat completion; the outcome's text is the assistant's reply."""
        return await self._send(
            "/v1/chat/completions", "chat", self._body({"messages": messages}, stream), stream
        )

    async def completion(self, prompt: str | list[int], stream: bool = False) -> Outcome:
        """A completion from text or token ids; the outcome carries the output token ids."""
        kind = "tokens" if isinstance(prompt, list) else "text"
        body = self._body({"prompt": prompt, "return_token_ids": True}, stream)
        return await self._send("/v1/completions", kind, body, stream)

    async def _send(self, path: str, kind: str, body: dict[str, Any], stream: bool) -> Outcome:
        rid = f"{kind}-{uuid.uuid4().hex[:12]}"
        headers = {"x-request-id": rid}
        if stream:
            async with self.gw.client.stream("POST", path, json=body, headers=headers, timeout=120.0) as resp:
                assert resp.status_code == 200, await resp.aread()
                chunks = [json.loads(line[6:]) async for line in resp.aiter_lines() if _is_data(line)]
            usage = chunks[-1]["usage"]
            text = "".join(_delta(c) for c in chunks if c.get("choices"))
            ids = [t for c in chunks for ch in c.get("choices", []) for t in ch.get("token_ids") or []]
        else:
            resp = await self.gw.client.post(path, json=body, headers=headers, timeout=120.0)
            assert resp.status_code == 200, resp.text
            reply = resp.json()
            usage, choice = reply["usage"], reply["choices"][0]
            text = choice["message"]["content"] or "" if "message" in choice else choice["text"]
            ids = list(choice.get("token_ids") or [])
        actual = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        return self._keep(rid, kind + ("-stream" if stream else ""), resp.headers, Answer(actual, text, ids))

    async def message(self, system: str, messages: list[dict[str, str]]) -> Outcome:
        """An Anthropic Messages request (JSON); the outcome's text is the reply's text blocks."""
        body = {"model": self.model, "max_tokens": MAX_TOKENS, "temperature": 0.0, "system": system}
        reply, headers, rid = await self._post("/v1/messages", "messages", body | {"messages": messages})
        text = "".join(b.get("text", "") for b in reply["content"] if b.get("type") == "text")
        actual = int(reply["usage"].get("cache_read_input_tokens") or 0)
        return self._keep(rid, "messages", headers, Answer(actual, text, []))

    async def response(self, items: list[dict[str, str]]) -> Outcome:
        """An OpenAI Responses request (JSON, not stored); the outcome's text is its output text."""
        body = {"model": self.model, "max_output_tokens": MAX_TOKENS, "temperature": 0.0, "store": False}
        reply, headers, rid = await self._post("/v1/responses", "responses", body | {"input": items})
        text = "".join(
            c.get("text", "") for o in reply["output"] if o.get("type") == "message" for c in o["content"]
        )
        actual = int((reply["usage"].get("input_tokens_details") or {}).get("cached_tokens") or 0)
        return self._keep(rid, "responses", headers, Answer(actual, text, []))

    async def _post(
        self, path: str, kind: str, body: dict[str, Any]
    ) -> tuple[dict[str, Any], httpx.Headers, str]:
        """A JSON request to `path` under a fresh request id: its answer, the answer's headers, the id."""
        rid = f"{kind}-{uuid.uuid4().hex[:12]}"
        resp = await self.gw.client.post(path, json=body, headers={"x-request-id": rid}, timeout=120.0)
        assert resp.status_code == 200, resp.text
        return resp.json(), resp.headers, rid

    def _keep(self, rid: str, kind: str, headers: httpx.Headers, answer: Answer) -> Outcome:
        """The one builder of an `Outcome`: request `rid` of `kind`, routed as the gateway's answer
        `headers` say (`_routing`: its engine and predicted cached tokens), with the engine's
        `answer`; kept in `outcomes`, in order."""
        predicted, engine = _routing(headers)
        outcome = Outcome(
            request_id=rid,
            kind=kind,
            engine=engine,
            predicted=predicted,
            actual=answer.actual,
            text=answer.text,
            token_ids=answer.token_ids,
        )
        self.outcomes.append(outcome)
        return outcome


def _is_data(line: str) -> bool:
    return line.startswith("data: ") and line != "data: [DONE]"


def _delta(chunk: dict[str, Any]) -> str:
    choice = chunk["choices"][0]
    return str((choice.get("delta") or {}).get("content") or choice.get("text") or "")


def _routing(headers: Any) -> tuple[int, str]:
    return int(headers["x-kvrouter-predicted-cached-tokens"]), str(headers["x-kvrouter-engine"])


async def caught_up(gw: Gateway, pair: EnginePair, timeout_s: float = 30.0) -> None:
    """Wait until the gateway's mirror of each engine has applied every batch the engine has published."""
    for i, engine in enumerate(pair.engines):
        replica = gw.parts.fleet.replica(EngineId(f"vllm-{i}"))
        # From 0, not the mirror's last seq: a restarted engine numbers its batches from 0 again.
        target = await asyncio.to_thread(last_published_seq, engine.replay)

        async def applied(replica: Any = replica, target: int = target) -> bool:
            return replica.last_seq is not None and replica.last_seq >= target and not replica.replaying

        await wait_for(applied, timeout_s)
