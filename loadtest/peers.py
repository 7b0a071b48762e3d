"""Peer routers to measure against, each run from its own virtual environment.

Peers are not dependencies of the gateway: the first use creates `.peers/<name>` beside the
repository and installs the peer there from PyPI.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from gateway.child import free_port

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Router:
    name: str
    url: str
    pid: int


@dataclass
class Peer:
    router: Router
    process: subprocess.Popen[bytes]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _venv(name: str, requirement: str) -> Path:
    home = ROOT / ".peers" / name
    python = home / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(home)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", requirement], check=True)
    return home


def _sglang_command(home: Path, policy: str, workers: Sequence[str], port: int) -> list[str]:
    return [
        str(home / "bin" / "python"),
        "-m",
        "sglang_router.launch_router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        policy,
        "--worker-urls",
        *workers,
    ]


PEERS = {
    "sglang-round_robin": ("sglang", "sglang-router", "round_robin"),
    "sglang-cache_aware": ("sglang", "sglang-router", "cache_aware"),
}


def start_peer(name: str, workers: Sequence[str], model: str, timeout: float = 60.0) -> Peer:
    if name not in PEERS:
        raise SystemExit(f"unknown peer {name!r}; choose from {', '.join(PEERS)}")
    kind, requirement, policy = PEERS[name]
    home = _venv(kind, requirement)
    port = free_port()
    process = subprocess.Popen(
        _sglang_command(home, policy, workers, port),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"peer {name} exited with {process.returncode}")
        try:
            probe = httpx.post(
                url + "/v1/chat/completions",
                json={
                    "model": model,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 1,
                },
                timeout=2,
            )
            if probe.status_code == 200:
                return Peer(Router(name, url, process.pid), process)
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"peer {name} did not answer within {timeout} s")
