"""Service discovery against a real UDP DNS server and a fake Kubernetes API on loopback.

The DNS server (dnspython) and the Kubernetes API (aiohttp: list and watch of EndpointSlices)
are small stand-ins for other people's systems; everything of ours runs for real, and the
end-to-end tests run the gateway and emulated replicas as processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import shutil
import socket
import ssl
import subprocess
import threading
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset
import httpx
import orjson
import pytest
from aiohttp import web

from prefix_gateway.backends.backend import Backend
from prefix_gateway.backends.discovery import Discovery
from prefix_gateway.backends.dns import DnsSource
from prefix_gateway.backends.kubernetes import KubernetesSource
from prefix_gateway.backends.membership import Membership, ServiceSpec
from prefix_gateway.backends.pool import BackendPool
from prefix_gateway.config import ConfigError, Settings
from prefix_gateway.emulator.process import EmulatorProcess
from prefix_gateway.processes import free_port
from tests.support import PATIENCE_SECONDS, GatewayProcess, eventually, wait_until

MODEL = "emulated-model"
SERVICE = "llm"
NAMESPACE = "inference"


class FakeDns:
    """An authoritative-looking UDP DNS server answering A/AAAA from a dict, in a thread."""

    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}
        self.silent = False
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._socket.bind(("127.0.0.1", 0))
        self._socket.settimeout(0.05)
        self.address = f"127.0.0.1:{self._socket.getsockname()[1]}"
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        while not self._stopped.is_set():
            try:
                data, peer = self._socket.recvfrom(4096)
            except TimeoutError:
                continue
            if self.silent:
                continue
            query = dns.message.from_wire(data)
            response = dns.message.make_response(query)
            question = query.question[0]
            addresses = self.records.get(question.name.to_text(omit_final_dot=True))
            if addresses is None:
                response.set_rcode(dns.rcode.NXDOMAIN)
            else:
                want_v6 = question.rdtype == dns.rdatatype.AAAA
                matching = [item for item in addresses if (":" in item) == want_v6]
                if matching:
                    kind = dns.rdatatype.to_text(question.rdtype)
                    response.answer.append(
                        dns.rrset.from_text(question.name, 1, "IN", kind, *matching)
                    )
            self._socket.sendto(response.to_wire(), peer)

    def __enter__(self) -> FakeDns:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stopped.set()
        self._thread.join()
        self._socket.close()


def endpoint_slice(
    name: str, addresses: dict[str, str], port: int, version: int, port_name: str = "http"
) -> dict[str, Any]:
    """An EndpointSlice; `addresses` maps each IP to `ready`, `not-ready` or `terminating`."""
    endpoints = [
        {
            "addresses": [address],
            "conditions": {
                "ready": state == "ready",
                "serving": state != "not-ready",
                "terminating": state == "terminating",
            },
        }
        for address, state in addresses.items()
    ]
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "resourceVersion": str(version),
            "labels": {"kubernetes.io/service-name": SERVICE},
        },
        "addressType": "IPv6" if any(":" in item for item in addresses) else "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
    }


class FakeKubernetes:
    """List and watch of EndpointSlices, as the API server serves them, in a thread."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self._tls = tls
        self.port = 0
        self.slices: dict[str, dict[str, Any]] = {}
        self.history: list[tuple[int, dict[str, Any]]] = []
        self.version = 100
        self.lists = 0
        self.authorizations: set[str] = set()
        self._watchers: set[asyncio.Queue[dict[str, Any] | None]] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._runner: web.AppRunner | None = None
        self.url = ""

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get(
            "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices", self._handle
        )
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self._tls)
        self._loop.run_until_complete(site.start())
        server = site._server
        assert server is not None
        port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        self.port = port
        self.url = f"{'https' if self._tls else 'http'}://127.0.0.1:{port}"
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()  # its own sockets too, not left to the collector

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.authorizations.add(request.headers.get("Authorization", ""))
        wrong_place = request.match_info["namespace"] != NAMESPACE
        selector = request.query.get("labelSelector")
        if wrong_place or selector != f"kubernetes.io/service-name={SERVICE}":
            return web.json_response({"kind": "Status", "code": 404}, status=404)
        if request.query.get("watch") != "true":
            self.lists += 1
            items = list(self.slices.values())
            metadata = {"resourceVersion": str(self.version)}
            return web.json_response(
                {"kind": "EndpointSliceList", "metadata": metadata, "items": items}
            )
        since = int(request.query.get("resourceVersion") or 0)
        response = web.StreamResponse()
        await response.prepare(request)
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        for version, event in self.history:
            if version > since:
                queue.put_nowait(event)
        self._watchers.add(queue)
        try:
            while True:
                change = await queue.get()
                if change is None:
                    break
                await response.write(orjson.dumps(change) + b"\n")
                if change["type"] == "ERROR":
                    break
        finally:
            self._watchers.discard(queue)
        return response

    def _emit(self, kind: str, item: dict[str, Any]) -> None:
        event = {"type": kind, "object": item}
        if kind != "ERROR":
            self.history.append((self.version, event))
        for queue in self._watchers:
            queue.put_nowait(event)

    def _call(self, work: Callable[[], None]) -> None:
        done = threading.Event()

        def run() -> None:
            work()
            done.set()

        self._loop.call_soon_threadsafe(run)
        done.wait(5)

    def put(self, name: str, addresses: dict[str, str], port: int, port_name: str = "http") -> None:
        def work() -> None:
            self.version += 1
            kind = "MODIFIED" if name in self.slices else "ADDED"
            item = endpoint_slice(name, addresses, port, self.version, port_name)
            self.slices[name] = item
            self._emit(kind, item)

        self._call(work)

    def delete(self, name: str) -> None:
        def work() -> None:
            self.version += 1
            item = dict(self.slices.pop(name))
            item["metadata"] = {**item["metadata"], "resourceVersion": str(self.version)}
            self._emit("DELETED", item)

        self._call(work)

    def expire_watches(self) -> None:
        """Tell every open watch its version is gone, as after a long disconnect."""
        gone = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}

        def work() -> None:
            self.history.clear()
            self._emit("ERROR", gone)

        self._call(work)

    def __enter__(self) -> FakeKubernetes:
        self._thread.start()
        self._ready.wait(5)
        return self

    def __exit__(self, *_: object) -> None:
        def close_watches() -> None:
            for queue in self._watchers:
                queue.put_nowait(None)

        self._call(close_watches)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def mark_healthy(pool: BackendPool) -> Callable[[Backend], Coroutine[Any, Any, None]]:
    """Stands in for the health probe, which the end-to-end tests run for real."""

    async def probe(backend: Backend) -> None:
        pool.models_listed(backend, backend.models or frozenset({MODEL}))
        pool.set_health(backend, True)

    return probe


def names(pool: BackendPool, model: str = MODEL) -> set[str]:
    serving = pool.serving(model)
    return {backend.name for backend in serving.backends} if serving else set()


# --- parsing ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "required", "expected"),
    [
        ("vllm.ns.svc:8000", True, ServiceSpec("vllm.ns.svc", "8000")),
        ("llama=vllm.ns.svc:8000", True, ServiceSpec("vllm.ns.svc", "8000", "llama")),
        ("http://vllm:8000", True, ServiceSpec("vllm", "8000")),
        ("vllm", False, ServiceSpec("vllm", "")),
        ("vllm:http", False, ServiceSpec("vllm", "http")),
        ("llama=vllm:8000", False, ServiceSpec("vllm", "8000", "llama")),
    ],
)
def test_targets_parse(spec: str, required: bool, expected: ServiceSpec) -> None:
    assert ServiceSpec.parse(spec, port_required=required) == expected


@pytest.mark.parametrize("spec", ["vllm.ns.svc", "vllm:http", "=:8000"])
def test_dns_targets_need_a_port(spec: str) -> None:
    with pytest.raises(ConfigError):
        ServiceSpec.parse(spec, port_required=True)


def test_discovery_alone_is_a_valid_configuration() -> None:
    Settings(backend_dns=("vllm.ns.svc:8000",)).validate()
    Settings(k8s_service=("vllm",)).validate()
    with pytest.raises(ConfigError):
        Settings().validate()


def test_kubernetes_needs_an_api_and_a_namespace(tmp_path: Path) -> None:
    settings = Settings(k8s_service=("vllm",), k8s_credentials=str(tmp_path))
    with pytest.raises(ConfigError, match="k8s-api-url"):
        Discovery.build(settings, BackendPool(), mark_healthy(BackendPool()), environ={})
    with pytest.raises(ConfigError, match="k8s-namespace"):
        Discovery.build(
            settings, BackendPool(), mark_healthy(BackendPool()), {"KUBERNETES_SERVICE_HOST": "h"}
        )
    (tmp_path / "namespace").write_text("team-a\n")
    discovery = Discovery.build(
        settings, BackendPool(), mark_healthy(BackendPool()), {"KUBERNETES_SERVICE_HOST": "fd00::1"}
    )
    source = discovery.sources[0]
    assert isinstance(source, KubernetesSource)
    assert source._access.api_url == "https://[fd00::1]:443"
    assert source._access.namespace == "team-a"
    asyncio.run(discovery.stop())


# --- membership ------------------------------------------------------------------------------


def drains() -> list[asyncio.Task[Any]]:
    """The drains under way on the running loop."""
    return [
        task
        for task in asyncio.all_tasks()
        if not task.done()
        and getattr(task.get_coro(), "__qualname__", "") == "BackendPool.finish_drain"
    ]


def suspended(task: asyncio.Task[Any]) -> bool:
    """The task has started and waits on something."""
    work = task.get_coro()
    return isinstance(work, Coroutine) and inspect.getcoroutinestate(work) == inspect.CORO_SUSPENDED


def test_membership_adds_drains_and_restores() -> None:
    async def scenario() -> None:
        pool = BackendPool.from_specs([f"{MODEL}=http://10.9.9.9:8000"])
        static = pool.backends[0]
        pool.set_health(static, True)
        membership = Membership(pool, "dns:vllm", None, mark_healthy(pool), drain_timeout=5)
        membership.update(["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
        await membership.probed()
        assert names(pool) == {"10.9.9.9:8000", "10.0.0.1:8000", "10.0.0.2:8000"}

        leaving = pool.get("10.0.0.2:8000")
        assert leaving is not None
        with pool.lease(leaving):
            membership.update(["http://10.0.0.1:8000"])
            assert names(pool) == {"10.9.9.9:8000", "10.0.0.1:8000"}
            # The drain has nothing to await before the request's end: once it waits, it
            # has seen the request in flight.
            (drain,) = drains()
            await eventually(lambda: suspended(drain), "the drain waiting")
            assert pool.get("10.0.0.2:8000") is leaving, "removed with a request in flight"
        await eventually(lambda: pool.get("10.0.0.2:8000") is None, "the drained backend removed")

        # A replica that comes back while it drains is simply routed to again.
        returning = pool.get("10.0.0.1:8000")
        assert returning is not None
        with pool.lease(returning):
            membership.update([])
            assert returning.draining
            membership.update(["http://10.0.0.1:8000"])
            assert not returning.draining
        await eventually(lambda: not drains(), "the interrupted drain ended")
        assert pool.get("10.0.0.1:8000") is returning
        assert pool.get("10.9.9.9:8000") is static, "a static backend is never discovered away"
        await membership.close()

    asyncio.run(scenario())


def test_a_stuck_request_does_not_hold_a_drain_forever() -> None:
    async def scenario() -> None:
        pool = BackendPool()
        membership = Membership(pool, "k8s:llm", MODEL, mark_healthy(pool), drain_timeout=0.1)
        membership.update(["http://10.0.0.1:8000"])
        await membership.probed()
        backend = pool.backends[0]
        assert backend.pinned_model == MODEL
        with pool.lease(backend):
            membership.update([])
            await eventually(lambda: not pool.backends, "the stuck drain given up")

    asyncio.run(scenario())


# --- DNS -------------------------------------------------------------------------------------


def test_dns_source_follows_a_and_aaaa_records(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario(server: FakeDns) -> None:
        pool = BackendPool()
        settings = Settings(
            backend_dns=("vllm.inference.svc:8000",),
            dns_nameserver=server.address,
            discovery_interval=0.3,
            drain_timeout=1,
        )
        discovery = Discovery.build(settings, pool, mark_healthy(pool))
        server.records["vllm.inference.svc"] = ["10.0.0.1", "10.0.0.2", "fd00::3"]
        await discovery.start()
        assert names(pool) == {"10.0.0.1:8000", "10.0.0.2:8000", "[fd00::3]:8000"}
        assert pool.get("[fd00::3]:8000") is not None
        assert pool.backends[0].url == "http://10.0.0.1:8000"

        server.records["vllm.inference.svc"] = ["10.0.0.2", "fd00::3", "10.0.0.4"]
        await eventually(
            lambda: names(pool) == {"10.0.0.2:8000", "[fd00::3]:8000", "10.0.0.4:8000"},
            "the new records followed",
        )

        # An unanswered lookup changes nothing; a name that no longer exists empties the pool.
        server.silent = True
        await eventually(
            lambda: "cannot resolve vllm.inference.svc" in caplog.text, "a lookup unanswered"
        )
        assert len(names(pool)) == 3
        server.silent = False
        del server.records["vllm.inference.svc"]
        await eventually(lambda: not pool.backends, "the pool emptied")
        await discovery.stop()

    with FakeDns() as server:
        asyncio.run(scenario(server))


def test_dns_lookup_failure_raises_for_the_caller() -> None:
    async def scenario(server: FakeDns) -> None:
        from prefix_gateway.backends.dns import build_resolver

        pool = BackendPool()
        membership = Membership(pool, "dns:vllm", None, mark_healthy(pool), 1)
        resolver = build_resolver(server.address)
        source = DnsSource(ServiceSpec("vllm", "8000"), membership, resolver, 0.2)
        server.silent = True
        with pytest.raises(dns.exception.Timeout):
            await source.sync()
        await source.close()

    import dns.exception

    with FakeDns() as server:
        asyncio.run(scenario(server))


# --- Kubernetes ------------------------------------------------------------------------------


def kubernetes_settings(api: FakeKubernetes, credentials: Path, spec: str) -> Settings:
    (credentials / "token").write_text("secret-token\n")
    (credentials / "namespace").write_text(NAMESPACE)
    return Settings(
        k8s_service=(spec,),
        k8s_api_url=api.url,
        k8s_credentials=str(credentials),
        discovery_interval=0.2,
        drain_timeout=1,
    )


def test_kubernetes_source_routes_only_to_ready_endpoints(tmp_path: Path) -> None:
    async def scenario(api: FakeKubernetes) -> None:
        pool = BackendPool()
        settings = kubernetes_settings(api, tmp_path, "llm:http")
        api.put("llm-a", {"10.0.0.1": "ready", "10.0.0.2": "not-ready"}, 8000)
        api.put("llm-b", {"10.0.1.1": "ready"}, 8000)
        discovery = Discovery.build(settings, pool, mark_healthy(pool))
        await discovery.start()
        assert names(pool) == {"10.0.0.1:8000", "10.0.1.1:8000"}

        api.put("llm-a", {"10.0.0.1": "terminating", "10.0.0.2": "ready"}, 8000)
        await eventually(
            lambda: names(pool) == {"10.0.0.2:8000", "10.0.1.1:8000"}, "the ready endpoints"
        )
        api.delete("llm-b")
        await eventually(lambda: names(pool) == {"10.0.0.2:8000"}, "the deleted slice's gone")
        await eventually(lambda: len(pool.backends) == 1, "the drained endpoint removed")

        # After the watch expires the source lists again and misses nothing.
        lists = api.lists
        api.expire_watches()
        api.put("llm-c", {"10.0.2.1": "ready"}, 8000)
        await eventually(
            lambda: names(pool) == {"10.0.0.2:8000", "10.0.2.1:8000"}, "the new slice's endpoint"
        )
        await eventually(lambda: api.lists > lists, "a new listing")
        assert api.authorizations == {"Bearer secret-token"}
        await discovery.stop()

    with FakeKubernetes() as api:
        asyncio.run(scenario(api))


def test_kubernetes_port_by_name_number_or_first(tmp_path: Path) -> None:
    async def scenario(api: FakeKubernetes) -> None:
        api.put("llm-a", {"10.0.0.1": "ready"}, 30000, port_name="sglang")
        for spec, expected in [
            ("llm", "10.0.0.1:30000"),
            ("llm:sglang", "10.0.0.1:30000"),
            ("llm:9000", "10.0.0.1:9000"),
        ]:
            pool = BackendPool()
            discovery = Discovery.build(
                kubernetes_settings(api, tmp_path, spec), pool, mark_healthy(pool)
            )
            await discovery.start()
            assert names(pool) == {expected}, spec
            await discovery.stop()
        pool = BackendPool()
        discovery = Discovery.build(
            kubernetes_settings(api, tmp_path, "llm:http"), pool, mark_healthy(pool)
        )
        await discovery.start()
        assert not pool.backends, "no port of that name: no replicas"
        await discovery.stop()

    with FakeKubernetes() as api:
        asyncio.run(scenario(api))


def self_signed_certificate(folder: Path) -> tuple[Path, Path]:
    certificate, key = folder / "server.crt", folder / "server.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=kubernetes",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(certificate),
        ],
        check=True,
        capture_output=True,
    )
    return certificate, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test certificate")
def test_in_cluster_defaults_reach_the_api_over_tls_with_the_pods_ca(tmp_path: Path) -> None:
    certificate, key = self_signed_certificate(tmp_path)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(certificate, key)
    credentials = tmp_path / "serviceaccount"
    credentials.mkdir()
    (credentials / "token").write_text("pod-token")
    (credentials / "namespace").write_text(NAMESPACE)

    async def scenario(api: FakeKubernetes) -> list[str]:
        settings = Settings(k8s_service=("llm",), k8s_credentials=str(credentials))
        environ = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(api.port)}
        pool = BackendPool()
        discovery = Discovery.build(settings, pool, mark_healthy(pool), environ)
        try:
            await discovery.sources[0].sync()
        finally:
            await discovery.stop()
        return sorted(names(pool))

    with FakeKubernetes(tls) as api:
        api.put("llm-a", {"10.0.0.1": "ready"}, 8000)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            asyncio.run(scenario(api))  # no ca.crt yet: the server is not trusted
        (credentials / "ca.crt").write_bytes(certificate.read_bytes())
        assert asyncio.run(scenario(api)) == ["10.0.0.1:8000"]
        assert "Bearer pod-token" in api.authorizations


# --- end to end: a replica leaves while requests keep succeeding -----------------------------


@contextlib.contextmanager
def loopback_replicas(count: int) -> Iterator[list[EmulatorProcess]]:
    """Replicas on 127.0.0.2, .3, ... sharing one port, as pods behind one Service do."""
    port = free_port("127.0.0.2")
    replicas = [
        EmulatorProcess(
            "--seed",
            str(position),
            "--decode-ms-per-token",
            "4",
            host=f"127.0.0.{position + 2}",
            port=port,
        )
        for position in range(count)
    ]
    try:
        for replica in replicas:
            replica.start()
        yield replicas
    finally:
        for replica in replicas:
            replica.stop()


class Traffic:
    """Conversations sent one after another from a thread, with every answer recorded."""

    def __init__(self, url: str) -> None:
        self._client = httpx.Client(base_url=url, timeout=30)
        self.results: list[tuple[int, int, str, str]] = []
        """(the request's number in sending order, status, backend, session)"""
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def send(self, session: str) -> tuple[int, str, str]:
        response = self._client.post(
            "/v1/chat/completions",
            headers={"x-session-id": session},
            json={
                "model": MODEL,
                "max_tokens": 8,
                "messages": [{"role": "user", "content": f"conversation {session} goes on"}],
            },
        )
        return (
            response.status_code,
            response.headers.get("x-gateway-backend", ""),
            response.headers.get("x-gateway-route", ""),
        )

    def _run(self) -> None:
        while not self._stop.is_set():
            number, session = self.sent, f"s{self.sent % 24}"
            self.sent += 1
            status, backend, _ = self.send(session)
            self.results.append((number, status, backend, session))

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(30)
        self._client.close()


def leave_mid_run(
    gateway: GatewayProcess, replicas: list[EmulatorProcess], leave: Callable[[], None]
) -> None:
    wait_until(
        lambda: httpx.get(gateway.url + "/ready", timeout=PATIENCE_SECONDS).status_code == 200,
        "the gateway ready",
    )
    wait_until(
        lambda: gateway.metric("gateway_backend_healthy") == len(replicas), "every replica healthy"
    )
    leaving = f"{replicas[-1].host}:{replicas[-1].port}"
    traffic = Traffic(gateway.url)
    # Every session bound before the traffic starts: two first turns of one session at once
    # could be placed apart, and the binding kept be the other one's.
    before = {session: traffic.send(session)[1] for session in (f"s{n}" for n in range(24))}
    assert leaving in before.values()
    with traffic:
        wait_until(lambda: len(traffic.results) > 10, "traffic flowing")
        leave()
        wait_until(
            lambda: gateway.metric("gateway_backend_healthy", backend=leaving) == 0,
            "the replica out of routing",
        )
        # Requests sent from here on were routed after the replica left.
        left_before = traffic.sent
        wait_until(
            lambda: gateway.metric("gateway_backend_in_flight", backend=leaving) == 0,
            "the replica's requests in flight finished",
        )
        replicas[-1].stop()  # the pod is gone for good
        wait_until(lambda: len(traffic.results) > left_before + 10, "traffic after the leave")
        after = {session: traffic.send(session)[1:] for session in before}
    statuses = {status for _, status, _, _ in traffic.results}
    assert statuses == {200}, "a request failed while a replica left"
    late = [backend for number, _, backend, _ in traffic.results if number >= left_before]
    assert late and leaving not in late
    # Only the sessions of the replica that left moved; every other session stayed put.
    for session, backend in before.items():
        if backend != leaving:
            assert after[session][0] == backend, (session, after[session], _moves(gateway))
        else:
            assert after[session][0] != leaving


PATIENT_PROBES = ("--health-timeout", "10", "--unhealthy-threshold", "5")
"""Probes no busy machine fails: a replica that stays must stay in routing throughout, or its
sessions move too (counted as `unhealthy`), which is not what these tests are about."""


def _moves(gateway: GatewayProcess) -> str:
    """The gateway's counts of sessions moved and of healthy backends, to tell why one moved."""
    lines = gateway.metrics().splitlines()
    wanted = ("gateway_session_moves_total{", "gateway_backend_healthy{", "gateway_backend_stalls")
    return "\n".join(line for line in lines if line.startswith(wanted))


@pytest.mark.slow
def test_replica_leaving_a_kubernetes_service_mid_run(tmp_path: Path) -> None:
    with FakeKubernetes() as api, loopback_replicas(3) as replicas:
        port = replicas[0].port
        ready = {replica.host: "ready" for replica in replicas}
        api.put("llm-a", ready, port)
        settings = kubernetes_settings(api, tmp_path, "llm:http")
        with GatewayProcess(
            [],
            "--k8s-service",
            "llm:http",
            "--k8s-api-url",
            settings.k8s_api_url,
            "--k8s-credentials",
            settings.k8s_credentials,
            "--discovery-interval",
            "0.2",
            *PATIENT_PROBES,
        ) as gateway:
            leave_mid_run(
                gateway,
                replicas,
                lambda: api.put("llm-a", {**ready, replicas[-1].host: "terminating"}, port),
            )


@pytest.mark.slow
def test_replica_leaving_a_headless_service_mid_run() -> None:
    with FakeDns() as server, loopback_replicas(3) as replicas:
        port = replicas[0].port
        server.records["llm.inference.svc"] = [replica.host for replica in replicas]
        with GatewayProcess(
            [],
            "--backend-dns",
            f"llm.inference.svc:{port}",
            "--dns-nameserver",
            server.address,
            "--discovery-interval",
            "0.2",
            *PATIENT_PROBES,
        ) as gateway:
            leave_mid_run(
                gateway,
                replicas,
                lambda: server.records.__setitem__(
                    "llm.inference.svc", [replica.host for replica in replicas[:-1]]
                ),
            )
