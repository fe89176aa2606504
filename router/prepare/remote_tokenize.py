"""Asking an engine's `/tokenize` for a request's prompt ids, when the router cannot reproduce its tokenizer.

vLLM's `/tokenize` takes the completion fields (`model`, `prompt`, `add_special_tokens`) or the chat
fields (`messages`, `add_generation_prompt`, `continue_final_message`, `add_special_tokens`,
`chat_template_kwargs`, `tools`) and answers `{"count", "max_model_len", "tokens", "token_strs"}`.
The request body's own fields are passed through untouched (as raw JSON), so the engine tokenizes
exactly what it would serve. The ids then go to `Models.prepare_tokens`. Failures raise
`RemoteTokenizeError` (the caller falls back to routing without hits).
"""

from __future__ import annotations

import aiohttp
import msgspec

__all__ = ["RemoteTokenizeError", "RemoteTokenizer", "TokenizeReply", "tokenize_payload"]


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
    """Posts to `<engine url>/tokenize` over a shared aiohttp session."""

    def __init__(self, session: aiohttp.ClientSession, timeout_s: float = 2.0) -> None:
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def tokenize(self, base_url: str, body: bytes) -> list[int]:
        """The prompt ids the engine at `base_url` derives from `body`; RemoteTokenizeError on failure."""
        url = base_url.rstrip("/") + "/tokenize"
        headers = {"content-type": "application/json"}
        try:
            async with self._session.post(
                url, data=tokenize_payload(body), headers=headers, timeout=self._timeout
            ) as resp:
                data = await resp.read()
                if resp.status != 200:
                    raise RemoteTokenizeError(f"{url}: HTTP {resp.status}: {data[:200]!r}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise RemoteTokenizeError(f"{url}: {exc!r}") from exc
        try:
            reply = _REPLY.decode(data)
        except msgspec.DecodeError as exc:
            raise RemoteTokenizeError(f"{url}: not a /tokenize reply: {exc}") from exc
        if reply.count != len(reply.tokens):
            raise RemoteTokenizeError(f"{url}: count {reply.count} != {len(reply.tokens)} tokens")
        return reply.tokens
