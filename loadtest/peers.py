"""Peer routers to measure against, each run from its own virtual environment.

Peers are not dependencies of the gateway: the first use creates `.peers/<name>` beside the
repository and installs the peer there from PyPI.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from prefix_gateway.processes import free_port

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
        # Its metrics port is fixed by default: two peers side by side need their own.
        "--prometheus-port",
        str(free_port()),
        "--worker-urls",
        *workers,
    ]


def _litellm_command(home: Path, workers: Sequence[str], model: str, port: int) -> list[str]:
    entries = [
        {
            "model_name": model,
            "litellm_params": {
                "model": f"openai/{model}",
                "api_base": worker + "/v1",
                "api_key": "unused",
            },
        }
        for worker in workers
    ]
    config = Path(tempfile.mkdtemp()) / "litellm.yaml"
    config.write_text(yaml.safe_dump({"model_list": entries}))
    return [
        str(home / "bin" / "litellm"),
        "--config",
        str(config),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--num_workers",
        "1",
    ]


PEERS = {
    "sglang-round_robin": ("sglang", "sglang-router", "round_robin"),
    "sglang-cache_aware": ("sglang", "sglang-router", "cache_aware"),
    "litellm": ("litellm", "litellm[proxy]", ""),
}


def start_peer(name: str, workers: Sequence[str], model: str, timeout: float = 180.0) -> Peer:
    if name not in PEERS:
        raise SystemExit(f"unknown peer {name!r}; choose from {', '.join(PEERS)}")
    kind, requirement, policy = PEERS[name]
    home = _venv(kind, requirement)
    port = free_port()
    if kind == "litellm":
        command = _litellm_command(home, workers, model, port)
    else:
        command = _sglang_command(home, policy, workers, port)
    # LiteLLM reads its model price list from the package, not the network, and runs without
    # a master key: a benchmark on loopback, whose clients send no key to any router.
    env = {
        **os.environ,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_TELEMETRY": "False",
        "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true",
    }
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
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
