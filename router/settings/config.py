"""The gateway's configuration: TOML decoded into msgspec Structs, then env and CLI overrides, then checks.

Precedence: defaults < the TOML file < `KVROUTER_*` environment variables < CLI overrides. Every
error names the source (file, variable or flag) and the field path (msgspec's `$.section.field`).
Secrets (API keys, admin token) are never config values: the config names the variable or file
holding them, and `router.settings.secrets` reads them. The override rules live in
`router.settings.overrides`.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints
from urllib.parse import urlsplit

import msgspec

from router.settings.group_rules import group_rule
from tokenization.base import TokenizationError
from tokenization.hub_names import hub_repo
from tokenization.reasoning_effort import DisabledThinkingEffort, ReasoningEffort

log = logging.getLogger(__name__)

__all__ = [
    "Auth",
    "Breaker",
    "ConfigError",
    "Discovery",
    "Embedded",
    "EngineConfig",
    "GroupConfig",
    "KubernetesDiscovery",
    "Limits",
    "Listen",
    "ModelConfig",
    "PolicyConfig",
    "Retry",
    "RouterConfig",
    "Timeouts",
    "decode_config",
    "explain_invalid",
    "load_file",
    "validate",
]

Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Positive = Annotated[float, msgspec.Meta(gt=0)]
NonNegative = Annotated[float, msgspec.Meta(ge=0)]
Count = Annotated[int, msgspec.Meta(ge=1)]


class ConfigError(ValueError):
    """An invalid configuration; the message names the source and the field."""


class _Table(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Base of every config table: a misspelt key is an error, not a silently ignored default."""


class Listen(_Table, frozen=True):
    """Where the gateway listens."""

    host: str = "127.0.0.1"
    port: Port = 8000
    workers: Count = 1
    """Gateway worker processes sharing the port; each keeps its own exact mirror of every engine."""
    access_log: bool = True
    """One INFO line per request on the `kvrouter.access` logger (router/edge/access_log.py)."""
    stream_coalesce_s: Annotated[float, msgspec.Meta(ge=0.0, le=0.05)] = 0.0
    """After each client write of a streamed answer's body (the first chunk's excepted), the engine's
    connection is not read for this long, so what it sends meanwhile leaves in one read and one write
    (fewer wake-ups and writes; each token up to this much later). 0, the default: every engine read is
    written at once. The first chunk is never held."""
    forwarded_allow_ips: list[str] = []
    """Proxies trusted for `X-Forwarded-For`/`-Proto` (uvicorn's `forwarded_allow_ips`: addresses,
    networks, or "*"): the access log's client is then the one they name. Empty, the default: no proxy
    is trusted and uvicorn's `ProxyHeadersMiddleware` is not installed (one ASGI layer less per request)."""


class GroupConfig(_Table, frozen=True):
    """One KV-cache group (vLLM spec kind, block size, sliding window or local-attention chunk, and
    whether it is an EAGLE draft group), in group_idx order."""

    kind: str = "full_attention"
    block_size: Count | None = None
    sliding_window: Count | None = None
    chunk_size: Count | None = None
    """`attention_chunk_size` of a chunked_local_attention group."""
    eagle: bool = False
    """vLLM's `is_eagle_group`: with `eagle_block_drop`, only flagged groups drop (all when none is)."""


class EngineConfig(_Table, frozen=True):
    """One engine: where to send requests, where its events (one endpoint per DP rank) come from."""

    name: str
    url: str
    model: str = ""
    events: list[str] = []
    replay: list[str] = []
    tokenizer: str | None = None
    block_size: Count | None = None
    groups: list[GroupConfig] = []
    report_mode: Literal["incremental", "full"] = "incremental"


class ModelConfig(_Table, frozen=True):
    """How the router reproduces a model's tokens and block keys."""

    name: str
    tokenizer: str | None = None
    """A tokenizer.json file, a directory holding one, or an HF repo id (`Org/Name`, through the hub's
    cache; docs/tokenization.md "Tokenizers named by repo id"); unset: the built-in tokenizer."""
    tokenizer_revision: str | None = None
    """The branch, tag or commit of the repo `tokenizer` names (unset: `main`)."""
    chat_template: str | None = None
    block_size: Count = 16
    groups: list[GroupConfig] = []
    hashing: Literal["router", "vllm"] = "router"
    hash_algo: Literal["sha256", "sha256_cbor"] = "sha256"
    hash_seed: str | None = None
    """hashing = "vllm": the engines' PYTHONHASHSEED, which vLLM's NONE_HASH is derived from (unset: its
    fixed "vllm-none-hash")."""
    remote_tokenize: bool = False
    loras: dict[str, str] = {}
    eagle_block_drop: bool = False
    """The engines run EAGLE/MTP without lookahead hashes: vLLM drops the last matched block."""
    lookahead_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    """The engines' lookahead block hashes (EAGLE's default): each block hash covers L more tokens."""
    vllm_version: Literal["0.32", "0.33"] = "0.33"
    """The engines' vLLM minor version; 0.32 has no lookahead hashes (docs/vllm.md "vLLM versions")."""
    reasoning_effort_map: dict[ReasoningEffort, str] = {}
    """The engines' `--reasoning-effort-map`: an effort renamed before the template renders it (chat,
    Responses and Messages alike; efforts not listed pass unchanged; unset: vLLM's default, none)."""
    anthropic_disabled_thinking_effort: DisabledThinkingEffort = "auto"
    """The engines' `--anthropic-disabled-thinking-effort`: the effort a Messages `thinking` `disabled`
    renders with (`auto`, vLLM's default: "none", or "low" for a template that refuses or ignores it)."""


class PolicyConfig(_Table, frozen=True):
    """Routing policy, its weights, the cost-model prior and the trust settings."""

    name: Literal["kv", "round_robin", "least_loaded", "random", "session", "prefix_approx"] = "kv"
    tie_tolerance_s: NonNegative = 0.002
    tie_min_hit_share: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.1
    """kv: in a tie, a cached prefix shorter than this share of the prompt comes after the load."""
    decode_penalty_s: NonNegative = 40e-6
    """kv: seconds each engine step takes longer per decoding sequence (engine_stub/runtime/cost_model.py)."""
    decode_step_s: NonNegative = 6e-3
    """kv: seconds a step takes longer when it decodes anything (the weights streamed once more): where
    each engine's value starts, learned from its streamed answers' decode times (router.core.policy.load)."""
    max_num_batched_tokens: Count = 8192
    """kv: the engines' token budget per step (vLLM's `max_num_batched_tokens`), for chunked prefill."""
    max_num_seqs: Count = 256
    """kv: the engines' running-batch limit (vLLM's `max_num_seqs`); past it requests wait for slots."""
    context_read_s_per_token: NonNegative = 38e-9
    """kv: seconds each engine step takes longer per token of context (KV) of the requests it holds."""
    seed: int = 0
    session_header: str = "x-session-id"
    """session: the configured session header, read before any other source of a session key."""
    session_agent_headers: bool = True
    """session: then the well-known agent clients' session headers (docs/routing.md "Sessions for agents")."""
    session_body: bool = True
    """session: then the body's ids (`prompt_cache_key`, `conversation`, `metadata.user_id`, `user`, ...)."""
    session_mode: Literal["hard", "soft"] = "hard"
    """session: `hard` keeps a session on its engine while eligible; `soft` moves it when kv's choice is
    predicted faster to first token by more than `session_margin_s`."""
    session_margin_s: NonNegative = 0.5
    session_capacity: Count = 100_000
    """session: pins kept (least recently used evicted first, counted)."""
    session_ttl_s: NonNegative = 3600.0
    """session: a pin unused this long is forgotten (counted; 0: never)."""
    stored_responses_capacity: Count = 100_000
    """Responses ids kept with the engine that stored them, so a `previous_response_id` goes there
    (least recently used evicted first, counted)."""
    prior_overhead_s: NonNegative = 0.02
    prior_per_token_s: Positive = 1e-4
    prior_weight: Positive = 4.0
    forgetting: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.98
    trust_silence_s: Positive = 5.0
    pending_ttl_s: NonNegative = 5.0
    shared_cost_model: bool = True
    scrape_period_s: NonNegative = 0.0
    """Scrape every engine's `vllm:` gauges from its /metrics this often (0: off)."""
    scrape_timeout_s: Positive = 1.0
    """One whole scrape's bound (connect, headers, body, parsing); a slow or failed scrape is counted
    and the last good one ages out."""
    scrape_max_bytes: Count = 4 * 1024 * 1024
    """A /metrics body over this is abandoned, its connection closed, and counted (`too_large`)."""
    scrape_max_age_s: Positive = 10.0
    """A scrape older than this is ignored (the router's own counts stand alone)."""
    max_predicted_ttft_s: NonNegative = 0.0
    """An engine predicted slower than this to first token is saturated; when all are, 503 (0: off)."""
    saturation_bound: Literal["ttft", "wait"] = "ttft"
    """What `max_predicted_ttft_s` bounds: the predicted TTFT, or the predicted wait (the TTFT less
    the request's own prefill on an idle engine: a long prompt is not refused by an idle fleet)."""
    max_scraped_waiting: Annotated[int, msgspec.Meta(ge=0)] = 0
    """An engine whose scraped waiting queue is longer than this is saturated (0: off)."""
    prefill_work_weight: NonNegative = 1.0
    """kv: cost = predicted TTFT + this x (1 + the engine's unanswered requests) x the request's own
    uncached prefill time (the work it adds, for whoever comes there after it)."""
    drain_queued_prefill: bool = True
    """kv: count the oldest unanswered request per engine as prefilled at the learned pace as time passes."""
    learn_prefill_from_service: bool = False
    """Learn the prefill cost from each answer's own service (since the engine could start it), not
    from its TTFT against the queue as sent (docs/gateway.md "The load model"; off: see BENCHMARKS.md)."""


class Timeouts(_Table, frozen=True):
    """Upstream and client timeouts in seconds (see config/router.toml for each phase)."""

    connect_s: Positive = 2.0
    pool_wait_s: Positive = 2.0
    """Longest wait for a pooled engine connection when the pool is at `limits.pool_per_engine` or
    `limits.pool_total`; then the request is refused (the overload answer naming that limit)."""
    first_byte_s: Positive = 60.0
    read_s: Positive = 60.0
    total_s: Positive = 600.0
    # The client side (router/edge/client_protocol.py), at nginx's defaults: client_header_timeout 60 s,
    # client_body_timeout 60 s, keepalive_timeout 75 s.
    client_header_s: Positive = 60.0
    """From connecting (or a kept-alive request's first byte) to the end of the request headers."""
    client_body_s: Positive = 60.0
    """From the end of the headers to the end of the body: one deadline, a trickle cannot extend it."""
    client_keepalive_s: Positive = 75.0
    """Idle time between requests on a kept-alive client connection."""
    client_write_s: Positive = 60.0
    """Longest wait on a client that takes no more of its answer (nginx's send_timeout): then the
    answer ends as `client_slow`, its connection and its engine stream closed."""
    hub_fetch_s: Positive = 30.0
    """Longest wait for the HF hub to give a repo-named tokenizer's files (at startup, or when a repo
    is first named later); then the model tokenizes on its engines (docs/tokenization.md)."""
    hub_retry_s: Positive = 30.0
    """The wait before the first background fetch of a repo-named tokenizer that could not be had;
    each later wait doubles, at most 600 s (router/links/hub_retry.py)."""
    hub_retries: Annotated[int, msgspec.Meta(ge=0)] = 8
    """How many background fetches of a missing repo-named tokenizer (0: none, restart to retry)."""
    stored_seek_s: Positive = 1.0
    """The bound on asking the engines which one holds a stored Responses answer never seen stored
    (`GET /v1/responses/{id}` on each, at once: router/edge/stored_seek.py; the picker's requests that
    name one, the gateway's `GET` and cancel of one); then the request is routed as without it."""


class Limits(_Table, frozen=True):
    """Request-size and concurrency limits, overload answer, connection pool sizes."""

    max_body_bytes: Count = 16 * 1024 * 1024
    max_in_flight_per_engine: Count = 256
    max_in_flight_total: Count = 1024
    overload_status: Literal[429, 503] = 429
    retry_after_s: Count = 1
    pool_per_engine: Count = 256
    pool_total: Count = 1024
    keepalive_s: Positive = 4.0  # under uvicorn's (and so vLLM's) 5 s keep-alive: no stale reuse
    key_cache_tokens: Annotated[int, msgspec.Meta(ge=0)] = (
        4_000_000  # router/core/keys/recent_prompts.py; 0 = off
    )
    drain_grace_s: NonNegative = 0.0
    """After SIGTERM: not ready at once, but new connections still accepted this long (endpoints update)."""
    drain_s: NonNegative = 30.0
    """Then: no new connections; open requests and streams may finish this long before they are cut."""
    # The client connection (router/edge/client_limits.py): Envoy's max_request_headers_kb (60 KiB) and
    # max_headers_count (100) bound the same; uvicorn and httptools bound none of them.
    client_max_header_bytes: Count = 64 * 1024
    """A request head's target and header fields (or a chunked body's trailer section); more: 431, closed."""
    client_max_headers: Count = 100
    """Header fields in a request head (or trailer fields in a chunked body); more: 431, closed."""
    client_max_discard_bytes: Annotated[int, msgspec.Meta(ge=0)] = 32 * 1024 * 1024
    """Of a body answered before it was all in (413, 401): read and dropped up to this many more bytes
    (a client still sending then reads the answer, not a reset); past them (0: at once) it is closed."""
    client_max_pipelined: Count = 32
    """Requests of one connection parsed and waiting behind the one being answered; at it, no more is
    read until one is answered (one more in the same read: the connection closes after the answers)."""


class Retry(_Table, frozen=True):
    """Attempts on different engines before any byte reached the client, with backoff."""

    attempts: Count = 3
    backoff_s: NonNegative = 0.01
    backoff_max_s: NonNegative = 0.2


class Breaker(_Table, frozen=True):
    """Per-engine circuit breaker: consecutive failures to open, cool-down before a probe."""

    failure_threshold: Count = 5
    open_s: NonNegative = 10.0


class Auth(_Table, frozen=True):
    """Where secrets live (never the secrets themselves): a variable name, or a file path."""

    api_keys_env: str = "KVROUTER_API_KEYS"
    api_keys_file: str | None = None
    admin_token_env: str = "KVROUTER_ADMIN_TOKEN"
    admin_token_file: str | None = None


class KubernetesDiscovery(_Table, frozen=True):
    """Engines from EndpointSlices, listed then watched through the Kubernetes API (kube_discovery.py)."""

    services: list[str] = []
    """Services whose EndpointSlices (label kubernetes.io/service-name) are the engines; one pool each."""
    label_selector: str = ""
    """A label selector on EndpointSlices, with or instead of `services` (either one turns this on)."""
    namespace: str = ""
    """Empty: the gateway pod's own namespace (its service account), else "default"."""
    api_url: str = ""
    """Empty: in-cluster service-account auth, else the kubeconfig. Set: this API server, no auth
    (tests, `kubectl proxy`)."""
    kubeconfig: str = ""
    """Outside a cluster: this kubeconfig (empty: $KUBECONFIG, else ~/.kube/config)."""
    model_label: str = "kvrouter.io/model"
    """The slice label naming its pool's model; without it `discovery.model`, else the engine's /v1/models."""
    http_port_name: str = "http"
    events_port_name: str = "kv-events"
    replay_port_name: str = "kv-replay"
    address_types: list[Literal["IPv4", "IPv6", "FQDN"]] = msgspec.field(
        default_factory=lambda: ["IPv4", "IPv6", "FQDN"]
    )
    """Slices of these address types are read; a dual-stack pod is one engine, of the first type listed."""
    watch_timeout_s: Annotated[int, msgspec.Meta(ge=1)] = 300
    """The API server ends each watch after this; it is then resumed from the last resourceVersion."""
    backoff_s: Positive = 0.5
    backoff_max_s: Positive = 30.0
    model_timeout_s: Positive = 5.0
    """One /v1/models question to an engine whose model no label names."""
    inference_pool: str = ""
    """An InferencePool (inference.networking.k8s.io/v1) in `namespace`: its selected pods x its target
    ports are the engines (router/links/inference_pool.py), instead of `services`/`label_selector`."""

    def __post_init__(self) -> None:
        if self.inference_pool and (self.services or self.label_selector):
            raise ValueError(
                "inference_pool names the engines alone: leave services and label_selector empty"
            )

    @property
    def enabled(self) -> bool:
        """True when a Service, a label selector or an InferencePool is configured."""
        return bool(self.services or self.label_selector or self.inference_pool)


class Discovery(_Table, frozen=True):
    """Engines from every A record of a DNS name (a headless service), re-resolved every period, or
    from the Kubernetes API (`[discovery.kubernetes]`); the ports and model here are the defaults."""

    dns_name: str | None = None
    port: Port = 8000
    events_port: Port | None = 5557
    replay_port: Port | None = None
    model: str = ""
    period_s: Positive = 10.0
    kubernetes: KubernetesDiscovery = KubernetesDiscovery()


class Embedded(_Table, frozen=True):
    """Engine stubs started as child processes when no engines are configured or discovered."""

    engines: Count = 2
    num_gpu_blocks: Count = 2048
    block_size: Count = 16
    model: str = "kvrouter-stub"
    tokenizer: str | None = None


class RouterConfig(_Table, frozen=True):
    """The whole gateway configuration (one table per section of config/router.toml)."""

    listen: Listen = Listen()
    engines: list[EngineConfig] = []
    models: list[ModelConfig] = []
    policy: PolicyConfig = PolicyConfig()
    timeouts: Timeouts = Timeouts()
    limits: Limits = Limits()
    retry: Retry = Retry()
    breaker: Breaker = Breaker()
    auth: Auth = Auth()
    discovery: Discovery = Discovery()
    embedded: Embedded = Embedded()

    @property
    def uses_embedded(self) -> bool:
        """True when neither engines nor discovery are configured: start stubs instead."""
        return not self.engines and self.discovery.dns_name is None and not self.discovery.kubernetes.enabled


_AT_PATH = re.compile(r"- at `\$((?:\.\w+|\[\d+\])*)`$")
_SEGMENT = re.compile(r"\.(\w+)|\[\d+\]")


def explain_invalid(exc: msgspec.DecodeError) -> str:
    """msgspec's message, plus the allowed values when the field at its path takes a fixed set of them."""
    message = str(exc)
    found = _AT_PATH.search(message)
    if found is None:
        return message
    kind: Any = RouterConfig
    for segment in _SEGMENT.finditer(found.group(1)):
        kind = _unwrap(kind)
        if segment.group(1) is None:  # [i]: the element type of a list
            kind = get_args(kind)[0] if get_origin(kind) is list else None
        elif isinstance(kind, type) and issubclass(kind, msgspec.Struct):
            kind = get_type_hints(kind, include_extras=True).get(segment.group(1))
        else:
            return message
    kind = _unwrap(kind)
    if get_origin(kind) is Literal:
        return f"{message} (one of: {', '.join(str(v) for v in get_args(kind))})"
    return message


def _unwrap(kind: Any) -> Any:
    """The type inside `Annotated[...]` and `X | None`."""
    if get_origin(kind) is Annotated:
        kind = get_args(kind)[0]
    if get_origin(kind) is Union:
        rest = [arg for arg in get_args(kind) if arg is not type(None)]
        kind = rest[0] if len(rest) == 1 else kind
    return kind


def decode_config(data: bytes | str, source: str) -> RouterConfig:
    """Decode TOML into a checked RouterConfig; errors name `source` and the field path."""
    try:
        config = msgspec.toml.decode(data, type=RouterConfig)
    except msgspec.DecodeError as exc:  # ValidationError is a subclass: both carry the path
        raise ConfigError(f"{source}: {explain_invalid(exc)}") from None
    validate(config, source)
    return config


def load_file(path: Path) -> RouterConfig:
    """Read and decode a TOML config file (without env or CLI overrides)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    return decode_config(data, str(path))


def validate(config: RouterConfig, source: str) -> None:
    """Checks beyond types: URLs, endpoints, unique names, consistent limits and timeouts. A setting
    the configured policy does not read is a logged warning, not an error (`_session_keys_unread`)."""
    problems = [*_engine_problems(config.engines), *_general_problems(config)]
    if problems:
        raise ConfigError("\n".join(f"{source}: {p}" for p in problems))
    for unread in _session_keys_unread(config.policy):
        log.warning("setting not read by this policy", extra={"source": source, "setting": unread})


def _engine_problems(engines: list[EngineConfig]) -> list[str]:
    problems, seen = [], set()
    for i, engine in enumerate(engines):
        at = f"$.engines[{i}]"
        if not engine.name or engine.name in seen:
            problems.append(f"{at}.name: engine names must be non-empty and unique, got {engine.name!r}")
        seen.add(engine.name)
        url = urlsplit(engine.url)
        if url.scheme not in ("http", "https") or not url.hostname or url.query or url.fragment:
            problems.append(f"{at}.url: must be an http(s) URL with a host, got {engine.url!r}")
        for j, endpoint in enumerate([*engine.events, *engine.replay]):
            field = f"events[{j}]" if j < len(engine.events) else f"replay[{j - len(engine.events)}]"
            if urlsplit(endpoint).scheme not in ("tcp", "ipc", "inproc"):
                problems.append(
                    f"{at}.{field}: must be a tcp://, ipc:// or inproc:// endpoint, got {endpoint!r}"
                )
        if engine.replay and len(engine.replay) != len(engine.events):
            problems.append(f"{at}.replay: one replay endpoint per events endpoint (DP rank), or none")
    return problems


def _group_problems(at: str, groups: list[GroupConfig], drop: bool) -> list[str]:
    problems = []
    for j, g in enumerate(groups):
        rule = group_rule(g.kind)
        if rule.required is not None and rule.missing(g) is not None:
            field, _, what = rule.required
            problems.append(f"{at}.groups[{j}].{field}: a {g.kind} group needs {what}")
        if not rule.eagle_allowed and drop and (g.eagle or not any(o.eagle for o in groups)):
            problems.append(f"{at}.groups[{j}]: vLLM has no EAGLE block drop for chunked local attention")
    return problems


def _tokenizer_problems(config: RouterConfig) -> list[str]:
    """A `tokenizer` that is neither a path nor a well-formed HF repo id, and a revision without a repo."""
    problems = []
    sources = [(f"$.models[{i}]", m.tokenizer) for i, m in enumerate(config.models)]
    sources += [(f"$.engines[{i}]", e.tokenizer) for i, e in enumerate(config.engines)]
    repos: dict[str, str | None] = {}  # a source reported as malformed has no entry
    for at, source in [*sources, ("$.embedded", config.embedded.tokenizer)]:
        try:
            repos[at] = hub_repo(source) if source is not None else None
        except TokenizationError as exc:
            problems.append(f"{at}.tokenizer: {exc}")
    for i, m in enumerate(config.models):
        at = f"$.models[{i}]"
        if m.tokenizer_revision is not None and at in repos and repos[at] is None:
            problems.append(f"{at}.tokenizer_revision: `tokenizer` must be an HF repo id to pin a revision")
    return problems


def _model_problems(config: RouterConfig) -> list[str]:
    problems = _tokenizer_problems(config)
    models = {m.name: m for m in config.models}
    for i, m in enumerate(config.models):
        at = f"$.models[{i}]"
        if m.eagle_block_drop and m.lookahead_tokens:
            problems.append(f"{at}.eagle_block_drop: vLLM turns the drop off when lookahead_tokens is set")
        if m.reasoning_effort_map and m.vllm_version == "0.32":
            problems.append(f"{at}.reasoning_effort_map: vLLM 0.32 has no --reasoning-effort-map")
        problems.extend(_group_problems(at, m.groups, m.eagle_block_drop))
    for i, engine in enumerate(config.engines):
        model = models.get(engine.model) or (config.models[0] if len(config.models) == 1 else None)
        drop = model.eagle_block_drop if model is not None else False
        problems.extend(_group_problems(f"$.engines[{i}]", engine.groups, drop))
    return problems


def _general_problems(config: RouterConfig) -> list[str]:
    problems = _model_problems(config)
    names = [m.name for m in config.models]
    if len(set(names)) != len(names) or "" in names:
        problems.append(f"$.models: model names must be non-empty and unique, got {names}")
    t = config.timeouts
    if max(t.connect_s, t.first_byte_s) > t.total_s:
        problems.append("$.timeouts.total_s: must be at least connect_s and first_byte_s")
    lim = config.limits
    if lim.max_in_flight_per_engine > lim.max_in_flight_total:
        problems.append("$.limits.max_in_flight_per_engine: must not exceed max_in_flight_total")
    if config.retry.backoff_max_s < config.retry.backoff_s:
        problems.append("$.retry.backoff_max_s: must be at least backoff_s")
    kube = config.discovery.kubernetes
    if kube.enabled and config.discovery.dns_name is not None:
        problems.append("$.discovery.kubernetes: use either dns_name or the Kubernetes API, not both")
    if kube.backoff_max_s < kube.backoff_s:
        problems.append("$.discovery.kubernetes.backoff_max_s: must be at least backoff_s")
    return problems


_SESSION_ONLY = (
    "session_mode",
    "session_margin_s",
    "session_capacity",
    "session_ttl_s",
    "session_agent_headers",
    "session_body",
)
"""The policy keys only `policy.name = "session"` reads (`session_header` also names the header
recordings keep)."""


def _session_keys_unread(policy: PolicyConfig) -> list[str]:
    """The session keys changed from their defaults under a policy that does not read them, each said
    with the fix. `kv` (the default) pins no session; it sends a session's step where its prefix is
    cached, weighed against the load, and `session` is `kv` plus the pins (docs/routing.md "Sessions
    for agents"). A warning, not an error: one config is commonly run under several policies
    (`--policy`, `kvrouter loadtest --policies kv,session`) to compare them."""
    if policy.name == "session":
        return []
    default = PolicyConfig()
    return [
        f'$.policy.{key}: applies only with policy.name = "session" (policy.name is {policy.name!r}, '
        "which pins no session): ignored"
        for key in _SESSION_ONLY
        if getattr(policy, key) != getattr(default, key)
    ]
