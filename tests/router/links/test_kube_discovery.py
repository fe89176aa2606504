"""The list/watch loop against a fake Kubernetes API on 127.0.0.1: watch, resume, 410, bookmarks, flaps."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from kubernetes_asyncio.client import ApiClient

from router.edge.model_probe import ModelProbe
from router.links.kube_discovery import KubeDiscovery, api_client, namespace_of
from router.settings.config import Discovery, EngineConfig, KubernetesDiscovery
from tests.gateway_helpers import fake_engine, wait_for
from tests.kube_api import FakeKubeApi, Fleet, endpoint, endpoint_slice, running_kube_api
from tests.kube_api import holds as _true

PORTS = {"http": 8000, "kv-events": 5557}
MODEL = {"kvrouter.io/model": "qwen"}


def settings(url: str) -> Discovery:
    k = KubernetesDiscovery(services=["qwen"], namespace="llm", api_url=url, backoff_s=0.01)
    return Discovery(kubernetes=k)


@asynccontextmanager
async def discovering(
    discovery: Discovery,
    client: ApiClient | None = None,
    fleet: Fleet | None = None,
    probe: ModelProbe | None = None,
) -> AsyncIterator[tuple[KubeDiscovery, Fleet]]:
    """A started `KubeDiscovery` feeding `fleet` (a new one by default), asking engines their models
    with `probe` (by default the gateway's, on its own HTTP client), closed on the way out."""
    fleet = fleet or Fleet()
    probe = probe or ModelProbe(discovery.kubernetes.model_timeout_s)
    disco = KubeDiscovery(discovery, fleet.on_change, probe, client)
    disco.start()
    try:
        yield disco, fleet
    finally:
        await disco.close()


@asynccontextmanager
async def watching() -> AsyncIterator[tuple[FakeKubeApi, KubeDiscovery, Fleet]]:
    async with running_kube_api() as (api, url), discovering(settings(url)) as (disco, fleet):
        yield api, disco, fleet


def qwen(*endpoints: dict[str, Any], name: str = "qwen-1") -> dict[str, Any]:
    return endpoint_slice(name, "qwen", list(endpoints), ports=PORTS, labels=MODEL)


async def test_list_then_watch_adds_and_removes_engines_as_pods_come_and_go() -> None:
    async with running_kube_api() as (api, url):
        await api.put(qwen(endpoint("10.0.0.1", "vllm-0")))
        await api.put(endpoint_slice("other", "llama", [endpoint("10.0.0.9", "x")], labels=MODEL))
        async with discovering(settings(url)) as (_, fleet):
            await wait_for(lambda: _has(fleet, "qwen/vllm-0"))
            assert api.lists[0]["labelSelector"] == "kubernetes.io/service-name=qwen"
            await wait_for(lambda: _true(api.open_watches == 1))
            watch = api.watches[0]
            assert watch["resourceVersion"] == "102" and watch["allowWatchBookmarks"] in ("true", "True")
            assert int(watch["timeoutSeconds"]) == 300
            assert fleet.engines["qwen/vllm-0"].events == ["tcp://10.0.0.1:5557"]

            await api.put(qwen(endpoint("10.0.0.1", "vllm-0"), endpoint("10.0.0.2", "vllm-1")))
            await wait_for(lambda: _true(sorted(fleet.engines) == ["qwen/vllm-0", "qwen/vllm-1"]))
            await api.put(qwen(endpoint("10.0.0.2", "vllm-1")))
            await wait_for(lambda: _true(sorted(fleet.engines) == ["qwen/vllm-1"]))
            await api.delete("qwen-1")
            await wait_for(lambda: _true(fleet.engines == {}))
            assert len(api.lists) == 1 and len(api.watches) == 1  # watched, never polled
            assert "llama" not in str(fleet.calls)  # another Service's slices are not selected


async def test_a_watch_the_server_ends_is_resumed_from_the_last_version() -> None:
    async with watching() as (api, disco, fleet):
        await api.put(qwen(endpoint("10.0.0.1", "a")))
        await wait_for(lambda: _has(fleet, "qwen/a"))
        await wait_for(lambda: _true(api.open_watches == 1))
        seen = api.version
        await api.end_watches()
        await wait_for(lambda: _true(len(api.watches) == 2 and api.open_watches == 1))
        assert api.watches[1]["resourceVersion"] == str(seen)
        await api.put(qwen(endpoint("10.0.0.1", "a"), endpoint("10.0.0.2", "b")))
        await wait_for(lambda: _has(fleet, "qwen/b"))
        assert len(api.lists) == 1 and disco.counts["resyncs"] == 0
        assert fleet.calls == [(["qwen/a"], []), (["qwen/b"], [])]  # nothing re-added by the restart


async def test_410_gone_means_a_full_resync_that_applies_only_the_difference() -> None:
    async with watching() as (api, disco, fleet):
        await api.put(qwen(endpoint("10.0.0.1", "a"), endpoint("10.0.0.2", "b")))
        await wait_for(lambda: _true(len(fleet.engines) == 2))
        await wait_for(lambda: _true(api.open_watches == 1))
        # While the router is disconnected, b leaves and c comes, and the history is compacted.
        await api.end_watches()
        api.compact()
        await api.put(qwen(endpoint("10.0.0.1", "a"), endpoint("10.0.0.3", "c")))
        api.compact()
        await wait_for(lambda: _true(sorted(fleet.engines) == ["qwen/a", "qwen/c"]))
        assert disco.counts["resyncs"] >= 1 and len(api.lists) >= 2
        assert fleet.calls[-1] == (["qwen/c"], ["qwen/b"])  # a stays, its mirror and pins with it
        assert all("qwen/a" not in removed for _, removed in fleet.calls)


async def test_bookmarks_move_the_resume_version_without_changing_engines() -> None:
    async with watching() as (api, disco, fleet):
        await api.put(qwen(endpoint("10.0.0.1", "a")))
        await wait_for(lambda: _has(fleet, "qwen/a"))
        await api.put(endpoint_slice("x", "llama", [endpoint("10.0.0.9", "x")]))  # not ours: not sent
        await api.bookmark()
        await wait_for(lambda: _true(disco.counts["bookmarks"] == 1))
        assert disco.slices.resource_version == str(api.version)
        calls = list(fleet.calls)
        await wait_for(lambda: _true(api.open_watches == 1))
        api.compact()  # the history before the bookmark is gone: resuming from it needs no LIST
        await api.end_watches()
        await wait_for(lambda: _true(len(api.watches) == 2 and api.open_watches == 1))
        assert api.watches[1]["resourceVersion"] == str(api.version)
        assert len(api.lists) == 1 and disco.counts["resyncs"] == 0 and fleet.calls == calls


async def test_a_pod_that_flaps_is_removed_and_added_each_time_and_nothing_accumulates() -> None:
    async with watching() as (api, disco, fleet):
        await api.put(qwen(endpoint("10.0.0.1", "a"), endpoint("10.0.0.2", "b")))
        await wait_for(lambda: _true(len(fleet.engines) == 2))
        for _ in range(5):
            await api.put(qwen(endpoint("10.0.0.1", "a"), endpoint("10.0.0.2", "b", ready=False)))
            await wait_for(lambda: _true(list(fleet.engines) == ["qwen/a"]))
            await api.put(qwen(endpoint("10.0.0.1", "a"), endpoint("10.0.0.2", "b", ready=True)))
            await wait_for(lambda: _true(len(fleet.engines) == 2))
        assert fleet.calls[1:] == [([], ["qwen/b"]), (["qwen/b"], [])] * 5
        assert disco.present == {"qwen/a", "qwen/b"} and len(disco.known) == 2
        # A terminating pod (rolling update) leaves before it is gone.
        await api.put(
            qwen(endpoint("10.0.0.1", "a"), endpoint("10.0.0.2", "b", ready=False, terminating=True))
        )
        await wait_for(lambda: _true(list(fleet.engines) == ["qwen/a"]))


async def test_a_recreated_pod_with_a_new_address_is_replaced() -> None:
    async with watching() as (api, _, fleet):
        await api.put(qwen(endpoint("10.0.0.1", "vllm-0")))
        await wait_for(lambda: _has(fleet, "qwen/vllm-0"))
        await api.put(qwen(endpoint("10.0.0.5", "vllm-0")))  # a StatefulSet pod back with a new IP
        await wait_for(lambda: _true(fleet.engines.get("qwen/vllm-0", EngineConfig(name="", url="")).url
                                     == "http://10.0.0.5:8000"))  # fmt: skip
        assert fleet.calls[-1] == (["qwen/vllm-0"], ["qwen/vllm-0"])


async def test_an_unreachable_api_is_retried_with_backoff_and_the_engines_are_kept() -> None:
    async with running_kube_api() as (api, url):
        await api.put(qwen(endpoint("10.0.0.1", "a")))
        fleet = Fleet()
        disco = KubeDiscovery(settings(url), fleet.on_change, ModelProbe(1.0))
        disco.start()
        await wait_for(lambda: _has(fleet, "qwen/a"))
    # The server is gone: the loop counts failures, keeps what it knew, and keeps trying.
    try:
        await wait_for(lambda: _true(disco.counts["failures"] >= 2))
        assert list(fleet.engines) == ["qwen/a"]
    finally:
        await disco.close()


async def test_a_bad_slice_is_a_counted_rejection_and_the_watch_goes_past_it() -> None:
    async with watching() as (api, disco, fleet):
        await api.put(qwen(endpoint("10.0.0.1", "a")))
        await wait_for(lambda: _has(fleet, "qwen/a"))
        broken = qwen(endpoint("10.0.0.2", "b"), name="qwen-2")
        del broken["addressType"]
        await api.put(broken)
        await wait_for(lambda: _true(disco.counts["rejected"] == 1))
        await api.put(qwen(endpoint("10.0.0.3", "c"), name="qwen-3"))
        await wait_for(lambda: _has(fleet, "qwen/c"))
        assert list(fleet.engines) == ["qwen/a", "qwen/c"] and disco.counts["failures"] == 0


def bad_slices() -> list[dict[str, Any]]:
    """Slices the decoder or `check_slice` refuses, each for another reason."""
    no_type = qwen(endpoint("10.0.0.2", "b"), name="qwen-2")
    del no_type["addressType"]
    bad_label = qwen(endpoint("10.0.0.3", "c"), name="qwen-3")
    bad_label["metadata"]["labels"]["team"] = 5  # labels are strings: ObjectMeta refuses it
    bad_port = endpoint_slice(
        "qwen-4", "qwen", [endpoint("10.0.0.4", "d")], ports={"http": 70000}, labels=MODEL
    )
    bad_address = qwen(endpoint("10.0.0.5:80", "e"), name="qwen-5")
    many_ranks = qwen(endpoint("10.0.0.6", "f"), name="qwen-6")
    many_ranks["metadata"]["labels"]["kvrouter.io/data-parallel-size"] = "100000000"
    return [no_type, bad_label, bad_port, bad_address, many_ranks]


async def test_bad_slices_in_a_list_are_left_out_counted_and_the_others_discovered() -> None:
    async with running_kube_api() as (api, url):
        await api.put(qwen(endpoint("10.0.0.1", "a")))
        for bad in bad_slices():
            await api.put(bad)
        await api.put(qwen(endpoint("10.0.0.9", "z"), name="qwen-9"))
        async with discovering(settings(url)) as (disco, fleet):
            await wait_for(lambda: _true(api.open_watches == 1))  # listed, and watching
            assert list(fleet.engines) == ["qwen/a", "qwen/z"]
            assert disco.counts["rejected"] == 5 and disco.counts["failures"] == 0
            await api.put(qwen(endpoint("10.0.0.10", "y"), name="qwen-10"))
            await wait_for(lambda: _has(fleet, "qwen/y"))


async def test_bad_slices_in_a_watch_are_passed_and_discovery_goes_on() -> None:
    async with watching() as (api, disco, fleet):
        await api.put(qwen(endpoint("10.0.0.1", "a")))
        await wait_for(lambda: _has(fleet, "qwen/a"))
        for bad in bad_slices():
            await api.put(bad)
        await api.put(qwen(endpoint("10.0.0.9", "z"), name="qwen-9"))
        await wait_for(lambda: _has(fleet, "qwen/z"))
        assert list(fleet.engines) == ["qwen/a", "qwen/z"]
        assert disco.counts["rejected"] == 5 and disco.counts["failures"] == 0
        assert disco.slices.resource_version == str(api.version)


async def test_the_model_of_an_unlabelled_pool_is_asked_from_the_engine() -> None:
    answers = {"n": 0}

    async def models(request: web.Request) -> web.Response:
        answers["n"] += 1
        if answers["n"] == 1:
            return web.Response(status=503)  # still loading: asked again after a backoff
        data = [{"id": "lora-a", "parent": "llama-3"}, {"id": "llama-3", "parent": None}]
        return web.json_response({"object": "list", "data": data})

    async with fake_engine(models) as engine_url, watching() as (api, disco, fleet):
        port = int(engine_url.rpartition(":")[2])
        await api.put(endpoint_slice("l", "qwen", [endpoint("127.0.0.1", "p")], ports={"http": port}))
        await wait_for(lambda: _has(fleet, "qwen/p"))
        assert fleet.engines["qwen/p"].model == "llama-3" and answers["n"] == 2
        pods = [endpoint("127.0.0.1", "p"), endpoint("10.9.9.9", "q", ready=False)]
        await api.put(endpoint_slice("l", "qwen", pods, ports={"http": port}))
        await wait_for(lambda: _true(disco.slices.resource_version == str(api.version)))
        assert answers["n"] == 2  # an engine already known is not asked again


async def test_a_model_answer_that_redirects_or_is_huge_is_a_failure_and_the_others_go_on() -> None:
    asked: list[str] = []

    async def elsewhere(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.json_response({"object": "list", "data": [{"id": "stolen", "parent": None}]})

    async def good(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "llama-3", "parent": None}]})

    async def huge(request: web.Request) -> web.Response:
        return web.Response(body=b'{"data": [' + b" " * (2 << 20) + b"]}", content_type="application/json")

    probe = ModelProbe(5.0)
    async with (
        fake_engine(elsewhere) as other,
        running_kube_api() as (api, url),
        discovering(settings(url), probe=probe) as (disco, fleet),
    ):

        async def redirect(request: web.Request) -> web.Response:
            raise web.HTTPFound(f"{other}/v1/models")

        async with fake_engine(redirect) as r, fake_engine(huge) as h, fake_engine(good) as g:
            for pod, engine_url in (("r", r), ("h", h), ("g", g)):
                port = int(engine_url.rpartition(":")[2])
                await api.put(endpoint_slice(pod, "qwen", [endpoint("127.0.0.1", pod)], ports={"http": port}))
            await wait_for(lambda: _true(_has_sync(fleet, "qwen/g") and disco.counts["failures"] >= 4))
            assert list(fleet.engines) == ["qwen/g"] and fleet.engines["qwen/g"].model == "llama-3"
            # Each failure counted by its reason too (`kvrouter_discovery_model_probe_errors_total`).
            assert probe.errors["redirect"] >= 1 and probe.errors["too_large"] >= 1
            assert disco.counts["failures"] == sum(probe.errors.values())
    assert asked == []  # the redirect was not followed


def _has_sync(fleet: Fleet, name: str) -> bool:
    return name in fleet.engines


async def test_a_long_list_is_read_page_by_page() -> None:
    async with running_kube_api() as (api, url):
        for i in range(501):
            await api.put(qwen(endpoint(f"10.0.{i // 250}.{i % 250 + 1}", f"p{i:03}"), name=f"qwen-{i:03}"))
        async with discovering(settings(url)) as (_, fleet):
            await wait_for(lambda: _true(len(fleet.engines) == 501))
            assert [q.get("continue") for q in api.lists] == [None, "500"]
            assert fleet.calls == [(sorted(fleet.engines), [])]  # applied once, after the last page


async def test_a_kubeconfig_names_the_server_and_the_token(tmp_path: Path) -> None:
    async with running_kube_api() as (api, url):
        api.token = "s3cret"
        await api.put(qwen(endpoint("10.0.0.1", "a")))
        kubeconfig = tmp_path / "config"
        kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: test\n"
            f"clusters:\n- name: fake\n  cluster:\n    server: {url}\n"
            "users:\n- name: router\n  user:\n    token: s3cret\n"
            "contexts:\n- name: test\n  context:\n    cluster: fake\n    user: router\n    namespace: llm\n"
        )
        k = KubernetesDiscovery(services=["qwen"], kubeconfig=str(kubeconfig), backoff_s=0.01)
        client = await api_client(k, environ={})  # not in a cluster: the kubeconfig
        async with discovering(Discovery(kubernetes=k), client) as (disco, fleet):
            await wait_for(lambda: _has(fleet, "qwen/a"))
            assert disco.counts["failures"] == 0
        api.token = "other"
        async with discovering(Discovery(kubernetes=k), await api_client(k, environ={}), fleet) as (wrong, _):
            await wait_for(lambda: _true(wrong.counts["failures"] >= 1))  # 401: counted, retried


async def test_missing_credentials_are_logged_counted_and_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    k = KubernetesDiscovery(services=["qwen"], kubeconfig=str(tmp_path / "absent"), backoff_s=0.01)
    async with discovering(Discovery(kubernetes=k)) as (disco, _):
        await wait_for(lambda: _true(disco.counts["failures"] >= 2))  # the loop lives on
        assert "kubernetes discovery failed" in caplog.text


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for IP 127.0.0.1 and its key, made by the openssl command (skip without it)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a server certificate")
    cert, key = directory / "server.crt", directory / "server.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=kube",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


async def test_in_cluster_service_account_auth_over_tls(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text("pod-token")
    (account / "ca.crt").write_text(cert.read_text())  # the cluster CA: here the server's own cert
    (account / "namespace").write_text("llm")
    async with running_kube_api(tls) as (api, url):
        api.token = "pod-token"
        await api.put(qwen(endpoint("10.0.0.1", "a")))
        port = url.rpartition(":")[2]
        env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": port}
        k = KubernetesDiscovery(services=["qwen"], backoff_s=0.01)
        client = await api_client(k, env, account)
        assert client.configuration.host == f"https://127.0.0.1:{port}"
        async with discovering(Discovery(kubernetes=k), client) as (disco, fleet):
            await wait_for(lambda: _has(fleet, "qwen/a"))
            assert disco.counts["failures"] == 0


def test_the_namespace_is_configured_or_the_service_accounts(tmp_path: Path) -> None:
    assert namespace_of(KubernetesDiscovery(namespace="llm")) == "llm"
    account = tmp_path / "namespace"
    account.write_text("serving\n")
    assert namespace_of(KubernetesDiscovery(), account) == "serving"
    assert namespace_of(KubernetesDiscovery(), tmp_path / "absent") == "default"


async def _has(fleet: Fleet, name: str) -> bool:
    return name in fleet.engines
