"""The pure InferencePool rules: which pods are engines, on which ports, with which event endpoints."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from router.links.inference_pool import (
    InferencePool,
    Pod,
    check_pod,
    check_pool,
    engines_from_pool,
    pool_selector,
)
from router.settings.config import Discovery, KubernetesDiscovery
from tests.kube_api import inference_pool, pod

APP = {"app": "vllm"}
DISCOVERY = Discovery(
    events_port=5557, replay_port=5600, kubernetes=KubernetesDiscovery(inference_pool="qwen")
)


def as_pool(obj: dict[str, Any]) -> InferencePool:
    return msgspec.convert(obj, InferencePool)


def as_pod(obj: dict[str, Any]) -> Pod:
    return msgspec.convert(obj, Pod)


def test_each_ready_pod_x_each_target_port_is_an_engine_with_its_rank_s_event_ports() -> None:
    pool = as_pool(inference_pool("qwen", APP, [8000, 8001]))
    pods = [
        as_pod(pod("vllm-0", "10.0.0.1", {**APP, "kvrouter.io/model": "qwen"})),
        as_pod(pod("vllm-1", "10.0.0.2", APP, ready=False)),  # not Ready: no engine
        as_pod(pod("vllm-2", "10.0.0.3", APP, phase="Pending")),
        as_pod(pod("other", "10.0.0.4", {"app": "other"})),  # not selected
    ]
    engines = engines_from_pool(DISCOVERY, pool, pods)
    assert list(engines) == ["qwen/vllm-0:8000", "qwen/vllm-0:8001"]
    first, second = engines.values()
    assert (first.url, first.model, first.events, first.replay) == (
        "http://10.0.0.1:8000", "qwen", ["tcp://10.0.0.1:5557"], ["tcp://10.0.0.1:5600"],
    )  # fmt: skip
    assert (second.url, second.events, second.replay) == (
        "http://10.0.0.1:8001", ["tcp://10.0.0.1:5558"], ["tcp://10.0.0.1:5601"],
    )  # fmt: skip


def test_one_port_names_the_engine_by_pod_and_annotations_and_ranks_as_for_slices() -> None:
    pool = as_pool(inference_pool("qwen", APP, [8000]))
    labels = {**APP, "kvrouter.io/data-parallel-size": "2"}
    annotations = {"kvrouter.io/events-port": "6000"}
    engines = engines_from_pool(
        DISCOVERY, pool, [as_pod(pod("vllm-0", "fd00::1", labels, annotations=annotations))]
    )
    [(name, engine)] = engines.items()
    assert name == "qwen/vllm-0" and engine.url == "http://[fd00::1]:8000" and engine.model == ""
    assert engine.events == ["tcp://[fd00::1]:6000", "tcp://[fd00::1]:6001"]
    assert engine.replay == ["tcp://[fd00::1]:5600", "tcp://[fd00::1]:5601"]


def test_without_an_events_port_no_subscription() -> None:
    pool = as_pool(inference_pool("qwen", APP, [8000]))
    quiet = Discovery(events_port=None, kubernetes=KubernetesDiscovery(inference_pool="qwen"))
    [engine] = engines_from_pool(quiet, pool, [as_pod(pod("vllm-0", "10.0.0.1", APP))]).values()
    assert engine.events == [] and engine.replay == []


def test_the_selector_is_the_pools_match_labels() -> None:
    assert pool_selector(as_pool(inference_pool("p", {"b": "2", "a": "1"}, [8000]))) == "a=1,b=2"


@pytest.mark.parametrize(
    ("selector", "ports", "error"),
    [
        (APP, [], "targetPorts is empty"),
        (APP, list(range(8000, 8009)), "at most 8"),
        (APP, [8000, 8000], "repeat"),
        ({}, [8000], "would select every pod"),
        ({"app": "a,b"}, [8000], "is not a label"),
    ],
)
def test_a_pool_that_cannot_name_engines_is_refused(
    selector: dict[str, str], ports: list[int], error: str
) -> None:
    with pytest.raises(ValueError, match=error):
        check_pool(as_pool(inference_pool("p", selector, ports)))


def test_a_port_out_of_range_does_not_decode() -> None:
    with pytest.raises(msgspec.ValidationError):
        as_pool(inference_pool("p", APP, [70000]))


def test_a_serving_pod_whose_engines_cannot_be_made_is_refused_and_one_not_serving_is_not() -> None:
    with pytest.raises(ValueError, match="not an IP address"):
        check_pod(DISCOVERY, as_pod(pod("bad", "not-an-ip", APP)))
    with pytest.raises(ValueError, match="pass 65535"):
        check_pod(
            DISCOVERY, as_pod(pod("high", "10.0.0.1", APP, annotations={"kvrouter.io/events-port": "65530"}))
        )
    check_pod(DISCOVERY, as_pod(pod("pending", "", APP, phase="Pending")))  # no IP yet: fine, not an engine


def test_a_pool_with_services_or_a_selector_is_a_config_error() -> None:
    for other in ({"services": ["s"]}, {"label_selector": "app=x"}):
        with pytest.raises(msgspec.ValidationError, match="inference_pool names the engines alone"):
            msgspec.convert({"inference_pool": "p", **other}, KubernetesDiscovery)
    assert KubernetesDiscovery(inference_pool="p").enabled
