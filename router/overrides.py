"""Overriding a loaded config from `KVROUTER_*` environment variables and CLI `--set key=value` flags.

Environment mapping (documented in config/router.toml too):
- `KVROUTER_<TABLE>_<KEY>` sets `<table>.<key>` for every scalar key of every table, e.g.
  `KVROUTER_LISTEN_PORT=9000`, `KVROUTER_TIMEOUTS_CONNECT_S=1.5`, `KVROUTER_LIMITS_MAX_BODY_BYTES=...`;
- `KVROUTER_POLICY` is short for `KVROUTER_POLICY_NAME`;
- `KVROUTER_ENGINES` and `KVROUTER_MODELS` replace those lists with a JSON array of tables;
- a value starting with `[` or `{` is read as JSON, any other value as a string converted to the
  field's type (`"9000"` -> 9000, `"true"` -> True);
- `KVROUTER_CONFIG` (the file) and the variables named by `auth.*_env` (secrets) are not overrides;
  any other unknown `KVROUTER_*` variable is an error, so a typo cannot be silently ignored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from router.config import ConfigError, RouterConfig, load_file, validate

__all__ = ["ENV_PREFIX", "apply_overrides", "env_overrides", "load_config", "parse_set_flags"]

ENV_PREFIX = "KVROUTER_"
_LISTS = ("engines", "models")
_ALIASES = {"KVROUTER_POLICY": "policy.name"}
_NOT_OVERRIDES = frozenset({"KVROUTER_CONFIG"})


def _env_name(key: str) -> str:
    return ENV_PREFIX + key.replace(".", "_").upper()


def _known_keys(config: RouterConfig) -> dict[str, str]:
    """Every overridable dotted key, by its environment variable name."""
    keys = {_env_name(name): name for name in _LISTS}
    for table in msgspec.structs.fields(RouterConfig):
        if table.name not in _LISTS:
            section = getattr(config, table.name)
            for field in msgspec.structs.fields(type(section)):
                keys[_env_name(f"{table.name}.{field.name}")] = f"{table.name}.{field.name}"
    return keys | _ALIASES


def env_overrides(config: RouterConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """The dotted-key overrides found in `environ` (values still strings); unknown names are errors."""
    known = _known_keys(config)
    secrets = {config.auth.api_keys_env, config.auth.admin_token_env}
    found: dict[str, str] = {}
    for name, value in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX) or name in _NOT_OVERRIDES or name in secrets:
            continue
        if name not in known:
            raise ConfigError(f"environment {name}: no such setting (see config/router.toml for the names)")
        found[known[name]] = value
    return found


def parse_set_flags(pairs: Sequence[str]) -> dict[str, str]:
    """`["listen.port=9000", ...]` from repeated `--set` flags -> `{"listen.port": "9000"}`."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {pair!r}: expected key=value, e.g. listen.port=9000")
        out[key.strip()] = value
    return out


def apply_overrides(config: RouterConfig, overrides: Mapping[str, object], source: str) -> RouterConfig:
    """A new config with each dotted-key override applied; errors name `source`, the key and the field."""
    data: dict[str, Any] = msgspec.to_builtins(config)
    for key, raw in overrides.items():
        value = _parse_value(raw, source, key)
        _assign(data, key, value, source)
        try:
            config = msgspec.convert(data, type=RouterConfig, strict=False)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"{source} {_label(source, key)}: {exc}") from None
    validate(config, f"{source} overrides")
    return config


def _label(source: str, key: str) -> str:
    return _env_name(key) if source == "environment" else key


def _parse_value(raw: object, source: str, key: str) -> object:
    if isinstance(raw, str) and raw.lstrip()[:1] in ("[", "{"):
        try:
            return msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            raise ConfigError(f"{source} {_label(source, key)}: invalid JSON: {exc}") from None
    return raw


def _assign(data: dict[str, Any], key: str, value: object, source: str) -> None:
    parts = key.split(".")
    if len(parts) == 1 and parts[0] in _LISTS:
        data[parts[0]] = value
        return
    if len(parts) != 2 or not isinstance(data.get(parts[0]), dict) or parts[1] not in data[parts[0]]:
        raise ConfigError(f"{source} {key!r}: no such setting (use table.key, e.g. listen.port)")
    data[parts[0]][parts[1]] = value


def load_config(path: Path | None, environ: Mapping[str, str], set_flags: Sequence[str] = ()) -> RouterConfig:
    """The effective config: the file (or defaults when None), then the environment, then `--set` flags."""
    config = RouterConfig() if path is None else load_file(path)
    config = apply_overrides(config, env_overrides(config, environ), "environment")
    return apply_overrides(config, parse_set_flags(set_flags), "--set")
