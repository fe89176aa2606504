"""No request body makes the gateway answer 5xx: bad ones are OpenAI-format 4xx naming the field,
and every answer is counted in `kvrouter_requests_total` (#10 item 7).

The known cases come first; then hypothesis (derandomized, bounded) drives bodies shaped like the
OpenAI request schema with wrong types, out-of-range numbers and deep nesting, and raw bytes, through
the real gateway (uvicorn) over a real engine stub.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.core.errors import ErrorBody
from router.settings.config import ModelConfig
from tests.gateway_helpers import (
    Gateway,
    engine_of,
    gateway_config,
    metric,
    running_gateway,
    running_stubs,
    wait_for,
)
from tests.stub_helpers import stub_config

MODEL = "kvrouter-stub"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
DEEP = b"[" * 10_000 + b"]" * 10_000


def deep_in(field: str, chat: bool = False) -> bytes:
    head = b'{"model": "kvrouter-stub", "messages": [{"role": "user", "content": "hi"}], ' if chat else b"{"
    return head + b'"' + field.encode() + b'": ' + DEEP + b"}"


KNOWN: list[tuple[str, bytes, str]] = [
    # (path, body, what the error names)
    (COMPLETIONS, b'{"model": "kvrouter-stub", "prompt": [-2, 5]}', "prompt[0]"),
    (COMPLETIONS, b'{"model": "kvrouter-stub", "prompt": [5, 4294967296]}', "prompt[1]"),
    (COMPLETIONS, b'{"model": "kvrouter-stub", "prompt": [100000000000000000000]}', "prompt[0]"),
    (COMPLETIONS, b'{"model": "kvrouter-stub", "prompt": [1e20]}', "prompt[0]"),
    (COMPLETIONS, b'{"model": "kvrouter-stub", "prompt": [[1, 2], [3, -1]]}', "prompt[1][1]"),
    (COMPLETIONS, deep_in("prompt"), "nested"),
    (COMPLETIONS, deep_in("unknown_field"), "nested"),
    (CHAT, deep_in("chat_template_kwargs", chat=True), "nested"),
    (CHAT, deep_in("tools", chat=True), "nested"),
    (
        CHAT,
        b'{"model": "kvrouter-stub", "messages": [{"role": "user", "content": 7}]}',
        "messages[0].content",
    ),
    (CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', "UTF-8"),
]


def error_of(answer: httpx.Response) -> ErrorBody:
    assert answer.headers["content-type"].startswith("application/json"), answer.headers
    return msgspec.json.decode(answer.content, type=ErrorBody)


async def test_known_bad_bodies_are_400s_naming_the_field_and_counted() -> None:
    async with fuzz_gateway() as gw:
        for path, body, named in KNOWN:
            answer = await gw.client.post(path, content=body, headers={"content-type": "application/json"})
            assert answer.status_code == 400, (body[:80], answer.text)
            error = error_of(answer).error
            assert error.type == "invalid_request_error", error
            assert named in error.message or named == error.param, (named, error)
        await wait_for(lambda: requests_counted(gw, "400", len(KNOWN)))


async def requests_counted(gw: Gateway, status: str, n: int) -> bool:
    text = (await gw.client.get("/metrics")).text
    return metric(text, "kvrouter_requests_total", status=status) == n


@asynccontextmanager
async def fuzz_gateway(models: list[ModelConfig] | None = None) -> AsyncIterator[Gateway]:
    """A gateway over one fast stub that answers few tokens (max_tokens unset: 4)."""
    async with running_stubs(1, stub_config(default_max_tokens=4)) as stubs:
        async with running_gateway(gateway_config([engine_of("e0", stubs[0])], models=models or [])) as gw:
            yield gw


# --- strategies: the OpenAI request schema, with every field also allowed to be anything ---

ODD_INTS = st.sampled_from([-(2**63), -2, -1, 0, 1, 2**31, 2**32 - 1, 2**32, 2**63, 2**64, 10**30])
INTS = st.integers(min_value=0, max_value=300) | ODD_INTS | st.integers()
FLOATS = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([1e20, -0.0, 1e308, 0.5])
TEXT = st.text(max_size=40) | st.sampled_from(["", "hello world", "\u0000", "\ud7ff\ue000", "{{ x }}", "<s>"])
SCALARS = st.none() | st.booleans() | INTS | FLOATS | TEXT
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)


def maybe(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly values of the schema's type, sometimes any JSON at all."""
    return valid | valid | JSON


TOKEN_IDS = st.lists(st.integers(min_value=0, max_value=50_000) | ODD_INTS, min_size=0, max_size=12)
PROMPT = maybe(TEXT | st.lists(TEXT, max_size=3) | TOKEN_IDS | st.lists(TOKEN_IDS, max_size=3))
COMMON = {
    "max_tokens": maybe(st.integers(min_value=1, max_value=4) | INTS),
    "stream": maybe(st.booleans()),
    "cache_salt": maybe(TEXT),
    "prompt_logprobs": maybe(st.none() | INTS),
    "vllm_xargs": maybe(
        st.fixed_dictionaries({"kv_cache_report_mode": maybe(st.sampled_from(["full", "x"]))})
    ),
}
COMPLETION = st.fixed_dictionaries(
    {"model": maybe(st.just(MODEL)), "prompt": PROMPT},
    optional={**COMMON, "add_special_tokens": maybe(st.booleans())},
)
PART = st.fixed_dictionaries({"type": maybe(st.sampled_from(["text", "image_url"])), "text": maybe(TEXT)})
MESSAGE = st.fixed_dictionaries(
    {"role": maybe(st.sampled_from(["user", "assistant", "system", "tool", "developer", "other"]))},
    optional={
        "content": maybe(TEXT | st.none() | st.lists(PART, max_size=3)),
        "name": maybe(TEXT),
        "tool_calls": maybe(
            st.lists(st.fixed_dictionaries({"function": maybe(st.fixed_dictionaries({"name": TEXT}))}))
        ),
        "tool_call_id": maybe(TEXT),
        "reasoning_content": maybe(TEXT),
    },
)
TOOL = st.fixed_dictionaries(
    {"type": st.just("function"), "function": maybe(st.fixed_dictionaries({"name": TEXT}))}
)
CHAT_BODY = st.fixed_dictionaries(
    {"model": maybe(st.just(MODEL)), "messages": maybe(st.lists(MESSAGE, min_size=1, max_size=4))},
    optional={
        **COMMON,
        "tools": maybe(st.lists(TOOL, max_size=2)),
        "add_generation_prompt": maybe(st.booleans()),
        "continue_final_message": maybe(st.booleans()),
        "add_special_tokens": maybe(st.booleans()),
        "chat_template_kwargs": maybe(st.dictionaries(TEXT, JSON, max_size=3)),
        "documents": maybe(st.lists(st.dictionaries(TEXT, TEXT, max_size=2), max_size=2)),
        "max_completion_tokens": maybe(st.integers(min_value=1, max_value=4) | INTS),
    },
)


def encoded(body: Any) -> bytes:
    """JSON as Python writes it: NaN and Infinity come out as (invalid) bare words, as some clients send."""
    return json.dumps(body).encode()


def mangled(data: bytes) -> st.SearchStrategy[bytes]:
    """`data` cut short, with bytes inserted, or as is."""
    cut = st.integers(min_value=0, max_value=len(data)).map(lambda n: data[:n])
    insert = st.tuples(st.integers(min_value=0, max_value=len(data)), st.binary(min_size=1, max_size=4)).map(
        lambda p: data[: p[0]] + p[1] + data[p[0] :]
    )
    return st.just(data) | st.just(data) | cut | insert


REQUESTS = st.one_of(
    st.tuples(st.just(COMPLETIONS), COMPLETION.map(encoded).flatmap(mangled)),
    st.tuples(st.just(CHAT), CHAT_BODY.map(encoded).flatmap(mangled)),
    st.tuples(st.sampled_from([COMPLETIONS, CHAT]), st.binary(max_size=64)),
)
FUZZ = settings(
    derandomize=True,
    database=None,
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def test_no_request_body_makes_a_5xx_and_every_answer_is_counted() -> None:
    async def main() -> None:
        async with fuzz_gateway() as gw:
            statuses: Counter[str] = Counter()
            await asyncio.to_thread(fuzz, gw.url, statuses)
            assert statuses["200"] > 0 and statuses["400"] > 0  # both valid and invalid bodies were sent
            for status, n in statuses.items():
                await wait_for(lambda s=status, n=n: requests_counted(gw, s, n))  # type: ignore[misc]

    asyncio.run(main())


def fuzz(url: str, statuses: Counter[str]) -> None:
    with httpx.Client(base_url=url, timeout=30.0) as client:

        @FUZZ
        @given(REQUESTS)
        def one(request: tuple[str, bytes]) -> None:
            path, body = request
            answer = client.post(path, content=body, headers={"content-type": "application/json"})
            statuses[str(answer.status_code)] += 1
            assert answer.status_code < 500, (body[:200], answer.status_code, answer.text[:300])
            if answer.status_code >= 400:
                error = error_of(answer).error
                assert error.message, answer.text

        one()


async def test_a_gateway_failure_is_an_openai_500_counted_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    template = tmp_path / "broken.jinja"
    template.write_text("{{ 1 // 0 }}")  # an operator's template bug: the gateway's fault, not the client's
    async with fuzz_gateway([ModelConfig(name=MODEL, chat_template=str(template))]) as gw:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        answer = await gw.client.post(CHAT, json=body, headers={"x-request-id": "bug-1"})
        assert answer.status_code == 500 and answer.headers["x-request-id"] == "bug-1"
        assert error_of(answer).error.type == "internal_error"
        assert any(r.exc_info and isinstance(r.exc_info[1], ZeroDivisionError) for r in caplog.records)
        await wait_for(lambda: requests_counted(gw, "500", 1))
