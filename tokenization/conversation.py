"""OpenAI chat messages -> the conversation a chat template renders, as vLLM 0.33.0 prepares it.

Text parts are joined with "\\n" (the "string" content format) or kept as ``{"type": "text"}`` parts
(the "openai" format, for templates that loop over content); tool-call arguments become objects; a
``developer`` role becomes ``system`` (merged into one leading system message) when the template does
not know it; tools become vLLM's dicts. Multimodal parts are rejected: the router cannot reproduce the
engine's placeholder expansion, so it must not guess their tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import msgspec

from tokenization.chat_template import ContentFormat
from tokenization.openai_request import ChatMessage, ContentPart, RequestError, Tool, ToolCall
from tokenization.template_message import TemplateMessage, same_objects

__all__ = ["conversation", "tool_dicts"]

_TEXT_FIELDS: Final = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
# Claude Code's per-request attribution line, which vLLM drops from system text.
_BILLING_HEADER: Final = "x-anthropic-billing-header"


def _part_text(part: ContentPart, where: str) -> str | None:
    field = _TEXT_FIELDS.get(part.type or "")
    if field is None:
        raise RequestError(f"{where}: content part type {part.type!r} is not supported (text only)")
    text: str | None = getattr(part, field)
    return text


def _texts(msg: ChatMessage, where: str) -> list[str]:
    if msg.content is None:
        return []
    if isinstance(msg.content, str):
        texts = [msg.content]
    else:
        found = (_part_text(p, f"{where}.content[{j}]") for j, p in enumerate(msg.content))
        texts = [t for t in found if t is not None]
    if msg.role == "system":
        texts = _strip_billing_header(texts)
    return texts


def _strip_billing_header(texts: list[str]) -> list[str]:
    out = []
    for text in texts:
        if text.startswith(_BILLING_HEADER):
            text = text.partition("\n")[2]
            if not text:
                continue
        out.append(text)
    return out


def _arguments(call: ToolCall) -> dict[str, Any]:
    """Arguments as an object, as templates expect; vLLM coerces empty, malformed or non-object JSON to {}."""
    raw = call.function.arguments
    if isinstance(raw, dict):
        return raw
    if not raw:
        return {}
    try:
        parsed = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _tool_call(call: ToolCall) -> dict[str, Any]:
    out: dict[str, Any] = {"function": {"name": call.function.name, "arguments": _arguments(call)}}
    if call.id is not None:
        out["id"] = call.id
    out["type"] = call.type
    return out


def _message(msg: ChatMessage, fmt: ContentFormat, where: str) -> dict[str, Any]:
    texts = _texts(msg, where)
    content: Any = "\n".join(texts)
    if fmt is ContentFormat.OPENAI and msg.role != "tool":
        content = [{"type": "text", "text": t} for t in texts]
    out: dict[str, Any] = {"role": msg.role, "content": content}
    if msg.role == "assistant" and msg.tool_calls:
        out["tool_calls"] = [_tool_call(c) for c in msg.tool_calls]
    reasoning = msg.reasoning if msg.reasoning is not None else msg.reasoning_content
    if msg.role == "assistant" and reasoning is not None:
        out["reasoning"] = out["reasoning_content"] = reasoning
    if msg.role == "tool" and msg.tool_call_id is not None:
        out["tool_call_id"] = msg.tool_call_id
    if msg.name is not None:
        out["name"] = msg.name
    return out


def _developer_to_system(conv: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Developer messages become system ones; several (or a late) system message merge into one at the top."""
    conv = [{**m, "role": "system"} if m["role"] == "developer" else m for m in conv]
    positions = [i for i, m in enumerate(conv) if m["role"] == "system"]
    if positions in ([], [0]):
        return conv
    texts = [_joined(conv[i]) for i in positions]
    merged = {"role": "system", "content": "\n\n".join(t for t in texts if t)}
    return [merged, *(m for m in conv if m["role"] != "system")]


def _joined(m: dict[str, Any]) -> str:
    content = m["content"]
    return content if isinstance(content, str) else "\n".join(p["text"] for p in content)


def _keep_message(msg: ChatMessage, fmt: ContentFormat, i: int) -> TemplateMessage:
    """`_message`, made and kept on the (frozen) message under its format: `conversation` reads it
    there for every later request that carries the message. A role and a string content alone (most
    messages; not a system one, whose text may lose a header) is that dict directly."""
    content = msg.content
    if (
        type(content) is str
        and fmt is ContentFormat.STRING
        and msg.role != "system"
        and msg.name is None
        and msg.tool_calls is None
        and msg.reasoning is None
        and msg.reasoning_content is None
        and msg.tool_call_id is None
    ):
        fields = {"role": msg.role, "content": content}
    else:
        fields = _message(msg, fmt, f"messages[{i}]")
    out = msg.__dict__[fmt] = TemplateMessage(fields)
    return out


def conversation(
    messages: Sequence[ChatMessage], fmt: ContentFormat, template_knows_developer: bool
) -> list[dict[str, Any]]:
    """The template's ``messages`` for a request; RequestError names the offending message or part."""
    conv, developer = _template_messages(messages, fmt)
    if developer and not template_knows_developer:
        return _developer_to_system(conv)
    return conv


_PREFIX_KEYS: Final = {fmt: f"prefix_{fmt.value}" for fmt in ContentFormat}
"""Under which name a message keeps the template dicts of the messages up to it, per format."""


def _template_messages(
    messages: Sequence[ChatMessage], fmt: ContentFormat
) -> tuple[list[dict[str, Any]], bool]:
    """Each message's `_message` dict (kept on the message), and whether a message has the developer
    role. What a conversation's leading messages give is also kept on the last of them, so a later turn
    that re-sends them (found by its second or third message from the end) reads the list instead of
    each message: a step per message is most of this on a long chat."""
    n, start, key = len(messages), 0, _PREFIX_KEYS[fmt]
    conv: list[dict[str, Any]] = []
    developer = False
    for back in (2, 3):
        memo = messages[n - back].__dict__.get(key) if n >= back else None
        if memo is not None and same_objects(memo[0], messages[: n - back]):
            start, conv, developer = n - back + 1, [*memo[1]], memo[2]
            break
    for i in range(start, n):
        m = messages[i]
        d = m.__dict__
        conv.append(d[fmt] if fmt in d else _keep_message(m, fmt, i))
        developer = developer or m.role == "developer"
        if i >= n - 2:
            d[key] = (messages[:i], tuple(conv), developer)
    return conv, developer


def tool_dicts(tools: Sequence[Tool] | None) -> list[dict[str, Any]] | None:
    """vLLM's ``tool.model_dump()``: ``description``/``parameters`` always present, ``strict`` only if set."""
    if tools is None:
        return None
    out = []
    for tool in tools:
        f = tool.function
        defer = f.defer_loading if f.defer_loading is not None else tool.defer_loading
        fn: dict[str, Any] = {"name": f.name, "description": f.description, "parameters": f.parameters}
        if f.strict is not None:
            fn["strict"] = f.strict
        if defer is not None:
            fn["defer_loading"] = defer
        entry: dict[str, Any] = {"type": tool.type, "function": fn}
        if tool.defer_loading is not None:
            entry["defer_loading"] = tool.defer_loading
        out.append(entry)
    return out
