"""Property, end to end through the real wire: the router predicts every admission lookup of the stub.

Random request streams (shared prefixes, branching, block-aligned resends, eviction pressure from a
small pool, LoRA, cache_salt, prompt_logprobs, full report mode) run on the engine stub's pure
Scheduler; each step's events go through a real EventPublisher over ZeroMQ on 127.0.0.1 to the
fleet's real EngineSubscriber and into the mirror. Before the step that looks a request up (scheduled
alone, so no other request's events precede its lookup), the router's `(hit, shared_prefix_boundary)`
must equal the stub's admission lookup, and after every batch the mirror's copies per engine hash
must equal the stub pool's. Layouts: single-group FA; FA+SWA; SWA+FA and Mamba+FA (the sparse group
first, as vLLM numbers Gemma-2's groups: its stores precede full attention's); FA+Mamba; FA+SWA with
mixed block sizes (4/8 and 8/4: hashes at the gcd, hits aligned to the lcm; FA 8 stores partial tails,
SWA 4 keeps blocks FA never names). Router keys and engine-exact keys. Full-mode requests are
announced to the fleet as a gateway would.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import msgspec
import pytest
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_stub.core.engine_config import CacheConfig, EngineCoreConfig, GroupKind, GroupSpec
from engine_stub.core.request import SubmitParams
from engine_stub.core.scheduler import Scheduler, StepOutput
from events.block_hash import RequestExtras
from events.config import KVEventsConfig
from events.publisher import EventPublisher
from events.sources import SubscriberConfig
from events.wire import KVEventBatch
from router.core.fleet_state import FleetState
from router.core.ids import EngineId, RequestId
from router.core.policy.scoring import Scorer, ScorerSettings
from router.core.routing import RoutingCore
from router.links.fleet_links import FleetLinks
from router.prepare.served_models import Models
from router.settings.config import EngineConfig, GroupConfig, ModelConfig, RouterConfig
from tokenization.openai_request import Endpoint
from tokenization.request_tokens import ReportMode

BS = 4
REPLICA = EngineId("stub")
LORA = "lora-a"
LORA_PATH = "/adapters/a"
EPHEMERAL = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0")
FAST = SubscriberConfig(replay_timeout_s=1.0, reconnect_ivl_ms=10, reconnect_ivl_max_ms=50)
LAYOUTS = {
    "fa": (GroupSpec(GroupKind.FULL_ATTENTION, BS),),
    "fa_swa": (GroupSpec(GroupKind.FULL_ATTENTION, BS), GroupSpec(GroupKind.SLIDING_WINDOW, BS, 8)),
    # Group 0 a sliding window, full attention second (vLLM's order for Gemma-2 / Gemma-3).
    "swa_fa": (GroupSpec(GroupKind.SLIDING_WINDOW, BS, 8), GroupSpec(GroupKind.FULL_ATTENTION, BS)),
    "fa_mamba": (GroupSpec(GroupKind.FULL_ATTENTION, BS), GroupSpec(GroupKind.MAMBA, BS)),
    "mamba_fa": (GroupSpec(GroupKind.MAMBA, BS), GroupSpec(GroupKind.FULL_ATTENTION, BS)),
    # Mixed block sizes: hashes at the gcd (4), hits aligned to the lcm (8).
    "fa4_swa8": (GroupSpec(GroupKind.FULL_ATTENTION, BS), GroupSpec(GroupKind.SLIDING_WINDOW, 2 * BS, 16)),
    "fa8_swa4": (GroupSpec(GroupKind.FULL_ATTENTION, 2 * BS), GroupSpec(GroupKind.SLIDING_WINDOW, BS, 8)),
}
MAX_PROMPT = 40


class Op(msgspec.Struct, frozen=True):
    """One request of the stream: which earlier prompt it extends and how, and its cache options."""

    base: int
    whole: bool
    cut: int
    aligned: bool
    new: list[int]
    lora: bool
    salt: str | None
    full: bool
    skip: bool
    max_tokens: int
    background: int

    def tokens(self, history: list[list[int]]) -> list[int]:
        prefix: list[int] = []
        if history:
            prev = history[self.base % len(history)]
            cut = len(prev) if self.whole else self.cut % (len(prev) + 1)
            prefix = prev[: cut - cut % BS if self.aligned else cut]
        return ([*prefix, *self.new] or [1])[:MAX_PROMPT]

    def body(self, tokens: list[int]) -> bytes:
        body: dict[str, object] = {"model": LORA if self.lora else "m", "prompt": tokens, "max_tokens": 1}
        if self.salt is not None:
            body["cache_salt"] = self.salt
        if self.full:
            body["vllm_xargs"] = {"kv_cache_report_mode": "full"}
        if self.skip:
            body["prompt_logprobs"] = 1
        return msgspec.json.encode(body)

    def params(self) -> SubmitParams:
        extras = RequestExtras(
            lora_name=LORA if self.lora else None,
            lora_path=LORA_PATH if self.lora else None,
            cache_salt=self.salt,
        )
        return SubmitParams(
            max_tokens=self.max_tokens,
            extras=extras,
            lora_id=1 if self.lora else None,
            report_mode=ReportMode.FULL if self.full else ReportMode.INCREMENTAL,
            skip_cache_read=self.skip,
        )


OPS = st.builds(
    Op,
    base=st.integers(0, 1000),
    whole=st.booleans(),
    cut=st.integers(0, 1000),
    aligned=st.booleans(),
    new=st.lists(st.integers(0, 3), max_size=12),
    lora=st.sampled_from([False, False, False, True]),
    salt=st.sampled_from([None, None, None, "s1"]),
    full=st.sampled_from([False, False, True]),
    skip=st.sampled_from([False] * 9 + [True]),
    max_tokens=st.integers(1, 6),
    background=st.integers(0, 4),
)


def router_config(layout: str, hashing: str, publisher: KVEventsConfig) -> RouterConfig:
    groups = [
        GroupConfig(kind=g.kind.value, block_size=g.block_size, sliding_window=g.sliding_window)
        for g in LAYOUTS[layout]
    ]
    assert publisher.replay_endpoint is not None
    engine = EngineConfig(
        name=REPLICA,
        url="http://127.0.0.1:9",
        model="m",
        events=[publisher.endpoint],
        replay=[publisher.replay_endpoint],
    )
    model = ModelConfig(
        name="m", block_size=BS, groups=groups, hashing="vllm" if hashing == "engine" else "router"
    )
    return RouterConfig(engines=[engine], models=[model])


async def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Poll `predicate` on the event loop until true; fail after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.0005)


class Harness:
    """The stub scheduler on one side of the wire, the fleet and routing core on the other."""

    def __init__(
        self,
        sched: Scheduler,
        publisher: EventPublisher,
        fleet: FleetState,
        models: Models,
        core: RoutingCore,
    ) -> None:
        self.sched, self.publisher, self.fleet, self.core = sched, publisher, fleet, core
        self.models = models
        self.checked = 0

    async def publish(self, out: StepOutput) -> None:
        for rid in out.preempted:  # a resumed request would be looked up with its outputs: not modelled
            self.sched.abort(rid)
        if out.events:
            seq = await self.publisher.publish(KVEventBatch(ts=0.0, events=out.events))
            rep = self.fleet.replica(REPLICA)
            await wait_for(lambda: rep.last_seq == seq, f"batch {seq} applied")
            self.check_resident()
        for rid in [*out.finished, *out.preempted]:
            self.fleet.request_finished(REPLICA, RequestId(rid), self.fleet.clock())

    def check_resident(self) -> None:
        """The mirror's copies per engine hash equal the stub pool's, group by group."""
        truth = self.sched.kv.pool.resident()
        for g in range(len(self.sched.config.cache.groups)):
            assert self.fleet.mirror.resident(REPLICA, 0, g) == truth.get(g, {}), f"group {g}"

    async def request(self, i: int, op: Op, tokens: list[int]) -> None:
        prepared = self.models.prepare(op.body(tokens), Endpoint.COMPLETIONS)
        assert prepared.prompt_tokens == len(tokens)
        rid = self.sched.submit(tokens, op.params(), request_id=f"r{i}")
        self.fleet.request_sent(REPLICA, RequestId(rid), prepared, at=0.0)
        assert self.fleet.trust(REPLICA, 0.0).trusted
        predicted, _ = self.core.predict(prepared)[REPLICA]
        out = self.sched.step(only={rid})
        admission = out.admissions[rid]
        got = (predicted.hit_tokens, predicted.shared_prefix_boundary)
        assert got == (admission.hit_tokens, admission.shared_prefix_boundary), f"request {i}: {op}"
        self.checked += 1
        await self.publish(out)
        if not admission.admitted:
            self.sched.abort(rid)
            self.fleet.request_finished(REPLICA, RequestId(rid), self.fleet.clock())

    async def background(self, steps: int) -> None:
        for _ in range(steps):
            running = {r.request_id for r in self.sched.running}
            if not running:
                return
            await self.publish(self.sched.step(only=running))


async def run(layout: str, hashing: str, blocks: int, ops: list[Op]) -> int:
    cache = CacheConfig(num_gpu_blocks=blocks, groups=LAYOUTS[layout])
    sched = Scheduler(EngineCoreConfig(cache=cache))
    ctx = zmq.asyncio.Context()
    try:
        async with EventPublisher(EPHEMERAL, host_ip="127.0.0.1", context=ctx) as publisher:
            config = router_config(layout, hashing, publisher.resolved)
            models = Models(config, loras={"m": {LORA: LORA_PATH}})
            fleet = FleetState(config, models.hasher, time.monotonic)
            links = FleetLinks(fleet, models, context=ctx, subscriber_config=FAST)
            core = RoutingCore(fleet, Scorer(ScorerSettings()), time.perf_counter)
            await links.start()
            try:
                await wait_for(lambda: fleet.trust(REPLICA, 0.0).trusted, "start-up replay")
                harness = Harness(sched, publisher, fleet, models, core)
                history: list[list[int]] = []
                for i, op in enumerate(ops):
                    tokens = op.tokens(history)
                    await harness.request(i, op, tokens)
                    await harness.background(op.background)
                    history.append(tokens)
                stats = fleet.mirror.stats
                assert (stats.remove_unknown, stats.store_unknown_parent) == (0, 0)
                return harness.checked
            finally:
                await links.close()
    finally:
        ctx.destroy(linger=0)


CASES = [(layout, hashing) for layout in LAYOUTS for hashing in ("router", "engine")]


@pytest.mark.parametrize(("layout", "hashing"), CASES)
@settings(max_examples=28, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blocks=st.integers(10, 40), ops=st.lists(OPS, min_size=1, max_size=24))
def test_router_predicts_every_admission(layout: str, hashing: str, blocks: int, ops: list[Op]) -> None:
    checked = asyncio.run(run(layout, hashing, blocks, ops))
    assert checked == len(ops)


PLAIN = Op(
    base=0,
    whole=False,
    cut=0,
    aligned=False,
    new=[],
    lora=False,
    salt=None,
    full=False,
    skip=False,
    max_tokens=1,
    background=0,
)
"""A request of the empty prompt, no options: the recorded streams below are replacements of it."""


def test_coarse_full_attention_with_router_keys() -> None:
    """The stream that once left the mirror missing an FA 8 block: router keys chained over 8 tokens
    never matched the request's keys at hb = 4."""
    plain = PLAIN
    ops = [
        msgspec.structs.replace(plain, base=65, cut=8, new=[0, 1]),
        msgspec.structs.replace(plain, base=588, cut=106, new=[2, 3, 0, 3, 2, 2], lora=True, full=True),
        msgspec.structs.replace(
            plain, base=51, whole=True, cut=724, aligned=True, new=[1, 2, 1, 2, 2], salt="s1", max_tokens=2
        ),
    ]
    ops[1] = msgspec.structs.replace(ops[1], max_tokens=4, background=1)
    assert asyncio.run(run("fa8_swa4", "router", 16, ops)) == 3


def test_a_report_after_a_skip_requests_store_is_not_taken_for_a_store() -> None:
    """The stream that once counted a full-mode report as a third copy (hybrid FA + Mamba, router
    keys): a skip-cache request's recompute store of block 0 was credited to an earlier request whose
    hit had dropped to 0 only through a Mamba eviction in the same batch, so the skip request stayed
    pending and, its hit being 0 forever, took the later full-mode report for its store."""
    plain = PLAIN
    ops = [
        plain,
        msgspec.structs.replace(plain, new=[0, 0, 0, 0, 0]),
        msgspec.structs.replace(plain, whole=True, new=[0] * 6, max_tokens=2, background=1),
        msgspec.structs.replace(plain, base=1, whole=True, max_tokens=3, background=1),
        msgspec.structs.replace(plain, base=1, whole=True, lora=True),
        msgspec.structs.replace(plain, base=1, whole=True, skip=True),
        msgspec.structs.replace(plain, base=1, whole=True, full=True),
    ]
    assert asyncio.run(run("fa_mamba", "router", 10, ops)) == len(ops)
