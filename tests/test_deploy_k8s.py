"""The Kubernetes manifests, checked without a cluster.

Every manifest, and every overlay and documented combination of components as kustomize builds
them, is validated against the Kubernetes OpenAPI schemas that `kubernetes-validate` ships (no
network). Builds are rendered by tests/kustomize_render.py, whose output is compared with
`kubectl kustomize` (kubectl comes with the test extra). Then the pieces are checked against
each other: selectors, named ports, probes, RBAC, settings and engine flags.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from prefix_gateway.backends.membership import ServiceSpec
from prefix_gateway.config import Settings, _env_name, load_settings
from tests.k8s_builds import (
    BUILDS,
    K8S,
    OVERLAYS,
    ROOT,
    build_dir,
    built,
    components_of,
    engine_of,
)
from tests.kustomize_render import CLUSTER_SCOPED, Manifest, load_documents, render

KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")
# Custom resources have no schema in kubernetes-validate; they are checked structurally.
CUSTOM_GROUPS = ("monitoring.coreos.com/",)
SETTINGS_VARIABLES = {_env_name(field) for field in dataclasses.fields(Settings)}
REFERENCE = re.compile(r"\$\((\w+)\)")
"""Kubernetes expands `$(NAME)` in a variable's value from the variables before it."""


def expand(value: str) -> str:
    """A value as Kubernetes expands it, with every referred secret standing in as `secret`."""
    return REFERENCE.sub("secret", value)


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
        if "path" in entry
    }


def manifest_files() -> list[Path]:
    """Every resource file; patches are only whole once merged and are checked rendered."""
    patches = patch_files()
    return sorted(
        path
        for path in K8S.rglob("*.yaml")
        if path.name != "kustomization.yaml" and path.resolve() not in patches
    )


_valid: set[str] = set()
"""Manifests already validated: most builds share most of theirs, and each validation reads
its schema from disk anew."""


def validate(doc: Manifest) -> None:
    text = json.dumps(doc, sort_keys=True)
    if text in _valid:
        return
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)
    _valid.add(text)


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


@pytest.mark.parametrize("name", BUILDS)
def test_every_build_is_valid_kubernetes(name: str) -> None:
    documents = built(name)
    assert len({key(doc) for doc in documents}) == len(documents), "duplicate resources"
    for doc in documents:
        if is_custom(doc):
            continue
        validate(doc)
        assert doc["metadata"].get("namespace") or doc["kind"] in CLUSTER_SCOPED


@pytest.mark.parametrize("name", ["base", *BUILDS])
def test_the_renderer_agrees_with_kubectl_kustomize(name: str) -> None:
    assert kubectl_kustomize(build_dir(name)) == {key(doc): doc for doc in built(name)}


def kubectl() -> str:
    """The test extra's kubectl (beside this interpreter), else one on PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.is_file() else shutil.which("kubectl")
    assert found, "no kubectl: `make install` installs the test extra, which has it"
    return found


def kubectl_kustomize(directory: Path) -> dict[tuple[str, str, str], Manifest]:
    printed = subprocess.run(
        [kubectl(), "kustomize", str(directory)], capture_output=True, text=True, check=True
    ).stdout
    return {key(doc): doc for doc in yaml.safe_load_all(printed) if doc}


# --- custom resources, structurally ----------------------------------------------------------


def test_only_the_monitoring_component_needs_the_prometheus_operator() -> None:
    for name in BUILDS:
        custom = {doc["kind"] for doc in built(name) if is_custom(doc)}
        monitored = "monitoring" in components_of(name)
        wanted = {"ServiceMonitor", "PrometheusRule"} if monitored else set()
        assert custom == wanted, name


@pytest.mark.parametrize("name", [name for name in BUILDS if "monitoring" in components_of(name)])
def test_service_monitor_selects_the_gateway_service_and_its_metrics_port(name: str) -> None:
    documents = built(name)
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
    metrics_port = int(gateway_environment(documents)["GATEWAY_METRICS_PORT"])
    assert gateway_ports(documents)["metrics"] == metrics_port


# --- the pieces fit together -----------------------------------------------------------------


def pod_spec(doc: Manifest) -> Manifest:
    spec: Manifest = doc["spec"]["template"]["spec"]
    return spec


def workloads(documents: list[Manifest]) -> list[Manifest]:
    return [doc for doc in documents if doc["kind"] in ("Deployment", "StatefulSet")]


@pytest.mark.parametrize("name", BUILDS)
def test_services_select_pods_and_name_their_ports(name: str) -> None:
    documents = built(name)
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


def gateway_config(documents: list[Manifest]) -> Manifest:
    """The gateway's ConfigMap: the one its container reads all of into its environment."""
    container = pod_spec(gateway_of(documents))["containers"][0]
    ((source,),) = [item.values() for item in container["envFrom"]]
    return by_kind(documents, "ConfigMap")[source["name"]]


def gateway_environment(documents: list[Manifest]) -> dict[str, str]:
    """The gateway's plain variables as its pod would have them: its ConfigMap, then its own."""
    container = pod_spec(gateway_of(documents))["containers"][0]
    environment = {**gateway_config(documents)["data"]}
    environment.update(
        {item["name"]: expand(item["value"]) for item in container["env"] if "value" in item}
    )
    return environment


def mounted_config(documents: list[Manifest], into: Path) -> dict[str, str]:
    """What the gateway's `--config` file needs outside the pod: the file of the ConfigMap
    mounted where GATEWAY_CONFIG points, written into `into`, and a stand-in for each variable
    it names a tenant's key by (the pod's come from a Secret). Nothing without a config."""
    path = gateway_environment(documents).get("GATEWAY_CONFIG")
    if path is None:
        return {}
    spec = pod_spec(gateway_of(documents))
    (mount,) = [
        mount
        for mount in spec["containers"][0]["volumeMounts"]
        if Path(path).parent == Path(mount["mountPath"])
    ]
    (volume,) = [volume for volume in spec["volumes"] if volume["name"] == mount["name"]]
    text = by_kind(documents, "ConfigMap")[volume["configMap"]["name"]]["data"][Path(path).name]
    (into / Path(path).name).write_text(text)
    variables = [tenant["api_key_env"] for tenant in yaml.safe_load(text).get("tenants", [])]
    return {
        "GATEWAY_CONFIG": str(into / Path(path).name),
        **{variable: f"stand-in-{variable.lower()}" for variable in variables},
    }


def gateway_settings(documents: list[Manifest], **changed: str) -> Settings:
    """The gateway's settings as its pod would load them, with `changed` variables (a path
    that exists only in the pod, say)."""
    return load_settings(environ={**gateway_environment(documents), **changed})


def test_gateway_deployment_is_highly_available_probed_and_locked_down() -> None:
    documents = render(K8S / "base")
    deployment = gateway_of(documents)
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
    # The autoscaler owns the count: one in the Deployment would reset it on every apply.
    assert "replicas" not in deployment["spec"]
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


@pytest.mark.parametrize("name", BUILDS)
def test_gateway_settings_are_real_and_point_at_services_of_the_overlay(
    name: str, tmp_path: Path
) -> None:
    documents = built(name)
    unknown = set(gateway_config(documents)["data"]) - SETTINGS_VARIABLES
    assert not unknown, f"not settings of prefix_gateway/config.py: {unknown}"
    # A tokenizer folder exists in the pod only (precise-routing mounts it): here, an empty one.
    precise = "precise-routing" in components_of(name)
    tokenizer = {"GATEWAY_TOKENIZER": str(tmp_path)} if precise else {}
    settings = gateway_settings(documents, **tokenizer, **mounted_config(documents, tmp_path))
    services = by_kind(documents, "Service")
    for spec in settings.k8s_service:
        target = ServiceSpec.parse(spec, port_required=False)
        replicas = services[target.host]
        assert replicas["spec"]["clusterIP"] == "None", "the replicas' Service is headless"
        assert target.port in {port["name"] for port in replicas["spec"]["ports"]}
        assert target.host == engine_of(name)
    assert urlsplit(settings.redis_url).hostname in services
    assert gateway_ports(documents) == {"http": settings.port, "metrics": settings.metrics_port}


def engine(name: str) -> Manifest:
    """The engine workload of the overlay `name` (vLLM's is a StatefulSet, for its volumes)."""
    (found,) = (doc for doc in workloads(built(name)) if doc["metadata"]["name"] == name)
    return found


def test_engines_cache_prefixes_and_report_cached_tokens() -> None:
    vllm = engine("vllm")
    arguments = pod_spec(vllm)["containers"][0]["args"]
    assert {"--enable-prefix-caching", "--enable-prompt-tokens-details"} <= set(arguments)
    sglang = engine("sglang")
    container = pod_spec(sglang)["containers"][0]
    assert "--enable-cache-report" in container["args"]
    assert "--disable-radix-cache" not in container["args"]
    for workload in (vllm, sglang):
        limits = pod_spec(workload)["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "1"
