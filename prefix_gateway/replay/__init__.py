"""Offline what-if replay: a trace through the gateway's own policies against simulated
replicas, in virtual time (docs/replay.md).
"""

from prefix_gateway.replay.report import Summary, render_table, summarise
from prefix_gateway.replay.simulator import (
    ORACLE,
    ROUTERS,
    ReplayConfig,
    RunResult,
    Served,
    run_replay,
)
from prefix_gateway.replay.synthetic import synthetic_trace
from prefix_gateway.replay.traces import Trace, TraceError, TraceRequest, chain_ids, read_mooncake

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
