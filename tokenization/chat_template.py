"""Jinja chat templates rendered the way HF transformers renders them.

Same environment (sandboxed, ``trim_blocks``, ``lstrip_blocks``, loop controls, the ``{% generation %}``
tag), the same helpers (``raise_exception``, ``tojson`` as ``json.dumps(ensure_ascii=False)``,
``strftime_now``) and the same call (``messages``, ``tools``, ``documents``, ``add_generation_prompt``,
the special tokens, then the caller's kwargs), plus transformers' ``continue_final_message`` cut.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from enum import StrEnum
from typing import Any, Final, NoReturn, cast

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import msgspec

from tokenization.base import Message, TokenizationError
from tokenization.skeletons import Skeletons, skeletons_apply, type_test
from tokenization.template_message import plain

__all__ = ["ChatOptions", "ChatTemplate", "ContentFormat", "TemplateSet"]


class ContentFormat(StrEnum):
    """How message content reaches the template: vLLM's "string" (parts joined) or "openai" (part list)."""

    STRING = "string"
    OPENAI = "openai"


class ChatOptions(msgspec.Struct, frozen=True):
    """Everything besides the messages that changes the rendered text."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Mapping[str, Any]] | None = None
    documents: list[Mapping[str, Any]] | None = None
    kwargs: dict[str, Any] = msgspec.field(default_factory=dict)


class _GenerationTag(jinja2.ext.Extension):
    """transformers' ``{% generation %}`` block: renders its body unchanged (we need no assistant mask)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # json.dumps, not msgspec: templates are written against Python's exact spacing and float repr.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


# The request data a template reads: JSON values (and the tuples/bools the conversation builds).
_PLAIN_TYPES: Final = frozenset({dict, list, tuple, str, int, float, bool, type(None)})
_VERDICTS_MAX: Final = 4096


class _Sandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """transformers' sandbox, with its attribute verdicts remembered for plain JSON types.

    For those types jinja2's verdict depends only on the type and the attribute name (underscore
    names, internal attributes, mutating methods), so remembering it changes no answer; it saves the
    isinstance/ABC checks on every `message.get(...)` of every render."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._verdicts: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        kind = type(obj)
        if kind not in _PLAIN_TYPES:
            return super().is_safe_attribute(obj, attr, value)
        verdict = self._verdicts.get((kind, attr))
        if verdict is None:
            verdict = super().is_safe_attribute(obj, attr, value)
            if len(self._verdicts) < _VERDICTS_MAX:
                self._verdicts[(kind, attr)] = verdict
        return verdict


def _make_environment(
    clock: Callable[[], datetime], skeletons: Skeletons | None = None
) -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """transformers' environment; with ``skeletons``, the variant that renders their stand-ins."""
    options: dict[str, Any] = {"finalize": skeletons.finalize} if skeletons is not None else {}
    env = _Sandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols], **options
    )
    if skeletons is not None:
        env.tests = {
            name: type_test(cast(Callable[..., Any], test), name) for name, test in env.tests.items()
        }
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: clock().strftime(fmt)
    return env


def _iterates_content(ast: jinja2.nodes.Template) -> bool:
    """True when some ``for`` loop walks ``x['content']``, ``x.content`` or a variable named content."""
    for loop in ast.find_all(jinja2.nodes.For):
        it = loop.iter
        if isinstance(it, jinja2.nodes.Name) and it.name == "content":
            return True
        if isinstance(it, jinja2.nodes.Getattr) and it.attr == "content":
            return True
        if isinstance(it, jinja2.nodes.Getitem) and isinstance(it.arg, jinja2.nodes.Const):
            if it.arg.value == "content":
                return True
    return False


class ChatTemplate:
    """A compiled chat template: ``render(messages, options, special)`` -> the prompt text.

    Its ``skeletons`` (tokenization.skeletons) live here, not in a cached encoder, because they are
    this template's compiled state rather than a cache of encodings: the template is compiled a second
    time around them (their ``finalize`` makes the stand-ins' markers), they hold rendered text only
    (no ids: any tokenizer's encoder renders through them alike), and their key is the template's
    inputs alone. Every encoder over the template shares them, as every render shares the compiled
    Jinja template; their counters reach the metrics through `CachedEncoder.stats`."""

    def __init__(self, source: str, clock: Callable[[], datetime] = datetime.now) -> None:
        env = _make_environment(clock)
        try:
            self._template = env.from_string(source)
            ast = env.parse(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise TokenizationError(f"chat template does not compile: {exc}") from exc
        self.source = source
        self.detected_format = ContentFormat.OPENAI if _iterates_content(ast) else ContentFormat.STRING
        self.supports_developer_role = '"developer"' in source or "'developer'" in source
        self.skeletons = Skeletons()
        self._skeleton_template: jinja2.Template | None = None
        self._last_inputs: tuple[ChatOptions, Mapping[str, str], tuple[Any, ...], _Inputs] | None = None
        if skeletons_apply(ast, source):
            self._skeleton_template = _make_environment(clock, self.skeletons).from_string(source)

    def render(self, messages: Sequence[Message], options: ChatOptions, special: Mapping[str, str]) -> str:
        """Render as ``apply_chat_template(tokenize=False)``; a template error -> TokenizationError.
        A structure rendered before is filled in from its skeleton (tokenization.skeletons)."""
        if options.continue_final_message and options.add_generation_prompt:
            raise TokenizationError("continue_final_message and add_generation_prompt cannot both be set")
        context = {**special, **options.kwargs}
        text = None
        skeleton_template = self._skeleton_template
        if skeleton_template is not None:
            inputs = (options.add_generation_prompt, options.tools, options.documents, context)
            text = self.skeletons.render(
                messages, inputs, lambda stand_ins: _render(skeleton_template, stand_ins, options, context)
            )
        if text is None:
            try:
                text = _render(self._template, plain(list(messages)), options, context)
            except jinja2.exceptions.TemplateError as exc:
                raise TokenizationError(f"chat template rejected the request: {exc}") from exc
        if options.continue_final_message:
            text = _cut_after_final_message(text, messages)
        return text

    def render_pieces(
        self, messages: Sequence[Message], options: ChatOptions, special: Mapping[str, str]
    ) -> tuple[list[str], bytes] | None:
        """`render`'s text as a skeleton's pieces (joined, they are that text) and the conversation's
        carry key (`Skeletons.carry_key`); None when no skeleton serves this request, or with
        ``continue_final_message`` (its cut is made on the text). Errors as `render` raises them."""
        skeleton_template = self._skeleton_template
        if skeleton_template is None or options.continue_final_message:
            return None
        made = self._inputs(options, special)
        if made is None:
            return None
        context, inputs, inputs_json = made
        key = self.skeletons.carry_key(messages, inputs, inputs_json)
        if key is None:
            return None
        pieces = self.skeletons.pieces(
            messages,
            inputs,
            lambda stand_ins: _render(skeleton_template, stand_ins, options, context),
            inputs_json,
        )
        return (pieces, key) if pieces is not None else None

    def _inputs(self, options: ChatOptions, special: Mapping[str, str]) -> _Inputs | None:
        """The render's context, the other inputs of its keys and their JSON (once for both keys); None
        when not JSON-encodable. The last ones are given again for the same ``options`` object and
        ``special`` (the same object, its items the same in order): the same keys' bytes, one object."""
        items = tuple(special.items())
        kept = self._last_inputs
        if kept is not None and kept[0] is options and kept[1] is special and kept[2] == items:
            return kept[3]
        context = {**special, **options.kwargs}
        inputs = (options.add_generation_prompt, options.tools, options.documents, context)
        try:
            made = (context, inputs, msgspec.json.encode(inputs))
        except (TypeError, msgspec.EncodeError):
            return None
        self._last_inputs = (options, special, items, made)
        return made


_Inputs = tuple[dict[str, Any], tuple[Any, ...], bytes]


def _render(
    template: jinja2.Template, messages: list[Any], options: ChatOptions, context: Mapping[str, Any]
) -> str:
    return template.render(
        messages=messages,
        tools=options.tools,
        documents=options.documents,
        add_generation_prompt=options.add_generation_prompt,
        **context,
    )


def _final_text(messages: Sequence[Message]) -> str:
    if not messages:
        raise TokenizationError("continue_final_message needs at least one message")
    content = messages[-1].get("content")
    if isinstance(content, str):
        return content
    for part in reversed(content if isinstance(content, list) else []):
        if isinstance(part, Mapping) and "text" in part:
            return str(part["text"])
    raise TokenizationError("continue_final_message: the final message has no text content")


def _cut_after_final_message(text: str, messages: Sequence[Message]) -> str:
    """Drop what the template put after the final message (end-of-turn markers), as transformers does."""
    final = _final_text(messages)
    stripped = final.strip()
    if stripped not in text:
        raise TokenizationError("continue_final_message: the final message is not in the rendered chat")
    loc = text.rindex(stripped)
    if text[loc : loc + len(final.lstrip())] == final:
        # The template kept the message's spacing (or it has none at either end): cut right after it.
        return text[: loc + len(final.lstrip())]
    return text[: loc + len(stripped)]


class TemplateSet(msgspec.Struct, frozen=True):
    """A model's templates: the default one and, when it ships one, transformers' ``tool_use`` variant."""

    default: ChatTemplate | None = None
    tool_use: ChatTemplate | None = None

    def select(self, tools: object) -> ChatTemplate:
        """transformers' choice: ``tool_use`` when tools are given and it exists, else ``default``."""
        if tools and self.tool_use is not None:
            return self.tool_use
        if self.default is None:
            raise TokenizationError("the tokenizer has no chat template: configure a .jinja file")
        return self.default

    def render_chat(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None,
        special: Mapping[str, str],
        kwargs: Mapping[str, Any],
    ) -> str:
        """HF's ``apply_chat_template``; ``continue_final_message`` and ``documents`` come in kwargs."""
        options = _options(add_generation_prompt, tools, kwargs)
        return self.select(tools).render(messages, options, special)

    def render_chat_pieces(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None,
        special: Mapping[str, str],
        kwargs: Mapping[str, Any],
    ) -> tuple[list[str], bytes] | None:
        """`render_chat` as `ChatTemplate.render_pieces` gives it (None: call `render_chat`)."""
        options = _options(add_generation_prompt, tools, kwargs)
        return self.select(tools).render_pieces(messages, options, special)


def _options(
    add_generation_prompt: bool, tools: Sequence[Mapping[str, Any]] | None, kwargs: Mapping[str, Any]
) -> ChatOptions:
    """HF's apply_chat_template arguments as `ChatOptions` (``continue_final_message`` and
    ``documents`` come in kwargs). A chat with neither tools nor other arguments (most) gets one
    shared object per ``add_generation_prompt`` (frozen, never changed)."""
    if tools is None and len(kwargs) == 1 and kwargs.get("continue_final_message") is False:
        if add_generation_prompt is True or add_generation_prompt is False:
            return _PLAIN_OPTIONS[add_generation_prompt]
    rest = dict(kwargs)
    return ChatOptions(
        add_generation_prompt=add_generation_prompt,
        continue_final_message=bool(rest.pop("continue_final_message", False)),
        tools=list(tools) if tools is not None else None,
        documents=rest.pop("documents", None),
        kwargs=rest,
    )


_PLAIN_OPTIONS: Final = {agp: ChatOptions(add_generation_prompt=agp) for agp in (False, True)}
