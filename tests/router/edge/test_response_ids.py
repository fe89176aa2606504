"""Reading a Responses answer's id as the relay passes it (router.edge.usage `response_id_of`)."""

from __future__ import annotations

import json

from router.edge.usage import UsageTap, response_id_of


def event(kind: str, payload: dict[str, object]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload})}\n\n".encode()


STREAM = (
    event("response.created", {"response": {"id": "resp_1", "status": "in_progress"}})
    + b"".join(event("response.output_text.delta", {"delta": "x"}) for _ in range(20))
    + event("response.completed", {"response": {"id": "resp_1", "usage": {"input_tokens": 3}}})
)


def test_a_json_answers_id_is_its_top_level_id() -> None:
    answer = json.dumps({"id": "resp_2", "object": "response", "output": [{"id": "msg_1"}]}).encode()
    assert response_id_of(answer, False) == "resp_2"
    assert response_id_of(b"not json", False) is None and response_id_of(b"{}", False) is None


def test_a_streams_id_is_read_from_its_completed_event_in_the_tail() -> None:
    assert response_id_of(STREAM, True) == "resp_1"
    tap = UsageTap(True)
    for i in range(0, len(STREAM), 7):  # in pieces, as a relay sees it
        tap.feed(STREAM[i : i + 7])
    assert tap.response_id() == "resp_1"
    cut = STREAM[: STREAM.index(b"event: response.completed")]
    assert response_id_of(cut[cut.index(b"event: response.output") :], True) is None  # no event carries one
