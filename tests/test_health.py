"""Ejection and readmission of replicas: the health rules over a real pool, without I/O."""

from __future__ import annotations

from prefix_gateway.backends.backend import Backend
from prefix_gateway.backends.health import CONNECT, Health
from prefix_gateway.backends.pool import BackendPool

MODEL = "m"


def serving_pool() -> tuple[BackendPool, Backend]:
    pool = BackendPool.from_specs([f"{MODEL}=http://a:1"])
    backend = pool.backends[0]
    pool.set_health(backend, True)
    return pool, backend


def test_a_starting_backend_serves_from_its_first_passed_probe() -> None:
    pool = BackendPool.from_specs([f"{MODEL}=http://a:1"])
    backend = pool.backends[0]
    Health(pool, 2, 3, 5).probed(backend, True)
    assert backend.healthy and pool.serving(MODEL) is not None


def test_failed_probes_eject_and_only_enough_passes_in_a_row_readmit() -> None:
    pool, backend = serving_pool()
    health = Health(pool, unhealthy_threshold=2, healthy_threshold=3, failure_threshold=5)
    health.probed(backend, False)
    assert backend.healthy
    health.probed(backend, False)
    assert not backend.healthy and backend.ejected_why == "2 failed probes"
    assert pool.serving(MODEL) is None
    health.probed(backend, True)
    health.probed(backend, True)
    health.probed(backend, False)  # the passes start over
    health.probed(backend, True)
    health.probed(backend, True)
    assert not backend.healthy
    health.probed(backend, True)
    assert backend.healthy and not backend.ejected and backend.ejected_why == ""
    assert pool.serving(MODEL) is not None


def test_failed_requests_in_a_row_eject_and_an_answer_ends_the_run() -> None:
    pool, backend = serving_pool()
    health = Health(pool, unhealthy_threshold=2, healthy_threshold=2, failure_threshold=3)
    health.request_failed(backend, "status_500")
    health.request_failed(backend, "status_500")
    health.request_succeeded(backend)
    assert backend.failures == 0 and backend.healthy
    for _ in range(3):
        health.request_failed(backend, "status_500")
    assert not backend.healthy
    assert backend.ejected_why == "3 failed requests in a row (status_500)"
    health.probed(backend, True)
    health.probed(backend, True)
    assert backend.healthy and backend.failures == 0


def test_a_refused_connection_ejects_at_once() -> None:
    pool, backend = serving_pool()
    Health(pool, 2, 2, 3).request_failed(backend, CONNECT)
    assert backend.ejected and not backend.healthy and backend.failures == 1
