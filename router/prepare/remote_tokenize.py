"""Asking an engine's `/tokenize` for a request's prompt ids, when the router cannot reproduce its tokenizer.

vLLM's `/tokenize` takes the completion fields (`model`, `prompt`, `add_special_tokens`) or the chat
fields (`messages`, `add_generation_prompt`, `continue_final_message`, `add_special_tokens`,
`chat_template_kwargs`, `tools`) and answers `{"count", "max_model_len", "tokens", "token_strs"}`.
The request body's own fields are passed through untouched (as raw JSON), so the engine tokenizes
exactly what it would serve. The ids then go to `Models.prepare_tokens`. Failures raise
`RemoteTokenizeError` (the caller falls back to routing without hits).

The exchange itself is the gateway's one HTTP client's (`router.edge.proxy.Proxy.call`, passed in as
a `Post`): its failures arrive already translated, as `UpstreamError`s.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec

from router.core.errors import UpstreamError
from router.core.ids import EngineId

__all__ = ["Post", "RemoteTokenizeError", "RemoteTokenizer", "TokenizeReply", "tokenize_payload"]

Post = Callable[[EngineId, str, str, bytes, float], Awaitable[tuple[int, bytes]]]
"""(engine, base URL, path, JSON body, timeout in seconds) -> (status, body) of the engine's whole
answer; a failed exchange raises `UpstreamError` (`router.edge.proxy.Proxy.call`)."""


class RemoteTokenizeError(Exception):
    """The engine's /tokenize failed or answered something that is not a token list."""


class TokenizeReply(msgspec.Struct):
    """vLLM's /tokenize answer (the fields the router reads)."""

    count: int
    tokens: list[int]
    max_model_len: int | None = None


_FIELDS_READ = (
    "model",
    "prompt",
    "messages",
    "add_special_tokens",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "tools",
)
_FIELDS = msgspec.json.Decoder(dict[str, msgspec.Raw])  # values stay raw JSON, passed through
_REPLY = msgspec.json.Decoder(TokenizeReply)


def tokenize_payload(body: bytes) -> bytes:
    """The /tokenize request body for an OpenAI completions or chat body (only the fields it reads)."""
    try:
        fields = _FIELDS.decode(body)
    except msgspec.DecodeError as exc:
        raise RemoteTokenizeError(f"cannot read the request body: {exc}") from exc
    return msgspec.json.encode({k: fields[k] for k in _FIELDS_READ if k in fields})


class RemoteTokenizer:
    """Posts to an engine's `/tokenize` through the gateway's HTTP client (`post`)."""

    def __init__(self, post: Post, timeout_s: float = 2.0) -> None:
        self._post = post
        self._timeout_s = timeout_s

    async def tokenize(self, engine: EngineId, base_url: str, body: bytes) -> list[int]:
        """The prompt ids `engine` (at `base_url`) derives from `body`; RemoteTokenizeError on failure."""
        url = base_url.rstrip("/") + "/tokenize"
        try:
            status, data = await self._post(
                engine, base_url, "/tokenize", tokenize_payload(body), self._timeout_s
            )
        except UpstreamError as exc:
            raise RemoteTokenizeError(f"{url}: {exc.message}") from exc
        if status != 200:
            raise RemoteTokenizeError(f"{url}: HTTP {status}: {data[:200]!r}")
        try:
            reply = _REPLY.decode(data)
        except msgspec.DecodeError as exc:
            raise RemoteTokenizeError(f"{url}: not a /tokenize reply: {exc}") from exc
        if reply.count != len(reply.tokens):
            raise RemoteTokenizeError(f"{url}: count {reply.count} != {len(reply.tokens)} tokens")
        return reply.tokens
