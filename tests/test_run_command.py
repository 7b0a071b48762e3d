"""`prefix-gateway serve --emulate N` as an operator runs it: its replicas end with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from prefix_gateway.logwatch import GATEWAY_LOG
from tests.support import ROOT, free_port


def children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        listed = (task / "children").read_text().split()
        found.update(int(child) for child in listed)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def start(port: int) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "prefix_gateway", "serve", "--port", str(port), "--emulate", "2"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, "the gateway did not start"
        assert process.poll() is None, process.stdout.read() if process.stdout else ""
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.1)


def gone(pids: set[int]) -> bool:
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("ending", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_the_emulated_replicas_end_with_the_gateway(ending: signal.Signals) -> None:
    process = start(free_port())
    replicas = children(process.pid)
    try:
        assert len(replicas) == 2
        os.kill(process.pid, ending)
        output, _ = process.communicate(timeout=60)
        assert gone(replicas), "an emulated replica outlived the gateway"
        if ending is not signal.SIGKILL:
            assert "stopped 2 emulated replicas" in output
            assert GATEWAY_LOG.errors(output) == []
            assert process.returncode == 128 + ending
    finally:
        for pid in replicas:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if process.poll() is None:
            process.kill()
            process.wait()
