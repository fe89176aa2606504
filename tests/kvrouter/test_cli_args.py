"""The `kvrouter` command line: global flags anywhere, --version, serve's help and errors, log formats."""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import sys

import pytest

from kvrouter.cli import build_parser, main, version
from kvrouter.cmd_serve import effective_config, policy_names
from kvrouter.logs import JsonFormatter, TextFormatter, resolve_format


@pytest.mark.parametrize(
    ("argv", "level", "fmt"),
    [
        (["serve"], "INFO", "auto"),
        (["--log-level", "WARNING", "serve"], "WARNING", "auto"),
        (["serve", "--log-level", "DEBUG"], "DEBUG", "auto"),
        (["serve", "--log-level", "debug", "--log-format", "text"], "DEBUG", "text"),
        (["--log-level", "ERROR", "--log-format", "json", "serve", "--log-level", "DEBUG"], "DEBUG", "json"),
        (["engine-stub", "--log-format", "text", "--port", "0"], "INFO", "text"),
        (["loadtest", "--requests", "3", "--log-level", "WARNING"], "WARNING", "auto"),
    ],
)
def test_global_flags_are_taken_before_or_after_the_subcommand(argv: list[str], level: str, fmt: str) -> None:
    args = build_parser().parse_args(argv)
    assert (args.log_level, args.log_format) == (level, fmt)


def test_every_subcommand_takes_the_global_flags() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert isinstance(sub, argparse._SubParsersAction)
    for name, command in sub.choices.items():
        flags = {option for action in command._actions for option in action.option_strings}
        assert {"--log-level", "--log-format"} <= flags, name


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out == f"kvrouter {version()}\n"
    assert version()[0].isdigit()


def test_an_unknown_log_level_lists_the_levels(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(["serve", "--log-level", "LOUD"])
    assert stop.value.code == 2
    assert "invalid choice: 'LOUD' (choose from 'DEBUG', 'INFO', 'WARNING', 'ERROR', 'CRITICAL')" in (
        capsys.readouterr().err
    )


def test_serve_help_shows_defaults_and_every_policy(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert policy_names() == ("kv", "round_robin", "least_loaded", "random", "session", "prefix_approx")
    assert f"(policy.name, default kv): one of {', '.join(policy_names())}" in text
    shown = [
        "listen.host, default 127.0.0.1",
        "listen.port, default 8000",
        "listen.workers, default 1",
        "--access-log, --no-access-log",
        "listen.access_log, default on",
        "--log-level LEVEL",
    ]
    assert [s for s in shown if s not in text] == []


def test_an_invalid_policy_lists_the_valid_ones() -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["serve", "--policy", "fastest", "--log-level", "ERROR"]) == 2
    assert f"(one of: {', '.join(policy_names())})" in err.getvalue()
    assert "kvrouter serve: --policy " in err.getvalue()  # the flag the user typed, not --set


@pytest.mark.parametrize(("flag", "on"), [([], True), (["--no-access-log"], False), (["--access-log"], True)])
def test_the_access_log_switch(flag: list[str], on: bool) -> None:
    args = build_parser().parse_args(["serve", *flag])
    assert effective_config(args, {}).listen.access_log is on
    off = effective_config(args, {"KVROUTER_LISTEN_ACCESS_LOG": "false"}).listen.access_log
    assert off is (flag == ["--access-log"])  # the flag beats the environment


def _record(**extra: object) -> logging.LogRecord:
    record = logging.makeLogRecord({"name": "kvrouter.access", "levelno": 20, "levelname": "INFO"})
    record.msg = "POST /v1/chat/completions 200"
    for key, value in extra.items():
        setattr(record, key, value)
    return record


def test_text_logs_keep_every_structured_field() -> None:
    record = _record(status=200, engine="e-0", actual_cached_tokens=None, path="/a b", ok=True, ids=[1, 2])
    assert TextFormatter().format(record) == (
        "INFO kvrouter.access: POST /v1/chat/completions 200 status=200 engine=e-0 actual_cached_tokens=- "
        'path="/a b" ok=true ids=[1,2]'
    )
    assert TextFormatter().format(_record()) == "INFO kvrouter.access: POST /v1/chat/completions 200"
    assert '"engine":"e-0"' in JsonFormatter().format(record)


def test_text_logs_put_the_fields_on_the_first_line_of_a_traceback() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = _record(request_id="r1")
        record.exc_info = sys.exc_info()
    first, *rest = TextFormatter().format(record).split("\n")
    assert first.endswith("request_id=r1") and rest[-1] == "ValueError: boom"


def test_auto_format_is_text_on_a_terminal_only() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert resolve_format("auto", Tty()) == "text"
    assert resolve_format("auto", io.StringIO()) == "json"
    assert resolve_format("json", Tty()) == "json"
