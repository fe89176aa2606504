"""A fake Kubernetes API server on 127.0.0.1:0 serving the list/watch protocol of EndpointSlices, Pods
and InferencePools.

`GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices` (and `/api/v1/namespaces/{ns}/pods`,
`/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools`) answers a LIST (a `...List`
with the current resourceVersion; `limit`/`continue` pages) or, with `watch=true`, a stream of JSON
lines `{"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": ...}` of the changes after the given
resourceVersion, as the API reference describes. A watch from a version older than the last
`compact()` gets an `ERROR` event carrying a 410 `Status` (Expired), as the real server does. The test
drives it: `put` and `delete` objects (by their `kind`), `bookmark()` (sent to watches that allowed
bookmarks), `end_watches()` (the server closing every open watch), `token` (a bearer token required),
and reads `lists` and `watches` (each call's query, and its `resource`). Label selectors: `k=v`,
`k!=v`, `k in (a,b)`, `k`, comma-joined; field selectors: `metadata.name=NAME`.
"""

from __future__ import annotations

import asyncio
import json
import re
import ssl
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from aiohttp import web

from router.settings.config import EngineConfig

__all__ = [
    "FakeKubeApi",
    "Fleet",
    "endpoint",
    "endpoint_slice",
    "holds",
    "inference_pool",
    "pod",
    "running_kube_api",
]

Obj = dict[str, Any]
_API = "discovery.k8s.io/v1"
_IN = re.compile(r"^([\w./-]+)\s+in\s+\(([^)]*)\)$")


def endpoint(address: str, pod: str, *, ready: bool | None = True, terminating: bool | None = None) -> Obj:
    """One endpoint of a slice: its address, the Pod it targets and its conditions."""
    conditions = {k: v for k, v in (("ready", ready), ("terminating", terminating)) if v is not None}
    return {
        "addresses": [address],
        "conditions": conditions,
        "targetRef": {"kind": "Pod", "namespace": "llm", "name": pod, "uid": f"uid-{pod}"},
        "nodeName": "node-1",
    }


def endpoint_slice(
    name: str,
    service: str,
    endpoints: list[Obj],
    *,
    ports: Mapping[str, int] | None = None,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
    address_type: str = "IPv4",
) -> Obj:
    """An EndpointSlice as the EndpointSlice controller writes it for `service`."""
    meta: Obj = {
        "name": name,
        "namespace": "llm",
        "labels": {"kubernetes.io/service-name": service, "endpointslice.kubernetes.io/managed-by":
                   "endpointslice-controller.k8s.io", **(labels or {})},
        "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": service, "uid": "u"}],
    }  # fmt: skip
    if annotations:
        meta["annotations"] = dict(annotations)
    return {
        "kind": "EndpointSlice",
        "apiVersion": _API,
        "metadata": meta,
        "addressType": address_type,
        "endpoints": endpoints,
        "ports": [{"name": n, "port": p, "protocol": "TCP"} for n, p in (ports or {}).items()],
    }


def pod(
    name: str,
    ip: str,
    labels: Mapping[str, str],
    *,
    ready: bool = True,
    phase: str = "Running",
    annotations: Mapping[str, str] | None = None,
) -> Obj:
    """A Pod as the kubelet reports it: its phase, Ready condition and IP."""
    meta: Obj = {"name": name, "namespace": "llm", "labels": dict(labels), "uid": f"uid-{name}"}
    if annotations:
        meta["annotations"] = dict(annotations)
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    status = {"phase": phase, "podIP": ip, "podIPs": [{"ip": ip}], "conditions": conditions}
    return {"kind": "Pod", "apiVersion": "v1", "metadata": meta, "spec": {"containers": []}, "status": status}


def inference_pool(name: str, selector: Mapping[str, str], ports: list[int]) -> Obj:
    """An InferencePool (inference.networking.k8s.io/v1) selecting pods by `selector` on `ports`."""
    return {
        "kind": "InferencePool",
        "apiVersion": "inference.networking.k8s.io/v1",
        "metadata": {"name": name, "namespace": "llm", "uid": f"uid-{name}"},
        "spec": {
            "selector": {"matchLabels": dict(selector)},
            "targetPorts": [{"number": p} for p in ports],
            "endpointPickerRef": {"name": f"{name}-epp", "portNumber": 9002},
        },
    }


_PLURAL = {"EndpointSlice": "endpointslices", "Pod": "pods", "InferencePool": "inferencepools"}


class Fleet:
    """What `on_change` was told, applied as the fleet would: the engines present now, and every call."""

    def __init__(self) -> None:
        self.engines: dict[str, EngineConfig] = {}
        self.calls: list[tuple[list[str], list[str]]] = []

    async def on_change(self, added: dict[str, EngineConfig], removed: set[str]) -> None:
        assert removed <= self.engines.keys()  # never asked to remove what it was not given
        for name in removed:
            del self.engines[name]
        assert not added.keys() & self.engines.keys()  # never given an engine twice
        self.engines.update(added)
        self.calls.append((sorted(added), sorted(removed)))


async def holds(value: bool) -> bool:
    """`value`, as the async predicate `wait_for` polls (`lambda: holds(x == y)`)."""
    return value


def _go_bool(value: str) -> bool:
    """A query flag as the API server reads it (Go's strconv.ParseBool; the Python client sends "True")."""
    return value in ("1", "t", "T", "TRUE", "true", "True")


def _matches(selector: str, labels: Mapping[str, str]) -> bool:
    for term in filter(None, (t.strip() for t in re.split(r",(?![^(]*\))", selector))):
        if found := _IN.match(term):
            if labels.get(found.group(1)) not in {v.strip() for v in found.group(2).split(",")}:
                return False
        elif "!=" in term:
            key, _, value = term.partition("!=")
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, _, value = term.partition("=")
            if labels.get(key) != value.lstrip("="):
                return False
        elif term not in labels:
            return False
    return True


def _selected(query: Mapping[str, str], obj: Obj) -> bool:
    """Whether `obj` matches the query's label and field selectors."""
    meta = obj["metadata"]
    field = query.get("fieldSelector", "")
    if field and (not field.startswith("metadata.name=") or meta.get("name") != field.partition("=")[2]):
        return False
    return _matches(query.get("labelSelector", ""), meta.get("labels") or {})


class FakeKubeApi:
    """The API server's state: objects by resource and name, a resourceVersion counter and the event
    history."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Obj]] = {plural: {} for plural in _PLURAL.values()}
        self.slices = self.objects["endpointslices"]
        self.version = 100
        self.history: list[tuple[int, str, Obj]] = []
        self.compacted = 0
        self.lists: list[Mapping[str, str]] = []
        self.watches: list[Mapping[str, str]] = []
        self.open_watches = 0
        self.token: str | None = None  # set: every call needs `Authorization: Bearer <token>`
        self._changed = asyncio.Condition()
        self._generation = 0

    async def _record(self, kind: str, obj: Obj) -> None:
        async with self._changed:
            self.version += 1
            obj = json.loads(json.dumps(obj))
            obj["metadata"]["resourceVersion"] = str(self.version)
            self.history.append((self.version, kind, obj))
            self._changed.notify_all()

    async def put(self, obj: Obj) -> None:
        """Create or replace an object (ADDED or MODIFIED)."""
        name, objects = obj["metadata"]["name"], self.objects[_PLURAL[obj["kind"]]]
        kind = "MODIFIED" if name in objects else "ADDED"
        await self._record(kind, obj)
        objects[name] = self.history[-1][2]

    async def delete(self, name: str, kind: str = "EndpointSlice") -> None:
        """Delete an object (DELETED, carrying its last state)."""
        await self._record("DELETED", self.objects[_PLURAL[kind]].pop(name))

    async def bookmark(self) -> None:
        """Send a BOOKMARK at the current version to every watch that allowed bookmarks."""
        async with self._changed:
            self.version += 1
            mark = {
                "kind": "EndpointSlice",
                "apiVersion": _API,
                "metadata": {"resourceVersion": str(self.version)},
            }
            self.history.append((self.version, "BOOKMARK", mark))
            self._changed.notify_all()

    def compact(self) -> None:
        """Forget the history: a watch from any version up to now gets 410 Gone."""
        self.compacted = self.version
        self.history.clear()

    async def end_watches(self) -> None:
        """Close every open watch (the server's timeout, or an API server restart)."""
        async with self._changed:
            self._generation += 1
            self._changed.notify_all()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self.token is not None and request.headers.get("Authorization") != f"Bearer {self.token}":
            status = {"kind": "Status", "status": "Failure", "reason": "Unauthorized", "code": 401}
            return web.json_response(status, status=401)
        query = dict(request.query)
        resource = request.path.rsplit("/", 1)[1]
        if _go_bool(query.get("watch", "")):
            self.watches.append({**query, "resource": resource})
            return await self._watch(request, query, resource)
        self.lists.append({**query, "resource": resource})
        return self._list(query, resource)

    def _list(self, query: Mapping[str, str], resource: str) -> web.Response:
        objects = self.objects[resource]
        items = [s for _, s in sorted(objects.items()) if _selected(query, s)]
        start = int(query.get("continue") or 0)
        limit = int(query.get("limit") or 0) or len(items)
        page = items[start : start + limit]
        meta: Obj = {"resourceVersion": str(self.version)}
        if start + limit < len(items):
            meta["continue"] = str(start + limit)
        kind = next(k for k, plural in _PLURAL.items() if plural == resource)
        return web.json_response({"kind": f"{kind}List", "metadata": meta, "items": page})

    async def _watch(
        self, request: web.Request, query: Mapping[str, str], resource: str
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        since = int(query.get("resourceVersion") or self.version)
        if since < self.compacted:
            status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                      "message": f"too old resource version: {since} ({self.compacted})",
                      "reason": "Expired", "code": 410}  # fmt: skip
            await response.write(json.dumps({"type": "ERROR", "object": status}).encode() + b"\n")
            return response
        bookmarks = _go_bool(query.get("allowWatchBookmarks", ""))
        self.open_watches += 1
        try:
            await self._stream(response, since, (query, resource), bookmarks)
        finally:
            self.open_watches -= 1
        return response

    async def _stream(
        self,
        response: web.StreamResponse,
        since: int,
        selected: tuple[Mapping[str, str], str],
        bookmarks: bool,
    ) -> None:
        query, resource = selected
        generation = self._generation
        while True:
            async with self._changed:
                await self._changed.wait_for(partial(self._due, generation, since))
                if self._ended(generation):
                    return
                events = [e for e in self.history if e[0] > since]
            for version, kind, obj in events:
                since = version
                if kind == "BOOKMARK" and not bookmarks:
                    continue
                if kind != "BOOKMARK" and (_PLURAL[obj["kind"]] != resource or not _selected(query, obj)):
                    continue
                await response.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

    def _due(self, generation: int, since: int) -> bool:
        return self._ended(generation) or self._after(since)

    def _ended(self, generation: int) -> bool:
        return self._generation != generation

    def _after(self, since: int) -> bool:
        return bool(self.history) and self.history[-1][0] > since


@asynccontextmanager
async def running_kube_api(tls: ssl.SSLContext | None = None) -> AsyncIterator[tuple[FakeKubeApi, str]]:
    """The fake API under a real aiohttp server on 127.0.0.1:0 (HTTPS with `tls`); yields it and its URL."""
    api = FakeKubeApi()
    app = web.Application()
    app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices", api.handle)
    app.router.add_get("/api/v1/namespaces/{namespace}/pods", api.handle)
    app.router.add_get(
        "/apis/inference.networking.k8s.io/v1/namespaces/{namespace}/inferencepools", api.handle
    )
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield api, f"{'https' if tls else 'http'}://{host}:{port}"
    finally:
        await api.end_watches()
        await runner.cleanup()
