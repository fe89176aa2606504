"""Responses `custom` and `namespace` tools, and the calls of them, as vLLM 0.33.0 shows them to the
model (`tool_parsers/utils.py get_function_tools`, `responses/utils.py
_construct_message_from_response_item`): a custom tool is a function taking one string `input`, a
namespace's functions are named `<namespace>__<name>`, a custom tool call's input is that function's
JSON arguments, a namespaced call is made by its flat name; a named tool choice resolves as vLLM's
`_resolve_named_tool_choice`. Before, these bodies were 400s."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tokenization.openai_request import RequestError
from tokenization.responses_request import decode_responses, responses_chat

SHIM: dict[str, Any] = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "The freeform text payload for this tool."}},
    "required": ["input"],
    "additionalProperties": False,
}


def chat_of(**fields: Any) -> Any:
    return responses_chat(decode_responses(json.dumps({"model": "m", **fields}).encode()))


def tools_of(**fields: Any) -> list[tuple[str, str | None, Any]]:
    chat = chat_of(**fields)
    return [(t.function.name, t.function.description, t.function.parameters) for t in chat.tools or []]


def test_a_custom_tool_is_a_function_taking_one_string() -> None:
    custom = {
        "type": "custom",
        "name": "apply_patch",
        "description": "Apply a patch",
        "format": {"type": "text"},
    }
    assert tools_of(input="x", tools=[custom]) == [("apply_patch", "Apply a patch", SHIM)]
    assert list(SHIM["properties"]) == ["input"] and list(tools_of(input="x", tools=[custom])[0][2]) == [
        "type",
        "properties",
        "required",
        "additionalProperties",
    ]  # fmt: skip  (the order vLLM renders the schema in)


def test_a_namespaces_functions_are_flattened_in_request_order() -> None:
    space = {
        "type": "namespace",
        "name": "git",
        "description": "git tools",
        "tools": [
            {
                "type": "function",
                "name": "log",
                "description": "Show the log",
                "parameters": {"type": "object"},
            },
            {"type": "custom", "name": "raw"},  # only its function tools are shown
            {"type": "function", "name": "diff", "strict": True},
        ],
    }
    plain = {"type": "function", "name": "bash", "parameters": {"type": "object"}}
    assert tools_of(input="x", tools=[plain, space]) == [
        ("bash", None, {"type": "object"}),
        ("git__log", "Show the log", {"type": "object"}),
        ("git__diff", None, None),
    ]
    assert chat_of(input="x", tools=[space]).tools[1].function.strict is True


def test_calls_of_custom_and_namespaced_tools_are_rendered_as_function_calls() -> None:
    items = [
        {"role": "user", "content": "Fix it."},
        {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** Begin Patch ü"},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done"},
        {"type": "function_call", "call_id": "c2", "name": "log", "namespace": "git", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c2", "output": "abc123"},
    ]
    messages = chat_of(input=items).messages
    assert [m.role for m in messages] == ["user", "assistant", "tool", "assistant", "tool"]
    [custom_call] = messages[1].tool_calls
    assert custom_call.id == "c1" and custom_call.function.name == "apply_patch"
    assert custom_call.function.arguments == '{"input": "*** Begin Patch ü"}'  # json.dumps, non-ASCII kept
    assert (messages[2].content, messages[2].tool_call_id) == ("Done", "c1")
    [namespaced] = messages[3].tool_calls
    assert (namespaced.function.name, namespaced.function.arguments) == ("git__log", "{}")


SPACES = [
    {"type": "namespace", "name": "a", "tools": [{"type": "function", "name": "run"}]},
    {
        "type": "namespace",
        "name": "b",
        "tools": [{"type": "function", "name": "run"}, {"type": "function", "name": "x"}],
    },
    {"type": "custom", "name": "patch"},
]


@pytest.mark.parametrize("name", ["a__run", "b__run", "x", "patch"])
def test_a_named_tool_choice_resolves_as_vllms(name: str) -> None:
    kind = "custom" if name == "patch" else "function"
    chat_of(input="x", tools=SPACES, tool_choice={"type": kind, "name": name})  # no error


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("run", "Tool choice 'run' is ambiguous: it is defined in more than one namespace (a__run, b__run)."),
        ("nope", "Tool choice 'function' not found in 'tools' parameter."),
    ],
)
def test_an_ambiguous_or_unknown_tool_choice_is_a_400(name: str, message: str) -> None:
    with pytest.raises(RequestError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        chat_of(input="x", tools=SPACES, tool_choice={"type": "function", "name": name})
    assert info.value.param == "tool_choice"


def test_a_custom_tool_with_a_grammar_format_is_a_400_as_in_vllm() -> None:
    grammar = {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}
    with pytest.raises(RequestError, match="only free-form text custom tools are accepted") as info:
        chat_of(input="x", tools=[{"type": "custom", "name": "p", "format": grammar}])
    assert info.value.param == "tools"
    chat_of(input="x", tools=[{"type": "custom", "name": "p", "format": {"type": "text"}}])  # free-form: fine
