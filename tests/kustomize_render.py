"""`kustomize build` for the subset of kustomization.yaml that k8s/ uses, so that the manifests
are checked where kubectl is not installed: resources, components, strategic-merge patches by
kind and name, JSON patches (add, replace) on a target, the namespace and images. Checked against
`kubectl kustomize` wherever kubectl is installed (tests/test_deploy_k8s*.py)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

Manifest = dict[str, Any]
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}
SUPPORTED = {"apiVersion", "kind", "resources", "components", "patches", "namespace", "images"}


def load_documents(path: Path) -> list[Manifest]:
    # libyaml's parser: the dashboard ConfigMap alone is 56 KB of YAML.
    return [doc for doc in yaml.load_all(path.read_text(), Loader=yaml.CSafeLoader) if doc]


def merge(target: Any, patch: Any) -> Any:
    """A strategic merge as kustomize does it for these manifests: maps merge, lists of named
    items merge by name (new items first, as kustomize puts them), other lists and scalars are
    replaced."""
    if isinstance(target, dict) and isinstance(patch, dict):
        merged = dict(target)
        for key, value in patch.items():
            merged[key] = merge(target[key], value) if key in target else copy.deepcopy(value)
        return merged
    named = (
        isinstance(target, list)
        and isinstance(patch, list)
        and all(isinstance(item, dict) and "name" in item for item in (*target, *patch))
    )
    if named:
        result = [copy.deepcopy(item) for item in target]
        added = []
        for item in patch:
            index = next((i for i, old in enumerate(result) if old["name"] == item["name"]), None)
            if index is None:
                added.append(copy.deepcopy(item))
            else:
                result[index] = merge(result[index], item)
        return added + result
    return copy.deepcopy(patch)


def json_patch(doc: Manifest, operations: list[Manifest]) -> None:
    """RFC 6902 `add` and `replace`, in place: all that the components use."""
    for operation in operations:
        assert operation["op"] in ("add", "replace"), f"unsupported: {operation}"
        *parents, last = [
            part.replace("~1", "/").replace("~0", "~") for part in operation["path"][1:].split("/")
        ]
        node: Any = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        value = copy.deepcopy(operation["value"])
        if isinstance(node, list):
            if last == "-":
                node.append(value)
            elif operation["op"] == "add":
                node.insert(int(last), value)
            else:
                node[int(last)] = value
        else:
            assert operation["op"] == "add" or last in node, f"nothing to replace: {operation}"
            node[last] = value


def targeted(doc: Manifest, target: Manifest) -> bool:
    group = doc["apiVersion"].rpartition("/")[0]
    wanted = {"group": group, "kind": doc["kind"], "name": doc["metadata"]["name"]}
    assert set(target) <= set(wanted), f"unsupported target: {target}"
    return all(wanted[field] == value for field, value in target.items())


def apply_patches(directory: Path, entries: list[Manifest], documents: list[Manifest]) -> None:
    for entry in entries:
        if "target" in entry:  # a JSON patch, in a file or inline
            text = (directory / entry["path"]).read_text() if "path" in entry else entry["patch"]
            operations = yaml.safe_load(text)
            # A target that matches nothing is no error to kustomize either.
            for doc in documents:
                if targeted(doc, entry["target"]):
                    json_patch(doc, operations)
            continue
        assert set(entry) == {"path"}, "a strategic-merge patch is a file"
        for patch in load_documents(directory / entry["path"]):
            found = [
                index
                for index, doc in enumerate(documents)
                if doc["kind"] == patch["kind"]
                and doc["metadata"]["name"] == patch["metadata"]["name"]
            ]
            assert len(found) == 1, f"patch {patch['kind']}/{patch['metadata']['name']}"
            documents[found[0]] = merge(documents[found[0]], patch)


def set_images(documents: list[Manifest], images: list[Manifest]) -> None:
    for doc in documents:
        template = doc.get("spec", {}).get("template", {}).get("spec", {})
        for container in (*template.get("initContainers", []), *template.get("containers", [])):
            name, _, tag = container["image"].partition(":")
            for image in images:
                if image["name"] == name:
                    new_tag = image.get("newTag", tag)
                    container["image"] = image.get("newName", name) + (
                        f":{new_tag}" if new_tag else ""
                    )


def render(directory: Path, documents: list[Manifest] | None = None) -> list[Manifest]:
    """The resources `kubectl kustomize directory` prints. A component adds its resources to,
    and patches, the `documents` of the kustomization that lists it."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert set(kustomization) <= SUPPORTED, f"{directory}: keep kustomizations renderable here"
    is_component = kustomization["kind"] == "Component"
    assert is_component == (documents is not None), f"{directory}: a component is only listed"
    documents = documents if documents is not None else []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        documents += render(path) if path.is_dir() else load_documents(path)
    for component in kustomization.get("components", []):
        render(directory / component, documents)
    apply_patches(directory, kustomization.get("patches", []), documents)
    namespace = kustomization.get("namespace")
    if namespace:
        for doc in documents:
            if doc["kind"] not in CLUSTER_SCOPED:
                doc["metadata"]["namespace"] = namespace
            for subject in doc.get("subjects", []):
                if subject.get("kind") == "ServiceAccount":
                    subject["namespace"] = namespace
    set_images(documents, kustomization.get("images", []))
    return documents
