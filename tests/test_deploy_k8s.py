"""The Kubernetes manifests, checked without a cluster.

Every manifest, and every overlay as kustomize builds it, is validated against the Kubernetes
OpenAPI schemas that `kubernetes-validate` ships (no network). Overlays are rendered by the
small renderer below (resources, strategic-merge patches by kind and name, namespace), which is
checked against `kubectl kustomize` wherever kubectl is installed. Then the pieces are checked
against each other: selectors, named ports, probes, RBAC, settings and engine flags.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from prefix_gateway.backends.membership import ServiceSpec
from prefix_gateway.config import Settings, _env_name, load_settings

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
OVERLAYS = sorted(path.parent for path in (K8S / "overlays").glob("*/kustomization.yaml"))
KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")
# Custom resources have no schema in kubernetes-validate; they are checked structurally below.
CUSTOM_GROUPS = ("monitoring.coreos.com/",)
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}
SETTINGS_VARIABLES = {_env_name(field) for field in dataclasses.fields(Settings)}
REFERENCE = re.compile(r"\$\((\w+)\)")
"""Kubernetes expands `$(NAME)` in a variable's value from the variables before it."""


def expand(value: str) -> str:
    """A value as Kubernetes expands it, with every referred secret standing in as `secret`."""
    return REFERENCE.sub("secret", value)


Manifest = dict[str, Any]


def load_documents(path: Path) -> list[Manifest]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


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


def render(directory: Path) -> list[Manifest]:
    """`kustomize build` for the subset of kustomization.yaml these overlays use."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    supported = {"apiVersion", "kind", "resources", "patches", "namespace"}
    assert set(kustomization) <= supported, f"{directory}: keep overlays renderable here"
    documents: list[Manifest] = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        documents += render(path) if path.is_dir() else load_documents(path)
    for patch_entry in kustomization.get("patches", []):
        assert set(patch_entry) == {"path"}, "only strategic-merge patch files"
        for patch in load_documents(directory / patch_entry["path"]):
            matches = [
                index
                for index, doc in enumerate(documents)
                if doc["kind"] == patch["kind"]
                and doc["metadata"]["name"] == patch["metadata"]["name"]
            ]
            assert len(matches) == 1, f"patch {patch['kind']}/{patch['metadata']['name']}"
            documents[matches[0]] = merge(documents[matches[0]], patch)
    namespace = kustomization.get("namespace")
    if namespace:
        for doc in documents:
            if doc["kind"] not in CLUSTER_SCOPED:
                doc["metadata"]["namespace"] = namespace
            for subject in doc.get("subjects", []):
                if subject.get("kind") == "ServiceAccount":
                    subject["namespace"] = namespace
    return documents


def key(doc: Manifest) -> tuple[str, str, str]:
    return (doc["apiVersion"], doc["kind"], doc["metadata"]["name"])


def by_kind(documents: list[Manifest], kind: str) -> dict[str, Manifest]:
    return {doc["metadata"]["name"]: doc for doc in documents if doc["kind"] == kind}


def is_custom(doc: Manifest) -> bool:
    return str(doc["apiVersion"]).startswith(CUSTOM_GROUPS)


def patch_files() -> set[Path]:
    return {
        (kustomization.parent / entry["path"]).resolve()
        for kustomization in K8S.rglob("kustomization.yaml")
        for entry in yaml.safe_load(kustomization.read_text()).get("patches", [])
    }


def manifest_files() -> list[Path]:
    """Every resource file; patches are only whole once merged and are checked rendered."""
    patches = patch_files()
    return sorted(
        path
        for path in K8S.rglob("*.yaml")
        if path.name != "kustomization.yaml" and path.resolve() not in patches
    )


def validate(doc: Manifest) -> None:
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


# --- schemas ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", manifest_files(), ids=lambda path: str(path.relative_to(K8S)))
def test_every_manifest_file_is_valid_kubernetes(path: Path) -> None:
    documents = load_documents(path)
    assert documents
    for doc in documents:
        if not is_custom(doc):
            validate(doc)


def test_every_file_is_a_resource_or_a_patch_of_some_kustomization() -> None:
    used = set(patch_files())
    for kustomization in K8S.rglob("kustomization.yaml"):
        for resource in yaml.safe_load(kustomization.read_text()).get("resources", []):
            used.add((kustomization.parent / resource).resolve())
    for path in K8S.rglob("*.yaml"):
        if path.name != "kustomization.yaml":
            assert path.resolve() in used, f"{path} is in no kustomization"


def test_the_validator_rejects_what_the_api_server_would() -> None:
    deployment = copy.deepcopy(by_kind(render(K8S / "base"), "Deployment")["prefix-gateway"])
    deployment["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "x"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    deployment = copy.deepcopy(by_kind(render(K8S / "base"), "Deployment")["prefix-gateway"])
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {
        "tcpSocket": {"port": 1}
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda path: path.name)
def test_every_rendered_overlay_is_valid_kubernetes(overlay: Path) -> None:
    documents = render(overlay)
    assert len({key(doc) for doc in documents}) == len(documents), "duplicate resources"
    for doc in documents:
        if is_custom(doc):
            continue
        validate(doc)
        assert doc["metadata"].get("namespace") or doc["kind"] in CLUSTER_SCOPED


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed here")
@pytest.mark.parametrize("overlay", [K8S / "base", *OVERLAYS], ids=lambda path: path.name)
def test_the_renderer_agrees_with_kubectl_kustomize(overlay: Path) -> None:
    built = subprocess.run(
        ["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, check=True
    ).stdout
    theirs = {key(doc): doc for doc in yaml.safe_load_all(built) if doc}
    ours = {key(doc): doc for doc in render(overlay)}
    assert ours == theirs


# --- custom resources, structurally ----------------------------------------------------------


def test_service_monitor_selects_the_gateway_service_and_its_metrics_port() -> None:
    documents = render(K8S / "base")
    (monitor,) = (doc for doc in documents if doc["kind"] == "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor["spec"]) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
    wanted = monitor["spec"]["selector"]["matchLabels"]
    services = [
        doc
        for doc in by_kind(documents, "Service").values()
        if wanted.items() <= doc["metadata"].get("labels", {}).items()
    ]
    assert [doc["metadata"]["name"] for doc in services] == ["prefix-gateway"]
    targets = {port["name"]: port["targetPort"] for port in services[0]["spec"]["ports"]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme"}
    assert endpoint["path"] == "/metrics"
    # The Service port that leads to the container port on which the gateway serves /metrics.
    assert targets[endpoint["port"]] == "metrics"
    assert gateway_ports(documents)["metrics"] == gateway_settings(documents).metrics_port


# --- the pieces fit together -----------------------------------------------------------------


def pod_spec(doc: Manifest) -> Manifest:
    spec: Manifest = doc["spec"]["template"]["spec"]
    return spec


def workloads(documents: list[Manifest]) -> list[Manifest]:
    return [doc for doc in documents if doc["kind"] in ("Deployment", "StatefulSet")]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda path: path.name)
def test_services_select_pods_and_name_their_ports(overlay: Path) -> None:
    documents = render(overlay)
    for service in by_kind(documents, "Service").values():
        selector = service["spec"]["selector"]
        targets = [
            doc
            for doc in workloads(documents)
            if selector.items() <= doc["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(targets) == 1, f"Service {service['metadata']['name']} selects {targets}"
        container_ports = {
            port["name"]
            for container in pod_spec(targets[0])["containers"]
            for port in container.get("ports", [])
        }
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in container_ports
    for workload in workloads(documents):
        selector = workload["spec"]["selector"]["matchLabels"]
        assert selector.items() <= workload["spec"]["template"]["metadata"]["labels"].items()


def gateway_of(documents: list[Manifest]) -> Manifest:
    return by_kind(documents, "Deployment")["prefix-gateway"]


def gateway_ports(documents: list[Manifest]) -> dict[str, int]:
    """The gateway container's ports by name."""
    (container,) = pod_spec(gateway_of(documents))["containers"]
    return {port["name"]: port["containerPort"] for port in container["ports"]}


def gateway_settings(documents: list[Manifest]) -> Settings:
    """The gateway's settings as its pod would load them: its ConfigMap, then its variables."""
    (config,) = by_kind(documents, "ConfigMap").values()
    container = pod_spec(gateway_of(documents))["containers"][0]
    assert container["envFrom"] == [{"configMapRef": {"name": config["metadata"]["name"]}}]
    environment = {**config["data"]}
    environment.update(
        {item["name"]: expand(item["value"]) for item in container["env"] if "value" in item}
    )
    return load_settings(environ=environment)


def test_gateway_deployment_is_highly_available_probed_and_locked_down() -> None:
    documents = render(K8S / "base")
    deployment = gateway_of(documents)
    assert deployment["spec"]["replicas"] >= 2
    spec = pod_spec(deployment)
    (container,) = spec["containers"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    for probe in ("readinessProbe", "livenessProbe"):
        # The API's port: the metrics port answers nothing but /metrics.
        assert container[probe]["httpGet"]["port"] == "http"
    assert set(ports) == {"http", "metrics"}
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    assert "memory" in container["resources"]["limits"]
    assert {item["topologyKey"] for item in spec["topologySpreadConstraints"]} >= {
        "kubernetes.io/hostname",
        "topology.kubernetes.io/zone",
    }
    pod_security = spec["securityContext"]
    assert pod_security["runAsNonRoot"] is True
    dockerfile_user = next(
        line.split()[1]
        for line in reversed((ROOT / "Dockerfile").read_text().splitlines())
        if line.startswith("USER ")
    )
    assert str(pod_security["runAsUser"]) == dockerfile_user.split(":")[0]
    container_security = container["securityContext"]
    assert container_security["allowPrivilegeEscalation"] is False
    assert container_security["capabilities"]["drop"] == ["ALL"]
    assert spec["terminationGracePeriodSeconds"] > 30, "longer than the gateway's own drain"
    environment = {item["name"]: item for item in container["env"]}
    assert environment["GATEWAY_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"] is True
    # Besides settings, only secrets that a setting's value refers to as $(NAME).
    helpers = set(environment) - SETTINGS_VARIABLES
    referred = {
        name for item in container["env"] for name in REFERENCE.findall(item.get("value", ""))
    }
    assert helpers <= referred
    for name in helpers:
        assert "secretKeyRef" in environment[name]["valueFrom"]


def test_disruption_budget_and_autoscaler_keep_two_gateways() -> None:
    documents = render(K8S / "base")
    deployment = gateway_of(documents)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    (budget,) = by_kind(documents, "PodDisruptionBudget").values()
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (autoscaler,) = by_kind(documents, "HorizontalPodAutoscaler").values()
    target = autoscaler["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "prefix-gateway")
    assert autoscaler["spec"]["minReplicas"] >= 2
    assert autoscaler["spec"]["minReplicas"] > budget["spec"]["minAvailable"]
    assert autoscaler["spec"]["maxReplicas"] > autoscaler["spec"]["minReplicas"]


def test_rbac_grants_only_reading_endpoint_slices_in_the_namespace() -> None:
    for overlay in OVERLAYS:
        documents = render(overlay)
        assert not by_kind(documents, "ClusterRole") and not by_kind(
            documents, "ClusterRoleBinding"
        )
        (role,) = by_kind(documents, "Role").values()
        assert role["rules"] == [
            {
                "apiGroups": ["discovery.k8s.io"],
                "resources": ["endpointslices"],
                "verbs": ["get", "list", "watch"],
            }
        ]
        (binding,) = by_kind(documents, "RoleBinding").values()
        assert binding["roleRef"]["name"] == role["metadata"]["name"]
        account = pod_spec(gateway_of(documents))["serviceAccountName"]
        assert account in by_kind(documents, "ServiceAccount")
        namespace = gateway_of(documents)["metadata"]["namespace"]
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": account, "namespace": namespace}
        ]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda path: path.name)
def test_gateway_settings_are_real_and_point_at_services_of_the_overlay(overlay: Path) -> None:
    documents = render(overlay)
    (config,) = by_kind(documents, "ConfigMap").values()
    unknown = set(config["data"]) - SETTINGS_VARIABLES
    assert not unknown, f"not settings of prefix_gateway/config.py: {unknown}"
    settings = gateway_settings(documents)
    services = by_kind(documents, "Service")
    for spec in settings.k8s_service:
        target = ServiceSpec.parse(spec, port_required=False)
        replicas = services[target.host]
        assert replicas["spec"]["clusterIP"] == "None", "the replicas' Service is headless"
        assert target.port in {port["name"] for port in replicas["spec"]["ports"]}
        assert target.host == overlay.name
    assert urlsplit(settings.redis_url).hostname in services
    assert gateway_ports(documents) == {"http": settings.port, "metrics": settings.metrics_port}


def test_engines_cache_prefixes_and_report_cached_tokens() -> None:
    vllm = by_kind(render(K8S / "overlays" / "vllm"), "Deployment")["vllm"]
    arguments = pod_spec(vllm)["containers"][0]["args"]
    assert {"--enable-prefix-caching", "--enable-prompt-tokens-details"} <= set(arguments)
    sglang = by_kind(render(K8S / "overlays" / "sglang"), "Deployment")["sglang"]
    container = pod_spec(sglang)["containers"][0]
    assert "--enable-cache-report" in container["args"]
    assert "--disable-radix-cache" not in container["args"]
    for engine in (vllm, sglang):
        limits = pod_spec(engine)["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "1"
