"""What the suite counts as an error a started process logged (`prefix_gateway/logwatch.py`):
each program's records cut by its own format, and a running process's log read a piece at a
time."""

from __future__ import annotations

import tempfile

from prefix_gateway.logwatch import (
    GATEWAY_LOG,
    PROMETHEUS_LOG,
    REDIS_LOG,
    VLLM_LOG,
    LogFormat,
    LogWatch,
)

LOG = """\
2026-12-02 06:14:38,123 INFO prefix_gateway.server: serving
2026-12-02 06:14:39,001 WARNING prefix_gateway.backends.health: 127.0.0.1:9 is down
ERROR:    Exception in ASGI application
Traceback (most recent call last):
  File "x.py", line 1, in handler
UnboundLocalError: cannot access local variable 'reply'
2026-12-02 06:14:40,002 ERROR gateway.relay: the replica hung up
Traceback (most recent call last):
  File "y.py", line 2, in relay
ConnectionResetError: reset
{"request_id":"r1","status":502}
INFO:     Shutting down
"""

VLLM = """\
(APIServer pid=71) INFO 12-07 09:41:00 [api_server.py:1] Starting vLLM API server
(APIServer pid=71) INFO:     127.0.0.1:5000 - "POST /v1/completions HTTP/1.1" 400 Bad Request
(EngineCore_DP0 pid=90) WARNING 12-07 09:41:01 [core.py:2] an ERROR in words
(EngineCore_DP0 pid=90) ERROR 12-07 09:41:02 [core.py:3] EngineCore encountered a fatal error.
(EngineCore_DP0 pid=90) Traceback (most recent call last):
(EngineCore_DP0 pid=90)   File "core.py", line 3, in run
(EngineCore_DP0 pid=90) RuntimeError: oops
(APIServer pid=71) INFO 12-07 09:41:03 [launcher.py:4] Shutting down FastAPI HTTP server.
(APIServer pid=71) ERROR 12-07 09:41:04 [async_llm.py:906] AsyncLLM output_handler failed.
(APIServer pid=71) ERROR 12-07 09:41:04 [async_llm.py:906] Traceback (most recent call last):
(APIServer pid=71) ERROR 12-07 09:41:04 [async_llm.py:906]   File "async_llm.py", line 849
(APIServer pid=71) ERROR 12-07 09:41:04 [async_llm.py:906] EngineDeadError: EngineCore gone.
(APIServer pid=71) ERROR 12-07 09:41:05 [async_llm.py:906] another error, a second later
"""

REDIS = """\
12:C 07 Dec 2026 09:41:00.001 # WARNING Memory overcommit must be enabled!
12:M 07 Dec 2026 09:41:00.002 * Ready to accept connections tcp
12:M 07 Dec 2026 09:41:05.000 # === REDIS BUG REPORT START: Cut & paste starting from here ===
12:M 07 Dec 2026 09:41:05.001 # Redis 7.0.15 crashed by signal: 11
"""

PROMETHEUS = """\
ts=2026-12-07T09:41:00.000Z caller=main.go:1 level=warn msg="no time series"
ts=2026-12-07T09:41:01.000Z caller=scrape.go:2 level=error component="scrape manager" msg="x"
panic: runtime error: index out of range
goroutine 1 [running]:
"""


def heads(log: LogFormat, text: str) -> list[str]:
    return [record.splitlines()[0] for record in log.records(text)]


def errors(log: LogFormat, text: str) -> list[bool]:
    return [log.is_error(record) for record in log.records(text)]


def test_a_gateway_log_is_cut_into_records_each_with_its_traceback() -> None:
    records = GATEWAY_LOG.records(LOG)
    assert [record.splitlines()[0] for record in records] == [
        "2026-12-02 06:14:38,123 INFO prefix_gateway.server: serving",
        "2026-12-02 06:14:39,001 WARNING prefix_gateway.backends.health: 127.0.0.1:9 is down",
        "ERROR:    Exception in ASGI application",
        "2026-12-02 06:14:40,002 ERROR gateway.relay: the replica hung up",
        '{"request_id":"r1","status":502}',
        "INFO:     Shutting down",
    ]
    assert records[2].endswith("UnboundLocalError: cannot access local variable 'reply'")
    assert records[3].endswith("ConnectionResetError: reset")


def test_errors_are_tracebacks_asgi_exceptions_and_error_records() -> None:
    assert errors(GATEWAY_LOG, LOG) == [False, False, True, True, False, False]
    assert GATEWAY_LOG.is_error("Traceback (most recent call last):\n  oops")
    assert GATEWAY_LOG.is_error("2026-12-02 06:14:40,002 CRITICAL gateway: gone")
    assert not GATEWAY_LOG.is_error("2026-12-02 06:14:40,002 WARNING gateway: an ERROR in words")


def test_vllm_records_carry_their_process_and_the_engine_core_traceback_stays_with_its_error() -> (
    None
):
    assert len(heads(VLLM_LOG, VLLM)) == 7
    assert errors(VLLM_LOG, VLLM) == [False, False, False, True, False, True, True]
    records = VLLM_LOG.records(VLLM)
    assert records[3].endswith("RuntimeError: oops")
    # A traceback logged a line at a time behind its record's head stays one record.
    assert records[5].endswith("EngineDeadError: EngineCore gone.")


def test_redis_warnings_pass_and_a_crash_report_is_an_error() -> None:
    assert errors(REDIS_LOG, REDIS) == [False, False, True, True]


def test_prometheus_errors_and_panics_are_errors_and_warnings_are_not() -> None:
    assert heads(PROMETHEUS_LOG, PROMETHEUS)[:2] == PROMETHEUS.splitlines()[:2]
    assert errors(PROMETHEUS_LOG, PROMETHEUS) == [False, True]
    assert PROMETHEUS_LOG.records(PROMETHEUS)[1].endswith("goroutine 1 [running]:")


def test_a_running_process_log_is_read_in_pieces_each_error_reported_once() -> None:
    watch = LogWatch(GATEWAY_LOG)
    watch.expect("the replica hung up")
    with tempfile.TemporaryFile() as log:
        log.write(b"2026-12-02 06:14:38,123 INFO gateway: serving\nERROR:    Exception in ASGI")
        log.flush()
        # The record being written is not judged before its line has ended.
        assert watch.errors(log) == []
        log.write(b" application\nTraceback (most recent call last):\n")
        log.flush()
        assert [error.splitlines()[0] for error in watch.errors(log)] == [
            "ERROR:    Exception in ASGI application"
        ]
        # The rest of the same record comes: it is not reported again.
        log.write(b'  File "x.py", line 1\nKeyError: 1\n')
        log.flush()
        assert watch.errors(log) == []
        log.write(b"2026-12-02 06:14:40,002 ERROR gateway.relay: the replica hung up\n")
        log.write(b"2026-12-02 06:14:41,000 WARNING gateway: slow\n")
        log.flush()
        assert watch.errors(log) == []
        # A record whose traceback comes in a later piece is an error once it is whole.
        log.write(b"2026-12-02 06:14:42,000 WARNING gateway: retrying\n")
        log.flush()
        assert watch.errors(log) == []
        log.write(b"Traceback (most recent call last):\nOSError: gone\n")
        log.flush()
        reported = watch.errors(log)
        assert len(reported) == 1 and reported[0].startswith("2026-12-02 06:14:42,000 WARNING")
        assert reported[0].endswith("OSError: gone")
