"""Engines found through the Kubernetes API: objects LISTed, then WATCHed (never polled).

`ListWatch` is the loop, for any kind of object (a `WatchSource`: EndpointSlices here, an
InferencePool and its pods in router.links.pool_discovery): LIST the selected objects (every page),
then WATCH from the list's resourceVersion with bookmarks on. Every event updates its `ObjectSet`, and
the owner's `EngineTable` recomputes the engine set (pure: router.links.endpoint_slices for slices)
and hands the difference to `on_change` (the fleet drops a removed engine's mirror, subscriber and
session pins). A watch the server ends is resumed from the last resourceVersion seen (an event's or a
bookmark's); 410 Gone means that version was compacted away, so the loop LISTs again (a full resync);
any other failure is counted, logged and retried after an exponential backoff, the engine set kept as
it is. An object the decoder or the source's check refuses is rejected alone, counted and logged: a
LIST leaves it out, a watch event leaves the object as it was and moves the resume version past it,
and discovery goes on for the others (one bad object failing the whole LIST, or a watch resumed
before it, would stall discovery for every engine). An event that is not an object's event (an
unknown type, not even JSON) is rejected the same way. An engine whose model no label names is asked
its `/v1/models` once per engine table, by the owner's `ModelAsker` (the gateway's is
router.edge.model_probe's, on its own HTTP client); until it answers it is left out and asked again
after a backoff. `KubeDiscovery` is one `ListWatch` of the selected EndpointSlices.
The API client is kubernetes_asyncio (on aiohttp, which it needs): in-cluster service-account auth,
a kubeconfig, or `api_url`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any, Final, Protocol, cast

import aiohttp
import msgspec
from kubernetes_asyncio import config as kube_config
from kubernetes_asyncio.client import ApiClient, Configuration, DiscoveryV1Api
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.watch import Watch

from router.links.endpoint_slices import (
    BookmarkObject,
    EndpointSlice,
    ObjectSet,
    RawSliceList,
    changes,
    check_slice,
    engines_from_slices,
    label_selector,
)
from router.settings.config import Discovery, EngineConfig, KubernetesDiscovery

__all__ = [
    "SERVICE_ACCOUNT",
    "ClientHolder",
    "EngineTable",
    "KubeDiscovery",
    "ListWatch",
    "ModelAsker",
    "WatchSource",
    "api_client",
    "namespace_of",
    "new_counts",
]

log = logging.getLogger(__name__)

_LIST: Final = msgspec.json.Decoder(RawSliceList)
_EVENTS: Final = ("ADDED", "MODIFIED", "DELETED")
_PAGE: Final = 500
SERVICE_ACCOUNT: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount")  # token, ca.crt, namespace


OnChange = Callable[[dict[str, EngineConfig], set[str]], Awaitable[None]]


class ModelAsker(Protocol):
    """Asks an engine the model it serves (router.edge.model_probe's `ModelProbe` in the gateway)."""

    async def __call__(self, engine: EngineConfig) -> str | None:
        """The engine's model; None when it cannot say (the asker counts and logs why)."""
        ...

    def close(self) -> None:
        """Let go of its connections."""
        ...


async def api_client(
    k: KubernetesDiscovery, environ: Mapping[str, str] | None = None, account: Path = SERVICE_ACCOUNT
) -> ApiClient:
    """A client for `api_url` (no auth), else in-cluster service-account auth (the API server from
    $KUBERNETES_SERVICE_HOST/PORT, the token and CA from `account`, the token re-read as it rotates),
    else the kubeconfig."""
    env = os.environ if environ is None else environ
    configuration = Configuration()
    if k.api_url:
        configuration.host = k.api_url.rstrip("/")
    elif env.get("KUBERNETES_SERVICE_HOST"):
        kube_config.load_incluster_config(  # type: ignore[no-untyped-call]
            client_configuration=configuration,
            token_filename=str(account / "token"),
            cert_filename=str(account / "ca.crt"),
            environ=dict(env),
        )
    else:
        await kube_config.load_kube_config(
            config_file=k.kubeconfig or None, client_configuration=configuration
        )
    return ApiClient(configuration)


def namespace_of(k: KubernetesDiscovery, account_file: Path = SERVICE_ACCOUNT / "namespace") -> str:
    """The configured namespace, else the pod's own (from its service account), else "default"."""
    if k.namespace:
        return k.namespace
    try:
        return account_file.read_text().strip() or "default"
    except OSError:
        return "default"


class WatchSource(msgspec.Struct, frozen=True):
    """What one `ListWatch` lists and watches: the objects of one kind in one namespace."""

    what: str
    """The kind's name in logs ("endpointslice", "pod", "inferencepool")."""
    kind: type[Any]
    """The Struct each object decodes to (it has a `metadata: ObjectMeta`)."""
    lister: Callable[[ApiClient], Callable[..., Awaitable[Any]]]
    """The generated client's list call for a client (its positional arguments bound)."""
    check: Callable[[Any], None]
    """Raises ValueError for an object that decodes but cannot be used (rejected alone)."""
    label_selector: str = ""
    field_selector: str = ""


class ListWatch:
    """LIST one kind of object (every page), then WATCH from the list's resourceVersion with bookmarks
    on, into an `ObjectSet`; `changed()` after every change (see the module docstring for resumes,
    410 resyncs, backoff and rejections). `counts` are shared with the owner (its metrics)."""

    def __init__(
        self,
        source: WatchSource,
        k: KubernetesDiscovery,
        counts: dict[str, int],
        changed: Callable[[], Awaitable[None]],
        client: Callable[[], Awaitable[ApiClient]],
    ) -> None:
        self.source, self.k, self.counts = source, k, counts
        self._changed, self._client = changed, client
        self.objects: ObjectSet[Any] = ObjectSet()
        self._list_decoder = msgspec.json.Decoder(source.kind)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the list/watch loop."""
        self._task = asyncio.create_task(self._run(), name=f"kubernetes-{self.source.what}-watch")

    async def close(self) -> None:
        """Stop the loop (the client is its owner's)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def _call(self, client: ApiClient) -> tuple[Callable[..., Awaitable[Any]], dict[str, str]]:
        """The list call for `client`, and the selectors it is given (those set)."""
        src = self.source
        selectors = {"label_selector": src.label_selector, "field_selector": src.field_selector}
        return src.lister(client), {k: v for k, v in selectors.items() if v}

    async def _run(self) -> None:
        failures = 0
        while True:
            try:
                client = await self._client()
                if not self.objects.resource_version:
                    await self._list(client)
                await self._watch(client)
                failures = 0
            except ApiException as exc:
                if exc.status == 410:  # compacted: the version is gone, only a LIST gets a new one
                    self.counts["resyncs"] += 1
                    log.info("kubernetes watch expired, listing again", extra={"reason": exc.reason})
                    self.objects.resource_version = ""
                    continue
                failures = await self._failed(exc, failures)
            except Exception as exc:  # the client raises bare Exception for a malformed line: never die
                failures = await self._failed(exc, failures)

    async def _failed(self, exc: Exception, failures: int) -> int:
        self.counts["failures"] += 1
        delay = min(self.k.backoff_max_s, self.k.backoff_s * 2**failures)
        log.warning(
            "kubernetes discovery failed",
            extra={
                "kind": self.source.what,
                "selector": self.source.label_selector or self.source.field_selector,
                "error": repr(exc),
                "retry_s": delay,
            },
        )
        await asyncio.sleep(delay)  # a backoff, not synchronisation
        return failures + 1

    def _timeout(self) -> aiohttp.ClientTimeout:
        # kubernetes_asyncio's request timeout is aiohttp's (its transport).
        # A server that stops answering mid-watch is noticed: it owes a line (or the end) by then.
        return aiohttp.ClientTimeout(sock_connect=10, sock_read=self.k.watch_timeout_s + 30)

    async def _list(self, client: ApiClient) -> None:
        items: list[Any] = []
        token: str | None = None
        call, selectors = self._call(client)
        while True:
            # _preload_content=False: the raw answer, decoded by our own Structs, not the client's models.
            response: Any = await call(
                limit=_PAGE,
                _continue=cast(str, token),  # None is not sent (the generated code skips it)
                _preload_content=False,
                _request_timeout=self._timeout(),
                **selectors,
            )
            try:
                page = _LIST.decode(await response.read())
            finally:
                response.release()
            for raw in page.items or []:
                if (item := self._admit("LIST", partial(self._list_decoder.decode, raw))) is not None:
                    items.append(item)
            token = page.metadata.continue_
            if not token:
                break
        self.counts["lists"] += 1
        self.objects.replace(items, page.metadata.resource_version)
        await self._changed()

    async def _watch(self, client: ApiClient) -> None:
        """One watch from the current resourceVersion, until the server ends it."""
        self.counts["watches"] += 1
        call, selectors = self._call(client)
        async with Watch(return_type="object") as watch:  # "object": the raw dicts, decoded here
            stream = watch.stream(
                call,
                resource_version=self.objects.resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=self.k.watch_timeout_s,
                _request_timeout=self._timeout(),
                **selectors,
            )
            quiet = True
            async for event in stream:
                quiet = False
                await self._on_event(event)
        if quiet:  # a server (or proxy) ending watches at once must not be asked again in a busy loop
            await asyncio.sleep(self.k.backoff_s)  # pacing, not synchronisation

    async def _on_event(self, event: object) -> None:
        """One line of the watch: the client's dict {type, raw_object, ...}, or the line itself when it
        was not JSON."""
        kind = event.get("type") if isinstance(event, dict) else None
        raw = event.get("raw_object") if isinstance(event, dict) else None
        if kind == "BOOKMARK":
            self.counts["bookmarks"] += 1
            self.objects.resource_version = _version_of(raw) or self.objects.resource_version
            return
        self.counts["events"] += 1
        item = self._admit(str(kind)[:40], partial(_watched, self.source.kind, kind, raw))
        if item is None:
            # Rejected alone: the object keeps its last good state, and the watch moves past it (a
            # resume from before it would meet it again).
            self.objects.resource_version = _version_of(raw) or self.objects.resource_version
            return
        self.objects.apply(str(kind), item)
        await self._changed()

    def _admit(self, kind: str, decode: Callable[[], Any]) -> Any:
        """The object `decode` gives, checked; None when refused (counted and logged)."""
        try:
            item = decode()
            self.source.check(item)
        except (msgspec.MsgspecError, ValueError) as exc:
            self.counts["rejected"] += 1
            log.warning(
                f"kubernetes {self.source.what} rejected", extra={"type": kind, "error": str(exc)[:300]}
            )
            return None
        return item


class EngineTable:
    """The discovered engine set handed to the fleet: recomputed by `apply()` from the watched objects
    (`current()`, pure), the difference given to `on_change`; an engine whose model no label names is
    asked its `/v1/models` first by `ask_model` (left out until it answers, asked again after a
    backoff; each failure also counted in `counts["failures"]`)."""

    def __init__(
        self,
        k: KubernetesDiscovery,
        on_change: OnChange,
        current: Callable[[], dict[str, EngineConfig]],
        counts: dict[str, int],
        ask_model: ModelAsker,
    ) -> None:
        self.k, self._on_change, self._current, self.counts = k, on_change, current, counts
        self._ask = ask_model
        self.known: dict[str, EngineConfig] = {}  # the pure engine set, minus engines of unknown model
        self.present: set[str] = set()  # names handed to the fleet
        self.models: dict[tuple[str, str], str] = {}  # /v1/models answers, by engine name and URL
        self.lock = asyncio.Lock()  # held while the set is recomputed and handed over
        self._retry: asyncio.Task[None] | None = None

    async def close(self) -> None:
        """Stop asking engines for their models."""
        if self._retry is not None:
            self._retry.cancel()
            await asyncio.gather(self._retry, return_exceptions=True)
            self._retry = None
        self._ask.close()

    async def apply(self) -> None:
        """Recompute the engine set and hand the difference to the fleet."""
        async with self.lock:
            current = self._current()
            added, removed = changes(self.known, current)
            ready: dict[str, EngineConfig] = {}
            for name, engine in added.items():
                resolved = await self._with_model(engine)
                if resolved is None:
                    del current[name]  # not known yet: asked again after a backoff
                else:
                    ready[name] = resolved
            self.known = current
            self.models = {key: m for key, m in self.models.items() if key[0] in current}  # pods come and go
            removed &= self.present
            self.present = (self.present - removed) | set(ready)
            if ready or removed:
                log.info(
                    "kubernetes discovery changed", extra={"added": sorted(ready), "removed": sorted(removed)}
                )
                await self._on_change(ready, removed)

    async def _with_model(self, engine: EngineConfig) -> EngineConfig | None:
        if engine.model:
            return engine
        model = self.models.get((engine.name, engine.url)) or await self._ask(engine)
        if model is None:
            self.counts["failures"] += 1
            if self._retry is None or self._retry.done():
                self._retry = asyncio.create_task(self._apply_later(), name="kubernetes-discovery-retry")
            return None
        self.models = {k: m for k, m in self.models.items() if k[0] != engine.name}  # one per engine
        self.models[engine.name, engine.url] = model
        return msgspec.structs.replace(engine, model=model)

    async def _apply_later(self) -> None:
        await asyncio.sleep(self.k.backoff_s)  # a backoff, not synchronisation
        await self.apply()


def new_counts() -> dict[str, int]:
    """The discovery's counters, all zero (exported as `kvrouter_discovery_operations_total{kind}`)."""
    kinds = ("lists", "watches", "resyncs", "failures", "bookmarks", "events", "rejected")
    return dict.fromkeys(kinds, 0)


class ClientHolder:
    """The discovery's one API client: made at first use (no credentials yet is a failure, retried
    by the loop that asked), closed once."""

    def __init__(self, k: KubernetesDiscovery, client: ApiClient | None = None) -> None:
        self.k, self.client = k, client

    async def get(self) -> ApiClient:
        if self.client is None:
            self.client = await api_client(self.k)
        return self.client

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None


class KubeDiscovery:
    """Lists and watches the selected EndpointSlices and calls `on_change(added, removed_names)`."""

    def __init__(
        self,
        discovery: Discovery,
        on_change: OnChange,
        ask_model: ModelAsker,
        client: ApiClient | None = None,
    ) -> None:
        """`ask_model`: asks an engine whose model no label names (closed with the discovery)."""
        if not (discovery.kubernetes.services or discovery.kubernetes.label_selector):
            raise ValueError("discovery.kubernetes names no services and no label_selector")
        self.discovery = discovery
        self.k = discovery.kubernetes
        self.namespace = namespace_of(self.k)
        self.selector = label_selector(discovery)
        self.counts = new_counts()
        self._client = ClientHolder(self.k, client)
        self.table = EngineTable(self.k, on_change, self._engines, self.counts, ask_model)
        namespace = self.namespace

        def lister(c: ApiClient) -> Callable[..., Awaitable[Any]]:
            return partial(DiscoveryV1Api(c).list_namespaced_endpoint_slice, namespace)

        check = partial(check_slice, discovery)
        source = WatchSource("endpointslice", EndpointSlice, lister, check, label_selector=self.selector)
        self.watch = ListWatch(source, self.k, self.counts, self.table.apply, self._client.get)

    @property
    def slices(self) -> ObjectSet[Any]:
        """The EndpointSlices as last listed and watched."""
        return self.watch.objects

    @property
    def known(self) -> dict[str, EngineConfig]:
        return self.table.known

    @property
    def present(self) -> set[str]:
        return self.table.present

    def _engines(self) -> dict[str, EngineConfig]:
        return engines_from_slices(self.discovery, self.watch.objects.objects.values())

    def start(self) -> None:
        """Start the list/watch loop."""
        self.watch.start()

    async def close(self) -> None:
        """Stop watching and close the API client."""
        await self.watch.close()
        await self.table.close()
        await self._client.close()


def _watched(struct: type[Any], kind: object, raw: object) -> Any:
    """The object of a watch event of `kind`; ValueError for a type that is not an object's event."""
    if kind not in _EVENTS:
        raise ValueError(f"unexpected watch event type {str(kind)[:40]!r}")
    return msgspec.convert(raw, struct)


def _version_of(raw: object) -> str:
    """The object's resourceVersion, "" when it has none readable."""
    try:
        return msgspec.convert(raw, BookmarkObject).metadata.resource_version
    except msgspec.ValidationError:
        return ""
