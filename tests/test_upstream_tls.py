"""Replicas as the gateway's components reach them: the request path's client and the probes
verify certificates alike, and neither goes through a proxy named in the environment."""

from __future__ import annotations

import asyncio
import shutil
import ssl
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import httpx
import pytest

from prefix_gateway.components import Components
from prefix_gateway.config import ConfigError, Settings
from prefix_gateway.proxy.upstream import UpstreamError
from tests.support import free_port
from tests.test_discovery import self_signed_certificate
from tests.test_http1 import answer, served


async def _answer_everything(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        head = await reader.readuntil(b"\r\n\r\n")
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                await reader.readexactly(int(line.split(b":")[1]))
        writer.write(answer(b"ok"))
        await writer.drain()


def replica(tls: ssl.SSLContext | None = None) -> AbstractAsyncContextManager[str]:
    return served(_answer_everything, tls)


async def reach(url: str, **settings: object) -> tuple[str, str]:
    """What the request path and a probe each got from `url`: "ok" or why they failed."""
    components = Components.build(Settings(backend=(url,), **settings).validate())  # type: ignore[arg-type]
    await components.upstream.start()
    try:
        try:
            response = await components.upstream.send(url + "/v1/completions", b"{}", [], True)
            sent = (await response.read()).decode()
            response.release()
        except UpstreamError as failed:
            sent = failed.cause
        try:
            probed = (await components.probes.get(url + "/health")).text
        except httpx.ConnectError:
            probed = "connect"
    finally:
        await components.upstream.close()
        await components.probes.aclose()
    return sent, probed


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test certificate")
def test_requests_and_probes_verify_replicas_certificates_alike(tmp_path: Path) -> None:
    certificate, key = self_signed_certificate(tmp_path)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(certificate, key)

    async def scenario() -> list[tuple[str, str]]:
        async with replica(tls) as url:
            return [
                await reach(url),  # the system's authorities do not know this one
                await reach(url, upstream_ca_file=str(certificate)),
                await reach(url, upstream_tls_verify=False),
            ]

    assert asyncio.run(scenario()) == [("connect", "connect"), ("ok", "ok"), ("ok", "ok")]


def test_a_missing_ca_file_is_refused_at_start_up(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="upstream_ca_file"):
        Settings(backend=("http://a:1",), upstream_ca_file=str(tmp_path / "none.pem")).validate()


def test_replicas_are_reached_directly_whatever_proxy_the_environment_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.setenv(name, nowhere)
        monkeypatch.setenv(name.lower(), nowhere)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)

    async def scenario() -> tuple[str, str]:
        async with replica() as url:
            return await reach(url)

    assert asyncio.run(scenario()) == ("ok", "ok")
