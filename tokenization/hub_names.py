"""Whether a `tokenizer` setting names a local path or an HF repo id (`Org/Name`), decided without the hub.

A local path when it exists or looks like one (absolute, `./`, `../`, `~`, a `.json` file); anything
else must be a repo id, or it is a configuration error. Read by the config's checks (no network, no
clock) and by `tokenization.hub`, which resolves the ids.
"""

from __future__ import annotations

import re
from pathlib import Path

from tokenization.base import TokenizationError

__all__ = ["hub_repo"]

_PART = r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"{_PART}/{_PART}", re.ASCII)


def _looks_like_path(source: str) -> bool:
    return (
        source.startswith(("/", ".", "~"))
        or "\\" in source
        or source.endswith(".json")
        or Path(source).expanduser().exists()
    )


def hub_repo(source: str) -> str | None:
    """The repo id `source` names, or None when it is a local path (existing, or shaped like one);
    TokenizationError when it is neither (a malformed id, a missing relative path)."""
    if _looks_like_path(source):
        return None
    if _REPO_ID.fullmatch(source) and "--" not in source and ".." not in source:
        return source
    raise TokenizationError(
        f"{source!r} is neither an existing file or directory nor a HuggingFace repo id 'Org/Name' "
        "(letters, digits, '-', '_', '.', at most 96 each; no '--' or '..')"
    )
