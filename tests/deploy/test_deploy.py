"""deploy/: every manifest renders and validates offline (the gateway's, and the endpoint picker's with
its Istio and agentgateway examples), and every key, port, path and name in it
exists in the code (config keys, the listen port, the probe paths, the secret variables, the image's
install line, the engines' KV-events config).

Kubernetes kinds are validated against the JSON schemas the `kubernetes-validate` wheel bundles
(strict: unknown fields are errors), for the oldest and the newest Kubernetes the kit supports. The
ServiceMonitor (a CRD) against tests/data/servicemonitor-v1.schema.json, a structural subset written
from the Prometheus Operator's API reference; the InferencePool, Gateway, HTTPRoute and
DestinationRule against tests/data/gateway-api-inference.schema.json, subsets written the same way.
Docker is not available here: the Dockerfile is checked statically.
"""

from __future__ import annotations

import json
import logging
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import msgspec
import pytest

from events.config import KVEventsConfig, decode_kv_events_config, is_bind_endpoint
from kvrouter.cli import build_parser
from kvrouter.cmd_epp import with_pool
from router.lifecycle import gateway_app
from router.links.endpoint_slices import (
    SERVICE_NAME_LABEL,
    EndpointSlice,
    engines_from_slices,
    label_selector,
)
from router.links.inference_pool import InferencePool, Pod, engines_from_pool
from router.settings.config import EngineConfig, RouterConfig, decode_config
from router.settings.overrides import load_config
from tests.kustomize import Resource, render

ROOT: Final = Path(__file__).resolve().parents[2]
DEPLOY: Final = ROOT / "deploy"
KUSTOMIZATIONS: Final = {
    "base": DEPLOY / "kubernetes" / "base",
    "example": DEPLOY / "kubernetes" / "overlays" / "example",
}
K8S_VERSIONS: Final = ("1.29", kubernetes_validate.latest_version())
SERVICE_MONITOR: Final = json.loads(
    (Path(__file__).parents[1] / "data" / "servicemonitor-v1.schema.json").read_text()
)
RENDERED: Final = {name: render(path) for name, path in KUSTOMIZATIONS.items()}


def one(resources: list[Resource], kind: str, name: str | None = None) -> Resource:
    found = [r for r in resources if r["kind"] == kind and (name is None or r["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def gateway(resources: list[Resource]) -> dict[str, Any]:
    container: dict[str, Any] = one(resources, "Deployment", "kvrouter")["spec"]["template"]["spec"][
        "containers"
    ][0]
    return container


def router_config(resources: list[Resource]) -> RouterConfig:
    toml = one(resources, "ConfigMap", "kvrouter-config")["data"]["router.toml"]
    return decode_config(toml, "router.toml of the ConfigMap")


@pytest.mark.parametrize("kustomization", sorted(RENDERED))
def test_every_manifest_validates_against_the_schemas(kustomization: str) -> None:
    resources = RENDERED[kustomization]
    assert {r["kind"] for r in resources} >= {
        "Deployment", "Service", "ConfigMap", "ServiceAccount", "Role", "RoleBinding",
        "PodDisruptionBudget", "HorizontalPodAutoscaler", "ServiceMonitor",
    }  # fmt: skip
    for resource in resources:
        if resource["apiVersion"] == "monitoring.coreos.com/v1":
            jsonschema.validate(resource, SERVICE_MONITOR)
            continue
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(resource, version, strict=True)


def test_a_misspelt_field_is_caught() -> None:
    deployment = json.loads(json.dumps(one(RENDERED["base"], "Deployment", "kvrouter")))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)
    monitor = json.loads(json.dumps(one(RENDERED["base"], "ServiceMonitor")))
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(monitor, SERVICE_MONITOR)


def pod_environ(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment, each secret reference standing for a value."""
    return {e["name"]: e.get("value", f"<{e['name']}>") for e in container.get("env", [])}


@pytest.mark.parametrize("kustomization", sorted(RENDERED))
def test_the_config_and_environment_load_with_the_real_config(
    kustomization: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    resources = RENDERED[kustomization]
    container = gateway(resources)
    args = build_parser().parse_args(container["args"])
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    assert args.config.parent == Path(mount["mountPath"])
    volume = next(
        v
        for v in one(resources, "Deployment", "kvrouter")["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "config"
    )
    configmap = one(resources, "ConfigMap", volume["configMap"]["name"])
    assert args.config.name in configmap["data"]
    path = tmp_path / args.config.name
    path.write_text(configmap["data"][args.config.name])
    with caplog.at_level(logging.WARNING):
        config = load_config(path, pod_environ(container))
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # no unknown KVROUTER_* variable
    assert config == router_config(resources) and not config.uses_embedded


@pytest.mark.parametrize("kustomization", sorted(RENDERED))
def test_ports_probes_and_secrets_are_the_codes(kustomization: str) -> None:
    resources = RENDERED[kustomization]
    config = router_config(resources)
    pod = one(resources, "Deployment", "kvrouter")["spec"]["template"]["spec"]
    container = gateway(resources)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": config.listen.port} and config.listen.host in ("0.0.0.0", "::")
    routes = {getattr(r, "path", None) for r in gateway_app(RouterConfig(), environ={}).routes}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] in routes and get["port"] in ports, probe
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    service = one(resources, "Service", "kvrouter")
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
    monitor = one(resources, "ServiceMonitor")["spec"]
    assert monitor["endpoints"][0]["path"] == "/metrics" in routes
    assert monitor["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    secrets = {e["name"] for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    assert secrets == {config.auth.api_keys_env, config.auth.admin_token_env}
    assert pod["enableServiceLinks"] is False


@pytest.mark.parametrize("kustomization", sorted(RENDERED))
def test_selectors_rbac_and_the_drain_budget_fit_together(kustomization: str) -> None:
    resources = RENDERED[kustomization]
    deployment = one(resources, "Deployment", "kvrouter")
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    for kind in ("Service", "PodDisruptionBudget", "ServiceMonitor"):
        spec = one(resources, kind, "kvrouter")["spec"]
        selector = spec["selector"].get("matchLabels", spec["selector"])
        assert selector.items() <= labels.items(), kind
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    hpa = one(resources, "HorizontalPodAutoscaler")["spec"]
    assert (
        hpa["scaleTargetRef"]["name"] == "kvrouter" and hpa["minReplicas"] <= deployment["spec"]["replicas"]
    )
    assert gateway(resources)["resources"]["requests"]["cpu"]  # CPU utilisation needs a request
    binding = one(resources, "RoleBinding")
    assert binding["subjects"][0]["name"] == pod["spec"]["serviceAccountName"]
    rules = one(resources, "Role", binding["roleRef"]["name"])["rules"]
    assert any(
        "discovery.k8s.io" in r["apiGroups"] and "endpointslices" in r["resources"]
        and {"list", "watch"} <= set(r["verbs"])
        for r in rules
    )  # fmt: skip
    # The grace period covers the preStop sleep, then the gateway's wait for open answers after SIGTERM.
    sleep = int(gateway(resources)["lifecycle"]["preStop"]["exec"]["command"][1])
    limits = router_config(resources).limits
    assert pod["spec"]["terminationGracePeriodSeconds"] >= sleep + limits.drain_grace_s + limits.drain_s + 5


def flags(args: list[str]) -> dict[str, str]:
    """`--name=value` and bare `--name` (value "") arguments."""
    return {a.partition("=")[0]: a.partition("=")[2] for a in args}


def controller_slice(service: Resource, pod_labels: dict[str, str], ports: dict[str, int]) -> EndpointSlice:
    """The EndpointSlice the EndpointSlice controller writes for `service` and one ready pod of the
    Deployment: the Service's labels plus the service-name label, its port names with the pod's numbers."""
    assert service["spec"]["selector"].items() <= pod_labels.items()
    labels = {**service["metadata"]["labels"], SERVICE_NAME_LABEL: service["metadata"]["name"]}
    named = [
        {"name": p["name"], "port": ports[p["targetPort"]], "protocol": "TCP"}
        for p in service["spec"]["ports"]
    ]
    obj = {
        "metadata": {"name": f"{service['metadata']['name']}-x1", "namespace": "llm", "labels": labels},
        "addressType": "IPv4",
        "endpoints": [{"addresses": ["10.1.2.3"], "conditions": {"ready": True},
                       "targetRef": {"kind": "Pod", "name": "vllm-0"}}],
        "ports": named,
    }  # fmt: skip
    return msgspec.convert(obj, EndpointSlice)


def pod_engine(name: str, args: dict[str, str], events: KVEventsConfig) -> EngineConfig:
    """The engine `name` that discovery should make of the example vLLM pod ready at 10.1.2.3, from
    the pod's own flags (`args`) and KV events config (`events`)."""
    assert events.replay_endpoint is not None
    return EngineConfig(
        name=name,
        url=f"http://10.1.2.3:{args['--port']}",
        model=args["--served-model-name"],
        events=[f"tcp://10.1.2.3:{urlsplit(events.endpoint).port}"],
        replay=[f"tcp://10.1.2.3:{urlsplit(events.replay_endpoint).port}"],
    )


def test_the_example_engines_publish_what_the_discovery_config_expects() -> None:
    resources = RENDERED["example"]
    config = router_config(resources)
    kube = config.discovery.kubernetes
    deployment = one(resources, "Deployment", "vllm")["spec"]["template"]
    vllm = deployment["spec"]["containers"][0]
    args = flags(vllm["args"])
    assert {"--enable-prefix-caching", "--enable-prompt-tokens-details"} <= args.keys()
    events = decode_kv_events_config(args["--kv-events-config"])
    assert events.enable_kv_cache_events and events.publisher == "zmq" and events.topic
    assert events.replay_endpoint is not None
    ports = {p["name"]: p["containerPort"] for p in vllm["ports"]}
    assert ports == {
        kube.http_port_name: int(args["--port"]),
        kube.events_port_name: urlsplit(events.endpoint).port,
        kube.replay_port_name: urlsplit(events.replay_endpoint).port,
    }
    assert is_bind_endpoint(events.endpoint) and is_bind_endpoint(events.replay_endpoint)
    (service_name,) = kube.services
    service = one(resources, "Service", service_name)
    assert label_selector(config.discovery) == f"{SERVICE_NAME_LABEL}={service_name}"
    # What the gateway makes of the slice the cluster would write for one ready vLLM pod.
    found = engines_from_slices(
        config.discovery, [controller_slice(service, deployment["metadata"]["labels"], ports)]
    )
    assert found == {f"{service_name}/vllm-0": pod_engine(f"{service_name}/vllm-0", args, events)}
    assert args["--served-model-name"] == config.models[0].name
    assert int(args["--block-size"]) == config.models[0].block_size


def dockerfile_lines() -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_the_image_installs_the_gateway_without_extras_as_a_non_root_user() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    lines = dockerfile_lines()
    installs = [shlex.split(m) for line in lines if (m := line.partition("pip install --no-cache-dir ")[2])]
    targets = [words[-1] for words in installs if not words[-1].startswith("-")]
    assert targets == ["."]  # the project itself: its dependencies, no [loadtest] or [test] extra
    extras = project["project"]["optional-dependencies"]
    assert any(d.startswith("matplotlib") for d in extras["loadtest"])
    assert not any(d.startswith("matplotlib") for d in project["project"]["dependencies"])
    assert "'.[test,loadtest]'" in (ROOT / "Makefile").read_text()  # make test installs both
    copied = {line.split()[1] for line in lines if line.startswith("COPY ") and "--from" not in line}
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages <= copied and "pyproject.toml" in copied
    assert [line for line in lines if line.startswith("FROM")][-1].startswith("FROM python:3.11-slim")
    assert project["project"]["requires-python"] == ">=3.11"
    user = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert user and user[-1] not in ("0", "root")
    assert gateway(RENDERED["base"])["image"].startswith("kvrouter:")
    pod = one(RENDERED["base"], "Deployment", "kvrouter")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == int(user[-1])
    exposed = [int(line.split()[1]) for line in lines if line.startswith("EXPOSE ")]
    assert exposed == [router_config(RENDERED["base"]).listen.port]
    cmd = json.loads(next(line for line in lines if line.startswith("CMD "))[4:])
    assert cmd == gateway(RENDERED["base"])["args"]


def test_every_toml_block_of_the_deploy_docs_decodes() -> None:
    text = (ROOT / "docs" / "deploy.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", text, re.DOTALL)
    assert len(blocks) >= 2
    for block in blocks:
        decode_config(block, "docs/deploy.md")


# The endpoint-picker kit (deploy/kubernetes/epp, docs/gateway-api.md) and its gateway examples.
EPP_KUSTOMIZATIONS: Final = {
    "epp": DEPLOY / "kubernetes" / "epp",
    "epp-istio": DEPLOY / "kubernetes" / "overlays" / "epp-istio",
    "epp-agentgateway": DEPLOY / "kubernetes" / "overlays" / "epp-agentgateway",
}
EPP_RENDERED: Final = {name: render(path) for name, path in EPP_KUSTOMIZATIONS.items()}
CUSTOM_KINDS: Final = json.loads(
    (Path(__file__).parents[1] / "data" / "gateway-api-inference.schema.json").read_text()
)["kinds"]


def picker(resources: list[Resource]) -> dict[str, Any]:
    container: dict[str, Any] = one(resources, "Deployment", "kvrouter-epp")["spec"]["template"]["spec"][
        "containers"
    ][0]
    return container


@pytest.mark.parametrize("kustomization", sorted(EPP_RENDERED))
def test_every_picker_manifest_validates_against_the_schemas(kustomization: str) -> None:
    resources = EPP_RENDERED[kustomization]
    kinds = {r["kind"] for r in resources}
    assert kinds >= {
        "Deployment",
        "Service",
        "ConfigMap",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "InferencePool",
    }
    if kustomization != "epp":  # the examples route to the pool through their gateway
        assert kinds >= {"Gateway", "HTTPRoute"}
    for resource in resources:
        if resource["kind"] in CUSTOM_KINDS:
            jsonschema.validate(resource, CUSTOM_KINDS[resource["kind"]])
            continue
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(resource, version, strict=True)


def test_a_misspelt_custom_field_is_caught() -> None:
    pool = json.loads(json.dumps(one(EPP_RENDERED["epp"], "InferencePool")))
    pool["spec"]["targetPort"] = pool["spec"].pop("targetPorts")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, CUSTOM_KINDS["InferencePool"])
    route = json.loads(json.dumps(one(EPP_RENDERED["epp-istio"], "HTTPRoute")))
    route["spec"]["rules"][0]["backendRef"] = route["spec"]["rules"][0].pop("backendRefs")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(route, CUSTOM_KINDS["HTTPRoute"])


@pytest.mark.parametrize("kustomization", sorted(EPP_RENDERED))
def test_the_picker_runs_as_its_flags_config_pool_and_ports_say(kustomization: str, tmp_path: Path) -> None:
    resources = EPP_RENDERED[kustomization]
    container = picker(resources)
    args = build_parser().parse_args(container["args"])
    assert args.func.__module__ == "kvrouter.cmd_epp"
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    assert args.config.parent == Path(mount["mountPath"])
    pod = one(resources, "Deployment", "kvrouter-epp")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "config")
    configmap = one(resources, "ConfigMap", volume["configMap"]["name"])
    path = tmp_path / args.config.name
    path.write_text(configmap["data"][args.config.name])
    config = with_pool(load_config(path, {}), args.pool_name, args.pool_namespace)
    pool = one(resources, "InferencePool")
    assert config.discovery.kubernetes.inference_pool == pool["metadata"]["name"] and not config.uses_embedded
    # TLS from the mounted Secret's pair, the names the picker reads.
    tls = next(m for m in container["volumeMounts"] if m["name"] == "tls")
    assert args.secure_serving and args.cert_path == Path(tls["mountPath"])
    assert next(v for v in pod["volumes"] if v["name"] == "tls")["secret"]["secretName"] == "kvrouter-epp-tls"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {
        "grpc": args.grpc_port,
        "grpc-health": args.grpc_health_port,
        "metrics": args.metrics_port,
    }
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["grpc"]["port"] == args.grpc_health_port, probe
    assert container["readinessProbe"]["grpc"]["service"] == "readiness"
    assert container["livenessProbe"]["grpc"]["service"] == "liveness"
    # The pool names this picker: its Service, on the port that reaches the ext_proc container port.
    ref = pool["spec"]["endpointPickerRef"]
    service = one(resources, "Service", ref["name"])
    assert (
        service["spec"]["selector"].items()
        <= one(resources, "Deployment", "kvrouter-epp")["spec"]["template"]["metadata"]["labels"].items()
    )
    ext_proc = next(p for p in service["spec"]["ports"] if p["port"] == ref["portNumber"])
    assert ports[ext_proc["targetPort"]] == args.grpc_port
    # RBAC: the picker's ServiceAccount may list and watch the pool and its pods.
    binding = one(resources, "RoleBinding", "kvrouter-epp")
    assert binding["subjects"][0]["name"] == pod["serviceAccountName"]
    rules = one(resources, "Role", binding["roleRef"]["name"])["rules"]
    for group, plural in (("inference.networking.k8s.io", "inferencepools"), ("", "pods")):
        assert any(
            group in r["apiGroups"] and plural in r["resources"] and {"list", "watch"} <= set(r["verbs"])
            for r in rules
        ), plural


@pytest.mark.parametrize("kustomization", ["epp-istio", "epp-agentgateway"])
def test_the_examples_route_to_the_pool_through_their_gateway(kustomization: str) -> None:
    resources = EPP_RENDERED[kustomization]
    gateway_name = one(resources, "Gateway")["metadata"]["name"]
    route = one(resources, "HTTPRoute")["spec"]
    assert [p["name"] for p in route["parentRefs"]] == [gateway_name]
    pool = one(resources, "InferencePool")["metadata"]["name"]
    backends = [b for rule in route["rules"] for b in rule["backendRefs"]]
    assert backends == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool}]
    if kustomization == "epp-istio":  # Istio's TLS to the picker, without verifying its certificate
        rule = one(resources, "DestinationRule")["spec"]
        service = one(resources, "Service", "kvrouter-epp")["metadata"]
        assert rule["host"] == f"{service['name']}.{service['namespace']}.svc.cluster.local"
        assert rule["trafficPolicy"]["tls"] == {"mode": "SIMPLE", "insecureSkipVerify": True}


def test_the_pool_selects_the_example_vllm_pods_and_the_picker_makes_them_engines() -> None:
    pool_obj = one(EPP_RENDERED["epp"], "InferencePool")
    toml = one(EPP_RENDERED["epp"], "ConfigMap", "kvrouter-epp-config")["data"]["router.toml"]
    config = decode_config(toml, "router.toml of the picker's ConfigMap")
    vllm_pod = one(RENDERED["example"], "Deployment", "vllm")["spec"]["template"]
    vllm = vllm_pod["spec"]["containers"][0]
    args = flags(vllm["args"])
    events = decode_kv_events_config(args["--kv-events-config"])
    assert events.replay_endpoint is not None
    # The kit's picker tokenizes locally, with the engines' tokenizer (no /tokenize round trip).
    assert [(m.tokenizer, m.remote_tokenize) for m in config.models] == [(args["--model"], False)]
    pod_obj = {
        "metadata": {"name": "vllm-0", "namespace": "llm", "labels": vllm_pod["metadata"]["labels"]},
        "status": {
            "phase": "Running",
            "podIP": "10.1.2.3",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    pool = msgspec.convert(pool_obj, InferencePool)
    found = engines_from_pool(config.discovery, pool, [msgspec.convert(pod_obj, Pod)])
    assert found == {"vllm/vllm-0": pod_engine("vllm/vllm-0", args, events)}
    assert args["--served-model-name"] == config.models[0].name
    assert int(args["--block-size"]) == config.models[0].block_size
