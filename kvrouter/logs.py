"""Structured logging: one JSON object per line, with the `extra` fields of each record."""

from __future__ import annotations

import logging
import sys
from typing import Any, Final

import msgspec

__all__ = ["JsonFormatter", "configure_logging"]

# Attributes every LogRecord has; anything else on a record came from `extra=`.
_STANDARD: Final = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}
_ENCODER: Final = msgspec.json.Encoder()


class JsonFormatter(logging.Formatter):
    """Formats a record as JSON: ts, level, logger, msg, then its extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return _ENCODER.encode(out).decode()


def configure_logging(level: str = "INFO", fmt: str = "json") -> None:
    """Send logs to stderr as JSON lines (or plain text), replacing any earlier handlers."""
    handler = logging.StreamHandler(sys.stderr)
    text = logging.Formatter("%(levelname)s %(name)s: %(message)s")
    handler.setFormatter(JsonFormatter() if fmt == "json" else text)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
