"""The gateway in its default mode: embedded stub processes, one killed mid-run, everything recorded."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import msgspec

from events.recording import DecisionRecord, FrameRecord, RequestRecord
from events.recording_file import RecordingReader
from kvrouter.cli import main as kvrouter_main
from router.core.policy.retry import OutcomeKind
from router.core.policy.scoring import Decision
from router.lifecycle import ServeOptions
from router.ops.debug import DecisionEntry, Explanation
from router.settings.config import Embedded, RouterConfig
from tests.gateway_helpers import ADMIN, Gateway, running_gateway, wait_for

ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}
SYSTEM = "Answer briefly and precisely. " * 30


def body(turn: int) -> dict[str, object]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {turn}"}]
    return {"model": "kvrouter-stub", "messages": messages, "max_tokens": 2}


async def predicted(gw: Gateway, turn: int) -> int:
    answer = await gw.client.post("/debug/route", json=body(turn), headers=ADMIN_AUTH)
    return msgspec.json.decode(answer.content, type=Explanation).decision.predicted_cached_tokens


async def test_embedded_engine_killed_mid_run_fails_over_and_the_recording_reads_back(tmp_path: Path) -> None:
    record = tmp_path / "gateway.kvrec"
    config = RouterConfig(embedded=Embedded(engines=2, num_gpu_blocks=256))
    async with running_gateway(config, ServeOptions(record=record, stub_timeout_s=60.0)) as gw:
        assert [e.name for e in gw.parts.fleet.engines()] == ["embedded-0", "embedded-1"]
        first = await gw.client.post("/v1/chat/completions", json=body(0))
        assert first.status_code == 200
        warm = first.headers["x-kvrouter-engine"]

        async def warm_seen() -> bool:
            return await predicted(gw, 1) > 0

        await wait_for(warm_seen)
        embedded = gw.service.embedded
        assert embedded is not None
        victim = embedded.processes[int(warm.removeprefix("embedded-"))]
        victim.kill()
        await victim.wait()

        answers = [await gw.client.post("/v1/chat/completions", json=body(t)) for t in range(1, 7)]
        assert [a.status_code for a in answers] == [200] * 6
        assert {a.headers["x-kvrouter-engine"] for a in answers} == {
            "embedded-1" if warm == "embedded-0" else "embedded-0"
        }
        rid = answers[0].headers["x-request-id"]
        entry = msgspec.json.decode(
            (await gw.client.get(f"/debug/decisions/{rid}", headers=ADMIN_AUTH)).content, type=DecisionEntry
        )
        assert [d.engine for d in entry.decisions] == [warm, answers[0].headers["x-kvrouter-engine"]]
        assert entry.attempts[0].outcome in (OutcomeKind.CONNECT_FAILED, OutcomeKind.DISCONNECTED)
        metrics = (await gw.client.get("/metrics")).text
        retried = [
            line for line in metrics.splitlines() if line.startswith("kvrouter_upstream_retries_total{")
        ]
        assert retried and sum(float(line.rsplit(" ", 1)[1]) for line in retried) >= 1
        request_ids = [first.headers["x-request-id"], *(a.headers["x-request-id"] for a in answers)]

    with RecordingReader.open(record) as reader:
        records = list(reader.records())
        assert set(reader.header.metadata["engines"]) == {"embedded-0", "embedded-1"}
    requests = [r for r in records if isinstance(r, RequestRecord)]
    decisions = [r for r in records if isinstance(r, DecisionRecord)]
    assert [r.request_id for r in requests] == request_ids
    assert all(r.endpoint == "/v1/chat/completions" and r.model == "kvrouter-stub" for r in requests)
    assert requests[0].body == msgspec.json.encode(body(0))
    failover = [d for d in decisions if d.request_id == rid]
    assert [(d.attempt, d.engine) for d in failover] == [(0, warm), (1, entry.decisions[1].engine)]
    assert msgspec.msgpack.decode(failover[0].decision, type=Decision) == entry.decisions[0]
    assert any(isinstance(r, FrameRecord) for r in records)
    times = [r.time for r in records if not isinstance(r, FrameRecord)]
    assert times == sorted(times)

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert kvrouter_main(["--log-level", "ERROR", "events", str(record)]) == 0
    assert "BlockStored" in out.getvalue()
    assert "7 RequestRecord(s) not shown" in err.getvalue()
