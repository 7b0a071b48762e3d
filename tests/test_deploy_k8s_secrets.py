"""The Kubernetes manifests keep their secrets and their pods to themselves: every key, token
and password comes from a Secret through the environment (never an argument, which `ps`
shows), Redis and the replicas require the secret the gateway holds, a NetworkPolicy admits
only the gateway to the replicas and Redis and only Prometheus to the gateway's metrics port,
and the engines do not run as root. Checked on the
overlays as kustomize builds them (tests/test_deploy_k8s.py renders and validates them)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import redis as redis_client

from prefix_gateway.processes import free_port
from tests.k8s_builds import BUILDS, K8S, built, engine_of
from tests.kustomize_render import Manifest, render
from tests.test_deploy_k8s import REFERENCE, by_kind, engine, gateway_of, pod_spec, workloads

SECRET_NAME = re.compile(r"KEY|TOKEN|PASSWORD|SECRET|AUTH", re.IGNORECASE)
SECRET_FLAG = re.compile(r"--(api-key|upstream-api-key|admin-token|requirepass|redis-url)\b")
SECRET_FROM_VARIABLE = re.compile(r'--api-key "\$[A-Z_]*KEY"')
ENGINES = {"vllm", "sglang"}


def containers(documents: list[Manifest]) -> list[tuple[str, Manifest]]:
    return [
        (workload["metadata"]["name"], container)
        for workload in workloads(documents)
        for kind in ("initContainers", "containers")
        for container in pod_spec(workload).get(kind, [])
    ]


def variables(container: Manifest) -> dict[str, Manifest]:
    return {item["name"]: item for item in container.get("env", [])}


def secret_of(variable: Manifest) -> tuple[str, str]:
    reference = variable["valueFrom"]["secretKeyRef"]
    return (reference["name"], reference["key"])


@pytest.mark.parametrize("name", BUILDS)
def test_no_argument_or_plain_variable_holds_a_secret(name: str) -> None:
    for workload, container in containers(built(name)):
        words = " ".join([*container.get("command", []), *container.get("args", [])])
        # An engine that takes its key only as a flag gets it from a Secret-fed variable,
        # expanded by a shell when the container starts: no manifest holds it.
        words = SECRET_FROM_VARIABLE.sub("", words)
        assert not SECRET_FLAG.search(words), f"{workload}: a secret as an argument: {words}"
        defined: set[str] = set()
        for name, variable in variables(container).items():
            if "value" in variable:
                # A plain value may carry a secret only as $(NAME) of a Secret-fed variable.
                for referred in REFERENCE.findall(variable["value"]):
                    assert referred in defined, f"{workload}: {name} refers to {referred}"
                    assert SECRET_NAME.search(referred)
                if SECRET_NAME.search(name):
                    assert REFERENCE.search(variable["value"]), f"{workload}: {name} in clear"
            else:
                assert "secretKeyRef" in variable["valueFrom"] or not SECRET_NAME.search(name)
            defined.add(name)


def test_redis_requires_the_password_the_gateway_connects_with() -> None:
    documents = render(K8S / "base")
    (redis,) = pod_spec(by_kind(documents, "StatefulSet")["redis"])["containers"]
    script = " ".join(redis["args"])
    assert "requirepass" in script and "$REDIS_PASSWORD" in script
    redis_variables = variables(redis)
    password = secret_of(redis_variables["REDIS_PASSWORD"])
    assert "optional" not in redis_variables["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert secret_of(redis_variables["REDISCLI_AUTH"]) == password  # the probe authenticates
    assert redis["readinessProbe"]["exec"]["command"] == ["redis-cli", "ping"]
    gateway = variables(pod_spec(gateway_of(documents))["containers"][0])
    assert secret_of(gateway["REDIS_PASSWORD"]) == password
    assert gateway["GATEWAY_REDIS_URL"]["value"].startswith("redis://:$(REDIS_PASSWORD)@redis:")


@pytest.mark.parametrize(
    ("engine_name", "variable"), [("vllm", "VLLM_API_KEY"), ("sglang", "SGLANG_API_KEY")]
)
def test_the_engine_requires_the_key_the_gateway_sends(engine_name: str, variable: str) -> None:
    documents = built(engine_name)
    (container,) = pod_spec(engine(engine_name))["containers"]
    key = secret_of(variables(container)[variable])
    if engine_name == "sglang":  # its key only as a flag, from the variable
        assert f'--api-key "${variable}"' in " ".join(container["command"])
    gateway = variables(pod_spec(gateway_of(documents))["containers"][0])
    assert secret_of(gateway["GATEWAY_UPSTREAM_API_KEY"]) == key


@pytest.mark.parametrize("engine_name", sorted(ENGINES))
def test_the_engine_runs_as_a_user_not_root_with_its_caches_writable(engine_name: str) -> None:
    spec = pod_spec(engine(engine_name))
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] > 0
    (container,) = spec["containers"]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    home = variables(container)["HOME"]["value"]
    assert home in {mount["mountPath"] for mount in container["volumeMounts"]}
    assert not any(mount["mountPath"].startswith("/root") for mount in container["volumeMounts"])


def selects(policy: Manifest, workload: Manifest) -> bool:
    wanted = policy["spec"]["podSelector"]["matchLabels"]
    labels: dict[str, Any] = workload["spec"]["template"]["metadata"]["labels"]
    return bool(wanted.items() <= labels.items())


def port_names(workload: Manifest) -> set[str]:
    return {
        port["name"]
        for container in pod_spec(workload)["containers"]
        for port in container["ports"]
    }


@pytest.mark.parametrize("name", BUILDS)
def test_a_network_policy_admits_only_the_gateway_to_replicas_and_redis(name: str) -> None:
    documents = built(name)
    policies = by_kind(documents, "NetworkPolicy").values()
    gateway = gateway_of(documents)
    gateway_labels = gateway["spec"]["template"]["metadata"]["labels"]
    for workload in workloads(documents):
        name = workload["metadata"]["name"]
        (policy,) = (policy for policy in policies if selects(policy, workload))
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        rules = policy["spec"]["ingress"]
        for rule in rules:
            assert {port["port"] for port in rule["ports"]} <= port_names(workload)
        if workload is gateway:
            continue
        assert name in ENGINES | {"redis"}
        for rule in rules:
            for peer in rule["from"]:
                # Only pods of the gateway, in this namespace (no namespaceSelector).
                assert set(peer) == {"podSelector"}, f"{name}: {peer}"
                assert peer["podSelector"]["matchLabels"].items() <= gateway_labels.items()
                assert (
                    peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"
                )
    assert {workload["metadata"]["name"] for workload in workloads(documents)} >= {
        "redis",
        engine_of(name),
    }


PROMETHEUS = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
}
"""Prometheus's pods in the namespace `monitoring` (one peer: both selectors must match)."""


def test_the_metrics_port_admits_only_prometheus_and_the_api_port_only_clients() -> None:
    documents = render(K8S / "base")
    gateway = gateway_of(documents)
    (policy,) = (
        policy
        for policy in by_kind(documents, "NetworkPolicy").values()
        if selects(policy, gateway)
    )
    admitted: dict[str, list[Manifest]] = {}
    for rule in policy["spec"]["ingress"]:
        # A rule without ports would admit its peers to every port, /metrics's included.
        assert rule.get("ports"), f"a rule for every port: {rule}"
        for port in rule["ports"]:
            admitted.setdefault(port["port"], []).extend(rule["from"])
    assert set(admitted) == {"http", "metrics"}
    assert admitted["metrics"] == [PROMETHEUS]
    assert PROMETHEUS not in admitted["http"]
    assert {"podSelector": {}} in admitted["http"]  # the gateway's own namespace
    # No rule admits every namespace: each peer is this namespace's pods or a chosen namespace.
    for peer in admitted["http"]:
        if "namespaceSelector" in peer:
            assert peer["namespaceSelector"].get("matchLabels"), f"every namespace: {peer}"


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_the_shipped_redis_command_refuses_clients_without_the_password(tmp_path: Path) -> None:
    """The manifest's own start script, run with a real redis-server on a loopback port."""
    documents = render(K8S / "base")
    (redis,) = pod_spec(by_kind(documents, "StatefulSet")["redis"])["containers"]
    assert redis["command"] == ["sh", "-c"]
    port = free_port()
    script = redis["args"][0].replace("/conf/", f"{tmp_path}/") + f" --port {port} --bind 127.0.0.1"
    password = "0123abcd" * 4
    environment = {**os.environ, "REDIS_PASSWORD": password}
    with subprocess.Popen(["sh", "-c", script], env=environment, cwd=tmp_path) as server:
        try:
            url = pod_spec(gateway_of(documents))["containers"][0]["env"]
            template = next(item["value"] for item in url if item["name"] == "GATEWAY_REDIS_URL")
            address = template.replace("$(REDIS_PASSWORD)", password).replace(
                "@redis:", "@127.0.0.1:"
            )
            address = address.replace(":6379/", f":{port}/")

            def ping(authenticated: str) -> str:
                client = redis_client.Redis.from_url(authenticated, socket_timeout=5)
                try:
                    return str(client.ping())
                except (redis_client.AuthenticationError, redis_client.ResponseError) as error:
                    return str(error)
                except redis_client.ConnectionError:
                    return "not listening yet"
                finally:
                    client.close()

            deadline = time.monotonic() + 30
            while ping(address) != "True":
                assert time.monotonic() < deadline, "redis never answered the gateway's URL"
                assert server.poll() is None, "redis-server exited"
                time.sleep(0.1)
            assert "Authentication required" in ping(f"redis://127.0.0.1:{port}/0")
            assert password not in " ".join(open_command_line(server.pid))
        finally:
            server.terminate()
            server.wait(10)


def open_command_line(pid: int) -> list[str]:
    """What `ps` shows of the process `pid`."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
