"""Several worker processes on one port under a supervisor (`--workers N`): it binds the socket
(and the metrics port's, with `--metrics-port`) once for every worker to accept from
(docs/deploy.md), restarts dead workers with a growing pause, passes signals on and keeps the
multiprocess metrics directory.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING

from prefix_gateway.config import Settings
from prefix_gateway.listeners import Listeners, bind_listeners

if TYPE_CHECKING:
    from prometheus_client import Counter

    from prefix_gateway.metrics.process import ProcessSeries

log = logging.getLogger("prefix_gateway.workers")

# prometheus_client reads this variable once, when it is first imported.
_METRICS_DIR_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"
# uvicorn's exit status when the app's start-up failed: starting again would fail again.
_STARTUP_FAILURE = 3
# A worker that dies younger than this is restarted after a pause that doubles each time.
_SHORT_LIFE_SECONDS = 5.0
_FIRST_PAUSE_SECONDS = 0.5
_LONGEST_PAUSE_SECONDS = 10.0
# Beyond the workers' own shutdown periods, before the supervisor kills what is left.
_STOP_MARGIN_SECONDS = 5.0


@dataclass
class MetricsDirectory:
    path: Path
    owned: bool  # created here, so removed at exit

    def remove(self) -> None:
        if self.owned:
            shutil.rmtree(self.path, ignore_errors=True)


def prepare_metrics_directory() -> MetricsDirectory:
    """Empties $PROMETHEUS_MULTIPROC_DIR, or creates a temporary one and sets the variable;
    called before prometheus_client is imported, which chooses its mode at import."""
    given = os.environ.get(_METRICS_DIR_VARIABLE)
    if given:
        directory = MetricsDirectory(Path(given), owned=False)
        directory.path.mkdir(parents=True, exist_ok=True)
        # Files of an earlier run would add its counts to this one's.
        for stale in directory.path.glob("*.db"):
            stale.unlink()
    else:
        directory = MetricsDirectory(Path(tempfile.mkdtemp(prefix="prefix-gateway-metrics-")), True)
        os.environ[_METRICS_DIR_VARIABLE] = str(directory.path)
    return directory


def run_workers(settings: Settings, directory: MetricsDirectory) -> int:
    """Serve with `settings.workers` processes until a signal has stopped them all; blocks."""
    from prometheus_client import CollectorRegistry, values

    from prefix_gateway.metrics.process import ProcessSeries
    from prefix_gateway.metrics.registry import worker_restarts_counter

    if values.ValueClass is values.MutexValue:
        # Imported before the variable was set (the command line's parsers import the
        # emulator): switch this process as the library would have at import. The workers
        # are fresh interpreters, started with the variable set.
        values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]
    if not settings.redis_url:
        log.warning(
            "%d workers without --redis-url: each keeps its own prefix index, sessions and"
            " stored responses' replicas, so prefix and session affinity hold only within a"
            " worker, and a previous_response_id only at the worker that saw it produced",
            settings.workers,
        )
    try:
        listeners = bind_listeners(settings)
    except OSError as exc:
        # As uvicorn ends one process that cannot bind its port.
        log.error("cannot listen: %s", exc)
        directory.remove()
        return _STARTUP_FAILURE
    restarts = worker_restarts_counter(CollectorRegistry())
    # The supervisor's own CPU and memory are the pod's too.
    own_process = ProcessSeries(CollectorRegistry(), multiprocess=True)
    try:
        return Supervisor(settings, listeners, directory.path, restarts, own_process).run()
    finally:
        listeners.close()
        directory.remove()


@dataclass
class _Slot:
    number: int
    process: BaseProcess | None = None
    started_at: float = 0.0
    generation: int = 0
    short_lives: int = 0
    start_at: float = 0.0


class Supervisor:
    def __init__(
        self,
        settings: Settings,
        listeners: Listeners,
        metrics_dir: Path,
        restarts: Counter,
        own_process: ProcessSeries,
    ) -> None:
        self._settings = settings
        self._own_process = own_process
        self._listeners: Listeners | None = listeners
        self._metrics_dir = metrics_dir
        self._restarts = restarts
        self._context = multiprocessing.get_context("spawn")
        self._slots = [_Slot(number) for number in range(settings.workers)]
        self._stopping_since: float | None = None
        self._exit_status = 0

    def run(self) -> int:
        wakeup_read, wakeup_write = socket.socketpair()
        wakeup_read.setblocking(False)
        wakeup_write.setblocking(False)
        previous_wakeup = signal.set_wakeup_fd(wakeup_write.fileno())
        handlers = {
            sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            for slot in self._slots:
                self._start(slot)
            assert self._listeners is not None
            log.info("serving on %s with %d workers", self._listeners.describe(), len(self._slots))
            while self._supervise(wakeup_read):
                self._own_process.refresh()  # a round lasts a second at most
        finally:
            signal.set_wakeup_fd(previous_wakeup)
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            wakeup_read.close()
            wakeup_write.close()
            self._kill_all()
        return self._exit_status

    def _supervise(self, wakeup: socket.socket) -> bool:
        """One round: wait for a death, a signal or a due restart; False once all have stopped."""
        alive = [slot.process for slot in self._slots if slot.process is not None]
        if self._stopping_since is not None and not alive:
            return False
        sentinels: list[socket.socket | int] = [wakeup]
        sentinels += [process.sentinel for process in alive]
        if wakeup in wait(sentinels, timeout=self._timeout()):
            with contextlib.suppress(BlockingIOError):
                while wakeup.recv(64):
                    pass
            self._stop_workers()
        now = time.monotonic()
        for slot in self._slots:
            if slot.process is not None and slot.process.exitcode is not None:
                self._on_exit(slot, now)
            if slot.process is None and self._stopping_since is None and now >= slot.start_at:
                self._restarts.inc()
                self._start(slot)
        if self._stopping_since is not None:
            limit = self._settings.shutdown_delay + self._settings.shutdown_grace
            if now - self._stopping_since > limit + _STOP_MARGIN_SECONDS:
                log.error("workers still running %.0f s after the signal: killed", limit)
                self._kill_all()
        return True

    def _timeout(self) -> float:
        pending = [slot.start_at for slot in self._slots if slot.process is None]
        if self._stopping_since is not None or not pending:
            return 1.0
        return max(0.0, min(1.0, min(pending) - time.monotonic()))

    def _stop_workers(self) -> None:
        if self._stopping_since is None:
            self._stopping_since = time.monotonic()
            log.warning("stopping %d workers", len(self._slots))
            # The workers' copies keep accepting through the shutdown delay; the ports close
            # with the last of them.
            if self._listeners is not None:
                self._listeners.close()
                self._listeners = None
        # A second signal is passed on too: the workers then skip what is left of the delay.
        for slot in self._slots:
            if slot.process is not None and slot.process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(slot.process.pid, signal.SIGTERM)

    def _on_exit(self, slot: _Slot, now: float) -> None:
        from prometheus_client.multiprocess import mark_process_dead

        process = slot.process
        assert process is not None
        process.join()
        slot.process = None
        mark_process_dead(process.pid, str(self._metrics_dir))  # type: ignore[no-untyped-call]
        if self._stopping_since is not None:
            return
        if process.exitcode == _STARTUP_FAILURE and slot.generation == 0:
            log.error("worker %d failed to start: stopping", slot.number)
            self._exit_status = _STARTUP_FAILURE
            self._stop_workers()
            return
        lived = now - slot.started_at
        slot.short_lives = slot.short_lives + 1 if lived < _SHORT_LIFE_SECONDS else 0
        pause = 0.0
        if slot.short_lives:
            pause = min(_LONGEST_PAUSE_SECONDS, _FIRST_PAUSE_SECONDS * 2 ** (slot.short_lives - 1))
        slot.start_at = now + pause
        log.error(
            "worker %d (pid %s) exited with status %s after %.1f s; starting it again in %.1f s",
            slot.number,
            process.pid,
            process.exitcode,
            lived,
            pause,
        )

    def _start(self, slot: _Slot) -> None:
        assert self._listeners is not None
        if slot.started_at:
            slot.generation += 1
        process = self._context.Process(
            target=_work,
            args=(self._settings, slot.number, os.getpid(), self._listeners),
            name=f"prefix-gateway-worker-{slot.number}",
        )
        process.start()
        slot.process = process
        slot.started_at = time.monotonic()

    def _kill_all(self) -> None:
        for slot in self._slots:
            process = slot.process
            if process is not None and process.exitcode is None:
                process.kill()
                process.join()
            if process is not None:
                from prometheus_client.multiprocess import mark_process_dead

                mark_process_dead(process.pid, str(self._metrics_dir))  # type: ignore[no-untyped-call]
                slot.process = None


def _work(settings: Settings, number: int, supervisor_pid: int, listeners: Listeners) -> None:
    """A worker process: the whole gateway on the supervisor's sockets."""
    # Signals come from the supervisor alone, not also from a terminal's Ctrl-C to the group.
    os.setpgrp()
    from prefix_gateway.app import GatewayApp
    from prefix_gateway.logs import configure_logging
    from prefix_gateway.server import WorkerRole, serve

    configure_logging(settings.log_level, settings.log_format)
    try:
        serve(GatewayApp(settings), settings, WorkerRole(number, supervisor_pid, listeners))
    except Exception:
        # A record in the log's format, not multiprocessing's plain traceback; same status.
        log.exception("worker %d failed", number)
        raise SystemExit(1) from None
