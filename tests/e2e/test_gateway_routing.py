"""The gateway end to end: real stubs, real uvicorn, the real `openai` client (sync and async)."""

from __future__ import annotations

import msgspec
import openai
from openai.types.chat import ChatCompletionMessageParam

from router.ops.debug import Explanation
from router.settings.config import EngineConfig, ModelConfig
from tests.gateway_helpers import (
    ADMIN,
    Gateway,
    engine_of,
    gateway_config,
    mirrors_caught_up,
    running_gateway,
    running_stubs,
    wait_for,
)

SYSTEM = "You are a careful assistant. " * 40  # a long shared prefix (many full blocks)
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}


def chat(*turns: str) -> list[ChatCompletionMessageParam]:
    messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": SYSTEM}]
    for i, text in enumerate(turns):
        if i % 2 == 0:
            messages.append({"role": "user", "content": text})
        else:
            messages.append({"role": "assistant", "content": text})
    return messages


async def predicted_for(gw: Gateway, messages: list[ChatCompletionMessageParam]) -> int:
    body = msgspec.json.encode({"model": "kvrouter-stub", "messages": messages, "max_tokens": 4})
    answer = await gw.client.post("/debug/route", content=body, headers=ADMIN_AUTH)
    assert answer.status_code == 200, answer.text
    return msgspec.json.decode(answer.content, type=Explanation).decision.predicted_cached_tokens


async def test_shared_prefix_lands_on_the_warm_engine_and_prediction_is_exact() -> None:
    async with running_stubs(2) as stubs:
        config = gateway_config([engine_of(f"e{i}", s) for i, s in enumerate(stubs)])
        async with running_gateway(config) as gw:
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
            first = chat("Tell me about prefix caching.")
            raw = await client.chat.completions.with_raw_response.create(
                model="kvrouter-stub",
                messages=first,
                max_tokens=4,
            )
            warm = raw.headers["x-kvrouter-engine"]
            assert raw.headers["x-kvrouter-predicted-cached-tokens"] == "0"
            answer = raw.parse().choices[0].message.content or ""
            follow = chat("Tell me about prefix caching.", answer, "And about routing?")
            caught_up = mirrors_caught_up(gw, {f"e{i}": s for i, s in enumerate(stubs)})
            for _ in range(3):  # every turn of the conversation stays on the warm engine
                await wait_for(caught_up)
                assert await predicted_for(gw, follow) > 0
                raw = await client.chat.completions.with_raw_response.create(
                    model="kvrouter-stub",
                    messages=follow,
                    max_tokens=4,
                )
                completion = raw.parse()
                assert raw.headers["x-kvrouter-engine"] == warm
                assert completion.usage is not None and completion.usage.prompt_tokens_details is not None
                actual = completion.usage.prompt_tokens_details.cached_tokens
                assert actual is not None and actual > 0
                assert int(raw.headers["x-kvrouter-predicted-cached-tokens"]) == actual
                assert raw.headers["x-request-id"]
            await client.close()


async def test_remote_tokenization_predicts_exactly() -> None:
    async with running_stubs(2) as stubs:
        engines = [engine_of(f"e{i}", s) for i, s in enumerate(stubs)]
        model = ModelConfig(name="kvrouter-stub", remote_tokenize=True)
        async with running_gateway(gateway_config(engines, models=[model])) as gw:
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
            prompt = "remote tokens " * 20
            first = await client.completions.with_raw_response.create(
                model="kvrouter-stub", prompt=prompt, max_tokens=2
            )
            await wait_for(mirrors_caught_up(gw, {f"e{i}": s for i, s in enumerate(stubs)}))
            raw = await client.completions.with_raw_response.create(
                model="kvrouter-stub", prompt=prompt + "and more", max_tokens=2
            )
            usage = raw.parse().usage
            assert raw.headers["x-kvrouter-engine"] == first.headers["x-kvrouter-engine"]
            assert usage is not None and usage.prompt_tokens_details is not None
            actual = usage.prompt_tokens_details.cached_tokens
            assert actual and int(raw.headers["x-kvrouter-predicted-cached-tokens"]) == actual
            await client.close()
            assert "kvrouter_remote_tokenize_failures_total 0.0" in (await gw.client.get("/metrics")).text


async def test_remote_tokenization_falls_back_to_the_local_tokenizer() -> None:
    dead = EngineConfig(name="dead", url="http://127.0.0.1:9", model="kvrouter-stub")
    model = ModelConfig(name="kvrouter-stub", remote_tokenize=True)
    async with running_gateway(gateway_config([dead], models=[model])) as gw:
        body = msgspec.json.encode({"model": "kvrouter-stub", "prompt": "hello " * 40, "max_tokens": 1})
        answer = await gw.client.post("/debug/route", content=body, headers=ADMIN_AUTH)
        assert answer.status_code == 200, answer.text
        explained = msgspec.json.decode(answer.content, type=Explanation)
        assert explained.decision.engine == "dead"
        assert "kvrouter_remote_tokenize_failures_total 1.0" in (await gw.client.get("/metrics")).text
