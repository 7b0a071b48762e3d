"""What the suite counts as an error a started process logged (`prefix_gateway/processes.py`)."""

from __future__ import annotations

from prefix_gateway.processes import is_error_record, log_records

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


def test_a_log_is_cut_into_records_each_with_its_traceback() -> None:
    records = log_records(LOG)
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
    flagged = [is_error_record(record) for record in log_records(LOG)]
    assert flagged == [False, False, True, True, False, False]
    assert is_error_record("Traceback (most recent call last):\n  oops")
    assert is_error_record("2026-12-02 06:14:40,002 CRITICAL gateway: gone")
    assert not is_error_record("2026-12-02 06:14:40,002 WARNING gateway: an ERROR in words")
