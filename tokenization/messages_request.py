"""Anthropic Messages (``POST /v1/messages``) -> the chat request vLLM 0.33.0 renders for it.

vLLM serves the Messages API by converting the body to a chat completions request
(``entrypoints/anthropic/serving.py``: ``to_chat_completion_request``) and rendering that with the
chat template like any chat. `messages_chat` is that conversion, written for our `ChatRequest`, so
the prompt ids come from the same chat path (tokenization.request_tokens) and equal the engine's:

- ``system`` (a string, or its text blocks joined with ``""``, a block starting with Claude Code's
  ``x-anthropic-billing-header`` dropped) becomes one leading system message;
- a ``system`` message inside ``messages`` stays where it is, unless the template rejects a late
  system message (`merges_inline_system`: vLLM's probe), when its text joins the leading one;
- blocks: ``text`` -> text parts (one part alone -> a string), ``thinking`` -> ``reasoning``,
  ``tool_use`` -> a tool call (its ``input`` the arguments), a user's ``tool_result`` -> a ``tool``
  message placed before the user message (which is dropped when nothing else is left in it), an
  assistant's ``tool_result`` -> a ``"Tool result: ..."`` text part; ``image`` -> an image part
  (rejected downstream as multimodal); ``redacted_thinking`` and ``tool_reference`` are skipped;
- tools -> function tools (``input_schema`` the parameters, ``"type": "object"`` added when absent),
  after applying the system messages' ``tool_addition``/``tool_removal`` blocks;
- ``output_config.effort`` -> the chat's ``reasoning_effort``; then ``thinking`` ``disabled`` -> the
  engine's disabled-thinking effort over it (tokenization.reasoning_effort); ``enabled`` sets only a
  thinking budget and ``adaptive`` nothing: neither enters the prompt.

Malformed bodies raise RequestError (HTTP 400, as vLLM's validation answers): an unknown block type, a
wrong role, a tool without ``name`` or ``input_schema``, a missing ``model``/``max_tokens``, a tool
change outside a system message, a ``tool_choice`` of type ``tool`` without a name, a ``thinking`` of
an unknown type, with ``budget_tokens`` under 1024 or not under ``max_tokens``, an ``output_config``
effort outside vLLM's ``AnthropicEffort``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Annotated, Any, Final, Literal

import jinja2
import jinja2.ext
import jinja2.sandbox
import msgspec

from tokenization.openai_request import (
    ChatMessage,
    ChatRequest,
    ContentPart,
    FunctionDefinition,
    RequestError,
    Tool,
    ToolCall,
    ToolCallFunction,
    VllmXargs,
    decode_body,
)
from tokenization.reasoning_effort import AnthropicEffort, ReasoningEffort

__all__ = [
    "MessagesBlock",
    "MessagesMessage",
    "MessagesRequest",
    "MessagesTool",
    "decode_messages",
    "disables_thinking",
    "merges_inline_system",
    "messages_chat",
]

_BILLING_HEADER: Final = "x-anthropic-billing-header"
_TOOL_CHANGES: Final = ("tool_addition", "tool_removal")

BlockType = Literal[
    "text",
    "image",
    "tool_use",
    "tool_result",
    "tool_reference",
    "thinking",
    "redacted_thinking",
    "tool_addition",
    "tool_removal",
]


class MessagesTool(msgspec.Struct):
    """A tool definition (vLLM's ``AnthropicTool``)."""

    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class ToolReference(msgspec.Struct, tag_field="type", tag="tool_reference"):
    """A tool named by a ``tool_addition``/``tool_removal`` block."""

    name: str


class ToolDefinition(msgspec.Struct, tag_field="type", tag="tool_definition"):
    """A tool defined by value in a ``tool_addition`` block."""

    definition: MessagesTool


class MessagesBlock(msgspec.Struct):
    """A content block (vLLM's ``AnthropicContentBlock``: one struct, the fields each type reads)."""

    type: BlockType
    text: str | None = None
    source: dict[str, Any] | None = None
    id: str | None = None
    tool_use_id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    content: str | list[dict[str, Any]] | None = None
    thinking: str | None = None
    tool: ToolReference | ToolDefinition | None = None


class MessagesMessage(msgspec.Struct):
    """One message of the conversation."""

    role: Literal["user", "assistant", "system"]
    content: str | list[MessagesBlock]


class MessagesToolChoice(msgspec.Struct):
    """``tool_choice`` (it does not enter the prompt; checked as vLLM checks it)."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


Display = Literal["summarized", "omitted", "updates"]
"""``thinking.display`` (accepted and ignored, as vLLM ignores it)."""


class ThinkingEnabled(msgspec.Struct, tag_field="type", tag="enabled"):
    """Extended thinking with a budget: a sampling limit, not part of the prompt."""

    budget_tokens: Annotated[int, msgspec.Meta(ge=1024)]
    display: Display | None = None


class ThinkingDisabled(msgspec.Struct, tag_field="type", tag="disabled"):
    """Thinking off: rendered with the engine's disabled-thinking effort."""


class ThinkingAdaptive(msgspec.Struct, tag_field="type", tag="adaptive"):
    """The model chooses the depth: nothing rendered."""

    display: Display | None = None


class OutputFormat(msgspec.Struct):
    """``output_config.format`` (a response format; checked as vLLM checks it, not rendered)."""

    type: Literal["json_schema"] = "json_schema"
    schema: dict[str, Any] | None = None


class OutputConfig(msgspec.Struct):
    """``output_config``: its ``effort`` becomes the chat's ``reasoning_effort``."""

    effort: AnthropicEffort | None = None
    format: OutputFormat | None = None


class MessagesRequest(msgspec.Struct):
    """``/v1/messages``: the fields vLLM 0.33.0 reads that shape the prompt or routing."""

    model: Annotated[str, msgspec.Meta(min_length=1)]
    messages: list[MessagesMessage]
    max_tokens: Annotated[int, msgspec.Meta(gt=0)]
    system: str | list[MessagesBlock] | None = None
    tools: list[MessagesTool] | None = None
    tool_choice: MessagesToolChoice | None = None
    metadata: dict[str, Any] | None = None
    stream: bool | None = False
    cache_salt: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)] | None = None
    vllm_xargs: VllmXargs | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    thinking: ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive | None = None
    output_config: OutputConfig | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """Read only as vLLM reads it here: a P/D prefill leg (``do_remote_decode``) skips the budget check."""
    # The ids a session key may come from (router.core.policy.session_key), typed as loosely as JSON:
    # only the session key reads them, and checks them there (a wrong type names no session, no 400).
    prompt_cache_key: Any = None
    conversation: Any = None
    user: Any = None
    safety_identifier: Any = None


_DECODER: Final = msgspec.json.Decoder(MessagesRequest)


def decode_messages(body: bytes) -> MessagesRequest:
    """Decode and check a Messages body; RequestError (a 400 naming the field) as vLLM rejects it."""
    req = decode_body(_DECODER, body, "invalid messages request")
    if isinstance(req.system, list):
        _reject_tool_changes(req.system, "system")
    for i, msg in enumerate(req.messages):
        if isinstance(msg.content, list):
            for j, block in enumerate(msg.content):
                _check_block(block, msg.role, f"messages[{i}].content[{j}]")
    choice = req.tool_choice
    if choice is not None and choice.type == "tool" and not choice.name:
        raise RequestError(
            "invalid messages request: tool_choice.name is required when type is 'tool'", "tool_choice"
        )
    _check_budget(req)
    return req


def _check_budget(req: MessagesRequest) -> None:
    """vLLM's ``validate_thinking_budget``: the budget under ``max_tokens``, but for a P/D prefill leg
    (sent with ``max_tokens`` 1; its decode leg carries the client's and is checked)."""
    if req.kv_transfer_params and req.kv_transfer_params.get("do_remote_decode"):
        return
    if isinstance(req.thinking, ThinkingEnabled) and req.thinking.budget_tokens >= req.max_tokens:
        raise RequestError(
            "invalid messages request: thinking.budget_tokens must be less than max_tokens", "thinking"
        )


def disables_thinking(req: MessagesRequest) -> bool:
    """Whether `req` renders with the engine's disabled-thinking effort (``thinking`` ``disabled``)."""
    return isinstance(req.thinking, ThinkingDisabled)


def _check_block(block: MessagesBlock, role: str, where: str) -> None:
    if block.type not in _TOOL_CHANGES:
        return
    if role != "system":
        raise RequestError(_only_system(block.type), where)
    if block.tool is None:
        raise RequestError(f"invalid messages request: tool is required for {block.type} blocks", where)
    if block.type == "tool_removal" and not isinstance(block.tool, ToolReference):
        raise RequestError("invalid messages request: tool_removal only accepts a tool_reference", where)


def _reject_tool_changes(blocks: list[MessagesBlock], where: str) -> None:
    for block in blocks:
        if block.type in _TOOL_CHANGES:
            raise RequestError(_only_system(block.type), where)


def _only_system(kind: str) -> str:
    return f'invalid messages request: {kind} blocks are only allowed in messages with role "system"'


@lru_cache(maxsize=64)
def merges_inline_system(template_source: str | None) -> bool:
    """vLLM's probe (``_detect_merge_inline_system``): whether the template fails on a system message
    after the first, so inline system messages must join the leading one. It renders [system, user,
    system, user] in a bare sandbox (no ``raise_exception``, no ``{% generation %}``), as vLLM does:
    any template error there, or no template, means merge."""
    if not template_source:
        return True
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    probe = [{"role": role, "content": "t"} for role in ("system", "user", "system", "user")]
    try:
        env.from_string(template_source).render(messages=probe, add_generation_prompt=False)
    except jinja2.TemplateError:
        return True
    return False


def messages_chat(
    req: MessagesRequest, merge_inline_system: bool, disabled_effort: ReasoningEffort = "none"
) -> ChatRequest:
    """The chat request vLLM renders for `req` (the module docstring); `disabled_effort`: the effort a
    disabled thinking renders with (the engine's option, or its probe: `disables_thinking` says when it
    is read). RequestError on a tool change naming an undeclared tool."""
    out: list[ChatMessage] = []
    system = _system_parts(req.system)
    if merge_inline_system:
        system += [t for m in req.messages if m.role == "system" and (t := _system_text(m.content))]
    if system:
        out.append(ChatMessage("system", "".join(system)))
    for msg in req.messages:
        if msg.role == "system":
            text = None if merge_inline_system else _system_text(msg.content)
            if text:
                out.append(ChatMessage("system", text))
        elif isinstance(msg.content, str):
            out.append(ChatMessage(msg.role, msg.content))
        else:
            _convert_blocks(msg.role, msg.content, out)
    return ChatRequest(
        messages=out,
        model=req.model,
        tools=_tools(req),
        stream=bool(req.stream),
        max_tokens=req.max_tokens,
        max_completion_tokens=req.max_tokens,
        cache_salt=req.cache_salt,
        vllm_xargs=req.vllm_xargs,
        chat_template_kwargs=req.chat_template_kwargs,
        reasoning_effort=_effort(req, disabled_effort),
    )


def _effort(req: MessagesRequest, disabled_effort: ReasoningEffort) -> ReasoningEffort | None:
    """vLLM's ``_handle_output_config`` then ``_handle_thinking``: a disabled thinking's effort wins."""
    if isinstance(req.thinking, ThinkingDisabled):
        return disabled_effort
    return req.output_config.effort if req.output_config is not None else None


def _system_parts(system: str | list[MessagesBlock] | None) -> list[str]:
    if not system:
        return []
    if isinstance(system, str):
        return [system]
    return [b.text for b in system if b.type == "text" and b.text and not b.text.startswith(_BILLING_HEADER)]


def _system_text(content: str | list[MessagesBlock]) -> str | None:
    """An inline system message's text (vLLM's ``_extract_system_text``); None when nothing is left."""
    if isinstance(content, str):
        return None if content.startswith(_BILLING_HEADER) else content
    return "".join(_system_parts(content)) or None


def _convert_blocks(role: str, blocks: list[MessagesBlock], out: list[ChatMessage]) -> None:
    """A user or assistant message's blocks: its tool results go to `out` first, then the message."""
    parts: list[ContentPart] = []
    calls: list[ToolCall] = []
    reasoning: list[str] = []
    for block in blocks:
        kind = block.type
        if kind == "text" and block.text:
            parts.append(ContentPart("text", block.text))
        elif kind == "image" and block.source:
            parts.append(ContentPart("image_url"))  # multimodal: the chat path rejects it
        elif kind == "thinking" and block.thinking is not None:
            reasoning.append(block.thinking)
        elif kind == "tool_use":
            # vLLM sends json.dumps(input) and the chat path decodes it back: the same object. A
            # block without an id gets a clock-made one there (`call_<time>`): not reproducible.
            calls.append(ToolCall(ToolCallFunction(block.name or "", block.input or {}), block.id))
        elif kind == "tool_result" and role == "user":
            out.append(
                ChatMessage("tool", _tool_result_text(block.content), tool_call_id=block.tool_use_id or "")
            )
        elif kind == "tool_result":
            # Python's str() of the content, as vLLM formats it (a list shows as its repr).
            parts.append(ContentPart("text", f"Tool result: {str(block.content) if block.content else ''}"))
    if not parts and role == "user":
        return  # no content (tool results only, say): vLLM drops the user message itself
    content: str | list[ContentPart] | None = None
    if parts:
        content = parts[0].text if len(parts) == 1 and parts[0].type == "text" else parts
    out.append(
        ChatMessage(
            role, content, tool_calls=calls or None, reasoning="".join(reasoning) if reasoning else None
        )
    )


def _tool_result_text(content: str | list[dict[str, Any]] | None) -> str:
    """A user tool result's text: its string, or its text items joined with newlines. Its images and
    tool references would be further messages: rejected (multimodal / not text)."""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for item in content or []:
        kind = item.get("type")
        if kind == "text":
            texts.append(str(item.get("text", "")))
        elif kind in ("image", "tool_reference"):
            raise RequestError(f"tool_result content of type {kind!r} is not supported (text only)")
    return "\n".join(texts)


def _tools(req: MessagesRequest) -> list[Tool] | None:
    """The function tools in effect (vLLM's ``_resolve_tools`` then ``_convert_tools``)."""
    tools = _resolve_tools(req)
    if tools is None:
        return None
    out = []
    for tool in tools:
        schema = tool.input_schema if "type" in tool.input_schema else {**tool.input_schema, "type": "object"}
        fn = FunctionDefinition(tool.name, tool.description, schema, tool.strict, tool.defer_loading)
        out.append(Tool(fn))
    return out


def _resolve_tools(req: MessagesRequest) -> list[MessagesTool] | None:
    """``tools`` after the system messages' tool changes, in order: added by value -> declared, added
    by reference -> no longer deferred, removed -> dropped."""
    changes = [
        b
        for m in req.messages
        if not isinstance(m.content, str)
        for b in m.content
        if b.type in _TOOL_CHANGES
    ]
    if not changes:
        return req.tools
    tools = {tool.name: tool for tool in req.tools or []}
    removed: set[str] = set()
    for block in changes:
        change = block.tool
        if isinstance(change, ToolDefinition):
            name = change.definition.name
            tools[name] = change.definition
        else:
            assert change is not None  # decode_messages checked it
            name = change.name
            if name not in tools:
                raise RequestError(f"{block.type} references tool {name!r}, which is not declared in tools")
            if block.type == "tool_addition":
                tools[name] = msgspec.structs.replace(tools[name], defer_loading=None)
        if block.type == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    return [tool for name, tool in tools.items() if name not in removed]
