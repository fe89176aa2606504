"""Which engines exist, read from EndpointSlices (`discovery.k8s.io/v1`): wire shapes and pure decisions.

The Structs hold the fields of the API reference the router reads (unknown fields are ignored, as the
API grows). `ObjectSet` is the watched state of any kind of object (`SliceSet` the slices'): a LIST replaces
it, each watch event updates it.
`engines_from_slices` turns the slices into the engine set: one engine per ready endpoint, named
`<service>/<pod>`, its ports from the slice's named ports, else its annotations, else `[discovery]`;
its model from the slice's model label (the EndpointSlice controller copies the Service's labels onto
its slices), else `discovery.model`, else "" (the engine is then asked, `router.links.kube_discovery`);
with the label `kvrouter.io/data-parallel-size: N`, one event (and replay) endpoint per rank.
`check_slice` refuses a slice whose engines cannot be made (an address not of its address type, more
than `MAX_DATA_PARALLEL` ranks, a rank's port past 65535; the decoder already refuses a port out of
range), so one bad slice is rejected alone before it reaches the set. `changes` is the difference the
fleet applies. No I/O here.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from typing import Annotated, Final, Generic, Protocol, TypeVar

import msgspec

from router.settings.config import Discovery, EngineConfig

__all__ = [
    "DATA_PARALLEL_LABEL",
    "EVENTS_PORT_ANNOTATION",
    "HTTP_PORT_ANNOTATION",
    "MAX_DATA_PARALLEL",
    "REPLAY_PORT_ANNOTATION",
    "SERVICE_NAME_LABEL",
    "EndpointSlice",
    "EndpointSliceList",
    "ObjectMeta",
    "ObjectSet",
    "RawSliceList",
    "SliceSet",
    "Status",
    "WatchEvent",
    "Wire",
    "annotated_port",
    "changes",
    "check_address",
    "check_slice",
    "data_parallel_ranks",
    "engines_from_slices",
    "label_selector",
]

SERVICE_NAME_LABEL: Final = "kubernetes.io/service-name"
HTTP_PORT_ANNOTATION: Final = "kvrouter.io/http-port"
EVENTS_PORT_ANNOTATION: Final = "kvrouter.io/events-port"
REPLAY_PORT_ANNOTATION: Final = "kvrouter.io/replay-port"
DATA_PARALLEL_LABEL: Final = "kvrouter.io/data-parallel-size"
MAX_DATA_PARALLEL: Final = 1024
"""Ranks one endpoint may declare with `DATA_PARALLEL_LABEL` (each is a subscriber and a socket)."""
_Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]


class Wire(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """Base of the API shapes: camelCase on the wire, unknown fields ignored."""


class ObjectMeta(Wire, frozen=True):
    name: str = ""
    namespace: str = ""
    resource_version: str = ""
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None
    deletion_timestamp: str | None = None


class ListMeta(Wire, frozen=True):
    resource_version: str = ""
    continue_: str | None = msgspec.field(default=None, name="continue")


class EndpointConditions(Wire, frozen=True):
    """nil `ready` means ready, nil `terminating` means not terminating (the API reference)."""

    ready: bool | None = None
    serving: bool | None = None
    terminating: bool | None = None


class ObjectReference(Wire, frozen=True):
    kind: str = ""
    name: str = ""
    namespace: str = ""


class Endpoint(Wire, frozen=True):
    addresses: list[str]
    conditions: EndpointConditions = EndpointConditions()
    hostname: str | None = None
    target_ref: ObjectReference | None = None


class EndpointPort(Wire, frozen=True):
    name: str | None = None
    port: _Port | None = None
    protocol: str | None = None


class EndpointSlice(Wire, frozen=True):
    metadata: ObjectMeta
    address_type: str
    endpoints: list[Endpoint] | None = None
    ports: list[EndpointPort] | None = None


class EndpointSliceList(Wire, frozen=True):
    metadata: ListMeta = ListMeta()
    items: list[EndpointSlice] | None = None


class RawSliceList(Wire, frozen=True):
    """A LIST page with its items undecoded, so each slice is decoded (and refused) alone."""

    metadata: ListMeta = ListMeta()
    items: list[msgspec.Raw] | None = None


class Status(Wire, frozen=True):
    """A failed call's answer (`kind: Status`); 410 means the resourceVersion is gone: LIST again."""

    code: int = 0
    reason: str = ""
    message: str = ""


class WatchEvent(Wire, frozen=True):
    """One line of a watch stream; `object` is decoded by `type` (a slice, a bookmark, a Status)."""

    type: str
    object: msgspec.Raw


class VersionMeta(Wire, frozen=True):
    resource_version: str = ""


class BookmarkObject(Wire, frozen=True):
    """A bookmark's object, or any object read for its resourceVersion alone (nothing else checked)."""

    metadata: VersionMeta = VersionMeta()


def label_selector(discovery: Discovery) -> str:
    """The EndpointSlices' selector: the configured Services' names, and the configured selector."""
    k = discovery.kubernetes
    parts = []
    if len(k.services) == 1:
        parts.append(f"{SERVICE_NAME_LABEL}={k.services[0]}")
    elif k.services:
        parts.append(f"{SERVICE_NAME_LABEL} in ({','.join(sorted(k.services))})")
    if k.label_selector:
        parts.append(k.label_selector)
    return ",".join(parts)


class _HasMeta(Protocol):
    @property
    def metadata(self) -> ObjectMeta: ...


Item = TypeVar("Item", bound=_HasMeta)


class ObjectSet(Generic[Item]):
    """API objects as last listed and watched, by namespace and name, with the resourceVersion."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], Item] = {}
        self.resource_version = ""

    def replace(self, items: Iterable[Item], resource_version: str) -> None:
        """A LIST's answer: exactly these objects exist."""
        self.objects = {_key(s): s for s in items}
        self.resource_version = resource_version

    def apply(self, event_type: str, item: Item) -> None:
        """One watch event (ADDED, MODIFIED or DELETED); ValueError for any other type."""
        if event_type in ("ADDED", "MODIFIED"):
            self.objects[_key(item)] = item
        elif event_type == "DELETED":
            self.objects.pop(_key(item), None)
        else:
            raise ValueError(f"unexpected watch event type {event_type!r}")
        if item.metadata.resource_version:
            self.resource_version = item.metadata.resource_version


SliceSet = ObjectSet[EndpointSlice]
"""The EndpointSlices as last listed and watched."""


def _key(item: _HasMeta) -> tuple[str, str]:
    return item.metadata.namespace, item.metadata.name


def _is_ready(endpoint: Endpoint) -> bool:
    c = endpoint.conditions
    return c.ready is not False and c.terminating is not True and bool(endpoint.addresses)


def annotated_port(meta: ObjectMeta, annotation: str, default: int | None) -> int | None:
    """The port in the object's `annotation`, else `default` (an annotation that is not a port too)."""
    value = (meta.annotations or {}).get(annotation, "")
    return int(value) if value.isdigit() and 0 < int(value) < 65536 else default


def data_parallel_ranks(labels: Mapping[str, str]) -> int:
    """The ranks `DATA_PARALLEL_LABEL` declares (1 without it); ValueError past `MAX_DATA_PARALLEL`."""
    dp = labels.get(DATA_PARALLEL_LABEL, "")
    ranks = int(dp) if dp.isascii() and dp.isdigit() and int(dp) > 0 else 1
    if ranks > MAX_DATA_PARALLEL:
        raise ValueError(f"{DATA_PARALLEL_LABEL} {ranks} is over {MAX_DATA_PARALLEL}")
    return ranks


def _port(item: EndpointSlice, name: str, annotation: str, default: int | None) -> int | None:
    """The slice's port named `name`, else the port in its annotation, else `default`."""
    for p in item.ports or []:
        if p.name == name and p.port is not None:
            return p.port
    return annotated_port(item.metadata, annotation, default)


def _slice_engines(discovery: Discovery, item: EndpointSlice) -> Iterable[EngineConfig]:
    k = discovery.kubernetes
    labels = item.metadata.labels or {}
    pool = labels.get(SERVICE_NAME_LABEL, item.metadata.name)
    http = _port(item, k.http_port_name, HTTP_PORT_ANNOTATION, discovery.port)
    events = _port(item, k.events_port_name, EVENTS_PORT_ANNOTATION, discovery.events_port)
    replay = _port(item, k.replay_port_name, REPLAY_PORT_ANNOTATION, discovery.replay_port)
    model = labels.get(k.model_label, discovery.model)
    ranks = data_parallel_ranks(labels)
    if max(events or 0, replay or 0) + ranks - 1 > 65535:
        raise ValueError(f"{ranks} ranks from port {max(events or 0, replay or 0)} pass 65535")
    for endpoint in item.endpoints or []:
        if not _is_ready(endpoint):
            continue
        address = endpoint.addresses[0]  # the API: all addresses are fungible, the first may be used
        check_address(item.address_type, address)
        host = f"[{address}]" if item.address_type == "IPv6" else address
        ref = endpoint.target_ref
        pod = ref.name if ref is not None and ref.name else endpoint.hostname or address
        yield EngineConfig(
            name=f"{pool}/{pod}",
            url=f"http://{host}:{http}",
            model=model,
            events=[f"tcp://{host}:{events + r}" for r in range(ranks)] if events else [],
            replay=[f"tcp://{host}:{replay + r}" for r in range(ranks)] if events and replay else [],
        )  # rank r publishes on port + r, and replays on replay port + r (vLLM's offset_endpoint)


def check_address(address_type: str, address: str) -> None:
    """ValueError unless `address` is an address of `address_type` (an FQDN slice's: any name)."""
    kinds = {"IPv4": ipaddress.IPv4Address, "IPv6": ipaddress.IPv6Address}
    kind = kinds.get(address_type)
    if kind is not None:
        try:
            kind(address)
        except ValueError:
            raise ValueError(f"{address[:60]!r} is not an {address_type} address") from None


def check_slice(discovery: Discovery, item: EndpointSlice) -> None:
    """ValueError when the slice's engines cannot be made (see the module docstring)."""
    for _ in _slice_engines(discovery, item):
        pass


def engines_from_slices(discovery: Discovery, slices: Iterable[EndpointSlice]) -> dict[str, EngineConfig]:
    """Every ready endpoint of the slices as an engine (see the module docstring), by name.

    Slices of an address type not in `kubernetes.address_types` are skipped; a pod in several slices
    (dual stack, or moving between slices) is one engine, from the slice of the preferred address type,
    then the first by name."""
    rank: dict[str, int] = {kind: i for i, kind in enumerate(discovery.kubernetes.address_types)}
    usable = [s for s in slices if s.address_type in rank]
    usable.sort(key=lambda s: (rank[s.address_type], s.metadata.namespace, s.metadata.name))
    out: dict[str, EngineConfig] = {}
    for item in usable:
        for engine in _slice_engines(discovery, item):
            out.setdefault(engine.name, engine)
    return dict(sorted(out.items()))


def changes(
    known: Mapping[str, EngineConfig], current: Mapping[str, EngineConfig]
) -> tuple[dict[str, EngineConfig], set[str]]:
    """(added, removed names) turning `known` into `current`; an engine whose table changed (a pod
    re-created with a new address, a new port) is in both: removed, then added afresh."""
    removed = {name for name, engine in known.items() if current.get(name) != engine}
    added = {name: engine for name, engine in current.items() if known.get(name) != engine}
    return added, removed
