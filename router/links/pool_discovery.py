"""Engines from an InferencePool: the pool and the pods it selects, each LISTed then WATCHed.

`PoolDiscovery` runs two `ListWatch` loops (router.links.kube_discovery: the same resumes, 410
resyncs, backoff and rejections as the EndpointSlice discovery): one on the pool named
`discovery.kubernetes.inference_pool` (a field selector on its name), one on the pods its
`spec.selector` selects, started once the pool is known and restarted when its selector changes (the
pods already known are kept until the new list replaces them, so a selector change removes only the
pods it no longer selects). After every change the engine set is recomputed by the pure
`router.links.inference_pool` (ready pods x target ports) and the difference handed to `on_change`
by the shared `EngineTable`. A deleted pool (or none yet) is no engines: the picker answers 503
`no_engine` until pods are there. A bad pool or pod is rejected alone, counted (`rejected`) and logged.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from kubernetes_asyncio.client import ApiClient, CoreV1Api, CustomObjectsApi

from router.links.inference_pool import (
    GROUP,
    PLURAL,
    VERSION,
    InferencePool,
    Pod,
    check_pod,
    check_pool,
    engines_from_pool,
    pool_selector,
)
from router.links.kube_discovery import (
    ClientHolder,
    EngineTable,
    ListWatch,
    ModelAsker,
    OnChange,
    WatchSource,
    namespace_of,
    new_counts,
)
from router.settings.config import Discovery, EngineConfig

__all__ = ["PoolDiscovery"]

log = logging.getLogger(__name__)


class PoolDiscovery:
    """Watches one InferencePool and its pods and calls `on_change(added, removed_names)`."""

    def __init__(
        self,
        discovery: Discovery,
        on_change: OnChange,
        ask_model: ModelAsker,
        client: ApiClient | None = None,
    ) -> None:
        """`ask_model`: asks an engine whose model no label names (closed with the discovery)."""
        k = discovery.kubernetes
        if not k.inference_pool:
            raise ValueError("discovery.kubernetes.inference_pool is not set")
        self.discovery, self.k, self.name = discovery, k, k.inference_pool
        self.namespace = namespace = namespace_of(k)
        self.counts = new_counts()
        self._client = ClientHolder(k, client)
        self.table = EngineTable(k, on_change, self._engines, self.counts, ask_model)

        def pools(c: ApiClient) -> Callable[..., Awaitable[Any]]:
            return partial(
                CustomObjectsApi(c).list_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL
            )

        source = WatchSource(
            "inferencepool", InferencePool, pools, check_pool, field_selector=f"metadata.name={self.name}"
        )
        self.pools = ListWatch(source, k, self.counts, self._pool_changed, self._client.get)
        self.pods: ListWatch | None = None
        self.selector = ""

    def pool(self) -> InferencePool | None:
        """The pool as last listed and watched; None when it does not exist (or was rejected)."""
        found: InferencePool | None = self.pools.objects.objects.get((self.namespace, self.name))
        return found

    def _engines(self) -> dict[str, EngineConfig]:
        pool = self.pool()
        if pool is None or self.pods is None:
            return {}
        return engines_from_pool(self.discovery, pool, self.pods.objects.objects.values())

    async def _pool_changed(self) -> None:
        """The pool changed: (re)start the pods' watch when its selector changed, then apply."""
        pool = self.pool()
        selector = pool_selector(pool) if pool is not None else ""
        if selector != self.selector:
            log.info("inferencepool selector", extra={"pool": self.name, "selector": selector})
            await self._watch_pods(selector)
        await self.table.apply()

    async def _watch_pods(self, selector: str) -> None:
        old, self.selector = self.pods, selector
        if old is not None:
            async with self.table.lock:  # (never cancelled while it hands a change to the fleet)
                self.pods = None
                await old.close()
        self.pods = None
        if not selector:
            return
        namespace, discovery = self.namespace, self.discovery

        def pods(c: ApiClient) -> Callable[..., Awaitable[Any]]:
            return partial(CoreV1Api(c).list_namespaced_pod, namespace)

        source = WatchSource("pod", Pod, pods, partial(check_pod, discovery), label_selector=selector)
        self.pods = ListWatch(source, self.k, self.counts, self.table.apply, self._client.get)
        if old is not None:  # kept until the new list replaces them (its version "": it lists first)
            self.pods.objects.objects = dict(old.objects.objects)
        self.pods.start()

    def start(self) -> None:
        """Start watching the pool (the pods' watch follows it)."""
        self.pools.start()

    async def close(self) -> None:
        """Stop watching and close the API client."""
        await self.pools.close()
        if self.pods is not None:
            await self.pods.close()
        await self.table.close()
        await self._client.close()
