"""Which engines an InferencePool (`inference.networking.k8s.io/v1`) names: wire shapes and pure decisions.

An InferencePool selects pods by labels (`spec.selector.matchLabels`, in its own namespace) and names
up to `MAX_TARGET_PORTS` `spec.targetPorts`; the Gateway API Inference Extension's endpoints are each
selected pod's IP x each target port. `engines_from_pool` makes one engine of each: named
`<pool>/<pod>` (one target port) or `<pool>/<pod>:<port>` (several), its URL `http://<pod IP>:<port>`.
Only pods that can serve are engines: phase Running, condition Ready True, an IP, not being deleted.

KV events, per pod: the annotations `kvrouter.io/events-port` and `kvrouter.io/replay-port` (as on an
EndpointSlice), else the per-pool rule `[discovery] events_port` / `replay_port`; the engine of the
i-th target port subscribes to `events_port + i` (and replays from `replay_port + i`): with one port
per data-parallel rank (vLLM's one API server per rank) rank i publishes on the base port + i, vLLM's
offset. The pod label `kvrouter.io/data-parallel-size: N` keeps its meaning (N ranks behind each
port, one event endpoint each, as for EndpointSlices). The model: the pod's `kvrouter.io/model` label
(`kubernetes.model_label`), else `discovery.model`, else the engine is asked (kube_discovery).

`check_pool` and `check_pod` refuse an object whose engines cannot be made (no target port, more than
`MAX_TARGET_PORTS`, an empty selector: it would select every pod of the namespace; an IP that is not
one, ports past 65535), so one bad object is rejected alone before it reaches the set. No I/O here.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from typing import Annotated, Final

import msgspec

from router.links.endpoint_slices import (
    EVENTS_PORT_ANNOTATION,
    REPLAY_PORT_ANNOTATION,
    ObjectMeta,
    Wire,
    annotated_port,
    data_parallel_ranks,
)
from router.settings.config import Discovery, EngineConfig

__all__ = [
    "GROUP",
    "MAX_TARGET_PORTS",
    "PLURAL",
    "VERSION",
    "InferencePool",
    "Pod",
    "check_pod",
    "check_pool",
    "engines_from_pool",
    "pool_selector",
]

GROUP: Final = "inference.networking.k8s.io"
VERSION: Final = "v1"
PLURAL: Final = "inferencepools"
MAX_TARGET_PORTS: Final = 8
_Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]


class LabelSelector(Wire, frozen=True):
    match_labels: dict[str, str] | None = None


class TargetPort(Wire, frozen=True):
    number: _Port


class InferencePoolSpec(Wire, frozen=True):
    selector: LabelSelector = LabelSelector()
    target_ports: list[TargetPort] | None = None


class InferencePool(Wire, frozen=True):
    metadata: ObjectMeta
    spec: InferencePoolSpec


class PodCondition(Wire, frozen=True):
    type: str
    status: str = ""


class PodStatus(Wire, frozen=True):
    phase: str = ""
    pod_ip: str | None = msgspec.field(default=None, name="podIP")
    conditions: list[PodCondition] | None = None


class Pod(Wire, frozen=True):
    metadata: ObjectMeta
    status: PodStatus = PodStatus()


def pool_selector(pool: InferencePool) -> str:
    """The pool's `matchLabels` as a label selector (`k=v,...`, sorted); "" for none."""
    labels = pool.spec.selector.match_labels or {}
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


def check_pool(pool: InferencePool) -> None:
    """ValueError when the pool cannot name engines (see the module docstring)."""
    ports = [p.number for p in pool.spec.target_ports or []]
    if not ports:
        raise ValueError("spec.targetPorts is empty")
    if len(ports) > MAX_TARGET_PORTS:
        raise ValueError(f"{len(ports)} spec.targetPorts, at most {MAX_TARGET_PORTS}")
    if len(set(ports)) != len(ports):
        raise ValueError(f"spec.targetPorts {ports} repeat a port")
    if not pool.spec.selector.match_labels:
        raise ValueError("spec.selector.matchLabels is empty (it would select every pod)")
    for key, value in pool.spec.selector.match_labels.items():
        if not key or any(c in key + value for c in ",=!() "):
            raise ValueError(f"spec.selector.matchLabels {key[:60]!r}: {value[:60]!r} is not a label")


def _serving(pod: Pod) -> bool:
    status = pod.status
    ready = any(c.type == "Ready" and c.status == "True" for c in status.conditions or [])
    return (
        status.phase == "Running"
        and ready
        and bool(status.pod_ip)
        and pod.metadata.deletion_timestamp is None
    )


def _selected(selector: Mapping[str, str], pod: Pod) -> bool:
    labels = pod.metadata.labels or {}
    return all(labels.get(key) == value for key, value in selector.items())


def _pod_engines(discovery: Discovery, pool: str, ports: list[int], pod: Pod) -> Iterable[EngineConfig]:
    """The engines of one pod: one per target port (see the module docstring)."""
    meta, address = pod.metadata, pod.status.pod_ip or ""
    labels = meta.labels or {}
    ranks = data_parallel_ranks(labels)
    events = annotated_port(meta, EVENTS_PORT_ANNOTATION, discovery.events_port)
    replay = annotated_port(meta, REPLAY_PORT_ANNOTATION, discovery.replay_port)
    if max(events or 0, replay or 0) + len(ports) * ranks - 1 > 65535:
        raise ValueError(
            f"{len(ports)} ports x {ranks} ranks from port {max(events or 0, replay or 0)} pass 65535"
        )
    try:
        host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    except ValueError:
        raise ValueError(f"status.podIP {address[:60]!r} is not an IP address") from None
    model = labels.get(discovery.kubernetes.model_label, discovery.model)
    for i, port in enumerate(ports):
        first = i * ranks  # this port's first rank
        yield EngineConfig(
            name=f"{pool}/{meta.name}" if len(ports) == 1 else f"{pool}/{meta.name}:{port}",
            url=f"http://{host}:{port}",
            model=model,
            events=[f"tcp://{host}:{events + first + r}" for r in range(ranks)] if events else [],
            replay=[f"tcp://{host}:{replay + first + r}" for r in range(ranks)] if events and replay else [],
        )


def check_pod(discovery: Discovery, pod: Pod) -> None:
    """ValueError when a serving pod's engines cannot be made, whatever pool selects it (checked
    with `MAX_TARGET_PORTS` ports, so no pool's ports can make it fail later)."""
    if _serving(pod):
        for _ in _pod_engines(discovery, "pool", list(range(1, MAX_TARGET_PORTS + 1)), pod):
            pass


def engines_from_pool(
    discovery: Discovery, pool: InferencePool, pods: Iterable[Pod]
) -> dict[str, EngineConfig]:
    """Every serving pod the pool selects x each target port, as engines by name (module docstring);
    the pods are `check_pod`'s."""
    ports = [p.number for p in pool.spec.target_ports or []]
    selector = pool.spec.selector.match_labels or {}
    out: dict[str, EngineConfig] = {}
    for pod in pods:
        if not (_serving(pod) and _selected(selector, pod)):
            continue
        out.update((e.name, e) for e in _pod_engines(discovery, pool.metadata.name, ports, pod))
    return dict(sorted(out.items()))
