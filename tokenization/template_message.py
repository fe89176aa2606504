"""A chat template's message dict that never changes once made, so values derived from it can be kept.

`conversation()` makes one per decoded message and keeps it on that message; a message reused from
the conversation's previous request (tokenization.chat_decoder) brings it along, and with it the
skeleton marks of it `Skeletons` made last time. Every mutating dict method raises, so nothing
derived from it can go stale. The real (non-skeleton) render gets plain dict copies: a template
then sees exactly the dicts it always saw. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import is_
from typing import Any, NoReturn

__all__ = ["TemplateMessage", "plain", "same_objects"]


class TemplateMessage(dict[str, Any]):
    """A frozen message dict; ``_skeleton_marks`` is `Skeletons`' (marked message, texts, its JSON),
    once made; ``_carry_head`` the JSON of the conversation's first two messages when this is the
    second (with the first), for `Skeletons.carry_key`; ``_marks_prefix`` the marks of the messages
    up to this one (the ones before it, their and its marks' JSON joined, their texts), for
    `Skeletons.pieces`; ``_marks_tail`` the marks joined after those (the other parts, then the
    bytes) by the last turn that read them; ``_carry_key`` the carry key made with this as the
    second message (the `Skeletons`, the first message and the context JSON object it was made
    for, then the key)."""

    __slots__ = ("_carry_head", "_carry_key", "_marks_prefix", "_marks_tail", "_skeleton_marks")

    def __init__(self, fields: dict[str, Any]) -> None:
        super().__init__(fields)
        self._skeleton_marks: tuple[dict[str, Any], tuple[str, ...], bytes] | None = None
        self._carry_head: tuple[object, bytes] | None = None
        self._carry_key: tuple[object, object, bytes, bytes] | None = None
        self._marks_prefix: tuple[Sequence[object], bytes, tuple[str, ...]] | None = None
        self._marks_tail: tuple[tuple[bytes, ...], bytes] | None = None

    def _frozen(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError("a TemplateMessage is never changed: copy it with dict(message)")

    __setitem__ = __delitem__ = __ior__ = update = pop = popitem = clear = setdefault = _frozen


def plain(messages: list[Any]) -> list[Any]:
    """``messages`` with every `TemplateMessage` as a plain dict copy (what a real render is given)."""
    return [dict(m) if type(m) is TemplateMessage else m for m in messages]


def same_objects(a: Sequence[object], b: Sequence[object]) -> bool:
    """Whether ``a`` and ``b`` hold the same objects in order: identity, not equality (``1 == 1.0``,
    yet a template renders them apart), compared in C."""
    return len(a) == len(b) and all(map(is_, a, b))
