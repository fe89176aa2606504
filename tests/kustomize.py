"""A renderer for the subset of kustomize that deploy/kubernetes uses, so CI renders it without kubectl.

Supported, as kustomize defines them (kubectl.docs.kubernetes.io, "Kustomization"): `resources`
(files, and directories holding a kustomization), `namespace`, `images` (name -> newName/newTag),
`configMapGenerator` (`files`, `behavior` create/replace, with `options.disableNameSuffixHash: true`:
kustomize's hash suffix is not reproduced) and `patches` whose patch is a JSON6902 list (`add`,
`replace`, `remove`) aimed at a `target` kind and name. Any other key is an error, so a manifest cannot
quietly use a feature that this renderer, and so the tests, would ignore.
`python -m tests.kustomize DIR` prints the rendered documents.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any, Final

import yaml

__all__ = ["KustomizeError", "render"]

Resource = dict[str, Any]

_KEYS: Final = {"apiVersion", "kind", "resources", "namespace", "images", "configMapGenerator", "patches"}
_CLUSTER_SCOPED: Final = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}
_POD_TEMPLATES: Final = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


class KustomizeError(ValueError):
    """The kustomization uses something this renderer does not support, or is inconsistent."""


def render(directory: Path) -> list[Resource]:
    """Every resource the kustomization in `directory` produces, in order, transformed."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(spec) - _KEYS
    if unknown:
        raise KustomizeError(f"{directory}: unsupported kustomization keys {sorted(unknown)}")
    resources: list[Resource] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        if path.is_dir():
            resources.extend(render(path))
        else:
            resources.extend(d for d in yaml.safe_load_all(path.read_text()) if d is not None)
    for generator in spec.get("configMapGenerator", []):
        _generate(directory, generator, resources)
    for patch in spec.get("patches", []):
        _patch(directory, patch, resources)
    if "namespace" in spec:
        for resource in resources:
            _set_namespace(resource, spec["namespace"])
    for image in spec.get("images", []):
        for resource in resources:
            _set_image(resource, image)
    return resources


def _generate(directory: Path, generator: dict[str, Any], resources: list[Resource]) -> None:
    unknown = set(generator) - {"name", "files", "behavior", "options"}
    if unknown or generator.get("options", {}) != {"disableNameSuffixHash": True}:
        raise KustomizeError(
            f"{directory}: configMapGenerator supports files with disableNameSuffixHash only"
        )
    data = {}
    for file in generator["files"]:
        key, _, source = file.rpartition("=") if "=" in file else (Path(file).name, "", file)
        data[key] = (directory / source).read_text()
    made = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": generator["name"]}, "data": data}
    same = [i for i, r in enumerate(resources) if r["kind"] == "ConfigMap" and _name(r) == generator["name"]]
    behavior = generator.get("behavior", "create")
    if behavior == "create" and not same:
        resources.append(made)
    elif behavior == "replace" and same:
        resources[same[0]] = made
    else:
        raise KustomizeError(f"{directory}: configMapGenerator {generator['name']}: cannot {behavior}")


def _patch(directory: Path, patch: dict[str, Any], resources: list[Resource]) -> None:
    target = patch.get("target", {})
    ops = yaml.safe_load(patch.get("patch", ""))
    if set(target) - {"kind", "name"} or set(patch) - {"target", "patch"} or not isinstance(ops, list):
        raise KustomizeError(f"{directory}: only inline JSON6902 patches with a kind/name target")
    hits = [r for r in resources if r["kind"] == target.get("kind") and _name(r) == target.get("name")]
    if not hits:
        raise KustomizeError(f"{directory}: patch target {target} matches no resource")
    for resource in hits:
        for op in ops:
            _apply(resource, op)


def _apply(resource: Resource, op: dict[str, Any]) -> None:
    """One RFC 6902 operation (`add`, `replace`, `remove`) on `resource`, in place."""
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
    node: Any = resource
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    kind = op["op"]
    if isinstance(node, list):
        index = len(node) if last == "-" else int(last)
        if kind == "add":
            node.insert(index, copy.deepcopy(op["value"]))
            return
        if kind in ("replace", "remove"):
            del node[index]
            if kind == "replace":
                node.insert(index, copy.deepcopy(op["value"]))
            return
    elif kind in ("add", "replace", "remove"):
        if kind != "add" and last not in node:
            raise KustomizeError(f"patch {op}: no {op['path']} to {kind}")
        if kind == "remove":
            del node[last]
        else:
            node[last] = copy.deepcopy(op["value"])
        return
    raise KustomizeError(f"unsupported patch operation {op}")


def _set_namespace(resource: Resource, namespace: str) -> None:
    if resource["kind"] in _CLUSTER_SCOPED:
        return
    resource["metadata"]["namespace"] = namespace
    if resource["kind"] == "RoleBinding":
        for subject in resource.get("subjects", []):
            if subject.get("kind") == "ServiceAccount":
                subject["namespace"] = namespace


def _set_image(resource: Resource, image: dict[str, str]) -> None:
    if resource["kind"] not in _POD_TEMPLATES:
        return
    pod = resource["spec"]["template"]["spec"]
    for container in [*pod.get("initContainers", []), *pod["containers"]]:
        name, _, tag = container["image"].partition(":")
        if name == image["name"]:
            container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"


def _name(resource: Resource) -> str:
    name: str = resource["metadata"]["name"]
    return name


if __name__ == "__main__":
    print(yaml.safe_dump_all(render(Path(sys.argv[1])), sort_keys=False), end="")
