"""Chat skeletons: a structure rendered once is filled in afterwards, and always equals a full render.

Every template below is rendered through `ChatTemplate.render` (skeletons on) and compared with the
same template rendered plainly, on random conversations whose texts are built to be awkward (empty,
whitespace only, marker-like NULs, text that looks like the template's own markup).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2.nodes
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.encoder_helpers import chat_ids, deepseek
from tokenization import BuiltinTokenizer
from tokenization.builtin import BUILTIN_CHAT_TEMPLATE
from tokenization.chat_template import ChatOptions, ChatTemplate, _options
from tokenization.loading import cached_encoder
from tokenization.skeletons import (
    Inspected,
    Opaque,
    Skeletons,
    _mark,
    _marks,
    _Skeleton,
    _stand_in,
    _structure,
    skeletons_apply,
)
from tokenization.template_message import TemplateMessage

DATA = Path(__file__).parents[1] / "data"
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}

# Templates that use the texts only in ways a skeleton reproduces, and ones that inspect them.
OPAQUE_USE = {
    "deepseek": (DATA / "deepseek_chat.jinja").read_text(),
    "parts": (DATA / "parts_chat.jinja").read_text(),
    "builtin": BUILTIN_CHAT_TEMPLATE,
    "qwen_plus": "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\\n{% endif %}",
    "truthiness": "{% for m in messages %}{% if m.content %}[{{ m.content }}]{% else %}(empty){% endif %}"
    "{{ m.get('reasoning_content') or '' }}{% endfor %}",
    "tests": "{% for m in messages %}{% if m.content is string and m.content is not none %}{{ m.content }}"
    "{% endif %}{% endfor %}",
}
INSPECTING = {
    "trim": "{% for m in messages %}{{ m['content'] | trim }}|{% endfor %}",
    "tilde": "{% for m in messages %}{{ m['content'] ~ '\\n' }}{% endfor %}",
    "length": "{% for m in messages %}{{ m['content'] | length }}{% endfor %}",
    "contains": "{% for m in messages %}{% if '</think>' in m['content'] %}T{% endif %}{{ m.content }}"
    "{% endfor %}",
    "value_tests": "{% for m in messages %}{% if m.content is lower %}L{% endif %}"
    "{% if m.content is eq 'hi' %}H{% endif %}{{ m.content }}{% endfor %}",
    "method": "{% for m in messages %}{{ m['content'].split('x')[0] }}{% endfor %}",
    "eq": "{% for m in messages %}{% if m.content == 'hi' %}H{% endif %}{% endfor %}",
    "slice": "{% for m in messages %}{{ m.content[:3] }}{% endfor %}",
    "tojson": "{% for m in messages %}{{ m | tojson }}{% endfor %}",
    "startswith_attr": "{% for m in messages %}{% if m.content.startswith %}S{% endif %}{{ m.content }}"
    "{% endfor %}",
    "set_block": "{% for m in messages %}{% set body %}{{ m.content }}{% endset %}{{ body | trim }}"
    "{% endfor %}",
    "macro": "{% macro t(x) %}{{ x }}{% endmacro %}{% for m in messages %}{{ t(m.content) | trim }}"
    "{% endfor %}",
    "filter_block": "{% for m in messages %}{% filter upper %}{{ m.content }}{% endfilter %}{% endfor %}",
    "clock": "{{ strftime_now('%Y') }}{% for m in messages %}{{ m.content }}{% endfor %}",
}
ALL = {**OPAQUE_USE, **INSPECTING}

TEXT = st.one_of(
    st.sampled_from(["", " ", "  \n", "hi", "</think>", "<|end|>", "\x00", "\x000:1\x00", "x{{ y }}"]),
    st.text(max_size=12),
)
BOOL = st.booleans()
ROLES = st.sampled_from(["system", "user", "assistant"])
MESSAGE = st.fixed_dictionaries(
    {
        "role": ROLES,
        "content": st.one_of(TEXT, st.lists(st.builds(lambda t: {"type": "text", "text": t}, TEXT))),
    },
    optional={"reasoning_content": TEXT},
)


def _plain(source: str) -> ChatTemplate:
    template = ChatTemplate(source, clock=lambda: datetime(2026, 1, 1))
    template._skeleton_template = None  # the reference: every render runs the template
    return template


def _render(template: ChatTemplate, messages: list[dict[str, Any]], gen: bool) -> str | Exception:
    try:
        return template.render(messages, ChatOptions(add_generation_prompt=gen), SPECIAL)
    except Exception as exc:
        return exc


_TEMPLATES: dict[str, tuple[ChatTemplate, ChatTemplate]] = {}


def _pair(name: str) -> tuple[ChatTemplate, ChatTemplate]:
    if name not in _TEMPLATES:
        clock = lambda: datetime(2026, 1, 1)  # noqa: E731
        _TEMPLATES[name] = (ChatTemplate(ALL[name], clock=clock), _plain(ALL[name]))
    return _TEMPLATES[name]


@settings(max_examples=200, deadline=None)
@given(
    conversations=st.lists(st.lists(MESSAGE, min_size=1, max_size=5), min_size=1, max_size=4),
    gen=st.booleans(),
)
def test_every_render_equals_the_plain_render(conversations: list[list[dict[str, Any]]], gen: bool) -> None:
    for name in ALL:
        fast, plain = _pair(name)
        for messages in conversations:
            got, want = _render(fast, messages, gen), _render(plain, messages, gen)
            if isinstance(want, Exception):
                assert isinstance(got, type(want)), (name, messages)
            else:
                assert got == want, (name, messages)


def test_a_structure_seen_before_is_filled_in_not_rendered() -> None:
    # a template of its own: the shared pair's cache may hold these structures from earlier tests
    fast, plain = ChatTemplate(ALL["deepseek"], clock=lambda: datetime(2026, 1, 1)), _pair("deepseek")[1]
    first = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    second = [{"role": "user", "content": "another user"}, {"role": "assistant", "content": "other reply"}]
    hits, misses = fast.skeletons.hits, fast.skeletons.misses
    for messages in (first, second):
        assert _render(fast, messages, True) == _render(plain, messages, True)
    assert (fast.skeletons.hits - hits, fast.skeletons.misses - misses) == (1, 1)
    emptied = [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]
    assert _render(fast, emptied, True) == _render(plain, emptied, True)
    assert fast.skeletons.misses - misses == 2  # emptiness is part of the structure


def test_templates_that_capture_output_or_read_a_clock_get_no_skeletons() -> None:
    env = jinja2.Environment()
    for name in ("set_block", "macro", "filter_block", "clock"):
        assert not skeletons_apply(env.parse(ALL[name]), ALL[name]), name
        assert _pair(name)[0]._skeleton_template is None
    for name in OPAQUE_USE:
        assert _pair(name)[0]._skeleton_template is not None, name


def test_a_template_that_always_inspects_its_texts_stops_trying() -> None:
    template = ChatTemplate(ALL["trim"])
    for i in range(template.skeletons.give_up_after):
        template.render([{"role": "user", "content": " x "}] * (i + 1), ChatOptions(), SPECIAL)
    assert not template.skeletons.enabled and template.skeletons.refused == template.skeletons.give_up_after


def test_a_stand_in_refuses_everything_but_output_truthiness_and_concatenation() -> None:
    text = Opaque((0,), truthy=True)
    assert bool(text) and not Opaque((0,), truthy=False)
    assert isinstance("a" + text + "b", Opaque)
    for op in (str, repr, len, hash, iter, lambda t: t == "x", lambda t: "x" in t, lambda t: t[0],
               lambda t: t.strip(), lambda t: f"{t}", lambda t: t * 2, lambda t: t + 1):  # fmt: skip
        with pytest.raises(Inspected):
            op(text)
    skeletons = Skeletons()
    assert skeletons.finalize("a" + text) == "a" + skeletons.marker(0)


def test_the_cache_is_bounded() -> None:
    skeletons = Skeletons(max_entries=2)
    render = lambda msgs: "".join(skeletons.finalize(m["content"]) for m in msgs)  # type: ignore[misc]  # noqa: E731
    for n in range(1, 5):
        assert skeletons.render([{"content": "x"}] * n, None, render) == "x" * n
    assert len(skeletons) == 2
    assert skeletons.bytes == sum(s.size for s in skeletons._entries.values())


def test_tokenizers_chat_tokens_stay_exact_through_skeletons() -> None:
    for tok in (
        deepseek(),
        BuiltinTokenizer(),
    ):
        for content in ("first question", "second, longer question"):
            messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": content}]
            text = tok.templates.select(None)._template.render(
                messages=messages, tools=None, documents=None, add_generation_prompt=True, **tok._context
            )
            assert tok.apply_chat_template(messages) == text
            assert chat_ids(cached_encoder(tok), messages) == tok.encode(text, add_special_tokens=False)
        assert tok.templates.select(None).skeletons.hits >= 1


@given(
    slots=st.lists(st.integers(0, 5), max_size=8),
    texts=st.lists(st.text(max_size=3), min_size=6, max_size=6),
)
def test_fill_places_each_slots_text_between_the_fragments(slots: list[int], texts: list[str]) -> None:
    """`_Skeleton.fill` (one itemgetter call and two slice assignments) is the plain interleaving, for
    no slot, one slot (itemgetter's scalar) and more."""
    fragments = [f"<{i}>" for i in range(len(slots) + 1)]
    expected = [fragments[0]]
    for slot, fragment in zip(slots, fragments[1:], strict=True):
        expected += [texts[slot], fragment]
    assert _Skeleton(fragments, slots).fill(texts) == expected


@given(
    texts=st.lists(st.text(max_size=6), min_size=1, max_size=3),
    context=st.sampled_from([None, {"a": 1}, [True, None]]),
)
def test_carry_keys_from_kept_messages_equal_fresh_ones(texts: list[str], context: object) -> None:
    """`Skeletons.carry_key` keeps the first two messages' JSON on the second `TemplateMessage`: the
    key equals the one from plain dicts, and another first message (or context) gives another key."""
    skeletons = Skeletons()
    plain = [{"role": "user", "content": t} for t in texts]
    kept = [TemplateMessage(m) for m in plain]
    key = skeletons.carry_key(kept, context)
    assert key == skeletons.carry_key(kept, context) == skeletons.carry_key(plain, context)
    changed = [TemplateMessage({"role": "user", "content": texts[0] + "!"}), *kept[1:]]
    assert skeletons.carry_key(changed, context) != key
    assert skeletons.carry_key(kept, context) == key  # the kept bytes follow the first message back
    assert skeletons.carry_key(kept, {"other": context}) != key


def _fresh_structure(messages: Sequence[Mapping[str, Any]]) -> tuple[bytes, list[str]]:
    texts: list[str] = []
    marks = [msgspec.json.encode(_stand_in(dict(m), texts, _mark)) for m in messages]
    return b",".join(marks), texts


@settings(max_examples=150, deadline=None)
@given(
    first=st.lists(MESSAGE, max_size=5),
    turns=st.lists(st.tuples(st.integers(0, 3), st.lists(MESSAGE, max_size=3), BOOL), min_size=1, max_size=6),
)
def test_structures_kept_across_turns_equal_fresh_ones(
    first: list[dict[str, Any]], turns: list[tuple[int, list[dict[str, Any]], bool]]
) -> None:
    """`_structure` reads the marks a conversation's earlier turn kept on its messages (a turn drops
    up to 3 last messages, adds new ones, sometimes as equal copies): always what fresh dicts give."""
    conv = [TemplateMessage(m) for m in first]
    assert _structure(conv) == _fresh_structure(conv)
    for drop, new, copy in turns:
        kept = conv[: max(0, len(conv) - drop)]
        kept = [TemplateMessage(dict(m)) for m in kept] if copy else kept
        conv = [*kept, *(TemplateMessage(m) for m in new)]
        assert _structure(conv) == _fresh_structure(conv)
        assert _structure(conv) == _fresh_structure(conv)  # again, from what it kept


@settings(max_examples=100, deadline=None)
@given(
    first=st.lists(MESSAGE, min_size=1, max_size=4),
    lasts=st.lists(MESSAGE, min_size=1, max_size=5),
    contexts=st.lists(st.sampled_from([b"[1]", b"[2]"]), min_size=5, max_size=5),
)
def test_kept_structure_keys_equal_fresh_ones(
    first: list[dict[str, Any]], lasts: list[dict[str, Any]], contexts: list[bytes]
) -> None:
    """Turns that each replace the last message (the same shape or not) find their skeleton by the
    key fresh marks and context give: the kept marks tail and last key are those bytes."""
    skeletons = Skeletons()
    head = [TemplateMessage(m) for m in first]
    known = {b"[1]": b"[1]", b"[2]": b"[2]"}  # one object per context, as a caller keeps it
    for last, context in zip(lasts, contexts, strict=False):
        conv = [*head, TemplateMessage(last)]
        got = skeletons.pieces(conv, None, lambda ms: "".join(map(str, range(len(ms)))), known[context])
        assert got is not None
        key = b"%b]%b" % (_fresh_structure(conv)[0], context)
        assert skeletons._last_key is not None and skeletons._last_key[2] == key and key in skeletons._entries


def test_kept_marks_are_read_only_for_the_same_message_objects() -> None:
    """A later message's kept marks are not read once an earlier message is another object, even an
    equal one: ``{"n": 1} == {"n": 1.0}``, yet they render apart."""
    shared, last = TemplateMessage({"role": "user", "content": "x"}), TemplateMessage({"role": "user"})
    _structure([TemplateMessage({"role": "tool", "n": 1}), shared, last])
    later = [TemplateMessage({"role": "tool", "n": 1.0}), shared, last]
    assert _structure(later) == _fresh_structure(later) and b"1.0" in _structure(later)[0]


@settings(max_examples=200, deadline=None)
@given(
    message=st.one_of(
        MESSAGE,
        st.fixed_dictionaries({"role": st.one_of(ROLES, st.text(max_size=3), st.just(1)), "content": TEXT}),
        st.builds(lambda t, r: {"content": t, "role": r}, TEXT, ROLES),  # keys in the other order
        st.builds(lambda t: {"role": "user", "content": t, "name": "n"}, TEXT),
    ),
    kept=BOOL,
)
def test_marks_of_plain_messages_shared_by_shape_equal_fresh_ones(
    message: dict[str, Any], kept: bool
) -> None:
    """A role-and-text message's marks are shared by its role and emptiness (`_plain_marks`); any
    message's marks equal those `_stand_in` makes, texts and JSON alike."""
    texts: list[str] = []
    marked = _stand_in(dict(message), texts, _mark)
    got = _marks(TemplateMessage(message) if kept else message)
    assert got[0] == marked and got[1] == tuple(texts) and got[2] == msgspec.json.encode(marked)


def test_a_kept_carry_key_is_given_only_for_the_same_inputs_object_and_first_message() -> None:
    """`carry_key` gives the key kept on the second message for the same `Skeletons`, first message
    and context JSON object; an equal JSON from elsewhere, another first message or another
    `Skeletons` (its own nonce) make the key afresh, always equal to a plain dicts' key."""
    skeletons, other = Skeletons(), Skeletons()
    msgs = [
        TemplateMessage({"role": "system", "content": "s"}),
        TemplateMessage({"role": "user", "content": "u"}),
    ]
    plain = [dict(m) for m in msgs]
    context_json = msgspec.json.encode({"a": 1})
    key = skeletons.carry_key(msgs, None, context_json)
    assert key is not None and skeletons.carry_key(msgs, None, context_json) is key
    assert skeletons.carry_key(msgs, None, msgspec.json.encode({"a": 1})) == key
    assert skeletons.carry_key(plain, None, context_json) == key
    assert other.carry_key(msgs, None, context_json) == other.carry_key(plain, None, context_json) != key
    first = TemplateMessage({"role": "system", "content": "t"})
    assert skeletons.carry_key([first, msgs[1]], None, context_json) == skeletons.carry_key(
        [dict(first), plain[1]], None, context_json
    )
    assert skeletons.carry_key(msgs, None, context_json) == key


@given(gen=st.sampled_from([True, False, 1, 0]), cont=st.sampled_from([False, True, 0, None]))
def test_shared_chat_options_equal_fresh_ones(gen: Any, cont: Any) -> None:
    """`_options` gives a shared object for a chat without tools or other arguments: equal, field for
    field and in type, to the one it would build."""
    got = _options(gen, None, {"continue_final_message": cont})
    fresh = ChatOptions(add_generation_prompt=gen, continue_final_message=bool(cont), kwargs={})
    assert got == fresh and type(got.add_generation_prompt) is type(gen)
    assert msgspec.json.encode(got) == msgspec.json.encode(fresh)


def test_kept_render_inputs_follow_the_special_tokens() -> None:
    """`ChatTemplate.render_pieces` keeps its last inputs' JSON for the same options object and
    special tokens: changed tokens (the same dict changed, or another) give the render they give."""
    template = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    )
    options = _options(True, None, {"continue_final_message": False})
    msgs = [TemplateMessage({"role": "user", "content": "hi"})]
    special = dict(SPECIAL)
    first = template.render_pieces(msgs, options, special)
    assert first is not None and "".join(first[0]) == template.render(msgs, options, special)
    special["bos_token"] = "<B>"
    again = template.render_pieces(msgs, options, special)
    assert again is not None and "".join(again[0]) == template.render(msgs, options, special)
    assert again[1] != first[1] and again[0][0].startswith("<B>")
    reordered = {"eos_token": "</s>", "bos_token": "<s>"}
    third = template.render_pieces(msgs, options, reordered)
    assert third is not None and third[1] != first[1]  # the JSON follows the order: another key
