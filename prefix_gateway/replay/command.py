"""`prefix-gateway replay TRACE`: the what-if table for a trace, one row per policy."""

from __future__ import annotations

import argparse
import sys
import time

from prefix_gateway.emulator.config import EmulatorConfig
from prefix_gateway.emulator.timing import TimeModel
from prefix_gateway.replay.report import render_table, summarise
from prefix_gateway.replay.simulator import ORACLE, ROUTERS, ReplayConfig, run_replay
from prefix_gateway.replay.synthetic import synthetic_trace
from prefix_gateway.replay.traces import Trace, TraceError, read_mooncake
from prefix_gateway.workloads import SHAPES

SYNTHETIC = "synthetic:"
# About what one 8-GPU replica of a 70B-class model holds next to its weights; the trace's
# replay is then cache-bound (docs/replay.md).
TRACE_CACHE_TOKENS = 1 << 20
TRACE_BLOCK_TOKENS = 512
# The routing benchmark's emulated replicas: 1,024 blocks of 16 tokens, a size the customers
# shape overflows on one replica.
SYNTHETIC_CACHE_TOKENS = 16_384
SYNTHETIC_BLOCK_TOKENS = EmulatorConfig().block_size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "trace",
        help="a Mooncake-format JSONL file, or synthetic:SHAPE[:SEED] with SHAPE one of "
        + ", ".join(SHAPES),
    )
    parser.add_argument("--replicas", type=int, default=8, help="simulated replicas")
    parser.add_argument(
        "--policy",
        action="append",
        choices=ROUTERS,
        help="policy to replay; repeat for several (default: all of them); the oracle is"
        " always replayed beside them, as the table's reference",
    )
    parser.add_argument(
        "--cache-tokens",
        type=int,
        help=f"KV-cache tokens per replica (default {TRACE_CACHE_TOKENS:,} for a trace file, "
        f"{SYNTHETIC_CACHE_TOKENS:,} for a synthetic shape)",
    )
    parser.add_argument(
        "--block-tokens",
        type=int,
        help=f"tokens per block (default {TRACE_BLOCK_TOKENS} for a trace file, as Mooncake's "
        f"hash_ids; {SYNTHETIC_BLOCK_TOKENS} for a synthetic shape, as the emulator)",
    )
    parser.add_argument(
        "--prefill-us-per-token",
        type=float,
        default=50.0,
        help="microseconds of prefill per uncached prompt token, one prefill at a time",
    )
    parser.add_argument(
        "--decode-ms-per-token",
        type=float,
        default=20.0,
        help="milliseconds per generated token, every running sequence in parallel",
    )
    parser.add_argument(
        "--max-running",
        type=int,
        default=EmulatorConfig().max_running,
        help="sequences a replica runs at once; more wait",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply arrival times by this (0.5: the same requests twice as fast)",
    )
    parser.add_argument(
        "--load-factor",
        type=float,
        default=ReplayConfig.load_factor,
        help="bounded-load factor c of the policies and the oracle",
    )
    parser.add_argument(
        "--load-floor",
        type=int,
        default=ReplayConfig.load_floor,
        help="in-flight requests every replica may take whatever the mean",
    )
    parser.add_argument("--limit", type=int, help="replay the first N requests only")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of synthetic shapes and the random policy"
    )
    parser.add_argument(
        "--affinity-blocks",
        type=int,
        default=2,
        help="trace file: leading blocks hashed into a request's affinity key",
    )
    parser.add_argument(
        "--rate", type=float, default=2.0, help="synthetic: sessions started per second"
    )
    parser.add_argument(
        "--think-seconds",
        type=float,
        default=3.0,
        help="synthetic: mean pause between an answer and the conversation's next turn",
    )
    parser.add_argument(
        "--scale", type=float, default=1.0, help="synthetic: multiply the number of sessions"
    )
    parser.add_argument(
        "--adapters",
        type=int,
        default=0,
        help="synthetic: each session names one of N LoRA adapters (Zipf weights; 0: none)",
    )
    parser.add_argument(
        "--max-loras",
        type=int,
        default=ReplayConfig.max_loras,
        help="LoRA adapters a replica keeps resident; another evicts one (a swap)",
    )


def load_trace(args: argparse.Namespace) -> Trace:
    if args.block_tokens is not None and args.block_tokens < 1:
        raise ValueError("--block-tokens must be at least 1")
    if args.time_scale <= 0:
        raise ValueError("--time-scale must be positive")
    if args.limit is not None and args.limit < 1:
        raise ValueError("--limit must be at least 1")
    if args.adapters < 0:
        raise ValueError("--adapters must not be negative")
    source: str = args.trace
    if source.startswith(SYNTHETIC):
        shape, _, seed = source.removeprefix(SYNTHETIC).partition(":")
        if shape not in SHAPES:
            raise TraceError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
        if seed and not seed.isdigit():
            raise TraceError(f"the seed in {source!r} must be a non-negative integer")
        return synthetic_trace(
            shape,
            int(seed) if seed else args.seed,
            block_tokens=_given(args.block_tokens, SYNTHETIC_BLOCK_TOKENS),
            scale=args.scale,
            rate=args.rate,
            think_seconds=args.think_seconds,
            time_scale=args.time_scale,
            limit=args.limit,
            adapters=args.adapters,
        )
    return read_mooncake(
        source,
        block_tokens=_given(args.block_tokens, TRACE_BLOCK_TOKENS),
        affinity_blocks=args.affinity_blocks,
        time_scale=args.time_scale,
        limit=args.limit,
    )


def replay_table(args: argparse.Namespace) -> str:
    """The table `prefix-gateway replay` prints for these arguments."""
    trace = load_trace(args)
    default_cache = SYNTHETIC_CACHE_TOKENS if trace.synthetic else TRACE_CACHE_TOKENS
    cache_tokens = _given(args.cache_tokens, default_cache)
    config = ReplayConfig(
        replicas=args.replicas,
        cache_tokens=cache_tokens,
        time_model=TimeModel(args.prefill_us_per_token / 1e6, args.decode_ms_per_token / 1e3),
        max_running=args.max_running,
        seed=args.seed,
        load_factor=args.load_factor,
        load_floor=args.load_floor,
        max_loras=args.max_loras,
    )
    policies = list(dict.fromkeys(args.policy or ROUTERS))
    if ORACLE not in policies:
        policies.append(ORACLE)  # each row's "of oracle" column is read against it
    summaries = [summarise(run_replay(trace, policy, config)) for policy in policies]
    title = (
        f"Replay of {trace.name}: {len(trace.requests):,} requests, {config.replicas} replicas "
        f"with {cache_tokens:,}-token caches in blocks of {trace.block_tokens}, prefill "
        f"{args.prefill_us_per_token:g} µs/token, decode {args.decode_ms_per_token:g} ms/token, "
        f"load bound c = {config.load_factor:g} (floor {config.load_floor}), "
        f"time scale {args.time_scale:g}, seed {args.seed}. "
        f"One unbounded cache: {trace.unbounded_hit_rate():.1%}."
    )
    return render_table(title, summaries)


def _given(value: int | None, default: int) -> int:
    return default if value is None else value


def main(args: argparse.Namespace) -> int:
    began = time.perf_counter()
    try:
        table = replay_table(args)
    except (OSError, ValueError) as exc:
        print(f"prefix-gateway: {exc}", file=sys.stderr)
        return 2
    print(table, flush=True)
    print(f"replayed in {time.perf_counter() - began:.1f} s", file=sys.stderr)
    return 0
