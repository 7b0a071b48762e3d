"""Offline what-if replay: a trace through the gateway's own policies against simulated replicas.

Requests (from a Mooncake-format trace or a synthetic shape) are routed by the same policy
objects, prefix index and recent-traffic counter the gateway runs, to replicas built from the
emulator's cache, prefill lane and time model, in virtual time. `oracle` routes on the
replicas' actual cache contents under the same load bound, as a reference.
"""

from gateway.replay.report import Summary, render_table, summarise
from gateway.replay.simulator import ORACLE, ROUTERS, ReplayConfig, RunResult, Served, run_replay
from gateway.replay.synthetic import synthetic_trace
from gateway.replay.traces import Trace, TraceError, TraceRequest, chain_ids, read_mooncake

__all__ = [
    "ORACLE",
    "ROUTERS",
    "ReplayConfig",
    "RunResult",
    "Served",
    "Summary",
    "Trace",
    "TraceError",
    "TraceRequest",
    "chain_ids",
    "read_mooncake",
    "render_table",
    "run_replay",
    "summarise",
    "synthetic_trace",
]
