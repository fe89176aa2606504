"""Chat renders reused across conversations of one structure: the template runs once per structure.

A chat template's output is its literal text with the messages' contents placed in it. Rendering the
template with every message text (``content``, text parts, ``reasoning_content``/``reasoning``)
replaced by an opaque stand-in gives a *skeleton*: literal fragments and numbered slots. A stand-in
supports only what cannot depend on the text beyond its emptiness: being passed around and output,
truthiness (``{{ content or '' }}``; emptiness is part of the key), ``+`` with strings or stand-ins
(it stays opaque), and the type-only tests (``is string``, ``is defined``, ...). Anything else —
``str()``, ``~``, filters, methods, comparisons, ``len``, iteration, ``tojson`` — raises, and a render
that raised is never used. So a render that completes followed the path the real render takes for any
texts with the same emptiness and the same everything else (the key), and the real text is the
skeleton with each slot filled. Templates that capture output into values (``{% set %}`` blocks,
macros, filter blocks, call blocks) or read a clock or randomness get no skeletons. A conversation
whose structure was rendered before (any conversation: structures repeat across users) then pays a
key and a join instead of the template; docs/tokenization.md has the argument. Pure: no I/O.
"""

from __future__ import annotations

import re
import secrets
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from operator import itemgetter
from typing import Any, Final

import jinja2
import jinja2.nodes
import msgspec

from tokenization.template_message import TemplateMessage, same_objects

__all__ = ["Inspected", "Opaque", "Skeletons", "skeletons_apply", "type_test"]

_TEXT_KEYS: Final = ("content", "reasoning_content", "reasoning")
# Tests whose answer is the same for every str: a stand-in gets the answer of any str.
_TYPE_TESTS: Final = frozenset(
    {"defined", "undefined", "none", "string", "mapping", "number", "integer", "float", "boolean",
     "iterable", "sequence", "callable", "true", "false", "escaped"}
)  # fmt: skip
_NONDETERMINISTIC: Final = ("strftime_now", "lipsum", "random")


class Inspected(Exception):
    """A skeleton render did something with a message text that depends on more than its emptiness."""


class Opaque:
    """A message text (or a concatenation with one) during a skeleton render; see the module doc."""

    __slots__ = ("_parts", "_truthy")

    def __init__(self, parts: tuple[str | int, ...], truthy: bool) -> None:
        self._parts, self._truthy = parts, truthy

    def __bool__(self) -> bool:
        return self._truthy

    def __add__(self, other: object) -> Opaque:
        if isinstance(other, Opaque):
            return Opaque(self._parts + other._parts, self._truthy or other._truthy)
        if isinstance(other, str):
            return Opaque((*self._parts, other), self._truthy or bool(other))
        raise Inspected("+")

    def __radd__(self, other: object) -> Opaque:
        if isinstance(other, str):
            return Opaque((other, *self._parts), self._truthy or bool(other))
        raise Inspected("+")

    def __getattr__(self, name: str) -> Any:
        raise Inspected(name)

    def _refuse(self, *args: object, **kwargs: object) -> Any:
        raise Inspected("operation")

    __str__ = __repr__ = __len__ = __iter__ = __contains__ = __getitem__ = _refuse
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __hash__ = __format__ = _refuse
    __mul__ = __rmul__ = __mod__ = __rmod__ = __html__ = _refuse

    def _marked(self, marker: Callable[[int], str]) -> str:
        """The output text with each slot as its marker."""
        return "".join(p if isinstance(p, str) else marker(p) for p in self._parts)


def skeletons_apply(ast: jinja2.nodes.Template, source: str) -> bool:
    """Whether a template's skeletons are exact: no output captured into a value, no clock, no randomness."""
    if any(word in source for word in _NONDETERMINISTIC):
        return False
    captures = (jinja2.nodes.AssignBlock, jinja2.nodes.Macro, jinja2.nodes.FilterBlock)
    if any(True for _ in ast.find_all(captures)):
        return False
    for block in ast.find_all(jinja2.nodes.CallBlock):
        # The {% generation %} tag renders its body unchanged; any other call block is a macro call.
        node = block.call.node if isinstance(block.call, jinja2.nodes.Call) else None
        if not (isinstance(node, jinja2.nodes.ExtensionAttribute) and node.name == "_body"):
            return False
    return True


class _Skeleton:
    __slots__ = ("_texts_of", "fragments", "pieces", "size", "slots")

    def __init__(self, fragments: list[str], slots: list[int]) -> None:
        assert len(fragments) == len(slots) + 1, "a split on markers alternates fragments and slots"
        self.fragments, self.slots = fragments, slots
        self.size = sum(len(f) for f in fragments) + 8 * len(slots)
        self.pieces = len(fragments) + len(slots)
        # The slots' texts taken in one C call (itemgetter gives a tuple from two slots on).
        self._texts_of = itemgetter(*slots) if len(slots) > 1 else None

    def fill(self, texts: Sequence[str]) -> list[str]:
        """The rendered text's pieces: the fragments with each slot's text between them."""
        fragments = self.fragments
        if self._texts_of is None:
            return [fragments[0], texts[self.slots[0]], fragments[1]] if self.slots else [fragments[0]]
        out = [""] * self.pieces
        out[0::2] = fragments
        out[1::2] = self._texts_of(texts)
        return out


Render = Callable[[list[dict[str, Any]]], str]
"""Renders the (stand-in) messages with everything else fixed; raises on a template error."""


class Skeletons:
    """A bounded LRU of skeletons by structure key, with hit/miss counters; off after repeated refusals."""

    def __init__(self, max_entries: int = 1024, max_bytes: int = 16 << 20, give_up_after: int = 16) -> None:
        self.max_entries, self.max_bytes, self.give_up_after = max_entries, max_bytes, give_up_after
        self.enabled = True
        self.hits = self.misses = self.refused = 0
        self.bytes = 0
        self._entries: OrderedDict[bytes, _Skeleton] = OrderedDict()
        self._nonce = secrets.token_hex(8)
        self._nonce_json = msgspec.json.encode(self._nonce)
        self._marker_re = re.compile("\x00" + self._nonce + ":([0-9]+)\x00")
        self._last_key: tuple[bytes, bytes, bytes] | None = None
        """The last structure key: the marks and context JSON objects it was made of, then the key."""

    def __len__(self) -> int:
        return len(self._entries)

    def render(
        self, messages: Sequence[Mapping[str, Any]], context: object, skeleton_render: Render
    ) -> str | None:
        """The rendered text from a skeleton (made with ``skeleton_render`` on a miss), or None when this
        request or template cannot use one (the caller then renders normally). ``context`` is every
        other input of the render (tools, options, special tokens), JSON-encodable."""
        pieces = self.pieces(messages, context, skeleton_render)
        return "".join(pieces) if pieces is not None else None

    def pieces(
        self,
        messages: Sequence[Mapping[str, Any]],
        context: object,
        skeleton_render: Render,
        context_json: bytes | None = None,
    ) -> list[str] | None:
        """`render`'s text as the pieces it joins (literal fragments and message texts, alternating),
        so a caller can compare two renders piece by piece. ``context_json``: ``context``'s JSON, when
        the caller has it."""
        if not self.enabled:
            return None
        # The key holds each text as its emptiness mark; stand-ins are made only on a miss, to render.
        marks, texts = _structure(messages)
        try:
            context_json = context_json if context_json is not None else msgspec.json.encode(context)
        except (TypeError, msgspec.EncodeError):
            return None
        kept = self._last_key
        if kept is not None and kept[0] is marks and kept[1] is context_json:
            key = kept[2]  # the same objects: the same key object, its hash made once
        else:
            key = b"%b]%b" % (marks, context_json)  # the marks' JSON values, then the context's: injective
            self._last_key = (marks, context_json, key)
        skeleton = self._entries.get(key)
        if skeleton is not None:
            self.hits += 1
            self._entries.move_to_end(key)
            return skeleton.fill(texts)
        self.misses += 1
        numbered: list[str] = []  # the same slot numbers as `texts`
        stand_ins = [_stand_in(m, numbered, _opaque) for m in messages]
        skeleton = self._make(stand_ins, skeleton_render)
        if skeleton is None:
            return None
        self._store(key, skeleton)
        return skeleton.fill(texts)

    def carry_key(
        self, messages: Sequence[Mapping[str, Any]], context: object, context_json: bytes | None = None
    ) -> bytes | None:
        """What a conversation's later turns share with it (this template, the other render inputs and
        the first two messages), to find its last render by; None when not JSON-encodable. Three JSON
        values joined (each delimits itself); the messages' encoding is kept on the second message
        when it is a `TemplateMessage` (a later turn carries the same two objects), and so is the key,
        given again for the same first message and the same ``context_json`` object (the caller's kept
        one, `ChatTemplate.render_pieces`). ``context_json``: ``context``'s JSON, when the caller has
        it."""
        second = messages[1] if len(messages) > 1 else None
        if context_json is not None and type(second) is TemplateMessage:
            kept = second._carry_key
            if kept is not None and kept[0] is self and kept[1] is messages[0] and kept[2] is context_json:
                return kept[3]  # the same object: found by identity, its hash made once
        try:
            context_json = context_json if context_json is not None else msgspec.json.encode(context)
            key = b"".join((self._nonce_json, context_json, _head_json(messages)))
        except (TypeError, msgspec.EncodeError):
            return None
        if type(second) is TemplateMessage:
            second._carry_key = (self, messages[0], context_json, key)
        return key

    def marker(self, slot: int) -> str:
        """The text a slot renders as in a skeleton render (a per-process nonce: requests cannot forge it)."""
        return f"\x00{self._nonce}:{slot}\x00"

    def finalize(self, value: object) -> object:
        """The skeleton environment's ``finalize``: a stand-in is output as its markers."""
        return value._marked(self.marker) if isinstance(value, Opaque) else value

    def _make(self, stand_ins: list[dict[str, Any]], skeleton_render: Render) -> _Skeleton | None:
        try:
            marked = skeleton_render(stand_ins)
        except Exception:
            self.refused += 1
            if self.refused >= self.give_up_after and not self._entries and not self.hits:
                self.enabled = False
            return None
        pieces = self._marker_re.split(marked)
        return _Skeleton(pieces[0::2], [int(i) for i in pieces[1::2]])

    def _store(self, key: bytes, skeleton: _Skeleton) -> None:
        if self.max_entries == 0 or skeleton.size > self.max_bytes:
            return
        self._entries[key] = skeleton
        self.bytes += skeleton.size
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.size


def type_test(test: Callable[..., Any], name: str) -> Callable[..., Any]:
    """A Jinja test for the skeleton environment: type-only tests answer for a stand-in as for a str,
    every other test refuses one."""

    def wrapped(value: object, *args: object, **kwargs: object) -> Any:
        if isinstance(value, Opaque) or any(isinstance(a, Opaque) for a in args):
            if name not in _TYPE_TESTS or args:
                raise Inspected(name)
            value = ""
        return test(value, *args, **kwargs)

    return wrapped


def _stand_in(
    message: Mapping[str, Any], texts: list[str], make: Callable[[str, int], object]
) -> dict[str, Any]:
    """``message`` with each text replaced by ``make(text, slot)`` (the texts appended to ``texts`` in
    slot order)."""
    out = dict(message)
    content = out.get("content")
    if type(content) is str:
        texts.append(content)
        out["content"] = make(content, len(texts) - 1)
    elif isinstance(content, list):
        out["content"] = [_part(p, texts, make) for p in content]
    for key in _TEXT_KEYS[1:]:
        value = out.get(key)
        if isinstance(value, str):
            texts.append(value)
            out[key] = make(value, len(texts) - 1)
    return out


Marks = tuple[dict[str, Any], tuple[str, ...], bytes]
"""A message's marked copy (`_stand_in` with `_mark`), its texts in slot order, and the marked copy's JSON."""


def _marks(message: Mapping[str, Any]) -> Marks:
    """``_stand_in(message, texts, _mark)``, the texts it took and its JSON; of a `TemplateMessage` made
    once and kept on it (it never changes, and marks depend on nothing else)."""
    kept = message._skeleton_marks if type(message) is TemplateMessage else None
    if kept is None:
        kept = _plain_marks(message)
        if kept is None:
            own: list[str] = []
            marked = _stand_in(message, own, _mark)
            kept = (marked, tuple(own), msgspec.json.encode(marked))
        if type(message) is TemplateMessage:
            message._skeleton_marks = kept
    return kept


_ROLE_CONTENT: Final = ("role", "content")
_PLAIN_MARKS: dict[tuple[str, bool], tuple[dict[str, Any], bytes]] = {}
_PLAIN_MARKS_MAX: Final = 64  # roles are a handful; more are odd requests, marked the long way


def _plain_marks(message: Mapping[str, Any]) -> Marks | None:
    """`_marks` of a message that is only a role and a text content (most are), its marked copy and JSON
    shared by every such message with that role and emptiness (all they depend on); None for others."""
    role, content = message.get("role"), message.get("content")
    if type(role) is not str or type(content) is not str or tuple(message) != _ROLE_CONTENT:
        return None
    shape = (role, content != "")
    marked = _PLAIN_MARKS.get(shape)
    if marked is None:
        out = {"role": role, "content": _mark(content, 0)}
        marked = (out, msgspec.json.encode(out))
        if len(_PLAIN_MARKS) < _PLAIN_MARKS_MAX:
            _PLAIN_MARKS[shape] = marked
    return (marked[0], (content,), marked[1])


def _structure(messages: Sequence[Mapping[str, Any]]) -> tuple[bytes, list[str]]:
    """The messages' marks' JSON values joined by commas (the structure a skeleton is found by) and
    their texts in slot order. Those of a conversation's leading messages are kept on the last of them
    when it is a `TemplateMessage` (`TemplateMessage._marks_prefix`), so a later turn that re-sends
    them (found by its second or third message from the end) reads them instead of each message's;
    the marks joined after them are kept there too (`TemplateMessage._marks_tail`: a new last turn
    of the same shape gives the same bytes object, its hash made once)."""
    n, start = len(messages), 0
    parts: list[bytes] = []
    texts: list[str] = []
    holder: TemplateMessage | None = None
    for back in (2, 3):
        at = messages[n - back] if n >= back else None
        if type(at) is not TemplateMessage:
            continue
        memo = at._marks_prefix
        if memo is not None and same_objects(memo[0], messages[: n - back]):
            start, parts, texts, holder = n - back + 1, [memo[1]], [*memo[2]], at
            break
    for i in range(start, n):
        m = messages[i]
        marked = _marks(m)
        parts.append(marked[2])
        texts += marked[1]
        if i == n - 2 and type(m) is TemplateMessage:  # (the last message's: below, from the whole)
            m._marks_prefix = (messages[:i], b",".join(parts), tuple(texts))
    marks = _joined_marks(parts, holder)
    last = messages[n - 1] if n else None
    if start < n and type(last) is TemplateMessage:
        last._marks_prefix = (messages[: n - 1], marks, tuple(texts))
    return marks, texts


def _joined_marks(parts: list[bytes], holder: TemplateMessage | None) -> bytes:
    """``b",".join(parts)``; after a ``holder``'s kept marks (``parts[0]``), the bytes kept on it when
    the other parts are the same objects (marks of plain messages are shared: `_plain_marks`)."""
    if holder is None:
        return b",".join(parts)
    tail = holder._marks_tail
    if tail is not None and same_objects(tail[0], parts):
        return tail[1]
    joined = b",".join(parts)
    holder._marks_tail = (tuple(parts), joined)
    return joined


def _head_json(messages: Sequence[Mapping[str, Any]]) -> bytes:
    """``msgspec.json.encode(messages[:2])``, kept on the second message when it is a `TemplateMessage`
    (with the first message it was encoded with: frozen, so the bytes stay right)."""
    second = messages[1] if len(messages) > 1 else None
    if type(second) is not TemplateMessage:
        return msgspec.json.encode(messages[:2])
    kept = second._carry_head
    if kept is None or kept[0] is not messages[0]:
        kept = second._carry_head = (messages[0], msgspec.json.encode(messages[:2]))
    return kept[1]


def _part(part: object, texts: list[str], make: Callable[[str, int], object]) -> object:
    if isinstance(part, Mapping) and isinstance(part.get("text"), str):
        texts.append(part["text"])
        return {**part, "text": make(part["text"], len(texts) - 1)}
    return part


def _opaque(text: str, slot: int) -> Opaque:
    return Opaque((slot,), text != "")


_MARKS: Final = (("\x00text", False), ("\x00text", True))


def _mark(text: str, slot: int) -> tuple[str, bool]:
    """A text's place in the structure key: its emptiness only."""
    return _MARKS[text != ""]
