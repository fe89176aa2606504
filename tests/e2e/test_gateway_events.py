"""A live gateway fed bad KV events over real ZeroMQ: each bad event costs only itself, and /metrics
and /debug/index say so; CPU blocks are accounted and emptied by AllBlocksCleared (issue #10, 1-2)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from events.frames import encode_seq
from events.wire import ENCODER, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from router.core.ids import EngineId
from router.settings.config import EngineConfig, ModelConfig
from tests.event_helpers import block_stored
from tests.gateway_helpers import ADMIN, Gateway, gateway_config, running_gateway, wait_for
from tests.zmq_helpers import TrackedContext, tracked_context

ADMIN_AUTH = {"authorization": f"Bearer {ADMIN}"}


@pytest.fixture
async def ctx() -> AsyncIterator[TrackedContext]:
    async for context in tracked_context():
        yield context


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of the one sample of the Prometheus text named `name` with these labels (and any
    others, such as `model`), or None when absent."""
    found = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


def store(hashes: list[int], tokens: Any, medium: Any = "GPU") -> BlockStored:
    return block_stored(hashes, tokens, 4, medium=medium)


class Engine:
    """A raw PUB socket standing in for an engine without replay: frames exactly as the test says."""

    def __init__(self, pub: zmq.asyncio.Socket, gw: Gateway) -> None:
        self.pub, self.gw, self.seq = pub, gw, 0

    async def send(self, *events: Any) -> None:
        """Publish the next batch, and wait until the gateway has handled it."""
        seq, self.seq = self.seq, self.seq + 1
        rep = self.gw.parts.fleet.replica(EngineId("e"))
        payload = ENCODER.encode(KVEventBatch(float(seq), list(events), 0))

        async def handled() -> bool:
            if rep.last_seq is None:  # the slow joiner: resend until the first one arrives
                await self.pub.send_multipart([b"", encode_seq(seq), payload])
            return rep.last_seq == seq

        await self.pub.send_multipart([b"", encode_seq(seq), payload])
        await wait_for(handled)


async def test_bad_events_and_frames_are_counted_in_metrics_and_good_neighbours_applied(
    ctx: TrackedContext,
) -> None:
    pub = ctx.client(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    engine = EngineConfig(name="e", url="http://127.0.0.1:9", model="m", events=[f"tcp://127.0.0.1:{port}"])
    config = gateway_config([engine], models=[ModelConfig(name="m", block_size=4)])
    async with running_gateway(config) as gw:
        e = Engine(pub, gw)
        await e.send()
        a, b = store([1], [1, 2, 3, 4]), store([2], [5, 6, 7, 8])
        await e.send(a, store([3], [9, 9, 9, 2**32]), b)
        await pub.send_multipart([b"", encode_seq(e.seq)])  # a frame short of its payload
        await e.send(store([4], [1, 2, 3, -1]), BlockRemoved([1], "GPU"), store([5], [1], medium="HBM"))
        text = (await gw.client.get("/metrics")).text
        assert metric(text, "kvrouter_engine_rejected_events_total", engine="e", reason="token_ids") == 2
        assert metric(text, "kvrouter_engine_rejected_events_total", engine="e", reason="medium") == 1
        assert metric(text, "kvrouter_engine_frame_errors_total", engine="e") == 1
        assert metric(text, "kvrouter_engine_handler_errors_total", engine="e") == 0
        assert metric(text, "kvrouter_engine_mirror_blocks", engine="e") == 1  # B; A was removed
        assert metric(text, "kvrouter_engine_mirror_trust", engine="e", state="stale") == 1

        await e.send(store(list(range(100, 1100)), [], medium="CPU"))
        index = (await gw.client.get("/debug/index", headers=ADMIN_AUTH)).json()
        assert index["replicas"]["e"]["other_media_blocks"] == {"CPU": 1000}
        assert index["bytes_estimate"] >= 1000 * 50 and index["replicas"]["e"]["bytes_estimate"] >= 1000 * 50
        text = (await gw.client.get("/metrics")).text
        assert metric(text, "kvrouter_engine_other_media_blocks", engine="e", medium="CPU") == 1000
        await e.send(AllBlocksCleared())
        index = (await gw.client.get("/debug/index", headers=ADMIN_AUTH)).json()
        assert index["replicas"]["e"]["other_media_blocks"] == {} and index["bytes_estimate"] == 0
        text = (await gw.client.get("/metrics")).text
        assert metric(text, "kvrouter_engine_other_media_blocks", engine="e", medium="CPU") is None
