"""Reading the gateway's secrets (API keys, admin token) from the variables or files the config names.

Secrets never appear in the config, in reprs or in logs: `Secrets` shows only how many keys it holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from router.settings.config import Auth, ConfigError

__all__ = ["Secrets", "load_secrets"]


class Secrets:
    """The accepted API keys (empty: no key required) and the admin token (None: admin API disabled)."""

    __slots__ = ("admin_token", "api_keys")

    def __init__(self, api_keys: frozenset[str], admin_token: str | None) -> None:
        self.api_keys = api_keys
        self.admin_token = admin_token

    def __repr__(self) -> str:
        admin = "set" if self.admin_token else "unset"
        return f"Secrets(api_keys=<{len(self.api_keys)} keys>, admin_token=<{admin}>)"


def _read(path: str, what: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"auth.{what}: cannot read {path}: {exc.strerror}") from None


def _keys(text: str, separator: str | None) -> frozenset[str]:
    lines = (line.split("#", 1)[0] for line in text.splitlines())
    parts = (p for line in lines for p in (line.split(separator) if separator else [line]))
    return frozenset(p.strip() for p in parts if p.strip())


def load_secrets(auth: Auth, environ: Mapping[str, str]) -> Secrets:
    """API keys from the file (one per line, `#` comments) and the variable (comma-separated); the admin
    token from its file, else its variable."""
    keys = _keys(environ.get(auth.api_keys_env, ""), ",")
    if auth.api_keys_file:
        keys |= _keys(_read(auth.api_keys_file, "api_keys_file"), None)
    token = environ.get(auth.admin_token_env) or None
    if auth.admin_token_file:
        token = _read(auth.admin_token_file, "admin_token_file").strip() or None
    return Secrets(keys, token)
