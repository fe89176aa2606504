"""OpenAI Responses (``POST /v1/responses``) -> the chat request vLLM 0.33.0 renders for it.

vLLM renders a (non-Harmony) Responses request as a chat (``renderers/online_renderer.py:
render_responses``, ``entrypoints/openai/responses/utils.py: construct_input_messages``). `responses_chat`
is that conversion, written for our `ChatRequest`, so the prompt ids come from the chat path:

- ``instructions`` -> a leading system message; a string ``input`` -> one user message;
- input items, in order: a message with role user/system/developer -> that message (``input_text``
  parts are text parts); an assistant message -> its (first part's) text, put into the previous
  assistant message when that has no content yet; ``function_call`` -> a tool call (``call_id``,
  ``name``, the ``arguments`` string), appended to the previous assistant message when there is one;
  ``reasoning`` -> ``reasoning`` (its first content text, else its first summary text), into the
  previous assistant message when that has none; ``function_call_output`` -> a ``tool`` message;
- the last item a message or reasoning ``in_progress``/``incomplete`` -> the final message is continued
  (``continue_final_message``, no generation prompt);
- ``function`` tools -> the chat's function tools, a ``namespace``'s named ``<namespace>__<name>``, a
  ``custom`` tool as a function of one string ``input``; the built-in tool types are not shown to the
  model; a ``custom_tool_call`` -> a tool call of that function (its input as ``{"input": ...}``), a
  namespaced ``function_call`` by its flat name, a ``custom_tool_call_output`` -> a ``tool`` message;
- ``reasoning.effort`` -> the chat's ``reasoning_effort`` (the template's ``reasoning_effort`` and
  ``enable_thinking``, as for chat completions);
- the text is encoded with ``add_special_tokens`` **True**: vLLM's Responses tokenize params keep
  that default, where chat completions set it False (a tokenizer whose post-processor adds BOS gives
  the Responses prompt a second one, as the engine does).

``previous_response_id`` prepends a stored conversation only the engine that stored it has: the ids
here are then those of the new part alone (routing sends the request to that engine). Malformed bodies
raise RequestError (HTTP 400, as vLLM answers): an unsupported item type, a wrong role, a tool without
``name``, ``tool_choice`` ``required`` or named without tools (or naming no tool, or an ambiguous
one), encrypted reasoning, a ``prompt``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final, Literal

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
from tokenization.reasoning_effort import ReasoningEffort

__all__ = [
    "CheckedResponses",
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "MessageItem",
    "ReasoningItem",
    "ResponsesRequest",
    "StoredRef",
    "decode_responses",
    "responses_chat",
    "stored_ref",
]

# The Responses tool types vLLM never renders for the model (built-ins run by the server, if at all).
_UNRENDERED_TOOLS: Final = frozenset(
    {
        "file_search",
        "web_search",
        "web_search_preview",
        "web_search_2025_08_26",
        "web_search_preview_2025_03_11",
        "computer_use_preview",
        "computer",
        "mcp",
        "code_interpreter",
        "image_generation",
        "local_shell",
        "shell",
        "apply_patch",
        "tool_search",
    }
)
_PARTIAL: Final = ("in_progress", "incomplete")


class InputPart(msgspec.Struct):
    """A content part of a message item: ``input_text``/``output_text`` carry text, others are media."""

    type: str
    text: str | None = None
    refusal: str | None = None


class MessageItem(msgspec.Struct):
    """A message item (``type`` ``message``, or no type)."""

    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputPart]
    status: str | None = None


class FunctionCallItem(msgspec.Struct):
    """A ``function_call`` item: a call the model made earlier."""

    call_id: str
    name: str
    arguments: str
    namespace: str | None = None


class FunctionCallOutputItem(msgspec.Struct):
    """A ``function_call_output`` item: a call's result."""

    call_id: str
    output: str | list[InputPart]


class CustomToolCallItem(msgspec.Struct):
    """A ``custom_tool_call`` item: a call of a ``custom`` tool, its freeform ``input``."""

    call_id: str
    name: str
    input: str | None = None


class CustomToolCallOutputItem(msgspec.Struct):
    """A ``custom_tool_call_output`` item: a custom tool call's result."""

    call_id: str
    output: str | list[InputPart]


class _Text(msgspec.Struct):
    text: str


class ReasoningItem(msgspec.Struct):
    """A ``reasoning`` item."""

    summary: list[_Text] = []
    content: list[_Text] | None = None
    encrypted_content: str | None = None
    status: str | None = None


class FunctionTool(msgspec.Struct):
    """A ``function`` tool."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class ReasoningConfig(msgspec.Struct):
    """A Responses request's ``reasoning``: its ``effort`` is rendered (`ChatRequest.reasoning_effort`)."""

    effort: ReasoningEffort | None = None


class ResponsesRequest(msgspec.Struct):
    """``/v1/responses``: the fields vLLM 0.33.0 reads that shape the prompt or routing. Items and tools
    are kept as objects here and checked by `decode_responses` (their kind decides their shape)."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    model: str | None = None
    tools: list[dict[str, Any]] = []
    tool_choice: str | dict[str, Any] = "auto"
    previous_response_id: str | None = None
    stream: bool | None = False
    max_output_tokens: int | None = None
    prompt: dict[str, Any] | None = None
    cache_salt: str | None = None
    vllm_xargs: VllmXargs | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning: ReasoningConfig | None = None
    # The ids a session key may come from (router.core.policy.session_key), typed as loosely as JSON:
    # only the session key reads them, and checks them there (a wrong type names no session, no 400).
    prompt_cache_key: Any = None
    conversation: Any = None
    metadata: Any = None
    user: Any = None
    safety_identifier: Any = None


Item = (
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem | CustomToolCallItem
    | CustomToolCallOutputItem
)  # fmt: skip
_ITEM_TYPES: Final[dict[str, type[Item]]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
    "custom_tool_call": CustomToolCallItem,
    "custom_tool_call_output": CustomToolCallOutputItem,
}
NAMESPACE_SEPARATOR: Final = "__"
"""A namespaced function is shown to the model as ``<namespace>__<name>`` (vLLM's
``flat_namespace_tool_name``)."""
CUSTOM_TOOL_INPUT_KEY: Final = "input"
"""The one argument of the function a ``custom`` tool is shown as (vLLM's ``CUSTOM_TOOL_INPUT_KEY``)."""


def _custom_tool_parameters() -> dict[str, Any]:
    """The schema of the single-string function a ``custom`` tool is shown as (vLLM's
    ``custom_tool_parameters``, its key order kept: the template renders it)."""
    return {
        "type": "object",
        "properties": {
            CUSTOM_TOOL_INPUT_KEY: {
                "type": "string",
                "description": "The freeform text payload for this tool.",
            }
        },
        "required": [CUSTOM_TOOL_INPUT_KEY],
        "additionalProperties": False,
    }


_DECODER: Final = msgspec.json.Decoder(ResponsesRequest)


class StoredRef(msgspec.Struct, frozen=True):
    """What routing reads of a Responses body about vLLM's stored responses: the stored response it
    continues, and whether its own answer is stored (vLLM's ``store`` defaults to true)."""

    previous_response_id: str | None = None
    store: bool | None = True


_REF_DECODER: Final = msgspec.json.Decoder(StoredRef)


def stored_ref(body: bytes) -> StoredRef:
    """The body's `StoredRef`; the defaults (no continuation, stored) for a body that does not decode
    as one (its preparation answers it, or the engine does)."""
    try:
        return _REF_DECODER.decode(body)
    except msgspec.DecodeError:  # (ValidationError included)
        return StoredRef()


@dataclass
class _Turn:
    """A chat message being built (items may add to the previous assistant message)."""

    role: str
    content: str | list[ContentPart] | None = None
    calls: list[ToolCall] | None = None
    reasoning: str | None = None
    tool_call_id: str | None = None

    def message(self) -> ChatMessage:
        return ChatMessage(
            self.role,
            self.content,
            tool_calls=self.calls,
            reasoning=self.reasoning,
            tool_call_id=self.tool_call_id,
        )


class CheckedResponses(msgspec.Struct, frozen=True):
    """A Responses request checked: the body's fields, its items and function tools typed."""

    request: ResponsesRequest
    items: tuple[Item, ...]
    tools: tuple[FunctionTool, ...]

    @property
    def model(self) -> str | None:
        """The body's ``model``."""
        return self.request.model


def decode_responses(body: bytes) -> CheckedResponses:
    """Decode and check a Responses body; RequestError (a 400 naming the field) as vLLM rejects it."""
    req = decode_body(_DECODER, body, "invalid responses request")
    if req.prompt is not None:
        raise RequestError("invalid responses request: prompt template is not supported", "prompt")
    items = () if isinstance(req.input, str) else tuple(_item(raw, i) for i, raw in enumerate(req.input))
    tools = tuple(t for i, raw in enumerate(req.tools) for t in _tools(raw, i))
    _check_tool_choice(req.tool_choice, req.tools)
    return CheckedResponses(req, items, tools)


def _convert(raw: Any, kind: type[Any], where: str) -> Any:
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as exc:
        raise RequestError(f"invalid responses request: {exc} (in `{where}`)", where) from None


def _item(raw: dict[str, Any], i: int) -> Item:
    kind = raw.get("type", "message")
    shape = _ITEM_TYPES.get(kind) if isinstance(kind, str) else None
    if shape is None:
        raise RequestError(f"invalid responses request: Unsupported input item type: {kind}", f"input[{i}]")
    item: Item = _convert(raw, shape, f"input[{i}]")
    if isinstance(item, ReasoningItem) and item.encrypted_content:
        raise RequestError("Encrypted content is not supported.", "input")
    return item


def _tools(raw: dict[str, Any], i: int) -> list[FunctionTool]:
    """The function tools one request tool is shown to the model as (vLLM's ``get_function_tools``): a
    ``function`` tool itself; a ``namespace``'s function tools, each named ``<namespace>__<name>``; a
    ``custom`` tool as a function taking one string (`_custom_tool_parameters`); a built-in none."""
    kind = raw.get("type")
    if kind == "function":
        return [_convert({k: v for k, v in raw.items() if k != "type"}, FunctionTool, f"tools[{i}]")]
    if kind == "namespace":
        space = _convert(raw, _Namespace, f"tools[{i}]")
        where = f"tools[{i}].tools"
        inner: list[FunctionTool] = [
            _convert({k: v for k, v in t.items() if k != "type"}, FunctionTool, where)
            for t in space.tools
            if t.get("type") == "function"
        ]
        return [msgspec.structs.replace(t, name=_flat(space.name, t.name)) for t in inner]
    if kind == "custom":
        _check_custom_format(raw.get("format"))
        custom = _convert(raw, _Custom, f"tools[{i}]")
        return [FunctionTool(custom.name, custom.description, _custom_tool_parameters())]
    if kind in _UNRENDERED_TOOLS:
        return []
    raise RequestError(f"invalid responses request: tool type {kind!r} is not supported", f"tools[{i}]")


class _Namespace(msgspec.Struct):
    name: str
    tools: list[dict[str, Any]]


class _Custom(msgspec.Struct):
    name: str
    description: str | None = None


def _check_custom_format(format_: Any) -> None:
    """vLLM's ``check_custom_tool_format``: a top-level ``custom`` tool with a ``grammar`` format is a
    400 (only free-form text custom tools are accepted; one inside a namespace is not checked)."""
    if isinstance(format_, dict) and format_.get("type") == "grammar":
        raise RequestError(
            "Custom tools with a grammar format are not supported; "
            "only free-form text custom tools are accepted.",
            "tools",
        )


def _flat(namespace: str, name: str) -> str:
    """``<namespace>__<name>``: how a namespaced function is named to the model."""
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}"


def _check_tool_choice(choice: str | dict[str, Any], tools: list[dict[str, Any]]) -> None:
    """vLLM's ``check_tool_usage``: ``required`` or a named tool needs tools, and the name must resolve
    (`_resolve_named_choice`)."""
    named = isinstance(choice, dict) and choice.get("type") in ("function", "custom")
    if not tools and (choice == "required" or named):
        if choice == "required":
            raise RequestError(
                "Tool choice 'required' must be specified with 'tools' parameter.", "tool_choice"
            )
        raise RequestError("Tool choice 'function' not found in 'tools' parameter.", "tool_choice")
    if named and isinstance(choice, dict):
        _resolve_named_choice(choice.get("name"), tools)


def _resolve_named_choice(name: object, tools: list[dict[str, Any]]) -> None:
    """vLLM's ``_resolve_named_tool_choice``: the name of a tool, a namespaced one's flat
    ``<namespace>__<name>``, or a namespaced one's own name when one namespace alone has it; else a 400
    (an ambiguous name names the namespaces)."""
    not_found = RequestError("Tool choice 'function' not found in 'tools' parameter.", "tool_choice")
    if not isinstance(name, str) or not name:
        raise not_found
    exact: set[str] = set()
    local: dict[str, list[str]] = {}
    for tool in tools:
        if tool.get("type") != "namespace":
            if isinstance(tool.get("name"), str):
                exact.add(tool["name"])
            continue
        space, inner = tool.get("name"), tool.get("tools")
        if not isinstance(inner, list) or not isinstance(space, str):
            return  # (vLLM resolves nothing further then: the name is kept as given)
        for t in inner:
            if isinstance(t, dict) and isinstance(t.get("name"), str):
                flat = _flat(space, t["name"])
                exact.add(flat)
                local.setdefault(t["name"], []).append(flat)
    candidates = local.get(name, [])
    if name in exact or len(candidates) == 1:
        return
    if candidates:
        raise RequestError(
            f"Tool choice '{name}' is ambiguous: it is defined in more than one namespace "
            f"({', '.join(candidates)}). Select it by its full '<namespace>__<name>' name.",
            "tool_choice",
        )
    raise not_found


def responses_chat(decoded: CheckedResponses) -> ChatRequest:
    """The chat request vLLM renders for a decoded Responses request (the module docstring)."""
    req = decoded.request
    turns: list[_Turn] = []
    if req.instructions:
        turns.append(_Turn("system", req.instructions))
    if isinstance(req.input, str):
        turns.append(_Turn("user", req.input))
    else:
        new: list[_Turn] = []
        for item in decoded.items:
            _add_item(item, new)
        turns += new
    tools = [
        Tool(FunctionDefinition(t.name, t.description, t.parameters, t.strict, t.defer_loading))
        for t in decoded.tools
    ]
    last = decoded.items[-1] if decoded.items else None
    partial = isinstance(last, (MessageItem, ReasoningItem)) and last.status in _PARTIAL
    return ChatRequest(
        messages=[t.message() for t in turns],
        model=req.model,
        tools=tools or None,
        add_generation_prompt=not partial,
        continue_final_message=partial,
        add_special_tokens=True,
        chat_template_kwargs=req.chat_template_kwargs,
        reasoning_effort=req.reasoning.effort if req.reasoning is not None else None,
        stream=bool(req.stream),
        max_tokens=req.max_output_tokens,
        cache_salt=req.cache_salt,
        vllm_xargs=req.vllm_xargs,
    )


def _add_item(item: Item, turns: list[_Turn]) -> None:
    """vLLM's ``_construct_message_from_response_item``: a new turn, or an addition to the previous
    assistant one."""
    prev = turns[-1] if turns and turns[-1].role == "assistant" else None
    if isinstance(item, (FunctionCallItem, CustomToolCallItem)):
        call = _call(item)
        if prev is not None:
            prev.calls = [*(prev.calls or []), call]
        else:
            turns.append(_Turn("assistant", calls=[call]))
    elif isinstance(item, ReasoningItem):
        texts = item.content or item.summary
        reasoning = texts[0].text if texts else ""
        if prev is not None and prev.reasoning is None:
            prev.reasoning = reasoning
        else:
            turns.append(_Turn("assistant", reasoning=reasoning))
    elif isinstance(item, (FunctionCallOutputItem, CustomToolCallOutputItem)):
        turns.append(_Turn("tool", _content(item.output), tool_call_id=item.call_id))
    elif item.role == "assistant":
        text = item.content if isinstance(item.content, str) else _first_text(item.content)
        if prev is not None and prev.content is None:
            prev.content = text
        else:
            turns.append(_Turn("assistant", text))
    else:
        turns.append(_Turn(item.role, _content(item.content)))


def _call(item: FunctionCallItem | CustomToolCallItem) -> ToolCall:
    """The tool call an earlier call item is rendered as: a namespaced function by its flat name; a
    custom tool's input as the one string argument of its function (JSON, non-ASCII kept)."""
    if isinstance(item, CustomToolCallItem):
        arguments = json.dumps({CUSTOM_TOOL_INPUT_KEY: item.input or ""}, ensure_ascii=False)
        return ToolCall(ToolCallFunction(item.name, arguments), item.call_id)
    name = _flat(item.namespace, item.name) if item.namespace else item.name
    return ToolCall(ToolCallFunction(name, item.arguments), item.call_id)


def _first_text(parts: list[InputPart]) -> str:
    """An assistant message's text: its first part's (vLLM reads ``content[0].text``)."""
    if not parts or parts[0].text is None:
        raise RequestError("an assistant message item needs a first part with text", "input")
    return parts[0].text


def _content(content: str | list[InputPart]) -> str | list[ContentPart]:
    if isinstance(content, str):
        return content
    return [ContentPart(p.type, p.text, p.refusal) for p in content]
