"""Render a kustomization the way `kustomize build` does, for the subset
deploy/kubernetes uses, so tests run with no kustomize binary (none ships in a
package registry this project can use).

Supported, and nothing else (any other key is an error, never silently ignored):
``resources`` (files, or folders with a kustomization), ``components``,
``namespace``, ``labels`` (metadata only: ``includeSelectors``/``includeTemplates``
false), ``images`` (``newName``/``newTag``) and ``patches`` given as a ``path`` to a
JSON 6902 patch (a list of add / replace / remove operations) with a ``target``
of kind and name.

    from tests.kustomize_lite import build
    objects = build("deploy/kubernetes/overlays/gpu")
"""

from __future__ import annotations

import copy
import pathlib
from typing import Any, Iterable

import yaml

_KEYS = {"apiVersion", "kind", "resources", "components", "namespace", "labels", "images", "patches"}
_CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass",
                   "CustomResourceDefinition", "PriorityClass"}


class KustomizeError(Exception):
    pass


def build(folder: str | pathlib.Path, extra_components: Iterable[str | pathlib.Path] = ()) -> list[dict[str, Any]]:
    """The objects ``kustomize build folder`` prints (``extra_components`` are added to
    the folder's own ``components``)."""
    folder = pathlib.Path(folder)
    spec = _load_kustomization(folder, "Kustomization")
    objects: list[dict[str, Any]] = []
    for entry in spec.get("resources", []):
        path = folder / entry
        if path.is_dir():
            objects.extend(build(path))
        elif path.is_file():
            objects.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
        else:
            raise KustomizeError(f"{folder}: resource {entry!r} does not exist")
    for component in [*(folder / c for c in spec.get("components", [])), *map(pathlib.Path, extra_components)]:
        objects = _transform(objects, _load_kustomization(component, "Component"), component)
    return _transform(objects, spec, folder)


def _load_kustomization(folder: pathlib.Path, kind: str) -> dict[str, Any]:
    path = folder / "kustomization.yaml"
    if not path.is_file():
        raise KustomizeError(f"{folder}: no kustomization.yaml")
    spec = yaml.safe_load(path.read_text()) or {}
    if spec.get("kind", "Kustomization") != kind:
        raise KustomizeError(f"{path}: kind {spec.get('kind')!r}, expected {kind}")
    unknown = set(spec) - _KEYS
    if unknown:
        raise KustomizeError(f"{path}: unsupported keys {sorted(unknown)}")
    return spec


def _transform(objects: list[dict[str, Any]], spec: dict[str, Any], folder: pathlib.Path) -> list[dict[str, Any]]:
    objects = copy.deepcopy(objects)
    for patch in spec.get("patches", []):
        if set(patch) != {"path", "target"} or set(patch["target"]) - {"kind", "name"}:
            raise KustomizeError(f"{folder}: only patches with path and target (kind, name) are supported: {patch}")
        operations = yaml.safe_load((folder / patch["path"]).read_text())
        if not isinstance(operations, list):
            raise KustomizeError(f"{folder / patch['path']}: only JSON 6902 patches (a list of operations)")
        matched = [o for o in objects if all(_field(o, key) == value for key, value in patch["target"].items())]
        if not matched:
            raise KustomizeError(f"{folder}: patch target {patch['target']} matches nothing")
        for obj in matched:
            for operation in operations:
                _apply(obj, operation)
    for image in spec.get("images", []):
        for container in (c for o in objects for c in _containers(o)):
            name, _, _tag = container["image"].partition(":")
            if name == image["name"]:
                new_name = image.get("newName", name)
                tag = image.get("newTag", _tag)
                container["image"] = f"{new_name}:{tag}" if tag else new_name
    for group in spec.get("labels", []):
        if group.get("includeSelectors") or group.get("includeTemplates"):
            raise KustomizeError(f"{folder}: labels with includeSelectors/includeTemplates are not supported")
        for obj in objects:
            obj.setdefault("metadata", {}).setdefault("labels", {}).update(group["pairs"])
    if "namespace" in spec:
        for obj in objects:
            if obj.get("kind") not in _CLUSTER_SCOPED:
                obj.setdefault("metadata", {})["namespace"] = spec["namespace"]
    return objects


def _field(obj: dict[str, Any], key: str) -> Any:
    return obj.get("kind") if key == "kind" else obj.get("metadata", {}).get(key)


def _containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    pod = obj.get("spec", {}).get("template", {}).get("spec", {})
    return [*pod.get("containers", []), *pod.get("initContainers", [])]


def _apply(document: dict[str, Any], operation: dict[str, Any]) -> None:
    """One JSON 6902 operation (add, replace, remove) on ``document``, in place."""
    op, path = operation.get("op"), operation.get("path", "")
    parts = [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]
    if not parts:
        raise KustomizeError(f"patch path {path!r}: the whole document cannot be patched")
    parent: Any = document
    for part in parts[:-1]:
        parent = parent[int(part)] if isinstance(parent, list) else parent[part]
    last = parts[-1]
    value = copy.deepcopy(operation.get("value"))
    if op == "add":
        if isinstance(parent, list):
            parent.insert(len(parent) if last == "-" else int(last), value)
        else:
            parent[last] = value
    elif op == "replace":
        if isinstance(parent, list):
            parent[int(last)] = value
        elif last not in parent:
            raise KustomizeError(f"patch replace {path!r}: nothing there to replace")
        else:
            parent[last] = value
    elif op == "remove":
        del parent[int(last) if isinstance(parent, list) else last]
    else:
        raise KustomizeError(f"patch op {op!r} is not supported (add, replace, remove)")
