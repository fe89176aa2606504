"""Replaying gateway recordings: every recorded decision reproduced exactly; other policies compared.

Recordings come from a real gateway over real stubs (multi-turn chats sharing a long system prompt, a
forced event gap filled by replay); the hand-built ones pin the link inference and the file handling.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest

from events.recording import FileHeader, FrameRecord, Record
from events.recording_file import RecordingReader, RecordingWriter
from events.sequence import Deliver
from events.wire import ENCODER, EngineBlockHash, KVEventBatch
from kvrouter.cli import main
from kvrouter.replay import (
    Comparison,
    DecisionReplay,
    LinkReplay,
    Rebuild,
    Replayer,
    ReplayState,
    Setup,
    compare,
)
from router.core.ids import EngineId
from router.core.policy.scoring import PolicyName, ScorerSettings
from router.ops.recording import GatewayRecorder
from router.settings.config import EngineConfig, RouterConfig
from tests.event_helpers import block_stored
from tests.gateway_helpers import running_stubs
from tests.replay_helpers import TURNS, USERS, read_records, record_session, with_config_header

DECISIONS = len(USERS) * TURNS


def replay(path: Path, config: RouterConfig, policy: PolicyName | None = None) -> list[DecisionReplay]:
    with RecordingReader.open(path) as reader:
        setup = Setup.from_header(reader.header, config)
    settings = setup.settings if policy is None else msgspec.structs.replace(setup.settings, policy=policy)
    replayer = Replayer(setup, settings)
    return [r for record in read_records(path) if (r := replayer.feed(record)) is not None]


async def test_kv_recording_with_a_gap_replays_exactly_and_round_robin_differs(tmp_path: Path) -> None:
    path = tmp_path / "kv.rec"
    async with running_stubs(2) as stubs:
        config = await record_session(stubs, "kv", path, gap=True)
    replays = replay(path, config)
    assert len(replays) == DECISIONS
    for r in replays:
        assert r.hits_match, r
        assert r.exact, (r.recorded, r.replayed)
    assert sum(r.recorded.predicted_cached_tokens > 0 for r in replays) >= len(USERS) * (TURNS - 1)
    # The cached blocks kv's ties read are recomputed on the rebuilt mirror too, equal to the gateway's.
    assert any(c.cached_blocks > 0 for r in replays for c in r.recorded.candidates)
    # The history matters: without the frames nothing is cached, and the replay says so.
    bare = Replayer(Setup(config))
    fed = [bare.feed(rec) for rec in read_records(path) if not isinstance(rec, FrameRecord)]
    blind = [r for r in fed if r is not None]
    assert len(blind) == DECISIONS
    assert sum(not r.hits_match for r in blind) >= len(USERS) * (TURNS - 1)

    rr = compare(replay(path, config, PolicyName.ROUND_ROBIN))
    assert (rr.recorded_policy, rr.replayed_policy, rr.decisions) == ("kv", "round_robin", DECISIONS)
    assert rr.different_engine > 0 and rr.hit_mismatches == 0
    assert rr.replayed_cached_tokens < rr.recorded_cached_tokens
    assert sorted(rr.replayed_share.values()) == [DECISIONS // 2, DECISIONS - DECISIONS // 2]
    for d in rr.differences:
        assert d.recorded_engine != d.replayed_engine and d.replayed_reason.startswith("round_robin: turn")


@pytest.mark.parametrize("policy", ["round_robin", "random", "session"])
async def test_stateful_policies_replay_exactly(tmp_path: Path, policy: str) -> None:
    path = tmp_path / f"{policy}.rec"
    async with running_stubs(2) as stubs:
        config = await record_session(stubs, policy, path)
    replays = replay(path, config)
    assert len(replays) == DECISIONS
    assert all(r.exact for r in replays), [(r.recorded.reason, r.replayed) for r in replays if not r.exact]
    # A scorer that did not see the earlier decisions (its state reset) chooses differently somewhere.
    if policy == "round_robin":
        kv = compare(replay(path, config, PolicyName.KV))
        assert kv.replayed_cached_tokens > kv.recorded_cached_tokens


async def test_cli_replay_state_verify_and_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw, path = tmp_path / "raw.rec", tmp_path / "kv.rec"
    async with running_stubs(2) as stubs:
        config = await record_session(stubs, "kv", raw)
    with_config_header(raw, path, config)
    capsys.readouterr()
    assert main(["replay", str(path), "--verify", "--no-progress", "--json"]) == 0
    verified = msgspec.json.decode(capsys.readouterr().out, type=Comparison)
    assert verified.exact == verified.decisions == DECISIONS
    assert main(["replay", str(path), "--no-progress", "--json"]) == 0
    state = msgspec.json.decode(capsys.readouterr().out, type=ReplayState)
    assert state.config_source == "recording"
    assert {r.replica for r in state.replicas} == {"e0", "e1"}
    assert sum(r.groups[0].unique_blocks for r in state.replicas) > 0
    assert all(r.trust is not None and r.trust.state.value == "fresh" for r in state.replicas)
    assert main(["replay", str(path), "--no-progress", "--until-seq", "0", "--json"]) == 0
    empty = msgspec.json.decode(capsys.readouterr().out, type=ReplayState)
    assert empty.records == 0 and all(r.groups[0].unique_blocks == 0 for r in empty.replicas)
    assert main(["replay", str(path), "--no-progress", "--policy", "round_robin"]) == 0
    text = capsys.readouterr().out
    assert "replayed under round_robin" in text and f"decisions {DECISIONS}:" in text


# -- hand-built recordings ----------------------------------------------------------------------

BS = 16
ENGINE = EngineConfig(
    name="e0", url="http://127.0.0.1:9", events=["tcp://127.0.0.1:9"], replay=["tcp://127.0.0.1:8"]
)
CONFIG = RouterConfig(engines=[ENGINE])


def store(seq: int, n_blocks: int = 1) -> bytes:
    """A batch storing `n_blocks` fresh blocks (distinct tokens per seq), as an engine publishes it."""
    tokens = [1000 * (seq + 1) + i for i in range(BS * n_blocks)]
    hashes: list[EngineBlockHash] = [10_000 * (seq + 1) + i for i in range(n_blocks)]
    event = block_stored(hashes, tokens, BS)
    return ENCODER.encode(KVEventBatch(float(seq), [event]))


def frame(seq: int, payload: bytes | None = None) -> FrameRecord:
    return FrameRecord(time.time(), "e0", b"kv-events", seq, payload if payload is not None else store(seq))


def write(path: Path, records: list[Record], tail: bytes = b"") -> None:
    with RecordingWriter.create(path, FileHeader(0.0, {"config": msgspec.to_builtins(CONFIG)})) as writer:
        for record in records:
            writer.write(record)
    with open(path, "ab") as f:
        f.write(tail)


class FutureRecord(Record, tag="from_the_future", frozen=True):
    note: str


def state_json(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, ReplayState, str]:
    code = main(["replay", str(path), "--no-progress", "--json"])
    out, err = capsys.readouterr()
    return code, msgspec.json.decode(out, type=ReplayState), err


def test_torn_tail_and_unknown_kinds_are_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "hand.rec"
    write(path, [frame(0), FutureRecord(time.time(), "skip me"), frame(1, store(1, 2))], tail=b"\x00\x00\x01")
    code, state, err = state_json(path, capsys)
    assert code == 0
    (e0,) = state.replicas
    assert (e0.last_seq, e0.batches_applied, e0.groups[0].unique_blocks) == (1, 2, 3)
    assert "torn last record" in err and "from_the_future" in err


def test_corruption_before_the_end_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.rec"
    write(path, [frame(0), frame(1)])
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # inside the last record's body...
    path.write_bytes(bytes(data) + b"more bytes")  # ...with data after it: corruption, not a torn tail
    code, state, err = state_json(path, capsys)
    assert code == 1 and state.replicas[0].last_seq == 0
    assert "corrupt record" in err


def test_gap_filled_by_replay_and_restart_rebuild_the_engine(tmp_path: Path) -> None:
    rebuild = Rebuild(Setup(CONFIG))
    # start-up replay answers 0, 1; live 2 and 4 arrive (3 lost live), the gap's replay brings 3, 4
    for seq in (0, 1, 2, 4, 3, 4):
        rebuild.frame(frame(seq))
    rep = rebuild.replicas[EngineId("e0")]
    assert (rep.last_seq, rep.applied, rep.duplicates) == (4, 5, 1)
    blocks = rebuild.mirror.replica(EngineId("e0"))
    assert blocks is not None and blocks.groups[0].n_keys == 5
    # the engine restarts: seq 0 again with other content; its replay brings the new 0
    restarted = store(100)
    rebuild.frame(frame(0, restarted))
    rebuild.frame(frame(0, restarted))
    assert (rep.resets, rep.last_seq, rep.applied) == (1, 0, 6)
    assert blocks.groups[0].n_keys == 1 and not rep.link.replaying


@pytest.mark.parametrize(
    ("received", "delivered"),
    [
        ([0, 1, 2], [0, 1, 2]),  # start-up replay, then live in order
        ([3, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4]),  # live 3 first, held until the start-up replay reaches it
        ([0, 1, 1, 2], [0, 1, 2]),  # a duplicate live frame
        ([0, 1, 4, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]),  # a gap: 4 held, the replay brings 2, 3 and 4 again
    ],
)
def test_link_inference_delivers_in_order(received: list[int], delivered: list[int]) -> None:
    link = LinkReplay(can_replay=True)
    link.start()
    out = [a.seq for seq in received for a in link.feed(seq, store(seq), 0.0) if isinstance(a, Deliver)]
    assert out == delivered
    assert not link.replaying or received == [0, 1, 2]


def test_setup_reads_the_config_from_the_header_and_matches_serve(tmp_path: Path) -> None:
    path = tmp_path / "header.rec"
    GatewayRecorder.create(path, {"policy": "kv"}, "x-session-id", CONFIG).close()
    with RecordingReader.open(path) as reader:
        setup = Setup.from_header(reader.header)
    assert setup.config == CONFIG and setup.source == "recording" and setup.exact
    assert list(setup.replicas) == ["e0"]
    assert setup.settings == ScorerSettings.from_config(CONFIG)
    old = FileHeader(
        0.0, {"engines": {"e0": {"url": ENGINE.url, "events": ENGINE.events}}, "policy": "random"}
    )
    fallback = Setup.from_header(old)
    assert not fallback.exact and fallback.settings.policy is PolicyName.RANDOM
