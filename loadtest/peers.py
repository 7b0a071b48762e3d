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
from collections.abc import Mapping, Sequence
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
    """`.peers/<name>` with `requirement` installed (once: a stamp file names it)."""
    home = ROOT / ".peers" / name
    python = home / "bin" / "python"
    stamp = home / f".installed-{requirement}"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(home)], check=True)
    if not stamp.exists():
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", requirement], check=True)
        stamp.touch()
    return home


def _router_command(
    program: Sequence[str], policy: str, workers: Sequence[str], port: int
) -> list[str]:
    """SGLang's and vLLM's routers take the same flags for what is set here."""
    return [
        *program,
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


def _kv_event_sources(kv_events: Mapping[str, str], block_size: int, model: str) -> list[str]:
    """vLLM's router's flags for each engine's KV-cache events (ZeroMQ, tcp:// only), which
    its kv_aware policy learns what each engine caches from, in blocks of `block_size`; it
    asks the model they serve with them."""
    if not kv_events:
        return []
    sources = [
        flag
        for worker, endpoint in kv_events.items()
        for flag in ("--kv-event-source", f"{worker}={endpoint}")
    ]
    return [*sources, "--kv-event-block-size", str(block_size), "--kv-event-model", model]


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


SGLANG_ROUTER = "sglang-router==0.3.2"
VLLM_ROUTER = "vllm-router==0.1.17"
PEERS = {
    "sglang-round_robin": ("sglang", SGLANG_ROUTER, "round_robin"),
    "sglang-cache_aware": ("sglang", SGLANG_ROUTER, "cache_aware"),
    "vllm-router-round_robin": ("vllm-router", VLLM_ROUTER, "round_robin"),
    "vllm-router-cache_aware": ("vllm-router", VLLM_ROUTER, "cache_aware"),
    "vllm-router-kv_aware": ("vllm-router", VLLM_ROUTER, "kv_aware"),
    "litellm": ("litellm", "litellm[proxy]", ""),
}
"""Each peer by name: its venv under `.peers/`, what pip installs there, its policy. The
routers run with their defaults otherwise (vllm-router 0.1.17's `cache_aware`:
`--cache-threshold 0.3 --balance-abs-threshold 64 --balance-rel-threshold 1.5`; SGLang's
router 0.3.2 the same names and values)."""
NEEDS_KV_EVENTS = frozenset({"vllm-router-kv_aware"})


def peer_versions(names: Sequence[str]) -> str:
    """`name version` of each package the named peers run, for a benchmark's header."""
    requirements = sorted({PEERS[name][1] for name in names if name in PEERS})
    return ", ".join(requirement.replace("==", " ") for requirement in requirements)


def start_peer(
    name: str,
    workers: Sequence[str],
    model: str,
    timeout: float = 180.0,
    kv_events: Mapping[str, str] | None = None,
    kv_block_size: int = 16,
) -> Peer:
    """The peer `name` in front of `workers`; `kv_events`: each worker's KV-event endpoint
    (blocks of `kv_block_size` tokens), for the peers that read them (`NEEDS_KV_EVENTS`, which
    refuse to start without)."""
    if name not in PEERS:
        raise SystemExit(f"unknown peer {name!r}; choose from {', '.join(PEERS)}")
    if name in NEEDS_KV_EVENTS and not kv_events:
        raise SystemExit(f"peer {name} needs the replicas' KV-cache events (real vLLM)")
    kind, requirement, policy = PEERS[name]
    home = _venv(kind, requirement)
    port = free_port()
    if kind == "litellm":
        command = _litellm_command(home, workers, model, port)
    elif kind == "vllm-router":
        program = [str(home / "bin" / "vllm-router")]
        command = _router_command(program, policy, workers, port)
        events = kv_events if name in NEEDS_KV_EVENTS else None
        command += _kv_event_sources(events or {}, kv_block_size, model)
    else:
        program = [str(home / "bin" / "python"), "-m", "sglang_router.launch_router"]
        command = _router_command(program, policy, workers, port)
    # LiteLLM reads its model price list from the package, not the network, and runs without
    # a master key: a benchmark on loopback, whose clients send no key to any router.
    env = {
        **os.environ,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_TELEMETRY": "False",
        "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true",
    }
    # Its log in a file, so that a peer that will not start says why.
    with tempfile.NamedTemporaryFile(prefix=f"peer-{name}-", suffix=".log", delete=False) as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            last = Path(log.name).read_text(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(
                f"peer {name} exited with {process.returncode}: {' | '.join(last)}"
                f" (log: {log.name})"
            )
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
