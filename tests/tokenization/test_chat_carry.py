"""Chat carry: a conversation's next turn extends its previous turn's ids, and always equals a full
render + plain encode.

The property test drives one tokenizer through a random sequence of turns of two conversations: new
turns, a replaced or extended last message, edits inside earlier messages, a changed system prompt,
tool calls and reasoning, identical re-sends, with texts built to cut badly (multi-byte characters,
digits, the tokenizer's added tokens written into the text, whitespace runs). Every turn's ids are
compared with the template rendered without skeletons and encoded plainly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.encoder_helpers import deepseek, encoder_of, new_reuse, plain_packed
from tokenization import HfTokenizer
from tokenization.cached_encoder import ChatPrompt
from tokenization.chat_carry import LONG_TAIL, ChatCarry, _shared_pieces
from tokenization.prefix_reuse import ReuseEntry
from tokenization.segment_cache import pack_ids

DATA = Path(__file__).parents[1] / "data"
BAR = "\uff5c"
ADDED = [
    f"<{BAR}User{BAR}>",
    f"<{BAR}Assistant{BAR}>",
    "<think>",
    "</think>",
    f"<{BAR}end\u2581of\u2581sentence{BAR}>",
]
PIECES = [
    "hello", " world", "wor", "ld", "  ", "\n\n", " \t", "123", "4567", ",", ".", "!?", "(x)", "café",
    "你好", "世界", "🙂", "e\u0301", "ü", "don't", "'s", "_", "-", *ADDED,
]  # fmt: skip
TEXT = st.lists(st.sampled_from(PIECES), min_size=0, max_size=12).map("".join)


def _deepseek() -> HfTokenizer:
    return deepseek()


@pytest.fixture(scope="module")
def ds() -> HfTokenizer:
    return _deepseek()


def plain_ids(tok: HfTokenizer, messages: list[dict[str, Any]], tools: list[Any] | None = None) -> list[int]:
    """The reference: the template rendered without skeletons, the text encoded without any cache."""
    template = tok.templates.select(tools)
    text = template._template.render(
        messages=messages, tools=tools, documents=None, add_generation_prompt=True, **tok._context
    )
    return tok.encode(text, add_special_tokens=False)


def carried_ids(
    tok: HfTokenizer, messages: list[dict[str, Any]], tools: list[Any] | None = None
) -> tuple[list[int], int]:
    encoded = encoder_of(tok).encode_chat(messages, ChatPrompt(tools=tools))
    ids, packed, link = encoded.ids, encoded.packed, encoded.link
    assert link is not None, "a skeleton-rendered chat without special tokens is carried"
    assert packed == pack_ids(ids)
    return list(ids), link.shared_tokens


def _tool_turn(name: str, args: str, output: str) -> list[dict[str, Any]]:
    call = {"type": "function", "function": {"name": name or "f", "arguments": {"q": args}}}
    return [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": output},
    ]


OPS = st.one_of(
    st.tuples(st.just("turn"), TEXT, TEXT),
    st.tuples(st.just("replace_last"), TEXT, TEXT),
    st.tuples(st.just("extend_last"), TEXT, TEXT),
    st.tuples(st.just("edit"), st.tuples(st.integers(0, 50), st.integers(0, 200)), TEXT),
    st.tuples(st.just("system"), TEXT, TEXT),
    st.tuples(st.just("tool"), TEXT, TEXT),
    st.tuples(st.just("reasoning"), TEXT, TEXT),
    st.tuples(st.just("same"), TEXT, TEXT),
    st.tuples(st.just("other"), TEXT, TEXT),
)


def _apply(conversations: list[list[dict[str, Any]]], op: tuple[str, Any, str]) -> list[dict[str, Any]]:
    """The next request: ``op`` applied to the last conversation (or to the other one)."""
    kind, a, b = op
    if kind == "other":
        conversations.reverse()
    msgs = [dict(m) for m in conversations[-1]]
    if kind == "turn":
        msgs += [{"role": "assistant", "content": a}, {"role": "user", "content": b}]
    elif kind == "replace_last":
        msgs[-1] = {"role": "user", "content": a + b}
    elif kind == "extend_last":
        msgs[-1] = {**msgs[-1], "content": msgs[-1]["content"] + a + b}
    elif kind == "edit":
        i, at = a[0] % len(msgs), a[1]
        text = msgs[i]["content"]
        msgs[i] = {**msgs[i], "content": text[:at] + b + text[at:]}
    elif kind == "system":
        msgs[0] = {"role": "system", "content": a + b}
    elif kind == "tool":
        msgs += [*_tool_turn(a[:8], a, b), {"role": "user", "content": b}]
    elif kind == "reasoning":
        msgs += [{"role": "assistant", "content": b, "reasoning_content": a}, {"role": "user", "content": a}]
    conversations[-1] = msgs
    return msgs


@settings(max_examples=80, deadline=None)
@given(
    starts=st.lists(st.tuples(TEXT, TEXT), min_size=2, max_size=2),
    ops=st.lists(OPS, min_size=1, max_size=10),
    long_tail=st.sampled_from([LONG_TAIL, 0]),
)
def test_every_carried_turn_equals_a_full_render_and_plain_encode(
    starts: list[tuple[str, str]], ops: list[tuple[str, Any, str]], long_tail: int
) -> None:
    tok = _deepseek()
    carry = encoder_of(tok).chat_carry()
    assert carry is not None
    carry.long_tail = long_tail  # 0: every tail is "long", prefix reuse searches all texts too
    conversations = [
        [{"role": "system", "content": "You help. " + s}, {"role": "user", "content": "Q: " + u}]
        for s, u in starts
    ]
    for msgs in [*conversations, *(_apply(conversations, op) for op in ops)]:
        ids, shared = carried_ids(tok, msgs)
        assert ids == plain_ids(tok, msgs)
        assert 0 <= shared <= len(ids)


def test_a_new_last_turn_encodes_only_its_own_pieces(ds: HfTokenizer) -> None:
    carry = encoder_of(ds).chat_carry()
    assert carry is not None
    long_turns = [
        {"role": "user" if i % 2 else "assistant", "content": "tokens and blocks " * 200} for i in range(6)
    ]
    base = [{"role": "system", "content": "You are terse."}, *long_turns]
    carried_ids(ds, [*base, {"role": "user", "content": "first question?"}])
    hits, encoded = carry.stats.hits, encoder_of(ds).stats().encoded_bytes
    ids, shared = carried_ids(ds, [*base, {"role": "user", "content": "second question?"}])
    assert carry.stats.hits == hits + 1
    assert ids == plain_ids(ds, [*base, {"role": "user", "content": "second question?"}])
    assert shared > len(ids) - 16  # all but the new question and the generation prompt
    assert encoder_of(ds).stats().encoded_bytes - encoded < 64


def test_the_same_conversation_resent_returns_the_same_ids_without_encoding(ds: HfTokenizer) -> None:
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "the same question 你好"}]
    first, _ = carried_ids(ds, msgs)
    again, shared = carried_ids(ds, [dict(m) for m in msgs])
    assert again == first == plain_ids(ds, msgs) and shared == len(first)


def test_tools_and_special_tokens_in_the_text_stay_exact(ds: HfTokenizer) -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "description": "d", "parameters": {}}}]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "find " + ADDED[0] + " it"}]
    for i in range(4):
        msgs += [*_tool_turn("lookup", f"q{i}", f"out {i} {ADDED[2]}"), {"role": "user", "content": f"{i}!"}]
        assert carried_ids(ds, msgs, tools)[0] == plain_ids(ds, msgs, tools)


def test_requests_the_carry_does_not_serve_take_the_text_path(ds: HfTokenizer) -> None:
    msgs = [{"role": "user", "content": "a question"}, {"role": "assistant", "content": "an answer"}]
    text = ds.apply_chat_template(msgs, add_generation_prompt=False, continue_final_message=True)
    continued = ChatPrompt(add_generation_prompt=False, template_kwargs={"continue_final_message": True})
    encoded = encoder_of(ds).encode_chat(msgs, continued)
    assert encoded.link is None and list(encoded.ids) == ds.encode(text, add_special_tokens=False)
    encoded = encoder_of(ds).encode_chat(msgs, ChatPrompt(add_special_tokens=True))
    ids, link = encoded.ids, encoded.link
    assert list(ids) == ds.encode(ds.apply_chat_template(msgs), add_special_tokens=True)
    # Carried only when the post-processor adds nothing around the text (DeepSeek's adds nothing).
    assert (link is None) == (encoder_of(ds)._special_wrap(True) != ([], []))


def test_special_tokens_around_the_text_are_not_carried(
    ds: HfTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(encoder_of(ds), "_wrap", ([0], []))
    msgs = [{"role": "user", "content": "a question"}]
    encoded = encoder_of(ds).encode_chat(msgs, ChatPrompt(add_special_tokens=True))
    assert encoded.link is None and list(encoded.ids) == [0, *plain_ids(ds, msgs)]


def test_the_carry_is_lru_and_bounded_in_turns_and_bytes(ds: HfTokenizer) -> None:
    reuse, encode = new_reuse(ds), plain_packed(ds)
    carry = ChatCarry(reuse, max_entries=3)
    for i in range(5):
        carry.encode_entry(f"k{i}".encode(), [f"conversation {i} "] * 3, encode)
    assert len(carry) == 3 and carry.stats.misses == 5
    assert carry.bytes == sum(t.size + len(k) for k, t in carry._turns.items())
    carry.encode_entry(b"k4", ["conversation 4 "] * 3 + ["and a next turn"], encode)
    assert carry.bytes == sum(t.size + len(k) for k, t in carry._turns.items())  # the old turn's bytes gone
    one = carry._turns[b"k3"].size + 2
    small = ChatCarry(reuse, max_bytes=2 * one)
    for i in range(4):
        small.encode_entry(f"k{i}".encode(), [f"conversation {i} "] * 3, encode)
    assert len(small) == 2 and small.bytes <= 2 * one
    with pytest.raises(ValueError):
        ChatCarry(reuse, max_entries=-1)


def test_a_long_new_tail_also_searches_older_texts(ds: HfTokenizer) -> None:
    # A conversation that branched: the carry's last turn shares only the head, an older text all but
    # the last question. Prefix reuse's search finds the older one, so only the question is encoded.
    head = [{"role": "system", "content": "branching"}, {"role": "user", "content": "start " * 50}]
    long_a = [{"role": "assistant", "content": "path a " * 300}, {"role": "user", "content": "more a"}]
    long_b = [{"role": "assistant", "content": "path b " * 300}, {"role": "user", "content": "more b"}]
    carried_ids(ds, [*head, *long_a, {"role": "user", "content": "q1"}])
    carried_ids(ds, [*head, *long_b])  # the conversation's last turn now
    encoded = encoder_of(ds).stats().encoded_bytes
    msgs = [*head, *long_a, {"role": "user", "content": "q2"}]
    ids, shared = carried_ids(ds, msgs)
    assert ids == plain_ids(ds, msgs)
    assert shared < 200 < len(ids)  # carried from the branch: its head only
    assert (
        encoder_of(ds).stats().encoded_bytes - encoded < 64
    )  # but encoded only past the older text's prefix


def test_a_carried_turn_holds_its_copied_ids_packed_only(ds: HfTokenizer) -> None:
    """A turn that extends the last one copies its ids as packed bytes: no tuple of the long shared
    head is built per turn, and the ids read back (unpacked) are a plain encode's."""
    carry = encoder_of(ds).chat_carry()
    assert carry is not None
    base = [{"role": "system", "content": "heads"}, {"role": "user", "content": "a shared question " * 40}]
    for i in range(3):
        msgs = [*base, {"role": "assistant", "content": "ok"}, {"role": "user", "content": f"then {i}?"}]
        entry = encoder_of(ds).encode_chat(msgs)._held
        assert isinstance(entry, ReuseEntry)
        if i:
            assert entry.copied > len(entry.tail) and entry._ids is None
        assert list(entry.ids) == plain_ids(ds, msgs)


@given(
    old=st.lists(st.sampled_from(["a", "b", "", "ab"]), max_size=12),
    new=st.lists(st.sampled_from(["a", "b", "", "ab"]), max_size=12),
)
def test_shared_pieces_is_the_first_difference(old: list[str], new: list[str]) -> None:
    """`_shared_pieces` (slices compared, then a binary search) counts what a piece-by-piece walk counts."""
    i = 0
    while i < min(len(old), len(new)) and old[i] == new[i]:
        i += 1
    assert _shared_pieces(old, new) == i
    assert _shared_pieces(old, [*old[:-1], "z"]) == max(0, len(old) - 1)


def test_the_generation_prompt_is_encoded_once_not_with_each_new_turn(ds: HfTokenizer) -> None:
    """A turn's new text ends with the template's closing fragment (the generation prompt): its ids are
    kept once (`ChatCarry._suffix`) and only the text before it is encoded, when the cut before it is
    provably safe; the ids stay a plain encode's, and a text that could span the cut is encoded whole."""
    carry = encoder_of(ds).chat_carry()
    assert carry is not None
    carry.long_tail = LONG_TAIL  # (the property test above leaves it at 0 at times: every tail long)
    seen: list[str] = []

    def encode(text: str) -> tuple[tuple[int, ...], bytes]:
        seen.append(text)
        return plain_packed(ds)(text)

    base = [{"role": "system", "content": "s"}, {"role": "user", "content": "the long question " * 30}]
    for i, tail in enumerate(["first 12", "second 13", f"spans <{BAR}Assi", "third 14"]):
        last = {"role": "user", "content": f"question {tail}"}
        msgs = [*base, {"role": "assistant", "content": "ok"}, last]
        rendered = ds.templates.render_chat_pieces(msgs, True, None, ds._context, {})
        assert rendered is not None
        pieces, key = rendered
        seen.clear()
        entry, _ = carry.encode_entry(key, pieces, encode)
        assert list(entry.ids) == plain_ids(ds, msgs)
        assert pieces[-1] == ADDED[1]
        if i == 1:  # the fragment encoded alone (once), the new text alone
            assert seen and all(text == ADDED[1] or ADDED[1] not in text for text in seen), seen
        if i == 3:  # the fragment's ids kept: only the new text is encoded
            assert len(seen) == 1 and ADDED[1] not in seen[0], seen
        if i == 2:  # the text's last bytes may start a token with the fragment's: the cut is not proven
            assert seen and seen[-1].endswith(ADDED[1])
    assert len(carry._suffixes) <= 64
