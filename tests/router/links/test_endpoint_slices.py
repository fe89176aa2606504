"""EndpointSlices -> the engine set (pure): readiness, ports, models, pools, IPv6, dual stack, changes."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from router.links.endpoint_slices import (
    DATA_PARALLEL_LABEL,
    MAX_DATA_PARALLEL,
    EndpointSlice,
    SliceSet,
    changes,
    check_slice,
    engines_from_slices,
    label_selector,
)
from router.settings.config import Discovery, EngineConfig, KubernetesDiscovery
from tests.kube_api import endpoint, endpoint_slice

PORTS = {"http": 8000, "kv-events": 5557, "kv-replay": 5558}
DISCOVERY = Discovery(kubernetes=KubernetesDiscovery(services=["qwen"]), model="", events_port=None)


def slices(*objs: dict[str, Any]) -> list[EndpointSlice]:
    return [msgspec.convert(o, EndpointSlice) for o in objs]


def engines(*objs: dict[str, Any], discovery: Discovery = DISCOVERY) -> dict[str, EngineConfig]:
    return engines_from_slices(discovery, slices(*objs))


def test_each_ready_endpoint_is_an_engine_named_for_its_service_and_pod() -> None:
    qwen = endpoint_slice(
        "qwen-abc", "qwen", [endpoint("10.0.0.1", "vllm-0"), endpoint("10.0.0.2", "vllm-1")],
        ports=PORTS, labels={"kvrouter.io/model": "qwen2.5-7b"},
    )  # fmt: skip
    assert engines(qwen) == {
        "qwen/vllm-0": EngineConfig(
            name="qwen/vllm-0", url="http://10.0.0.1:8000", model="qwen2.5-7b",
            events=["tcp://10.0.0.1:5557"], replay=["tcp://10.0.0.1:5558"],
        ),
        "qwen/vllm-1": EngineConfig(
            name="qwen/vllm-1", url="http://10.0.0.2:8000", model="qwen2.5-7b",
            events=["tcp://10.0.0.2:5557"], replay=["tcp://10.0.0.2:5558"],
        ),
    }  # fmt: skip


@pytest.mark.parametrize(
    ("ready", "terminating", "included"),
    [
        (True, None, True),
        (None, None, True),  # the API: an unknown state is read as ready
        (False, None, False),
        (True, False, True),
        (None, True, False),  # terminating: no new requests, even when a controller left ready unset
        (False, True, False),
        (True, True, False),  # publishNotReadyAddresses-style overrides still drain a terminating pod
    ],
)
def test_readiness_conditions(ready: bool | None, terminating: bool | None, included: bool) -> None:
    obj = endpoint_slice("s", "qwen", [endpoint("10.0.0.1", "p", ready=ready, terminating=terminating)])
    assert bool(engines(obj)) is included


def test_an_endpoint_without_addresses_or_a_slice_without_endpoints_is_nothing() -> None:
    empty = endpoint_slice("a", "qwen", [])
    empty["endpoints"] = None  # the API writes null for a Service with no pods
    no_address = endpoint_slice("b", "qwen", [{"addresses": [], "conditions": {"ready": True}}])
    assert engines(empty, no_address) == {}


def test_ports_named_first_then_annotations_then_the_discovery_defaults() -> None:
    defaults = Discovery(
        kubernetes=KubernetesDiscovery(services=["x"]), port=9000, events_port=6000, replay_port=None
    )
    named = endpoint_slice("a", "named", [endpoint("10.0.0.1", "p")], ports={"http": 8001, "kv-events": 7001})
    annotated = endpoint_slice(
        "b", "annotated", [endpoint("10.0.0.2", "p")], ports={"web": 8080},
        annotations={"kvrouter.io/http-port": "8002", "kvrouter.io/events-port": "7002",
                     "kvrouter.io/replay-port": "7003"},
    )  # fmt: skip
    bad = endpoint_slice(
        "c",
        "bad",
        [endpoint("10.0.0.3", "p")],
        annotations={"kvrouter.io/http-port": "http", "kvrouter.io/events-port": "0"},
    )
    found = engines(named, annotated, bad, discovery=defaults)
    assert found["named/p"].url == "http://10.0.0.1:8001" and found["named/p"].events == [
        "tcp://10.0.0.1:7001"
    ]
    assert found["named/p"].replay == []
    assert found["annotated/p"].url == "http://10.0.0.2:8002"
    assert found["annotated/p"].events == ["tcp://10.0.0.2:7002"]
    assert found["annotated/p"].replay == ["tcp://10.0.0.2:7003"]
    assert found["bad/p"].url == "http://10.0.0.3:9000" and found["bad/p"].events == ["tcp://10.0.0.3:6000"]


def test_the_port_names_are_configurable() -> None:
    k = KubernetesDiscovery(
        services=["x"], http_port_name="api", events_port_name="zmq", replay_port_name="zmq-replay"
    )
    obj = endpoint_slice("a", "x", [endpoint("10.0.0.1", "p")], ports={"api": 1, "zmq": 2, "zmq-replay": 3})
    e = engines(obj, discovery=Discovery(kubernetes=k))["x/p"]
    assert (e.url, e.events, e.replay) == ("http://10.0.0.1:1", ["tcp://10.0.0.1:2"], ["tcp://10.0.0.1:3"])


def test_no_events_port_means_no_subscription_and_no_replay() -> None:
    obj = endpoint_slice("a", "x", [endpoint("10.0.0.1", "p")], ports={"http": 8000, "kv-replay": 5558})
    e = engines(obj)["x/p"]
    assert e.events == [] and e.replay == []


def test_several_pools_one_model_each_and_the_model_fallbacks() -> None:
    qwen = endpoint_slice("q", "qwen", [endpoint("10.0.0.1", "a")], labels={"kvrouter.io/model": "qwen"})
    llama = endpoint_slice("l", "llama", [endpoint("10.0.0.2", "b")], labels={"kvrouter.io/model": "llama"})
    unlabelled = endpoint_slice("u", "other", [endpoint("10.0.0.3", "c")])
    assert {n: e.model for n, e in engines(qwen, llama, unlabelled).items()} == {
        "llama/b": "llama", "other/c": "", "qwen/a": "qwen",  # "": asked from the engine's /v1/models
    }  # fmt: skip
    fixed = Discovery(kubernetes=KubernetesDiscovery(services=["x"], model_label="m"), model="fixed")
    assert {e.model for e in engines(qwen, unlabelled, discovery=fixed).values()} == {"fixed"}


def test_ipv6_addresses_are_bracketed_in_urls_and_endpoints() -> None:
    obj = endpoint_slice("v6", "qwen", [endpoint("fd00::1", "p")], ports=PORTS, address_type="IPv6")
    e = engines(obj)["qwen/p"]
    assert e.url == "http://[fd00::1]:8000"
    assert e.events == ["tcp://[fd00::1]:5557"] and e.replay == ["tcp://[fd00::1]:5558"]
    loopback = endpoint_slice("v6", "qwen", [endpoint("::1", "p")], ports=PORTS, address_type="IPv6")
    assert engines(loopback)["qwen/p"].events == ["tcp://[::1]:5557"]


def test_a_dual_stack_pod_is_one_engine_of_the_preferred_address_type() -> None:
    v4 = endpoint_slice("qwen-v4", "qwen", [endpoint("10.0.0.1", "p")], ports=PORTS)
    v6 = endpoint_slice("qwen-v6", "qwen", [endpoint("fd00::1", "p")], ports=PORTS, address_type="IPv6")
    assert engines(v6, v4)["qwen/p"].url == "http://10.0.0.1:8000"
    prefer_v6 = Discovery(kubernetes=KubernetesDiscovery(services=["qwen"], address_types=["IPv6", "IPv4"]))
    assert engines(v4, v6, discovery=prefer_v6)["qwen/p"].url == "http://[fd00::1]:8000"
    only_v6 = Discovery(kubernetes=KubernetesDiscovery(services=["qwen"], address_types=["IPv6"]))
    assert list(engines(v4, discovery=only_v6)) == []


def test_a_pod_moving_between_slices_is_one_engine_and_fqdn_and_unnamed_endpoints_work() -> None:
    a = endpoint_slice("qwen-a", "qwen", [endpoint("10.0.0.1", "p")])
    b = endpoint_slice("qwen-b", "qwen", [endpoint("10.0.0.1", "p")])
    assert list(engines(b, a)) == ["qwen/p"]
    fqdn = endpoint_slice(
        "f", "ext", [{"addresses": ["vllm.example.internal"], "conditions": {}}], address_type="FQDN"
    )
    no_pod = endpoint_slice("n", "bare", [{"addresses": ["10.0.0.9"], "hostname": "h0"}])
    found = engines(fqdn, no_pod)
    assert found["ext/vllm.example.internal"].url == "http://vllm.example.internal:8000"
    assert found["bare/h0"].url == "http://10.0.0.9:8000"


def test_a_slice_without_the_service_label_is_named_for_itself() -> None:
    obj = endpoint_slice("custom", "x", [endpoint("10.0.0.1", "p")])
    del obj["metadata"]["labels"]["kubernetes.io/service-name"]
    assert list(engines(obj)) == ["custom/p"]


def test_unknown_fields_are_ignored_and_a_malformed_slice_is_a_validation_error() -> None:
    obj = endpoint_slice("a", "x", [endpoint("10.0.0.1", "p")])
    obj["endpoints"][0]["zone"] = "z1"
    obj["endpoints"][0]["hints"] = {"forZones": [{"name": "z1"}]}
    obj["newField"] = {"x": 1}
    assert list(engines(obj)) == ["x/p"]
    del obj["addressType"]
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(obj, EndpointSlice)


@pytest.mark.parametrize(
    ("services", "selector", "expected"),
    [
        (["qwen"], "", "kubernetes.io/service-name=qwen"),
        (["qwen", "llama"], "", "kubernetes.io/service-name in (llama,qwen)"),
        ([], "app.kubernetes.io/part-of=vllm", "app.kubernetes.io/part-of=vllm"),
        (["qwen"], "tier=gpu", "kubernetes.io/service-name=qwen,tier=gpu"),
    ],
)
def test_the_label_selector(services: list[str], selector: str, expected: str) -> None:
    k = KubernetesDiscovery(services=services, label_selector=selector)
    assert label_selector(Discovery(kubernetes=k)) == expected


def test_the_slice_set_follows_list_and_watch_events() -> None:
    state = SliceSet()
    a, b = slices(endpoint_slice("a", "x", []), endpoint_slice("b", "x", []))
    state.replace([a], "10")
    assert list(state.objects) == [("llm", "a")] and state.resource_version == "10"
    b11 = msgspec.structs.replace(b, metadata=msgspec.structs.replace(b.metadata, resource_version="11"))
    state.apply("ADDED", b11)
    assert sorted(state.objects) == [("llm", "a"), ("llm", "b")] and state.resource_version == "11"
    state.apply("DELETED", a)
    state.apply("DELETED", a)  # a second delete of a gone slice changes nothing
    assert list(state.objects) == [("llm", "b")] and state.resource_version == "11"
    with pytest.raises(ValueError, match="unexpected watch event type"):
        state.apply("ERROR", a)
    state.replace([], "20")
    assert state.objects == {} and state.resource_version == "20"


def test_changes_remove_then_add_an_engine_whose_table_changed() -> None:
    old = EngineConfig(name="x/p", url="http://10.0.0.1:8000")
    moved = EngineConfig(name="x/p", url="http://10.0.0.7:8000")
    kept = EngineConfig(name="x/q", url="http://10.0.0.2:8000")
    new = EngineConfig(name="x/r", url="http://10.0.0.3:8000")
    added, removed = changes({"x/p": old, "x/q": kept}, {"x/p": moved, "x/q": kept, "x/r": new})
    assert added == {"x/p": moved, "x/r": new} and removed == {"x/p"}
    assert changes({"x/q": kept}, {}) == ({}, {"x/q"})
    assert changes({"x/q": kept}, {"x/q": kept}) == ({}, set())


def test_a_data_parallel_pool_gets_one_event_endpoint_per_rank_at_vllms_offsets() -> None:
    labels = {"kvrouter.io/model": "m", "kvrouter.io/data-parallel-size": "3"}
    obj = endpoint_slice("dp", "dp", [endpoint("10.0.0.1", "p")], ports={"http": 8000, "kv-events": 5557,
                         "kv-replay": 5600}, labels=labels)  # fmt: skip
    e = engines(obj)["dp/p"]
    assert e.events == ["tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558", "tcp://10.0.0.1:5559"]
    assert e.replay == ["tcp://10.0.0.1:5600", "tcp://10.0.0.1:5601", "tcp://10.0.0.1:5602"]
    assert e.replica_ids() == ["dp/p/dp0", "dp/p/dp1", "dp/p/dp2"]
    for bad in ("0", "x", ""):
        labels["kvrouter.io/data-parallel-size"] = bad
        obj["metadata"]["labels"] = {**obj["metadata"]["labels"], **labels}
        assert len(engines(obj)["dp/p"].events) == 1  # not a positive count: one rank


@pytest.mark.parametrize(
    ("address", "labels", "ports", "error"),
    [
        ("10.0.0.1; rm -rf", {}, {}, "not an IPv4 address"),
        ("10.0.0.1", {DATA_PARALLEL_LABEL: str(MAX_DATA_PARALLEL + 1)}, {}, "over"),
        ("10.0.0.1", {DATA_PARALLEL_LABEL: "8"}, {"kv-events": 65530}, "pass 65535"),
    ],
)
def test_a_slice_whose_engines_cannot_be_made_is_refused(
    address: str, labels: dict[str, str], ports: dict[str, int], error: str
) -> None:
    (good,) = slices(endpoint_slice("q", "qwen", [endpoint("10.0.0.1", "p")], ports={"http": 8000}))
    check_slice(DISCOVERY, good)
    bad = endpoint_slice("q", "qwen", [endpoint(address, "p")], ports={"http": 8000, **ports}, labels=labels)
    with pytest.raises(ValueError, match=error):
        check_slice(DISCOVERY, slices(bad)[0])


def test_a_port_out_of_range_is_a_validation_error() -> None:
    with pytest.raises(msgspec.ValidationError):
        slices(endpoint_slice("q", "qwen", [endpoint("10.0.0.1", "p")], ports={"http": 70000}))
