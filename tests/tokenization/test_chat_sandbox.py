"""The chat-template sandbox: remembered attribute verdicts answer exactly as jinja2's own sandbox."""

from __future__ import annotations

import jinja2
import jinja2.sandbox
import pytest

from tokenization import TokenizationError
from tokenization.chat_template import ChatOptions, ChatTemplate

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "extra": "x"}]
SOURCES = [
    "{{ messages[0].__class__ }}",  # dunder attribute: unsafe, renders as undefined
    "{{ messages[0]._private }}",  # underscore name
    "{{ messages[0].get.__self__ }}",  # internal attribute of a builtin method
    "{{ messages.append(1) }}",  # mutating a list: refused
    "{{ messages[0].update({}) }}",  # mutating a dict
    "{{ messages[0].pop('role') }}",
    "{% for m in messages %}{{ m.get('role') }}:{{ m.content }}:{{ m.get('extra', '-') }};{% endfor %}",
    "{{ messages | length }} {{ 'a,b'.split(',') }} {{ messages[0].keys() | list }} {{ 'x'.upper() }}",
]


def reference(source: str) -> str | type[Exception]:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    try:
        return env.from_string(source).render(messages=MESSAGES, add_generation_prompt=True)
    except jinja2.exceptions.TemplateError:
        return TokenizationError


def ours(template: ChatTemplate) -> str | type[Exception]:
    try:
        return template.render(MESSAGES, ChatOptions(), {})
    except TokenizationError:
        return TokenizationError


@pytest.mark.parametrize("source", SOURCES)
def test_every_render_answers_as_the_plain_sandbox(source: str) -> None:
    template = ChatTemplate(source)
    expected = reference(source)
    # The first render computes each verdict, the later ones use the remembered verdicts.
    assert [ours(template) for _ in range(3)] == [expected] * 3
    assert MESSAGES[0] == {"role": "user", "content": "hi"}


def test_the_unsafe_cases_are_refused_or_hidden() -> None:
    """A guard on the reference itself: these sources really are the sandbox's refusals."""
    assert [reference(s) for s in SOURCES[:6]] == ["", "", "", *[TokenizationError] * 3]
