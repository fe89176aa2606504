"""Opening a recording for the replay commands: the reader, and the gateway's setup from its header."""

from __future__ import annotations

import sys
from pathlib import Path

from events.recording import RecordingError
from events.recording_file import ReadStats, RecordingReader
from kvrouter.replay.setup import ReplayConfigError, Setup
from router.settings.config import ConfigError, load_file

__all__ = ["CannotReplay", "open_recording", "warn_about"]


class CannotReplay(Exception):
    """The recording or the config cannot be read; the message says which and why."""


def open_recording(path: Path, config_path: Path | None) -> tuple[RecordingReader, Setup]:
    """Open `path` and build the setup (config from `config_path`, else from the recording)."""
    try:
        given = load_file(config_path) if config_path is not None else None
    except ConfigError as exc:
        raise CannotReplay(str(exc)) from None
    try:
        reader = RecordingReader.open(path)
    except (OSError, RecordingError) as exc:
        raise CannotReplay(f"cannot read {path}: {exc}") from None
    try:
        setup = Setup.from_header(reader.header, given)
    except (ReplayConfigError, ValueError, OSError) as exc:
        reader.close()
        raise CannotReplay(f"{path}: {exc}") from None
    if not setup.exact:
        print(
            f"warning: {path} holds no gateway config; using its engine list and policy name with default"
            " settings (pass --config FILE for an exact replay)",
            file=sys.stderr,
        )
    return reader, setup


def warn_about(path: Path, stats: ReadStats) -> None:
    """Tell stderr about a torn tail and skipped unknown record kinds."""
    if stats.torn_tail is not None:
        tail = stats.torn_tail
        print(
            f"warning: {path}: torn last record ({tail.size} bytes at {tail.offset}) skipped", file=sys.stderr
        )
    for kind, count in sorted(stats.unknown_kinds.items()):
        print(f"warning: {path}: {count} record(s) of unknown kind {kind!r} skipped", file=sys.stderr)
