"""InferencePool discovery against a fake Kubernetes API on 127.0.0.1: the pool and its pods listed then
watched, pods coming and going, the pool's selector and ports changing, resyncs, bad objects."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from router.edge.model_probe import ModelProbe
from router.links.pool_discovery import PoolDiscovery
from router.settings.config import Discovery, KubernetesDiscovery
from tests.gateway_helpers import wait_for
from tests.kube_api import FakeKubeApi, Fleet, holds, inference_pool, pod, running_kube_api

APP = {"app": "vllm", "kvrouter.io/model": "qwen"}
SELECTOR = {"app": "vllm"}


def settings(url: str) -> Discovery:
    k = KubernetesDiscovery(inference_pool="qwen", namespace="llm", api_url=url, backoff_s=0.01)
    return Discovery(kubernetes=k)


@asynccontextmanager
async def watching() -> AsyncIterator[tuple[FakeKubeApi, PoolDiscovery, Fleet]]:
    async with running_kube_api() as (api, url):
        fleet = Fleet()
        disco = PoolDiscovery(settings(url), fleet.on_change, ModelProbe(1.0))
        disco.start()
        try:
            yield api, disco, fleet
        finally:
            await disco.close()


def selectors(calls: list[Any]) -> list[str]:
    """The label selectors of the pods' LISTs or WATCHes, in order."""
    return [q["labelSelector"] for q in calls if q["resource"] == "pods"]


def watches_of(api: FakeKubeApi, resource: str) -> list[Any]:
    return [w for w in api.watches if w["resource"] == resource]


async def test_the_pools_ready_pods_x_its_ports_are_engines_as_pods_come_and_go() -> None:
    async with running_kube_api() as (api, url):
        await api.put(inference_pool("qwen", SELECTOR, [8000]))
        await api.put(inference_pool("other", {"app": "other"}, [8000]))  # not ours
        await api.put(pod("vllm-0", "10.0.0.1", APP))
        fleet = Fleet()
        disco = PoolDiscovery(settings(url), fleet.on_change, ModelProbe(1.0))
        disco.start()
        try:
            await wait_for(lambda: holds(list(fleet.engines) == ["qwen/vllm-0"]))
            engine = fleet.engines["qwen/vllm-0"]
            assert (engine.url, engine.model, engine.events) == (
                "http://10.0.0.1:8000",
                "qwen",
                ["tcp://10.0.0.1:5557"],
            )
            lists = {q["resource"]: q for q in api.lists}
            assert lists["inferencepools"]["fieldSelector"] == "metadata.name=qwen"
            assert lists["pods"]["labelSelector"] == "app=vllm"
            await wait_for(lambda: holds(len(watches_of(api, "pods")) == 1 and api.open_watches == 2))

            await api.put(pod("vllm-1", "10.0.0.2", APP, ready=False))  # starting: not yet an engine
            await api.put(pod("stranger", "10.0.0.9", {"app": "other"}))  # not selected
            await api.put(pod("vllm-1", "10.0.0.2", APP))  # ready now
            await wait_for(lambda: holds(sorted(fleet.engines) == ["qwen/vllm-0", "qwen/vllm-1"]))
            await api.delete("vllm-0", "Pod")
            await wait_for(lambda: holds(list(fleet.engines) == ["qwen/vllm-1"]))
            assert fleet.calls == [(["qwen/vllm-0"], []), (["qwen/vllm-1"], []), ([], ["qwen/vllm-0"])]
            assert len(api.lists) == 2  # one LIST of each, then watched
        finally:
            await disco.close()


async def test_several_target_ports_are_one_engine_each_and_a_port_change_replaces_them() -> None:
    async with watching() as (api, _, fleet):
        await api.put(pod("vllm-0", "10.0.0.1", APP))
        await api.put(inference_pool("qwen", SELECTOR, [8000, 8001]))
        await wait_for(lambda: holds(sorted(fleet.engines) == ["qwen/vllm-0:8000", "qwen/vllm-0:8001"]))
        assert fleet.engines["qwen/vllm-0:8001"].events == ["tcp://10.0.0.1:5558"]  # rank 1's publisher
        await api.put(inference_pool("qwen", SELECTOR, [8000]))
        await wait_for(lambda: holds(list(fleet.engines) == ["qwen/vllm-0"]))


async def test_a_selector_change_keeps_the_pods_still_selected_and_drops_the_others() -> None:
    async with watching() as (api, _, fleet):
        await api.put(pod("a", "10.0.0.1", {**APP, "tier": "1"}))
        await api.put(pod("b", "10.0.0.2", {**APP, "tier": "2"}))
        await api.put(inference_pool("qwen", SELECTOR, [8000]))
        await wait_for(lambda: holds(sorted(fleet.engines) == ["qwen/a", "qwen/b"]))
        await api.put(inference_pool("qwen", {**SELECTOR, "tier": "1"}, [8000]))
        await wait_for(lambda: holds(list(fleet.engines) == ["qwen/a"]))
        assert fleet.calls[-1] == ([], ["qwen/b"])  # a was never removed
        # (b left at once: the pods known are filtered by the new selector until the new LIST is in)
        await wait_for(lambda: holds(selectors(api.lists) == ["app=vllm", "app=vllm,tier=1"]))
        await wait_for(lambda: holds(selectors(api.watches)[-1:] == ["app=vllm,tier=1"]))
        assert list(fleet.engines) == ["qwen/a"] and fleet.calls[-1] == ([], ["qwen/b"])


async def test_a_deleted_pool_is_no_engines_until_it_is_back() -> None:
    async with watching() as (api, disco, fleet):
        await api.put(pod("a", "10.0.0.1", APP))
        await api.put(inference_pool("qwen", SELECTOR, [8000]))
        await wait_for(lambda: holds(list(fleet.engines) == ["qwen/a"]))
        await api.delete("qwen", "InferencePool")
        await wait_for(lambda: holds(fleet.engines == {} and disco.pods is None))
        await api.put(inference_pool("qwen", SELECTOR, [8000]))
        await wait_for(lambda: holds(list(fleet.engines) == ["qwen/a"]))


async def test_410_gone_resyncs_the_pods_and_applies_only_the_difference() -> None:
    async with watching() as (api, disco, fleet):
        await api.put(inference_pool("qwen", SELECTOR, [8000]))
        await api.put(pod("a", "10.0.0.1", APP))
        await api.put(pod("b", "10.0.0.2", APP))
        await wait_for(lambda: holds(len(fleet.engines) == 2 and api.open_watches == 2))
        await api.end_watches()
        api.compact()
        await api.delete("b", "Pod")
        await api.put(pod("c", "10.0.0.3", APP))
        api.compact()
        await wait_for(lambda: holds(sorted(fleet.engines) == ["qwen/a", "qwen/c"]))
        assert disco.counts["resyncs"] >= 1
        assert all("qwen/a" not in removed for _, removed in fleet.calls)


async def test_bad_pools_and_pods_are_counted_rejections_and_discovery_goes_on() -> None:
    async with watching() as (api, disco, fleet):
        no_ports = inference_pool("qwen", SELECTOR, [])
        await api.put(no_ports)  # refused: the pool stays unknown
        await wait_for(lambda: holds(disco.counts["rejected"] == 1))
        await api.put(inference_pool("qwen", SELECTOR, [8000]))
        await api.put(pod("a", "10.0.0.1", APP))
        await api.put(pod("bad-ip", "10.0.0.256", APP))
        huge = pod("huge", "10.0.0.5", {**APP, "kvrouter.io/data-parallel-size": "100000000"})
        await api.put(huge)
        bad_labels = pod("bad-labels", "10.0.0.6", APP)
        bad_labels["metadata"]["labels"]["team"] = 5  # labels are strings
        await api.put(bad_labels)
        await api.put(pod("z", "10.0.0.9", APP))
        await wait_for(lambda: holds(sorted(fleet.engines) == ["qwen/a", "qwen/z"]))
        assert disco.counts["rejected"] == 4 and disco.counts["failures"] == 0
        broken = inference_pool("qwen", SELECTOR, [8000])
        broken["spec"]["targetPorts"] = [{"number": 70000}]
        await api.put(broken)  # refused: the pool keeps its last good state
        await wait_for(lambda: holds(disco.counts["rejected"] == 5))
        await api.put(pod("y", "10.0.0.10", APP))
        await wait_for(lambda: holds(sorted(fleet.engines) == ["qwen/a", "qwen/y", "qwen/z"]))
