"""Overriding a loaded config from `KVROUTER_*` environment variables and CLI `--set key=value` flags.

Environment mapping (documented in config/router.toml too):
- `KVROUTER_<TABLE>_<KEY>` sets `<table>.<key>` for every scalar key of every table, e.g.
  `KVROUTER_LISTEN_PORT=9000`, `KVROUTER_TIMEOUTS_CONNECT_S=1.5`, `KVROUTER_LIMITS_MAX_BODY_BYTES=...`;
- `KVROUTER_POLICY` is short for `KVROUTER_POLICY_NAME`;
- `KVROUTER_ENGINES` and `KVROUTER_MODELS` replace those lists with a JSON array of tables;
- a value starting with `[` or `{` is read as JSON, any other value as a string converted to the
  field's type (`"9000"` -> 9000, `"true"` -> True);
- `KVROUTER_CONFIG` (the file) and the variables named by `auth.*_env` (secrets) are not overrides;
  a default secret variable (`KVROUTER_API_KEYS`) set while `auth.*_env` names another is an error;
- the variables Kubernetes injects into every pod for a Service named `kvrouter` or `kvrouter-<x>`
  (`KVROUTER[_X]_SERVICE_HOST`, `_SERVICE_PORT[_<PORT NAME>]`, `_PORT=tcp://IP:PORT`,
  `_PORT_<N>_<TCP|UDP|SCTP>[_PROTO|_PORT|_ADDR]`, recognised by name and value) are ignored. Where
  one has a setting's name (`KVROUTER_LISTEN_PORT=tcp://...` from a Service `kvrouter-listen`) its
  value tells them apart: a service link is ignored with a warning, never read as the setting;
- any other unknown name is an error when it looks like a misspelt setting (under a table's prefix,
  or within a typo of a real name), so a typo is never silently ignored, and a warning otherwise.
"""

from __future__ import annotations

import difflib
import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import msgspec

from router.settings.config import Auth, ConfigError, RouterConfig, explain_invalid, load_file, validate

__all__ = [
    "ENV_PREFIX",
    "apply_overrides",
    "env_overrides",
    "is_kubernetes_service_link",
    "load_config",
    "parse_set_flags",
]

log = logging.getLogger(__name__)

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


# What kubelet injects per Service (pkg/kubelet/envvars/envvars.go; kubernetes.io, "Service",
# Environment variables): name shape -> value shape. The Service's name, upper-cased with dashes as
# underscores, is the prefix: `KVROUTER` for a Service `kvrouter`, `KVROUTER_METRICS` for `kvrouter-metrics`.
_SERVICE = r"KVROUTER(?:_[A-Z0-9_]+?)?"
_LINK = r"(?:tcp|udp|sctp)://(?:\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):\d{1,5}"
_KUBERNETES: Final = tuple(
    (re.compile(name), re.compile(value))
    for name, value in (
        (rf"{_SERVICE}_SERVICE_HOST", r"\S+"),
        (rf"{_SERVICE}_SERVICE_PORT(?:_[A-Z0-9_]+)?", r"\d{1,5}"),
        (rf"{_SERVICE}_PORT", _LINK),
        (rf"{_SERVICE}_PORT_\d{{1,5}}_(?:TCP|UDP|SCTP)", _LINK),
        (rf"{_SERVICE}_PORT_\d{{1,5}}_(?:TCP|UDP|SCTP)_PROTO", r"tcp|udp|sctp"),
        (rf"{_SERVICE}_PORT_\d{{1,5}}_(?:TCP|UDP|SCTP)_PORT", r"\d{1,5}"),
        (rf"{_SERVICE}_PORT_\d{{1,5}}_(?:TCP|UDP|SCTP)_ADDR", r"\S+"),
    )
)
_DEFAULT_SECRETS: Final = {
    Auth().api_keys_env: "auth.api_keys_env",
    Auth().admin_token_env: "auth.admin_token_env",
}
_TYPO_CUTOFF: Final = 0.85  # difflib ratio: KVROUTER_LISTN_PORT ~ KVROUTER_LISTEN_PORT is 0.97


def is_kubernetes_service_link(name: str, value: str) -> bool:
    """True when `name=value` is one of the variables Kubernetes injects for a Service `kvrouter[-x]`."""
    return any(n.fullmatch(name) and v.fullmatch(value) for n, v in _KUBERNETES)


def _misspelt(name: str, known: Mapping[str, str]) -> str | None:
    """The setting `name` most likely misspells (None: it looks like no setting at all)."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=_TYPO_CUTOFF)
    if close:
        return close[0]
    tables = {_env_name(t.name) + "_" for t in msgspec.structs.fields(RouterConfig)}
    return next((t + "*" for t in tables if name.startswith(t)), None)


def env_overrides(config: RouterConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """The dotted-key overrides found in `environ` (values still strings); see the module docstring
    for the variables that are skipped, warned about, or refused as misspelt settings."""
    known = _known_keys(config)
    secrets = {config.auth.api_keys_env, config.auth.admin_token_env}
    found: dict[str, str] = {}
    for name, value in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX) or name in _NOT_OVERRIDES or name in secrets:
            continue
        if is_kubernetes_service_link(name, value):
            if name in known:
                log.warning(
                    "environment %s=%s is a Kubernetes service link, not the setting %s: ignored "
                    "(set it in the config or with --set, or give the pod enableServiceLinks: false)",
                    name, value, known[name], extra={"variable": name},
                )  # fmt: skip
            continue
        if name in known:
            found[known[name]] = value
            continue
        moved = _DEFAULT_SECRETS.get(name)
        if moved is not None:  # a secret left where the config no longer looks: refuse, never run open
            where = getattr(config.auth, moved.partition(".")[2])
            raise ConfigError(f"environment {name}: not read, because {moved} names {where} instead")
        near = _misspelt(name, known)
        if near is not None:
            hint = f"did you mean {near}? config/router.toml lists the names"
            raise ConfigError(f"environment {name}: no such setting ({hint})")
        log.warning("environment %s: no such setting, ignored", name, extra={"variable": name})
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
            raise ConfigError(f"{source} {_label(source, key)}: {explain_invalid(exc)}") from None
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
