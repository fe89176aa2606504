"""`kvrouter explain`: recorded decisions recomputed exactly; a new prompt's decision at a point in time."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from events.recording import DecisionRecord, RequestRecord
from events.recording_file import RecordingReader
from kvrouter.cli import main
from kvrouter.replay import NewPromptExplanation, Replayer, Setup, explain_request, render_decision
from router.core.ids import EngineId
from router.core.policy.scoring import Decision, PolicyName
from tests.gateway_helpers import running_stubs
from tests.replay_helpers import TURNS, USERS, chat_body, read_records, record_session, with_config_header
from tests.scoring_helpers import scored, snapshot

DECISION = msgspec.msgpack.Decoder(Decision)


@pytest.fixture
async def recording(tmp_path: Path) -> Path:
    """A kv-policy gateway recording with its config in the header."""
    raw, path = tmp_path / "raw.rec", tmp_path / "kv.rec"
    async with running_stubs(2) as stubs:
        config = await record_session(stubs, "kv", raw)
    with_config_header(raw, path, config)
    return path


def recorded_ids(path: Path) -> list[str]:
    return [r.request_id for r in read_records(path) if isinstance(r, RequestRecord)]


def last_engine_of(path: Path, request_id: str) -> str | None:
    decisions = [
        r for r in read_records(path) if isinstance(r, DecisionRecord) and r.request_id == request_id
    ]
    return DECISION.decode(decisions[-1].decision).engine


async def test_every_recorded_request_is_recomputed_exactly(recording: Path) -> None:
    ids = recorded_ids(recording)
    assert len(ids) == len(USERS) * TURNS
    for rid in ids:
        with RecordingReader.open(recording) as reader:
            found = explain_request(Replayer(Setup.from_header(reader.header)), reader.records(), rid)
        assert [r.attempt for r in found] == [0] and found[0].exact and found[0].hits_match
    assert explain_request(Replayer(Setup.from_header(reader.header)), read_records(recording), "nope") == []


async def test_cli_request_id_shows_the_table(recording: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rid = recorded_ids(recording)[-1]  # a third turn: warm on one engine
    capsys.readouterr()
    assert main(["explain", str(recording), "--request-id", rid, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "recorded" in out and "identical" in out
    chosen = last_engine_of(recording, rid)
    rows = [line for line in out.splitlines() if line.startswith(("* e", "  e")) and "engine" not in line]
    assert {line.split()[1] if line.startswith("*") else line.split()[0] for line in rows} == {"e0", "e1"}
    assert any(line.startswith(f"* {chosen}") for line in rows)
    assert main(["explain", str(recording), "--request-id", "unknown-id", "--no-progress"]) == 1


async def test_new_prompt_before_and_after_the_history(
    recording: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    user = USERS[0]
    served = last_engine_of(recording, recorded_ids(recording)[(TURNS - 1) * len(USERS)])
    messages = msgspec.json.encode(msgspec.json.decode(chat_body(user, TURNS + 1), type=dict)["messages"])
    capsys.readouterr()
    args = ["explain", str(recording), "--messages", messages.decode(), "--no-progress", "--json"]
    assert main([*args, "--at", "+3600"]) == 0
    late = msgspec.json.decode(capsys.readouterr().out, type=NewPromptExplanation)
    assert late.decision.engine == served and late.decision.predicted_cached_tokens > 0
    assert late.records == len(list(read_records(recording)))
    assert main([*args, "--at", "0"]) == 0
    early = msgspec.json.decode(capsys.readouterr().out, type=NewPromptExplanation)
    assert early.records == 0 and early.decision.predicted_cached_tokens == 0
    assert {c.engine for c in early.decision.candidates} == {"e0", "e1"}
    text_args = ["explain", str(recording), "--prompt", "hello there", "--at", "+3600", "--no-progress"]
    assert main(text_args) == 0
    assert "policy kv ->" in capsys.readouterr().out


async def test_bad_arguments_are_refused(recording: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["explain", str(recording), "--no-progress"]
    assert main([*base, "--prompt", "hi"]) == 2  # no --at
    assert main([*base, "--messages", "{not json", "--at", "0"]) == 2
    assert main([*base, "--prompt", "hi", "--at", "soon"]) == 2
    assert main(["explain", str(recording.with_suffix(".missing")), "--request-id", "x"]) == 2
    err = capsys.readouterr().err
    assert "--at T is required" in err and "--messages" in err and "not a time" in err


def test_render_decision_marks_the_choice_and_ineligible_candidates() -> None:
    load = snapshot(0.02, 1e-4, in_flight=1, decoding=1, queued_prefill_tokens=32)
    a = scored("a", load, 36, 0.03, hit=64)
    b = scored("b", load, 100, 0.04, "circuit breaker open")
    text = render_decision(
        Decision(
            engine=EngineId("a"),
            policy=PolicyName.KV,
            reason="kv: lowest",
            predicted_cached_tokens=64,
            candidates=[a, b],
        ),
        "title",
    )
    lines = text.splitlines()
    assert lines[0] == "title" and lines[2].startswith("* a") and lines[3].startswith("  b")
    assert lines[3].endswith("no: circuit breaker open") and "30.00" in lines[2]
    assert lines[-1] == "  policy kv -> a: kv: lowest"


async def test_a_new_prompt_of_a_recorded_session_is_explained_with_its_pin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under the session policy, `--session` names the session as the gateway's configured header
    did: the replayed pins hold it, and the explanation says it is kept on its engine."""
    raw, path = tmp_path / "raw.rec", tmp_path / "session.rec"
    async with running_stubs(2) as stubs:
        config = await record_session(stubs, "session", raw)
    with_config_header(raw, path, config)
    user = USERS[0]  # (its requests carried the configured header, x-session-id)
    served = last_engine_of(path, recorded_ids(path)[(TURNS - 1) * len(USERS)])
    messages = msgspec.json.encode(msgspec.json.decode(chat_body(user, TURNS + 1), type=dict)["messages"])
    capsys.readouterr()
    args = ["explain", str(path), "--messages", messages.decode(), "--no-progress", "--json", "--at", "+600"]
    assert main([*args, "--session", user]) == 0
    kept = msgspec.json.decode(capsys.readouterr().out, type=NewPromptExplanation).decision
    assert kept.engine == served
    assert kept.reason.startswith(f"session 'x-session-id={user}': kept on {served} (hard pin"), kept.reason
    assert main(args) == 0  # no session named: kv's choice
    assert msgspec.json.decode(capsys.readouterr().out, type=NewPromptExplanation).decision.reason.startswith(
        "session: no session key; kv:"
    )
