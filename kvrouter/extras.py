"""Optional dependency groups (pyproject's extras): a command that needs one names it when it is missing.

The gateway image installs kvrouter without extras, so every command module must import without them;
what only one command needs is imported when that command runs, after `require_extra` has checked it.
"""

from __future__ import annotations

import importlib

__all__ = ["MissingExtra", "require_extra"]


class MissingExtra(RuntimeError):
    """A command needs an optional dependency group that is not installed; the message says how to add it."""


def require_extra(extra: str, *modules: str, command: str) -> None:
    """Import each of `modules`; MissingExtra naming `command`, them and `kvrouter[extra]` if one fails."""
    missing = []
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise MissingExtra(
            f"{command} needs the optional [{extra}] dependencies ({', '.join(missing)} not installed): "
            f"pip install 'kvrouter[{extra}]'"
        )
