"""Structured logging: one JSON object per line (or one text line with key=value fields) per record.

Both formats carry the `extra` fields of each record, so `--log-format text` loses nothing.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Final, TextIO

import msgspec

__all__ = [
    "LOG_FORMATS",
    "LOG_LEVELS",
    "JsonFormatter",
    "TextFormatter",
    "configure_logging",
    "resolve_format",
]

LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMATS: Final = ("json", "text", "auto")

# Attributes every LogRecord has; anything else on a record came from `extra=`.
# uvicorn's `color_message` repeats the message with terminal colour codes.
_STANDARD: Final = frozenset(vars(logging.makeLogRecord({}))) | {
    "message",
    "asctime",
    "taskName",
    "color_message",
}
_ENCODER: Final = msgspec.json.Encoder()


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {key: value for key, value in vars(record).items() if key not in _STANDARD}


class JsonFormatter(logging.Formatter):
    """Formats a record as JSON: ts, level, logger, msg, then its extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **_extras(record),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return _ENCODER.encode(out).decode()


class TextFormatter(logging.Formatter):
    """`LEVEL logger: message key=value ...`: every extra field kept, values quoted when they need it."""

    def __init__(self) -> None:
        super().__init__("%(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)  # includes the traceback, if any, on the lines after
        fields = " ".join(f"{key}={_text_value(value)}" for key, value in _extras(record).items())
        if not fields:
            return line
        head, newline, rest = line.partition("\n")
        return f"{head} {fields}{newline}{rest}"


def _text_value(value: object) -> str:
    """A value as logfmt writes it: bare when plain, JSON (quoted, escaped) otherwise; None is `-`."""
    if value is None:
        return "-"
    if isinstance(value, str):
        plain = bool(value) and not any(c in value for c in ' ="\\\n\t')
        return value if plain else _ENCODER.encode(value).decode()
    try:
        return _ENCODER.encode(value).decode()
    except TypeError:
        return _ENCODER.encode(str(value)).decode()


def resolve_format(fmt: str, stream: TextIO) -> str:
    """`auto` is text on a terminal and JSON otherwise; `json` and `text` stay as they are."""
    if fmt != "auto":
        return fmt
    isatty = getattr(stream, "isatty", None)
    return "text" if isatty is not None and isatty() else "json"


def configure_logging(level: str = "INFO", fmt: str = "json") -> None:
    """Send logs to stderr as JSON lines (or text lines with key=value fields), replacing earlier handlers."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if resolve_format(fmt, sys.stderr) == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
