"""The admin API open on loopback without a token, behind a reverse proxy on the same host: it
judges the client the proxy names, as the forwarding headers are judged. A proxy of the test's
own on loopback relays each request as nginx's defaults do (`Host: 127.0.0.1`, the client's
address appended to `X-Forwarded-For`); the gateway believes it through `--trusted-proxies`, or
sees the forwarding header without believing it. A client elsewhere gets 403 `foreign_client`
and changes nothing; one on this machine, relayed or not, is served.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.fault_servers import FaultServer, read_request
from tests.support import GatewayProcess
from tests.threaded_server import ThreadedServer

MODEL = "proxied-model"
OUTSIDE = "203.0.113.9"


class ReverseProxy(ThreadedServer):
    """Relays each request to `target` as a reverse proxy on the same host does: `Host` set
    to the target's address and `X-Forwarded-For` naming the client (`client_for`, as if it
    had come from there)."""

    def __init__(self, target: str, client_for: str) -> None:
        super().__init__()
        self._target = target
        self.client_for = client_for

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await read_request(reader)
        if request is None:
            return
        host, _, port = self._target.partition(":")
        upstream_reader, upstream = await asyncio.open_connection(host, int(port))
        headers = {
            **{k: v for k, v in request.headers.items() if k not in ("host", "connection")},
            "host": host,
            "x-forwarded-for": self.client_for,
            "x-forwarded-proto": "http",
            "connection": "close",
            "content-length": str(len(request.body)),
        }
        head = f"{request.method} {request.path} HTTP/1.1\r\n" + "".join(
            f"{name}: {value}\r\n" for name, value in headers.items()
        )
        try:  # both closed whatever happens, or a later test finds them unclosed
            upstream.write(head.encode() + b"\r\n" + request.body)
            await upstream.drain()
            while data := await upstream_reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            upstream.close()
            writer.close()


@pytest.fixture(scope="module")
def replica() -> Iterator[FaultServer]:
    with FaultServer() as started:
        yield started


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("admin-proxy") / "gateway.yaml"
    path.write_text(yaml.safe_dump({"tenants": [{"name": "search", "api_key": "search-key"}]}))
    return path


@pytest.fixture(scope="module", params=["trusted", "untrusted"])
def gateway(
    request: pytest.FixtureRequest, replica: FaultServer, config: Path
) -> Iterator[GatewayProcess]:
    """Behind the proxy: believed (`--trusted-proxies 127.0.0.1`), or not."""
    trusted = ("--trusted-proxies", "127.0.0.1") if request.param == "trusted" else ()
    with GatewayProcess([f"{MODEL}={replica.url}"], "--config", str(config), *trusted) as started:
        yield started


def _names(gateway: GatewayProcess) -> list[str]:
    listing = httpx.get(gateway.url + "/admin/backends", timeout=30).json()["data"]
    return sorted(item["name"] for item in listing)


def test_a_client_elsewhere_named_by_the_proxy_is_refused_and_changes_nothing(
    gateway: GatewayProcess,
) -> None:
    before = _names(gateway)
    with (
        ReverseProxy(f"127.0.0.1:{gateway.port}", OUTSIDE) as proxy,
        FaultServer() as newcomer,
    ):
        tenants = httpx.get(proxy.url + "/admin/tenants", timeout=30)
        added = httpx.post(proxy.url + "/admin/backends", json={"url": newcomer.url}, timeout=30)
        explained = httpx.post(
            proxy.url + "/admin/explain",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
    # A proxy that says so in RFC 7239's header is believed as much.
    forwarded = httpx.get(
        gateway.url + "/admin/tenants",
        headers={"forwarded": f'for="{OUTSIDE}:4711";proto=https, for=127.0.0.1'},
        timeout=30,
    )
    for answer in (tenants, added, explained, forwarded):
        assert answer.status_code == 403, answer.text
        error = answer.json()["error"]
        assert error["code"] == "foreign_client"
        assert OUTSIDE in error["message"]
    assert _names(gateway) == before


def test_a_client_on_this_machine_is_served_through_the_proxy_and_directly(
    gateway: GatewayProcess,
) -> None:
    with ReverseProxy(f"127.0.0.1:{gateway.port}", "127.0.0.1") as proxy:
        relayed = httpx.get(proxy.url + "/admin/tenants", timeout=30)
    direct = httpx.get(gateway.url + "/admin/tenants", timeout=30)
    for answer in (relayed, direct):
        assert answer.status_code == 200, answer.text
        assert [tenant["name"] for tenant in answer.json()["data"]] == ["search"]


def test_an_admin_token_is_required_whoever_the_proxy_names(
    replica: FaultServer, tmp_path: Path
) -> None:
    """With a token the client's address does not matter: the token decides."""
    with (
        GatewayProcess(
            [f"{MODEL}={replica.url}"], "--trusted-proxies", "127.0.0.1", "--admin-token", "tok"
        ) as gateway,
        ReverseProxy(f"127.0.0.1:{gateway.port}", OUTSIDE) as proxy,
    ):
        missing = httpx.get(proxy.url + "/admin/backends", timeout=30)
        given = httpx.get(
            proxy.url + "/admin/backends", headers={"authorization": "Bearer tok"}, timeout=30
        )
    assert missing.status_code == 401
    assert given.status_code == 200
