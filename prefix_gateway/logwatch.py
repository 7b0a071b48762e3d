"""What a child process's log says went wrong: the log cut into records, each judged an error or
not by its program's own format, read a piece at a time while the process runs.

The gateway, the emulated replicas, vLLM, Redis and Prometheus each mark a record's first line
and its level their own way; a `LogFormat` says how, and a `LogWatch` reads one log with it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, ClassVar, Protocol

TRACEBACK = "Traceback (most recent call last):"
ASGI_ERROR = "Exception in ASGI application"
# Kept of a record in a report: its head says what it is, a traceback's start says where.
REPORTED_CHARACTERS = 4000


def read_log(log: IO[bytes], offset: int = 0) -> bytes:
    """What a child process wrote to `log` from `offset` on. Read without moving the file's
    position: the child writes through the same open file, at that position."""
    descriptor = log.fileno()
    return os.pread(descriptor, max(0, os.fstat(descriptor).st_size - offset), offset)


@dataclass(frozen=True)
class LogFormat:
    """A program's log: `record` matches a record's first line (its `level` group, if the
    format has levels); a record is an error when its level is one of `error_levels` or it contains
    one of `markers`. With `json_lines`, a line that starts with `{` is a record of its own,
    its level in its `level` field."""

    record: re.Pattern[str]
    error_levels: frozenset[str] = frozenset({"ERROR", "CRITICAL"})
    markers: tuple[str, ...] = (TRACEBACK,)
    json_lines: bool = False
    same_record: re.Pattern[str] | None = None
    """A line's head which, when the line before had the same one, continues its record: a
    program that writes each line of a record with the record's own head."""

    def starts_record(self, line: str) -> bool:
        return self.record.match(line) is not None or (self.json_lines and line.startswith("{"))

    def records(self, text: str) -> list[str]:
        """`text` cut into records: each from a record's first line to the next one's."""
        records: list[list[str]] = [[]]
        head: str | None = None
        for line in text.splitlines():
            if self.starts_record(line):
                own = self._head(line)
                if records[-1] and (own is None or own != head):
                    records.append([])
                head = own
            records[-1].append(line)
        return ["\n".join(lines) for lines in records if lines]

    def _head(self, line: str) -> str | None:
        found = self.same_record.match(line) if self.same_record is not None else None
        return found.group(0) if found is not None else None

    def errors(self, text: str) -> list[str]:
        """The error records of a whole log."""
        return [record for record in self.records(text) if self.is_error(record)]

    def is_error(self, record: str) -> bool:
        if any(marker in record for marker in self.markers):
            return True
        return self.level(record) in self.error_levels

    def level(self, record: str) -> str | None:
        found = self.record.match(record)
        if found is not None and "level" in found.groupdict():
            return found.group("level").upper()
        return _json_level(record) if self.json_lines else None


def _json_level(record: str) -> str | None:
    if not record.startswith("{"):
        return None
    try:
        line = json.loads(record.split("\n", 1)[0])
    except ValueError:
        return None
    level = line.get("level") if isinstance(line, dict) else None
    return level.upper() if isinstance(level, str) else None


GATEWAY_LOG = LogFormat(
    # The gateway's `%(asctime)s %(levelname)s ...` and uvicorn's `LEVEL:    ...`; a JSON line
    # (`--log-format json`, the access log) is a record of its own.
    record=re.compile(
        r"^(?:\d{4}-\d\d-\d\d [\d:,.]+ )?(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL)\b"
    ),
    markers=(TRACEBACK, ASGI_ERROR),
    json_lines=True,
)
VLLM_LOG = LogFormat(
    # `(APIServer pid=12) INFO 12-07 09:41:00 [file.py:1] ...`, uvicorn's `INFO:     ...` behind
    # the same prefix; the engine core's lines (its tracebacks too) carry a prefix of their own.
    record=re.compile(
        r"^(?:\([^)]*pid=\d+\) )?(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL)(?::| \d\d-\d\d )"
    ),
    # `logger.exception` writes each line of its traceback behind the record's own head.
    same_record=re.compile(r"^(?:\([^)]*pid=\d+\) )?[A-Z]+ \d\d-\d\d [\d:]+ \[[^\]]+\]"),
)
REDIS_LOG = LogFormat(
    # `12:M 07 Dec 2026 09:41:00.000 # ...`: `#` is a warning, the most Redis says of a record;
    # what is worse shows as a crash report or a fatal line.
    record=re.compile(r"^\d+:[XCSM] \d\d \w{3} \d{4} [\d:.]+ (?P<level>[.\-*#]) "),
    error_levels=frozenset(),
    markers=("REDIS BUG REPORT", "crashed by signal", "ASSERTION FAILED", "Fatal error"),
)
PROMETHEUS_LOG = LogFormat(
    # logfmt: `ts=... caller=... level=error msg=...`; a Go panic has no level.
    record=re.compile(r"^(?:ts|time)=\S+ (?:\S+ )*?level=(?P<level>\w+)"),
    markers=("panic: ", "fatal error: "),
)


@dataclass
class LogWatch:
    """Reads one log a piece at a time: each call returns the error records written since the
    last that no expected pattern allows. A record cut by a read is judged again whole when
    the rest of it comes, and reported once."""

    format: LogFormat
    expected: list[re.Pattern[str]] = field(default_factory=list)
    _offset: int = 0
    _open: str = ""
    """The last record read so far: more of it may still come."""
    _open_reported: bool = False

    def expect(self, pattern: str) -> None:
        self.expected.append(re.compile(pattern))

    def errors(self, log: IO[bytes]) -> list[str]:
        data = read_log(log, self._offset)
        # A line still being written waits for its end.
        complete = data[: data.rfind(b"\n") + 1]
        self._offset += len(complete)
        text = complete.decode(errors="replace")
        if not text:
            return []
        records = self.format.records(text)
        reported = [False] * len(records)
        if self._open and not self.format.starts_record(text.split("\n", 1)[0]):
            records[0] = f"{self._open}\n{records[0]}"
            reported[0] = self._open_reported
        found = []
        for position, record in enumerate(records):
            if not reported[position] and self.unexpected(record):
                found.append(record[:REPORTED_CHARACTERS])
                reported[position] = True
        self._open, self._open_reported = records[-1], reported[-1]
        return found

    def unexpected(self, record: str) -> bool:
        return self.format.is_error(record) and not any(
            pattern.search(record) for pattern in self.expected
        )


class Witness(Protocol):
    """A process whose log a test suite reads."""

    @property
    def label(self) -> str: ...

    def unexpected_errors(self) -> list[str]: ...


class Witnesses:
    """The processes started and not yet read to their end. A test suite sets `watching` to
    an instance; the classes that start processes report each start and end to it."""

    watching: ClassVar[Witnesses | None] = None

    def __init__(self) -> None:
        self._live: dict[int, Witness] = {}
        self._found: list[tuple[str, str]] = []

    def started(self, process: Witness) -> None:
        self._live[id(process)] = process

    def ended(self, process: Witness) -> None:
        """Read a process's log a last time, once it has ended and before its log is closed."""
        if self._live.pop(id(process), None) is not None:
            self._found.extend((process.label, record) for record in process.unexpected_errors())

    def read(self) -> list[tuple[str, str]]:
        """The errors logged since the last read: of the processes that ended meanwhile and of
        those still running."""
        found, self._found = self._found, []
        for process in list(self._live.values()):
            found.extend((process.label, record) for record in process.unexpected_errors())
        return found


def started(process: Witness) -> None:
    _tell(Witnesses.started, process)


def ended(process: Witness) -> None:
    _tell(Witnesses.ended, process)


def _tell(event: Callable[[Witnesses, Witness], None], process: Witness) -> None:
    witnesses = Witnesses.watching
    if witnesses is not None:
        event(witnesses, process)
