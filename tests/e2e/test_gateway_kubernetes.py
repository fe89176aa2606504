"""A gateway that finds its engines through a (fake) Kubernetes API: discovers stubs, routes, drops one."""

from __future__ import annotations

from urllib.parse import urlsplit

from events.config import KVEventsConfig
from router.core.ids import EngineId
from router.settings.config import Discovery, EngineConfig, KubernetesDiscovery, PolicyConfig
from tests.gateway_helpers import (
    engine_of,
    gateway_config,
    mirrors_caught_up,
    running_gateway,
    running_stubs,
    wait_for,
)
from tests.kube_api import endpoint, endpoint_slice, running_kube_api
from tests.stub_helpers import stub_config

BODY = {"model": "kvrouter-stub", "prompt": "the quick brown fox " * 8, "max_tokens": 3}


def slice_for(pod: str, engine: EngineConfig, *, ready: bool = True) -> dict[str, object]:
    """The slice of one stub: pods whose target ports differ are in different slices of one Service."""
    ports = {
        "http": urlsplit(engine.url).port or 0,
        "kv-events": urlsplit(engine.events[0]).port or 0,
        "kv-replay": urlsplit(engine.replay[0]).port or 0,
    }
    return endpoint_slice(
        f"stubs-{pod}", "stubs", [endpoint("127.0.0.1", pod, ready=ready)], ports=ports,
        labels={"kvrouter.io/model": "kvrouter-stub"},
    )  # fmt: skip


async def test_the_gateway_routes_to_discovered_pods_and_drops_a_removed_one() -> None:
    async with running_stubs(2) as stubs, running_kube_api() as (api, url):
        engines = [engine_of("unused", s) for s in stubs]
        await api.put(slice_for("vllm-0", engines[0]))
        await api.put(slice_for("vllm-1", engines[1]))
        kube = KubernetesDiscovery(services=["stubs"], namespace="llm", api_url=url, backoff_s=0.01)
        session = PolicyConfig(name="session", trust_silence_s=30.0)
        config = gateway_config([], discovery=Discovery(kubernetes=kube), policy=session)
        async with running_gateway(config) as gw:

            async def names() -> list[str]:
                return sorted(e.name for e in gw.parts.fleet.engines())

            async def discovered() -> bool:
                return await names() == ["stubs/vllm-0", "stubs/vllm-1"]

            await wait_for(discovered)
            assert gw.parts.fleet.replica(EngineId("stubs/vllm-0")).engine.events == engines[0].events
            pinned = await gw.client.post("/v1/completions", json=BODY, headers={"x-session-id": "s1"})
            assert pinned.status_code == 200
            first = pinned.headers["x-kvrouter-engine"]
            assert first in ("stubs/vllm-0", "stubs/vllm-1")
            subscriber = gw.parts.links.subscriber(EngineId(first))
            assert subscriber is not None
            assert f'kvrouter_requests_total{{engine="{first}"' in (await gw.client.get("/metrics")).text

            # The pinned pod turns not-ready: it leaves the fleet, its subscriber, mirror and pin with it.
            pod = first.rpartition("/")[2]
            await api.put(slice_for(pod, engines[int(pod[-1])], ready=False))

            async def dropped() -> bool:
                return first not in await names()

            await wait_for(dropped)
            assert gw.parts.links.subscriber(EngineId(first)) is None
            assert f'engine="{first}"' not in (await gw.client.get("/metrics")).text  # its series left too
            (other,) = await names()
            for _ in range(3):
                answer = await gw.client.post("/v1/completions", json=BODY, headers={"x-session-id": "s1"})
                assert answer.status_code == 200 and answer.headers["x-kvrouter-engine"] == other

            # It comes back ready: a fresh engine, a new subscriber.
            await api.put(slice_for(pod, engines[int(pod[-1])]))
            await wait_for(discovered)
            again = gw.parts.links.subscriber(EngineId(first))
            assert again is not None and again is not subscriber
            await api.delete(f"stubs-{other.rpartition('/')[2]}")

            async def only_first() -> bool:
                return await names() == [first]

            await wait_for(only_first)
            answer = await gw.client.post("/v1/completions", json=BODY)
            assert answer.status_code == 200 and answer.headers["x-kvrouter-engine"] == first
            text = (await gw.client.get("/metrics")).text
            assert 'kvrouter_discovery_operations_total{kind="lists"} 1.0' in text
            assert 'kvrouter_discovery_operations_total{kind="events"} 3.0' in text
            assert 'kvrouter_discovery_operations_total{kind="failures"} 0.0' in text
            assert 'kvrouter_discovery_model_probe_errors_total{reason="connection"} 0.0' in text


async def test_an_ipv6_pod_is_discovered_mirrored_and_routed_to() -> None:
    v6_events = KVEventsConfig(
        enable_kv_cache_events=True, endpoint="tcp://[::1]:0", replay_endpoint="tcp://[::1]:0"
    )
    async with running_stubs(1, stub_config(host="::1", host_ip="::1", kv_events=v6_events)) as stubs:
        info = stubs[0].info
        assert info is not None
        source = info.kv_event_sources[0]
        assert source.endpoint.startswith("tcp://[::1]:") and source.replay_endpoint is not None
        ports = {
            "http": stubs[0].port,
            "kv-events": int(source.endpoint.rpartition(":")[2]),
            "kv-replay": int(source.replay_endpoint.rpartition(":")[2]),
        }
        v6 = endpoint_slice(
            "v6", "stubs", [endpoint("::1", "vllm-0")], ports=ports, address_type="IPv6",
            labels={"kvrouter.io/model": "kvrouter-stub"},
        )  # fmt: skip
        async with running_kube_api() as (api, url):
            await api.put(v6)
            kube = KubernetesDiscovery(services=["stubs"], namespace="llm", api_url=url, backoff_s=0.01)
            async with running_gateway(gateway_config([], discovery=Discovery(kubernetes=kube))) as gw:

                async def found() -> bool:
                    return [e.name for e in gw.parts.fleet.engines()] == ["stubs/vllm-0"]

                await wait_for(found)
                engine = gw.parts.fleet.replica(EngineId("stubs/vllm-0")).engine
                assert engine.url == f"http://[::1]:{stubs[0].port}"
                assert engine.events == [f"tcp://[::1]:{ports['kv-events']}"]
                answer = await gw.client.post("/v1/completions", json=BODY)
                assert answer.status_code == 200 and answer.headers["x-kvrouter-engine"] == "stubs/vllm-0"
                await wait_for(mirrors_caught_up(gw, {"stubs/vllm-0": stubs[0]}))  # events over IPv6
