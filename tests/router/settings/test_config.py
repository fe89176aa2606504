"""Config: the shipped TOML, errors naming file and field, env and CLI overrides, secrets."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import msgspec
import pytest

from router.prepare.engine_variants import resolve_variant
from router.settings.config import ConfigError, RouterConfig, decode_config, load_file
from router.settings.overrides import apply_overrides, env_overrides, load_config, parse_set_flags
from router.settings.secrets import load_secrets

SHIPPED = Path(__file__).resolve().parents[3] / "config" / "router.toml"
ENGINE = '[[engines]]\nname = "{name}"\nurl = "{url}"\n'


def test_shipped_file_documents_the_defaults() -> None:
    config = load_file(SHIPPED)
    assert config == RouterConfig()
    assert config.uses_embedded


def _all_tables(struct: type[msgspec.Struct]) -> list[type[msgspec.Struct]]:
    tables = [struct]
    for field in msgspec.structs.fields(struct):
        inner = field.type
        if isinstance(inner, type) and issubclass(inner, msgspec.Struct):
            tables.extend(_all_tables(inner))
        for arg in getattr(inner, "__args__", ()):
            if isinstance(arg, type) and issubclass(arg, msgspec.Struct):
                tables.extend(_all_tables(arg))
    return tables


def test_shipped_file_mentions_every_key() -> None:
    text = SHIPPED.read_text()
    tables = set(_all_tables(RouterConfig))
    assert len(tables) >= 12
    for table in tables:
        for field in msgspec.structs.fields(table):
            if table is not RouterConfig:
                pattern = rf"^#? ?({field.name} = |\[\[?\w+\.{field.name}\]\]?)"
                assert re.search(pattern, text, re.M), f"{table.__name__}.{field.name}"


def test_commented_examples_are_valid() -> None:
    text = re.sub(r"^# (?=\[\[|\w+ = )", "", SHIPPED.read_text(), flags=re.M)
    config = decode_config(text, "uncommented")
    engine = config.engines[0]
    assert (engine.name, engine.events, engine.groups[0].sliding_window) == (
        "engine-0",
        [engine.events[0]],
        4096,
    )
    assert config.models[0].hashing == "router"
    assert config.discovery.dns_name == "vllm.default.svc.cluster.local"
    assert not config.uses_embedded


def refused(toml: str, words: list[str]) -> None:
    """`toml` is refused with a `ConfigError` whose message holds each of `words`."""
    with pytest.raises(ConfigError) as info:
        decode_config(toml, "cfg.toml")
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    ("toml", "words"),
    [
        ('[listen]\nport = "x"\n', ["cfg.toml", "Expected `int`, got `str`", "$.listen.port"]),
        ("[listen]\nport = 70000\n", ["cfg.toml", "$.listen.port", "<= 65535"]),
        ("[listen]\nprot = 1\n", ["cfg.toml", "unknown field `prot`", "$.listen"]),
        ('[policy]\nname = "fastest"\n', ["cfg.toml", "$.policy.name"]),
        ("[retry]\nattempts = 0\n", ["$.retry.attempts", ">= 1"]),
        ("[listen\n", ["cfg.toml", "line 1"]),
        (ENGINE.format(name="a", url="ftp://h:1"), ["$.engines[0].url", "http(s)"]),
        (ENGINE.format(name="a", url="http://h:1/?x=1"), ["$.engines[0].url"]),
        (ENGINE.format(name="a", url="http:///nohost"), ["$.engines[0].url"]),
        (
            ENGINE.format(name="a", url="http://h:1") + ENGINE.format(name="a", url="http://h:2"),
            ["engines[1].name"],
        ),
        (ENGINE.format(name="a", url="http://h:1") + 'events = ["h:5557"]\n', ["$.engines[0].events[0]"]),
        (
            ENGINE.format(name="a", url="http://h")
            + 'events = ["tcp://h:1", "tcp://h:2"]\nreplay = ["tcp://h:3"]\n',
            ["$.engines[0].replay"],
        ),
        ("[timeouts]\nfirst_byte_s = 900.0\n", ["$.timeouts.total_s"]),
        ("[limits]\nmax_in_flight_per_engine = 5000\n", ["max_in_flight_per_engine"]),
        ('[[models]]\nname = "m"\n[[models]]\nname = "m"\n', ["$.models", "unique"]),
    ],
)
def test_invalid_config_names_file_and_field(toml: str, words: list[str]) -> None:
    refused(toml, words)


def test_unreadable_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.toml: cannot read"):
        load_file(tmp_path / "nope.toml")


def test_env_overrides(tmp_path: Path) -> None:
    environ = {
        "KVROUTER_LISTEN_PORT": "9000",
        "KVROUTER_POLICY": "round_robin",
        "KVROUTER_TIMEOUTS_CONNECT_S": "1.5",
        "KVROUTER_ENGINES": '[{"name": "e0", "url": "http://127.0.0.1:8100", "events": ["tcp://127.0.0.1:5557"]}]',
        "KVROUTER_CONFIG": str(SHIPPED),
        "KVROUTER_API_KEYS": "secret-1",
        "PATH": "/bin",
    }
    config = load_config(SHIPPED, environ)
    assert config.listen.port == 9000
    assert config.policy.name == "round_robin"
    assert config.timeouts.connect_s == 1.5
    assert [e.name for e in config.engines] == ["e0"]
    assert not config.uses_embedded


def test_cli_flags_beat_the_environment() -> None:
    config = load_config(None, {"KVROUTER_LISTEN_PORT": "9000"}, ["listen.port=9100", "policy.name=random"])
    assert (config.listen.port, config.policy.name) == (9100, "random")


@pytest.mark.parametrize(
    ("environ", "words"),
    [
        ({"KVROUTER_LISTEN_PORT": "eighty"}, ["KVROUTER_LISTEN_PORT", "$.listen.port"]),
        ({"KVROUTER_LISTN_PORT": "1"}, ["KVROUTER_LISTN_PORT", "no such setting"]),
        ({"KVROUTER_ENGINES": "[{"}, ["KVROUTER_ENGINES", "invalid JSON"]),
        ({"KVROUTER_ENGINES": '[{"name": "e"}]'}, ["KVROUTER_ENGINES", "url"]),
        ({"KVROUTER_ENGINES": '[{"name": "e", "url": "file:///x"}]'}, ["environment", "$.engines[0].url"]),
    ],
)
def test_bad_env_names_the_variable(environ: dict[str, str], words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, environ)
    for word in words:
        assert word in str(info.value)


def test_bad_flags() -> None:
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_set_flags(["listen.port"])
    with pytest.raises(ConfigError, match=r"'listen\.nope': no such setting"):
        apply_overrides(RouterConfig(), {"listen.nope": "1"}, "--set")
    with pytest.raises(ConfigError, match=r"--set retry.attempts: .*\$\.retry\.attempts"):
        apply_overrides(RouterConfig(), {"retry.attempts": "0"}, "--set")


def test_secret_variable_names_follow_the_config() -> None:
    config = apply_overrides(RouterConfig(), {"auth.api_keys_env": "MY_KEYS"}, "--set")
    assert env_overrides(config, {"MY_KEYS": "k"}) == {}
    with pytest.raises(ConfigError, match="KVROUTER_API_KEYS"):
        env_overrides(config, {"KVROUTER_API_KEYS": "k"})


def test_secrets_from_env_and_files(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nfile-key-1\n\nfile-key-2  # ci\n")
    token = tmp_path / "token"
    token.write_text("admin-from-file\n")
    toml = f'[auth]\napi_keys_file = "{keys}"\nadmin_token_file = "{token}"\n'
    auth = decode_config(toml, "t").auth
    secrets = load_secrets(auth, {"KVROUTER_API_KEYS": "env-1, env-2", "KVROUTER_ADMIN_TOKEN": "ignored"})
    assert secrets.api_keys == {"env-1", "env-2", "file-key-1", "file-key-2"}
    assert secrets.admin_token == "admin-from-file"
    assert "env-1" not in repr(secrets) and "admin-from" not in repr(secrets)
    assert repr(secrets) == "Secrets(api_keys=<4 keys>, admin_token=<set>)"
    none = load_secrets(RouterConfig().auth, {})
    assert (none.api_keys, none.admin_token) == (frozenset(), None)
    with pytest.raises(ConfigError, match=r"auth\.api_keys_file: cannot read"):
        load_secrets(decode_config(f'[auth]\napi_keys_file = "{tmp_path}/missing"\n', "t").auth, {})


EAGLE_MODEL = """
[[models]]
name = "m"
block_size = 4
eagle_block_drop = true
[[models.groups]]
[[models.groups]]
kind = "sliding_window"
block_size = 8
sliding_window = 16
eagle = true
[[models.groups]]
kind = "chunked_local_attention"
chunk_size = 16
"""


def test_eagle_and_chunked_local_groups_reach_the_model_spec() -> None:
    config = decode_config(EAGLE_MODEL, "eagle.toml")
    spec = resolve_variant(config.models[0]).spec
    assert spec.eagle_block_drop and spec.lookahead_tokens == 0
    assert [(g.kind, g.block_size, g.sliding_window, g.chunk_size, g.eagle) for g in spec.groups] == [
        ("full_attention", 4, None, None, False),
        ("sliding_window", 8, 16, None, True),
        ("chunked_local_attention", 4, None, 16, False),
    ]
    assert spec.eagle_groups() == (False, True, False)
    lookahead = decode_config('[[models]]\nname = "m"\nlookahead_tokens = 2\n', "la.toml")
    assert resolve_variant(lookahead.models[0]).spec.lookahead_tokens == 2


@pytest.mark.parametrize(
    ("toml", "words"),
    [
        (
            '[[models]]\nname = "m"\neagle_block_drop = true\nlookahead_tokens = 1\n',
            ["$.models[0]", "lookahead"],
        ),
        ('[[models]]\nname = "m"\nlookahead_tokens = -1\n', ["$.models[0].lookahead_tokens", ">= 0"]),
        (
            '[[models]]\nname = "m"\n[[models.groups]]\nkind = "chunked_local_attention"\n',
            ["$.models[0].groups[0].chunk_size"],
        ),
        (
            '[[models]]\nname = "m"\n[[models.groups]]\nkind = "sliding_window"\n',
            ["$.models[0].groups[0].sliding_window"],
        ),
        (
            EAGLE_MODEL.replace("eagle = true", "eagle = false"),
            ["$.models[0].groups[2]", "EAGLE"],
        ),
        ('[[models]]\nname = "m"\n[[models.groups]]\nchunk_size = 0\n', ["$.models[0].groups[0].chunk_size"]),
    ],
)
def test_invalid_eagle_and_group_keys(toml: str, words: list[str]) -> None:
    refused(toml, words)


@pytest.mark.parametrize(
    ("toml", "words"),
    [
        (
            '[[models]]\nname = "m"\nreasoning_effort_map = { extreme = "max" }\n',
            ["$.models[0].reasoning_effort_map", "extreme"],
        ),
        (
            '[[models]]\nname = "m"\nvllm_version = "0.32"\nreasoning_effort_map = { medium = "low" }\n',
            ["$.models[0].reasoning_effort_map", "0.32"],
        ),
        (
            '[[models]]\nname = "m"\nanthropic_disabled_thinking_effort = "minimal"\n',
            ["$.models[0].anthropic_disabled_thinking_effort", "minimal"],
        ),
    ],
)
def test_invalid_reasoning_effort_keys(toml: str, words: list[str]) -> None:
    """As vLLM refuses them at startup (`validate_reasoning_effort_map`, the option's choices)."""
    refused(toml, words)


@pytest.mark.parametrize(
    "setting",
    ['session_mode = "soft"', "session_margin_s = 0.1", "session_body = false", "session_ttl_s = 0"],
)
def test_a_session_key_changed_under_another_policy_is_a_warning(
    setting: str, caplog: pytest.LogCaptureFixture
) -> None:
    """kv (the default) pins no session: a session key set for it is not silently ignored, but said
    (a warning: one config is often run under several policies to compare them)."""
    key = setting.split(" ")[0]
    with caplog.at_level(logging.WARNING, logger="router.settings.config"):
        assert decode_config(f"[policy]\n{setting}\n", "cfg.toml").policy.name == "kv"
    said = [r.__dict__.get("setting", "") for r in caplog.records]
    assert any(f"$.policy.{key}" in s and 'policy.name = "session"' in s for s in said), said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="router.settings.config"):
        assert decode_config(f'[policy]\nname = "session"\n{setting}\n', "cfg.toml").policy.name == "session"
    assert not caplog.records


# What kubelet injects into every pod of a namespace for `Service kvrouter` (cluster IP 10.0.0.1, one
# TCP port 8000 named `http`): pkg/kubelet/envvars/envvars.go; kubernetes.io, "Service" >
# "Environment variables" (the `redis-primary` example, here for the name kvrouter).
KUBERNETES_SERVICE_LINKS = {
    "KVROUTER_SERVICE_HOST": "10.0.0.1",
    "KVROUTER_SERVICE_PORT": "8000",
    "KVROUTER_SERVICE_PORT_HTTP": "8000",
    "KVROUTER_PORT": "tcp://10.0.0.1:8000",
    "KVROUTER_PORT_8000_TCP": "tcp://10.0.0.1:8000",
    "KVROUTER_PORT_8000_TCP_PROTO": "tcp",
    "KVROUTER_PORT_8000_TCP_PORT": "8000",
    "KVROUTER_PORT_8000_TCP_ADDR": "10.0.0.1",
}


def _service_links(
    service: str, ip: str, port: int, proto: str = "TCP", port_name: str = ""
) -> dict[str, str]:
    """The variables Kubernetes injects for a Service of that name, IP and (first and only) port."""
    host = f"[{ip}]" if ":" in ip else ip  # net.JoinHostPort, as kubelet writes it
    prefix, link = service.upper().replace("-", "_"), f"{proto.lower()}://{host}:{port}"
    out = {f"{prefix}_SERVICE_HOST": ip, f"{prefix}_SERVICE_PORT": str(port), f"{prefix}_PORT": link}
    if port_name:
        out[f"{prefix}_SERVICE_PORT_{port_name.upper().replace('-', '_')}"] = str(port)
    at = f"{prefix}_PORT_{port}_{proto}"
    return out | {at: link, f"{at}_PROTO": proto.lower(), f"{at}_PORT": str(port), f"{at}_ADDR": ip}


def test_kubernetes_service_links_are_ignored_silently(caplog: pytest.LogCaptureFixture) -> None:
    assert _service_links("kvrouter", "10.0.0.1", 8000, port_name="http") == KUBERNETES_SERVICE_LINKS
    environ = {
        **KUBERNETES_SERVICE_LINKS,
        **_service_links("kvrouter-metrics", "10.0.0.2", 9090, port_name="metrics"),
        **_service_links("kvrouter-headless", "fd00::7", 5557, proto="UDP"),
        "KVROUTER_LISTEN_PORT": "9000",  # a real setting beside them still applies
    }
    with caplog.at_level(logging.DEBUG, logger="router.settings.overrides"):
        assert env_overrides(RouterConfig(), environ) == {"listen.port": "9000"}
        assert load_config(None, environ).listen.port == 9000
    assert caplog.records == []


@pytest.mark.parametrize(
    ("service", "key"),
    [("kvrouter-listen", "listen.port"), ("kvrouter-discovery", "discovery.port"),
     ("kvrouter-discovery-events", "discovery.events_port")],
)  # fmt: skip
def test_a_service_link_named_like_a_setting_is_ignored_with_a_warning(
    service: str, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A Service `kvrouter-listen` injects KVROUTER_LISTEN_PORT=tcp://...: its value says it is no port."""
    links = _service_links(service, "10.0.0.3", 8000)
    name = f"{service.upper().replace('-', '_')}_PORT"
    assert links[name] == "tcp://10.0.0.3:8000"
    with caplog.at_level(logging.WARNING, logger="router.settings.overrides"):
        assert env_overrides(RouterConfig(), links) == {}
    assert [r.getMessage() for r in caplog.records] == [
        f"environment {name}=tcp://10.0.0.3:8000 is a Kubernetes service link, not the setting {key}: "
        "ignored (set it in the config or with --set, or give the pod enableServiceLinks: false)"
    ]


def test_unknown_variables_warn_and_misspelt_settings_are_errors(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="router.settings.overrides"):
        assert env_overrides(RouterConfig(), {"KVROUTER_FOO": "1", "KVROUTER_VERSION": "1.2"}) == {}
    assert [r.getMessage() for r in caplog.records] == [
        "environment KVROUTER_FOO: no such setting, ignored",
        "environment KVROUTER_VERSION: no such setting, ignored",
    ]
    for typo, meant in [
        ("KVROUTER_LISTEN_PROT", "KVROUTER_LISTEN_PORT"),
        ("KVROUTER_POLICE", "KVROUTER_POLICY"),
        ("KVROUTER_ENGINE", "KVROUTER_ENGINES"),
        ("KVROUTER_LIMITS_MAX_BODY", "KVROUTER_LIMITS_MAX_BODY_BYTES"),
        ("KVROUTER_LIMITS_NOPE", "KVROUTER_LIMITS_*"),
        ("KVROUTER_LISTEN_SERVICE_PORT", "KVROUTER_LISTEN_*"),  # not a link: its value is no port number
    ]:
        with pytest.raises(
            ConfigError, match=re.escape(f"environment {typo}: no such setting (did you mean {meant}?")
        ):
            env_overrides(RouterConfig(), {typo: "x"})


def test_an_invalid_choice_lists_the_valid_ones(tmp_path: Path) -> None:
    names = "kv, round_robin, least_loaded, random, session, prefix_approx"
    with pytest.raises(ConfigError, match=re.escape(f"$.policy.name` (one of: {names})")):
        load_config(None, {"KVROUTER_POLICY": "fastest"})
    path = tmp_path / "r.toml"
    path.write_text(ENGINE.format(name="e", url="http://127.0.0.1:1") + 'report_mode = "sometimes"\n')
    with pytest.raises(ConfigError, match=re.escape("$.engines[0].report_mode` (one of: incremental, full)")):
        load_file(path)
    with pytest.raises(ConfigError, match=re.escape("$.limits.overload_status` (one of: 429, 503)")):
        apply_overrides(RouterConfig(), {"limits.overload_status": "500"}, "--set")


def test_kubernetes_discovery_from_the_environment_and_its_checks() -> None:
    env = {"KVROUTER_DISCOVERY_KUBERNETES": '{"services": ["qwen", "llama"], "namespace": "llm"}'}
    config = apply_overrides(RouterConfig(), env_overrides(RouterConfig(), env), "environment")
    assert config.discovery.kubernetes.services == ["qwen", "llama"] and not config.uses_embedded
    with pytest.raises(ConfigError, match="either dns_name or the Kubernetes API"):
        decode_config('[discovery]\ndns_name = "x"\n[discovery.kubernetes]\nservices = ["y"]\n', "t.toml")
    with pytest.raises(ConfigError, match="backoff_max_s"):
        decode_config('[discovery.kubernetes]\nservices = ["a"]\nbackoff_s = 5\nbackoff_max_s = 1\n', "t")
    with pytest.raises(ConfigError, match="address_types"):
        decode_config('[discovery.kubernetes]\naddress_types = ["IPv5"]\n', "t.toml")


def test_a_malformed_hf_repo_id_is_a_config_error_naming_the_field() -> None:
    toml = b"""
[[models]]
name = "m"
tokenizer = "Qwen/Qwen3 8B"
tokenizer_revision = "main"
[[engines]]
name = "e"
url = "http://127.0.0.1:1"
tokenizer = "Qwen3-8B"
"""
    with pytest.raises(ConfigError) as info:
        decode_config(toml, "router.toml")
    lines = str(info.value).splitlines()
    assert len(lines) == 2, lines  # the revision is not reported again beside its malformed repo
    assert lines[0].startswith("router.toml: $.models[0].tokenizer: 'Qwen/Qwen3 8B' is neither")
    assert lines[1].startswith("router.toml: $.engines[0].tokenizer: 'Qwen3-8B' is neither")


def test_a_revision_needs_a_repo_id_and_a_repo_id_is_accepted() -> None:
    pinned = decode_config(
        b'[[models]]\nname = "m"\ntokenizer = "Qwen/Qwen3-8B"\ntokenizer_revision = "v1"\n', "t"
    )
    assert (pinned.models[0].tokenizer, pinned.models[0].tokenizer_revision) == ("Qwen/Qwen3-8B", "v1")
    with pytest.raises(
        ConfigError, match=r"\$\.models\[0\]\.tokenizer_revision: `tokenizer` must be an HF repo id"
    ):
        decode_config(
            b'[[models]]\nname = "m"\ntokenizer = "/t/tokenizer.json"\ntokenizer_revision = "v1"\n', "t"
        )
