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
- ``function`` tools -> the chat's function tools; the built-in tool types are not shown to the model;
- ``reasoning.effort`` -> the chat's ``reasoning_effort`` (the template's ``reasoning_effort`` and
  ``enable_thinking``, as for chat completions);
- the text is encoded with ``add_special_tokens`` **True**: vLLM's Responses tokenize params keep
  that default, where chat completions set it False (a tokenizer whose post-processor adds BOS gives
  the Responses prompt a second one, as the engine does).

``previous_response_id`` prepends a stored conversation only the engine that stored it has: the ids
here are then those of the new part alone (routing sends the request to that engine). Malformed bodies
raise RequestError (HTTP 400, as vLLM answers): an unsupported item type, a wrong role, a tool without
``name``, ``tool_choice`` ``required`` or named without tools, encrypted reasoning, a ``prompt``.
"""

from __future__ import annotations

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

    effort: str | None = None


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


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
_ITEM_TYPES: Final[dict[str, type[Item]]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
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
    tools = tuple(t for i, raw in enumerate(req.tools) if (t := _tool(raw, i)) is not None)
    _check_tool_choice(req.tool_choice, bool(req.tools), tools)
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
    if isinstance(item, FunctionCallItem) and item.namespace:
        raise RequestError("namespaced function calls are not supported by the router", f"input[{i}]")
    return item


def _tool(raw: dict[str, Any], i: int) -> FunctionTool | None:
    kind = raw.get("type")
    if kind == "function":
        tool: FunctionTool = _convert(
            {k: v for k, v in raw.items() if k != "type"}, FunctionTool, f"tools[{i}]"
        )
        return tool
    if kind in _UNRENDERED_TOOLS:
        return None
    raise RequestError(f"invalid responses request: tool type {kind!r} is not supported", f"tools[{i}]")


def _check_tool_choice(
    choice: str | dict[str, Any], has_tools: bool, tools: tuple[FunctionTool, ...]
) -> None:
    """vLLM's ``check_tool_usage``: ``required`` or a named function needs tools, and the name must be one."""
    named = isinstance(choice, dict) and choice.get("type") in ("function", "custom")
    if not has_tools and (choice == "required" or named):
        if choice == "required":
            raise RequestError(
                "Tool choice 'required' must be specified with 'tools' parameter.", "tool_choice"
            )
        raise RequestError("Tool choice 'function' not found in 'tools' parameter.", "tool_choice")
    if named and isinstance(choice, dict) and choice.get("name") not in {t.name for t in tools}:
        raise RequestError("Tool choice 'function' not found in 'tools' parameter.", "tool_choice")


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
    if isinstance(item, FunctionCallItem):
        call = ToolCall(ToolCallFunction(item.name, item.arguments), item.call_id)
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
    elif isinstance(item, FunctionCallOutputItem):
        turns.append(_Turn("tool", _content(item.output), tool_call_id=item.call_id))
    elif item.role == "assistant":
        text = item.content if isinstance(item.content, str) else _first_text(item.content)
        if prev is not None and prev.content is None:
            prev.content = text
        else:
            turns.append(_Turn("assistant", text))
    else:
        turns.append(_Turn(item.role, _content(item.content)))


def _first_text(parts: list[InputPart]) -> str:
    """An assistant message's text: its first part's (vLLM reads ``content[0].text``)."""
    if not parts or parts[0].text is None:
        raise RequestError("an assistant message item needs a first part with text", "input")
    return parts[0].text


def _content(content: str | list[InputPart]) -> str | list[ContentPart]:
    if isinstance(content, str):
        return content
    return [ContentPart(p.type, p.text, p.refusal) for p in content]
