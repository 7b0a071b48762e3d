"""The Kubernetes components and the README's path, checked without a cluster: the monitoring
component's generated PrometheusRule and dashboard ConfigMap are what their sources make, its
selector label can be changed as docs/deploy.md says, precise routing wires the tokenizer and
vLLM's KV-cache events end to end, client keys are required once switched on, the vLLM example
is pinned and keeps its model, and the README's overlay builds into valid manifests whose
secrets the README creates. Schemas and kubectl agreement: tests/test_deploy_k8s.py."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from engines.venv import VLLMVenv
from tests.k8s_builds import ROOT, built, combination_text, k8s_copy, operator_overlay
from tests.kustomize_render import Manifest, render
from tests.test_deploy_k8s import (
    by_kind,
    engine,
    gateway_environment,
    gateway_of,
    gateway_settings,
    is_custom,
    key,
    kubectl,
    kubectl_kustomize,
    mounted_config,
    pod_spec,
    validate,
)

SCRIPT = ROOT / "scripts" / "k8s_monitoring.py"


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("k8s_monitoring", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def generate(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(SCRIPT), "--root", str(root), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def secret_refs(container: Manifest) -> dict[str, dict[str, Any]]:
    return {
        item["name"]: item["valueFrom"]["secretKeyRef"]
        for item in container.get("env", [])
        if "secretKeyRef" in item.get("valueFrom", {})
    }


# --- monitoring --------------------------------------------------------------------------------


def test_the_generated_monitoring_files_are_what_their_sources_make() -> None:
    generator = load_generator()
    assert generator.stale(ROOT) == [], "run: python3 scripts/k8s_monitoring.py"
    documents = built("vllm+monitoring")
    (rule,) = by_kind(documents, "PrometheusRule").values()
    alerts = yaml.safe_load((ROOT / generator.ALERTS).read_text())
    assert rule["spec"] == alerts
    dashboard = by_kind(documents, "ConfigMap")["prefix-gateway-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["prefix-gateway.json"]) == json.loads(
        (ROOT / generator.DASHBOARD).read_text()
    )
    for monitored in (rule, by_kind(documents, "ServiceMonitor")["prefix-gateway"]):
        assert monitored["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_the_generator_notices_a_changed_source_and_rewrites_its_file(tmp_path: Path) -> None:
    for source in ("deploy/prometheus", "deploy/grafana", "k8s/components/monitoring"):
        shutil.copytree(ROOT / source, tmp_path / source)
    assert generate(tmp_path, "--check").returncode == 0
    alerts = tmp_path / "deploy/prometheus/alerts.yml"
    added = (
        "\n      - alert: PrefixGatewayAddedLater\n"
        "        expr: vector(1)\n"
        "        labels:\n          severity: info\n"
    )
    alerts.write_text(alerts.read_text() + added)
    check = generate(tmp_path, "--check")
    assert check.returncode == 1
    assert "prometheusrule.yaml is stale" in check.stderr and "dashboard" not in check.stderr
    assert generate(tmp_path).returncode == 0
    assert generate(tmp_path, "--check").returncode == 0
    rule = yaml.safe_load((tmp_path / "k8s/components/monitoring/prometheusrule.yaml").read_text())
    names = [item["alert"] for group in rule["spec"]["groups"] for item in group["rules"]]
    assert names[-1] == "PrefixGatewayAddedLater"
    assert rule["spec"] == yaml.safe_load(alerts.read_text())


def deploy_doc_block(marker: str) -> str:
    """The ```yaml block of docs/deploy.md that contains `marker`."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    blocks: list[str] = re.findall(r"```yaml\n(.*?)```", text, re.S)
    (block,) = (block for block in blocks if marker in block)
    return block


def test_the_selector_label_changes_as_the_docs_say() -> None:
    overlay = operator_overlay(
        "relabelled",
        combination_text("vllm", ("monitoring",)) + deploy_doc_block("monitoring.coreos.com"),
    )
    documents = render(overlay)
    custom = [doc for doc in documents if is_custom(doc)]
    assert {doc["kind"] for doc in custom} == {"ServiceMonitor", "PrometheusRule"}
    for doc in custom:
        assert doc["metadata"]["labels"]["release"] == "prometheus"
    assert kubectl_kustomize(overlay) == {key(doc): doc for doc in documents}


# --- precise routing ---------------------------------------------------------------------------


def test_precise_routing_gives_the_gateway_the_engines_tokens_blocks_and_events(
    tmp_path: Path,
) -> None:
    documents = built("vllm+precise-routing")
    spec = pod_spec(gateway_of(documents))
    (fetch,) = spec["initContainers"]
    (gateway,) = spec["containers"]
    assert fetch["image"] == gateway["image"]
    environment = gateway_environment(documents)
    folder = environment["GATEWAY_TOKENIZER"]
    # The init container fills the volume the gateway reads the tokenizer from.
    mounts = {mount["mountPath"]: mount["name"] for mount in gateway["volumeMounts"]}
    (filled,) = (mount["name"] for mount in fetch["volumeMounts"])
    assert mounts[folder] == filled
    assert {volume["name"]: volume for volume in spec["volumes"]}[filled]["emptyDir"]
    script = fetch["args"][0]
    compile(script, "tokenizer", "exec")
    # What the gateway's tokenizer loads from a folder (prefix_gateway/prompt/tokens.py).
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert f'"{name}"' in script
    assert f'local_dir="{folder}"' in script
    fetched = {item["name"]: item for item in fetch["env"]}["MODEL"]["value"]

    vllm = pod_spec(by_kind(documents, "StatefulSet")["vllm"])["containers"][0]
    arguments = vllm["args"]
    assert f"--model={fetched}" in arguments, "the tokenizer of the model vLLM serves"
    settings = gateway_settings(documents, GATEWAY_TOKENIZER=str(tmp_path))
    assert settings.kv_events is True
    assert f"--block-size={settings.engine_block_size}" in arguments
    events = json.loads(arguments[arguments.index("--kv-events-config") + 1])
    assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
    ports = {port["name"]: port["containerPort"] for port in vllm["ports"]}
    assert events["endpoint"] == f"tcp://*:{ports['kv-events']}"
    # The replicas' NetworkPolicy lets the gateway subscribe.
    policy = by_kind(documents, "NetworkPolicy")["vllm"]
    assert {port["port"] for port in policy["spec"]["ingress"][0]["ports"]} == {"http", "kv-events"}


def test_precise_routing_without_vllm_fails_to_build() -> None:
    overlay = operator_overlay("sglang-precise", combination_text("sglang", ("precise-routing",)))
    with pytest.raises(AssertionError, match="patch StatefulSet/vllm"):
        render(overlay)
    failed = subprocess.run([kubectl(), "kustomize", str(overlay)], capture_output=True, text=True)
    assert failed.returncode != 0 and "StatefulSet.v1.apps/vllm" in failed.stderr


# --- client keys -------------------------------------------------------------------------------


def test_client_keys_come_only_with_the_component_and_then_are_required() -> None:
    without = secret_refs(pod_spec(gateway_of(built("vllm")))["containers"][0])
    assert "GATEWAY_API_KEYS" not in without
    for name in ("vllm+api-keys", "sglang+api-keys"):
        refs = secret_refs(pod_spec(gateway_of(built(name)))["containers"][0])
        assert refs["GATEWAY_API_KEYS"] == {"name": "prefix-gateway-keys", "key": "api-keys"}


# --- tenants -----------------------------------------------------------------------------------


def test_tenants_are_configured_from_a_mounted_file_with_keys_from_a_secret(
    tmp_path: Path,
) -> None:
    documents = built("vllm+tenants")
    container = pod_spec(gateway_of(documents))["containers"][0]
    given = mounted_config(documents, tmp_path)
    tenants = yaml.safe_load(Path(given["GATEWAY_CONFIG"]).read_text())["tenants"]
    assert len(tenants) >= 2 and all(tenant["tokens_per_minute"] > 0 for tenant in tenants)
    refs = secret_refs(container)
    for tenant in tenants:
        # Each key from the Secret, required: no pod serves a tenant without its key.
        ref = refs[tenant["api_key_env"]]
        assert (ref["name"], ref["key"]) == ("prefix-gateway-tenant-keys", tenant["name"])
        assert not ref.get("optional")
        assert "api_key" not in tenant, "a key in a ConfigMap"
    # The gateway takes the rendered configuration, as its pod would give it.
    environment = {"PATH": "/usr/bin:/bin", **gateway_environment(documents), **given}
    printed = prefix_gateway_config(environment)
    assert printed.returncode == 0, printed.stderr
    read = yaml.safe_load(printed.stdout)["tenants"]
    assert [(t["name"], t["api_key_env"], t["tokens_per_minute"]) for t in read] == [
        (t["name"], t["api_key_env"], t["tokens_per_minute"]) for t in tenants
    ]
    assert "stand-in-" not in printed.stdout
    # Without one key (a Secret lacking it) the gateway does not start.
    missing = tenants[-1]["api_key_env"]
    refused = prefix_gateway_config({k: v for k, v in environment.items() if k != missing})
    assert refused.returncode == 2
    assert f"the environment variable {missing} is not set" in refused.stderr


def prefix_gateway_config(environment: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prefix_gateway", "config"],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )


# --- the vLLM example --------------------------------------------------------------------------


def installed_vllm_version() -> str | None:
    venv = VLLMVenv().location
    found = sorted(venv.glob("lib/python3*/site-packages/vllm-*.dist-info"))
    return found[0].name.removeprefix("vllm-").removesuffix(".dist-info") if found else None


def test_the_vllm_example_is_pinned_probed_and_keeps_its_model_on_a_volume() -> None:
    statefulset = engine("vllm")
    (container,) = pod_spec(statefulset)["containers"]
    image, _, tag = container["image"].partition(":")
    assert image == "vllm/vllm-openai" and re.fullmatch(r"v\d+\.\d+\.\d+", tag)
    version = installed_vllm_version()
    if version is not None:  # the release the real-engine tests run
        assert tag == f"v{version}"
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    # Hugging Face's cache on a claim of each replica's own, not an emptyDir.
    home = {item["name"]: item.get("value") for item in container["env"]}["HF_HOME"]
    (mount,) = (m for m in container["volumeMounts"] if home.startswith(m["mountPath"] + "/"))
    claims = {claim["metadata"]["name"] for claim in statefulset["spec"]["volumeClaimTemplates"]}
    assert mount["name"] in claims
    assert mount["name"] not in {volume["name"] for volume in pod_spec(statefulset)["volumes"]}


# --- the README's path -------------------------------------------------------------------------


def readme_kubernetes() -> str:
    text = (ROOT / "README.md").read_text()
    return text[
        text.index("## Kubernetes\n") : text.index("\n## ", text.index("## Kubernetes\n") + 1)
    ]


def test_the_readme_overlay_builds_valid_manifests_whose_secrets_it_creates() -> None:
    section = readme_kubernetes()
    assert "docker build" in section and "docker push" in section
    (kustomization,) = re.findall(r"<<'EOF'\n(.*?)\nEOF\n", section, re.S)
    target = re.search(r"mkdir -p (k8s/overlays/\w+)", section)
    assert target is not None
    image = re.search(r"^IMAGE=(\S+):(\S+)$", section, re.M)
    assert image is not None
    assert 'kustomize edit set image prefix-gateway="$IMAGE"' in section
    # What `kustomize edit set image prefix-gateway=NAME:TAG` writes into the file.
    edited = yaml.safe_load(kustomization)
    edited["images"] = [{"name": "prefix-gateway", "newName": image[1], "newTag": image[2]}]
    overlay = operator_overlay(Path(target[1]).name, yaml.safe_dump(edited))
    assert overlay.parent.parent == k8s_copy()
    documents = render(overlay)
    assert kubectl_kustomize(overlay) == {key(doc): doc for doc in documents}
    kinds = {doc["kind"] for doc in documents}
    assert {"PrometheusRule", "ServiceMonitor"} <= kinds
    assert "prefix-gateway-dashboard" in by_kind(documents, "ConfigMap")
    created = {
        (name, field)
        for name, field in re.findall(
            r"kubectl -n llm create secret generic (\S+) --from-literal=([\w-]+)=", section
        )
    }
    for doc in documents:
        if is_custom(doc):
            continue
        validate(doc)
        if doc["kind"] in ("Deployment", "StatefulSet"):
            spec = pod_spec(doc)
            for container in (*spec.get("initContainers", []), *spec["containers"]):
                assert container["image"] != "prefix-gateway:0.1.0", "the image was set"
                for ref in secret_refs(container).values():
                    if not ref.get("optional"):
                        assert (ref["name"], ref["key"]) in created, f"{ref} is never created"
