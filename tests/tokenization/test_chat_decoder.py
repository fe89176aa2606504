"""Chat bodies decoded reusing the previous request's messages: always what `decode_chat` gives.

Random conversations are re-sent turn after turn (with messages edited, re-spaced, dropped, made
invalid), and every body's decode is compared with `decode_chat`'s: the same request field for
field, or the same error with the same field path. The template dicts and skeleton marks kept on
reused messages are compared with ones made from scratch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenization.chat_decoder import ChatDecoder
from tokenization.chat_template import ContentFormat
from tokenization.conversation import _message, conversation
from tokenization.openai_request import ChatMessage, ChatRequest, RequestError, decode_chat
from tokenization.skeletons import _mark, _marks, _stand_in
from tokenization.template_message import TemplateMessage, plain

TEXT = st.text(alphabet=st.sampled_from('ab \n"\\é中\x00'), max_size=8)
PART = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "input_text", "refusal"]), "text": TEXT}),
    st.fixed_dictionaries({"type": st.just("image_url")}),
    st.just({"type": "text", "text": 5}),
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "developer", "tool"])},
    optional={
        "content": st.one_of(TEXT, st.none(), st.lists(PART, max_size=3), st.just(7)),
        "name": TEXT,
        "reasoning_content": TEXT,
        "reasoning": TEXT,
        "tool_call_id": TEXT,
        "tool_calls": st.lists(
            st.fixed_dictionaries({"function": st.fixed_dictionaries({"name": TEXT, "arguments": TEXT})}),
            max_size=2,
        ),
        "extra": st.integers(),
    },
)
FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["m", "n"]),
        "add_generation_prompt": st.booleans(),
        "continue_final_message": st.booleans(),
        "max_tokens": st.one_of(st.integers(0, 9), st.just("x")),
        "stream": st.booleans(),
        "unknown": TEXT,
    },
)
STEP: st.SearchStrategy[tuple[str, list[dict[str, Any]]]] = st.one_of(
    st.tuples(st.just("append"), st.lists(MESSAGE, min_size=1, max_size=3)),
    st.tuples(st.just("replace_last"), st.lists(MESSAGE, min_size=1, max_size=1)),
    st.tuples(st.just("drop_last"), st.just([])),
    st.tuples(st.just("respace"), st.just([])),
    st.tuples(st.just("same"), st.just([])),
)


def _body(messages: list[dict[str, Any]], fields: dict[str, Any], spaced: bool) -> bytes:
    doc = {"messages": messages, **fields}
    if "model" in fields and spaced:  # the other opening the shared-bytes path takes
        doc = {"model": fields["model"], **doc}
    return json.dumps(doc, indent=1 if spaced else None, ensure_ascii=spaced).encode()


TAMPER: st.SearchStrategy[bytes | None] = st.one_of(
    st.none(),
    st.sampled_from(
        [b', "messages": []', b', "messages": [0]', b', "\\u006dessages": [0]', b', "tools": 1',
         b', "x": "messages"', b', "model": 3', b', "model": "z"']
    ),
)  # fmt: skip
"""Text put after the messages array (a second ``messages`` key among them: the last one counts)."""
SPLICE: st.SearchStrategy[bytes | None] = st.one_of(
    st.none(), st.sampled_from([b".5", b"5", b" ", b"e1,", b"]"])
)
"""Bytes put right after the first message (where a body sharing it may be cut)."""


def _tampered(body: bytes, tamper: bytes | None, splice: bytes | None, first: dict[str, Any] | None) -> bytes:
    if tamper is not None and body.endswith(b"}"):
        body = body[:-1] + tamper + b"}"
    if splice is not None and first is not None:
        head = json.dumps(first).encode()
        at = body.find(head)
        if at >= 0:
            body = body[: at + len(head)] + splice + body[at + len(head) :]
    return body


def _outcome(decode: Any, body: bytes) -> ChatRequest | tuple[str, str | None]:
    try:
        result: ChatRequest = decode(body)
    except RequestError as exc:
        return str(exc), exc.param
    return result


@settings(max_examples=300, deadline=None)
@given(
    start=st.lists(MESSAGE, min_size=0, max_size=4),
    steps=st.lists(st.tuples(STEP, FIELDS, TAMPER, SPLICE), min_size=1, max_size=8),
    max_entries=st.sampled_from([0, 1, 512]),
)
def test_every_body_decodes_as_decode_chat_decodes_it(
    start: list[dict[str, Any]],
    steps: list[tuple[tuple[str, list[dict[str, Any]]], dict[str, Any], bytes | None, bytes | None]],
    max_entries: int,
) -> None:  # fmt: skip
    decoder = ChatDecoder(max_entries=max_entries)
    messages, spaced = list(start), False
    for (op, new), fields, tamper, splice in steps:
        if op == "append":
            messages += new
        elif op == "replace_last":
            messages = [*messages[:-1], *new]
        elif op == "drop_last":
            messages = messages[:-1]
        elif op == "respace":
            spaced = not spaced
        body = _tampered(_body(messages, fields, spaced), tamper, splice, messages[0] if messages else None)
        assert _outcome(decoder.decode, body) == _outcome(decode_chat, body)
    assert len(decoder) <= max_entries


@pytest.mark.parametrize(
    "body",
    [b"", b"{", b"[]", b'{"messages": 3}', b'{"messages": [{"role": 1}]}', b'{"messages": [3]}',
     b'{"model": 3, "messages": []}', b'{"messages": [], "add_generation_prompt": true, '
     b'"continue_final_message": true}', b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
     b'{"messages": [{"role": 1}], "messages": []}', b'{"messages": [{"role": 1}], "\\u006dessages": []}',
     b"[" * 100_000 + b"]" * 100_000, b'{"messages": [' + b"[" * 100_000 + b"]" * 100_000 + b"]}"],
)  # fmt: skip
def test_bad_bodies_raise_what_decode_chat_raises(body: bytes) -> None:
    decoder = ChatDecoder()
    decoder.decode(b'{"messages": [{"role": "user", "content": "hi"}]}')
    assert _outcome(decoder.decode, body) == _outcome(decode_chat, body)


def _chat(*texts: str) -> bytes:
    roles = ["user", "assistant"]
    return json.dumps(
        {"messages": [{"role": roles[i % 2], "content": t} for i, t in enumerate(texts)]}
    ).encode()


def test_a_new_turn_reuses_the_earlier_messages_objects() -> None:
    decoder = ChatDecoder()
    first = decoder.decode(_chat("a", "b", "c"))
    second = decoder.decode(_chat("a", "b", "c", "d", "e"))
    assert all(x is y for x, y in zip(first.messages, second.messages[:3], strict=False))
    assert (decoder.reused, decoder.decoded) == (3, 5)
    edited = decoder.decode(_chat("a", "b", "X", "d", "e"))
    assert edited.messages[2] is not second.messages[2] and edited.messages[3] is second.messages[3]
    assert edited == decode_chat(_chat("a", "b", "X", "d", "e"))


def test_a_new_turn_parses_only_what_follows_the_shared_messages() -> None:
    decoder = ChatDecoder()
    first = decoder.decode(_chat("a" * 50, "b", "c"))
    body = _chat("a" * 50, "b", "c", "d")
    second = decoder.decode(body)
    assert decoder.skipped_bytes == len(_chat("a" * 50, "b", "c")) - len('{"messages": [') - 2
    assert all(x is y for x, y in zip(first.messages, second.messages[:3], strict=False))
    edited = _chat("a" * 50, "b", "X", "d")
    assert decoder.decode(edited) == decode_chat(edited) and decoder.skipped_bytes > len(body)
    other_opening = b'{"stream": false, ' + body[1:]  # messages not first: parsed whole, still equal
    skipped = decoder.skipped_bytes
    assert decoder.decode(other_opening) == decode_chat(other_opening)
    assert decoder.decode(other_opening) == decode_chat(other_opening) and decoder.skipped_bytes == skipped


def test_conversations_are_lru_and_bounded_in_entries_and_bytes() -> None:
    decoder = ChatDecoder(max_entries=2)
    for first in ("a", "b", "c"):
        decoder.decode(_chat(first, "x"))
    assert len(decoder) == 2
    decoder.decode(_chat("a", "x"))  # evicted: decoded again
    assert decoder.reused == 0
    small = ChatDecoder(max_bytes=100)
    small.decode(_chat("a" * 200))
    assert len(small) == 0 and small.bytes == 0
    with pytest.raises(ValueError):
        ChatDecoder(max_entries=-1)


@settings(max_examples=150, deadline=None)
@given(message=MESSAGE, fmt=st.sampled_from(list(ContentFormat)))
def test_kept_template_dicts_and_marks_equal_fresh_ones(message: dict[str, Any], fmt: ContentFormat) -> None:
    """`conversation`'s kept dict (made directly for a role and a string content) is `_message`'s, in
    its key order too, and so are its marks."""
    body = json.dumps({"messages": [message]}).encode()
    try:
        (msg,) = decode_chat(body).messages
        fresh = _message(msg, fmt, "messages[0]")
    except RequestError:
        return
    kept = conversation([msg], fmt, True)[0]
    assert type(kept) is TemplateMessage and kept == fresh and list(kept) == list(fresh)
    assert conversation([msg], fmt, True)[0] is kept  # made once per message and format
    again: list[str] = []
    marked, texts, marked_json = _marks(kept)
    assert marked == _stand_in(fresh, again, _mark) and list(texts) == again
    assert marked_json == msgspec.json.encode(marked)
    assert _marks(kept) is _marks(kept)  # kept on the message


def test_a_template_message_cannot_change_and_renders_as_a_plain_dict() -> None:
    kept = TemplateMessage({"role": "user", "content": "hi"})
    changes: list[Callable[[], object]] = [
        lambda: kept.__setitem__("role", "x"),
        lambda: kept.update(role="x"),
        lambda: kept.pop("role"),
        lambda: kept.setdefault("name", "x"),
        lambda: kept.clear(),
    ]
    for change in changes:
        with pytest.raises(TypeError):
            change()
    assert kept == {"role": "user", "content": "hi"}
    copies = plain([kept, {"role": "assistant"}])
    assert [type(m) for m in copies] == [dict, dict] and copies[0] == kept
    assert msgspec.json.encode(kept) == b'{"role":"user","content":"hi"}'


def _conversation_or_error(
    messages: list[ChatMessage], fmt: ContentFormat, knows_developer: bool
) -> list[dict[str, Any]] | str:
    try:
        return conversation(messages, fmt, knows_developer)
    except RequestError as exc:
        return str(exc)


@settings(max_examples=150, deadline=None)
@given(
    first=st.lists(MESSAGE, max_size=4),
    turns=st.lists(st.tuples(st.integers(0, 3), st.lists(MESSAGE, max_size=3)), min_size=1, max_size=6),
    fmt=st.sampled_from(list(ContentFormat)),
    knows_developer=st.booleans(),
)
def test_conversations_kept_across_turns_equal_fresh_ones(
    first: list[dict[str, Any]],
    turns: list[tuple[int, list[dict[str, Any]]]],
    fmt: ContentFormat,
    knows_developer: bool,
) -> None:
    """A conversation's turns carry its earlier messages' objects (each turn drops up to 3 last
    messages and adds new ones): what `conversation` reads from the earlier turns' kept dicts always
    equals what fresh messages give, errors included."""
    valid = [m for m in first + [m for _, new in turns for m in new] if _decodes(m)]
    objects = {id(m): decode_chat(json.dumps({"messages": [m]}).encode()).messages[0] for m in valid}
    docs = [m for m in first if id(m) in objects]
    for drop, new in [(0, []), *turns]:
        docs = [*docs[: max(0, len(docs) - drop)], *(m for m in new if id(m) in objects)]
        messages = [objects[id(m)] for m in docs]
        fresh = decode_chat(json.dumps({"messages": docs}).encode()).messages
        expected = _conversation_or_error(fresh, fmt, knows_developer)
        assert _conversation_or_error(messages, fmt, knows_developer) == expected
        assert _conversation_or_error(messages, fmt, knows_developer) == expected  # from what it kept


def _decodes(message: dict[str, Any]) -> bool:
    try:
        decode_chat(json.dumps({"messages": [message]}).encode())
    except RequestError:
        return False
    return True


def test_a_kept_conversation_prefix_is_read_only_for_the_same_message_objects() -> None:
    """Equal is not enough: arguments ``{"a": 1}`` and ``{"a": 1.0}`` are equal, yet a template
    renders them apart, so a later message's kept prefix is not read after an earlier message changed."""

    def messages(number: str) -> list[ChatMessage]:
        call = {"function": {"name": "f", "arguments": "ARGS"}}
        doc = {"messages": [{"role": "assistant", "tool_calls": [call]}, {"role": "user", "content": "x"}]}
        body = json.dumps(doc).replace('"ARGS"', '{"a": ' + number + "}")
        return decode_chat(body.encode()).messages

    first, second = messages("1"), messages("1.0")
    shared = first[1]
    last = decode_chat(b'{"messages": [{"role": "user", "content": "y"}]}').messages[0]
    conversation([first[0], shared, last], ContentFormat.STRING, True)
    conv = conversation([second[0], shared, last], ContentFormat.STRING, True)
    assert type(conv[0]["tool_calls"][0]["function"]["arguments"]["a"]) is float
