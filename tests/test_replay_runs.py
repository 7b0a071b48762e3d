"""Whole replays on small generated traces: determinism, the oracle, the load bound, the CLI."""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from prefix_gateway.cli import build_parser
from prefix_gateway.emulator.timing import TimeModel
from prefix_gateway.replay import (
    ROUTERS,
    ReplayConfig,
    RunResult,
    read_mooncake,
    run_replay,
    summarise,
    synthetic_trace,
)
from prefix_gateway.replay.command import replay_table
from prefix_gateway.replay.report import render_table

ROOT = Path(__file__).resolve().parents[1]


def conversation_trace(
    path: Path, seed: int, conversations: int, turns: int, gap_ms: int, block: int = 512
) -> Path:
    """A Mooncake-format trace of conversations sharing a one-block system prompt.

    Each turn re-sends the history (one new id for the old partial block, then new blocks for
    the answer and the next question); turns of different conversations interleave.
    """
    rng = random.Random(seed)
    next_id = 1
    histories: list[list[int]] = [[0] for _ in range(conversations)]
    order = [number for number in range(conversations) for _ in range(turns)]
    rng.shuffle(order)
    lines = []
    for position, number in enumerate(order):
        history = histories[number]
        grown = rng.randint(1, 4)
        history.extend(range(next_id, next_id + grown))
        next_id += grown
        tokens = (len(history) - 1) * block + rng.randint(1, block)
        record = {
            "timestamp": position * gap_ms,
            "input_length": tokens,
            "output_length": rng.randint(1, 200),
            "hash_ids": list(history),
        }
        lines.append(orjson.dumps(record))
        history.pop()  # the partial last block is re-sent, completed, under a new id
        history.extend(range(next_id, next_id + 1))
        next_id += 1
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def args_for(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["replay", *argv])


def test_same_seed_same_table_byte_for_byte(tmp_path: Path) -> None:
    trace = conversation_trace(
        tmp_path / "trace.jsonl", seed=5, conversations=12, turns=5, gap_ms=700
    )
    flags = ["--replicas", "3", "--cache-tokens", "40960", "--seed", "9"]
    tables = [replay_table(args_for(str(trace), *flags)) for _ in range(2)]
    assert tables[0] == tables[1]
    assert tables[0].count("\n| ") == 1 + len(ROUTERS)  # header row and one row a policy

    synthetic = ["synthetic:mixed", "--limit", "80", "--replicas", "3", "--rate", "5"]
    first = replay_table(args_for(*synthetic, "--seed", "1"))
    assert first == replay_table(args_for(*synthetic, "--seed", "1"))
    assert first != replay_table(args_for(*synthetic, "--seed", "2"))


def test_oracle_is_an_upper_bound_when_requests_never_overlap(tmp_path: Path) -> None:
    """One request at a time and caches that never evict: the oracle's greedy choice keeps
    every prefix on the one replica that holds it, so it reuses all that one unbounded cache
    would, and no policy can reuse more."""
    path = conversation_trace(
        tmp_path / "trace.jsonl", seed=2, conversations=10, turns=4, gap_ms=60_000
    )
    trace = read_mooncake(path)
    config = ReplayConfig(replicas=4, cache_tokens=1 << 20, time_model=TimeModel(1e-5, 1e-3))
    rates = {policy: summarise(run_replay(trace, policy, config)).hit_rate for policy in ROUTERS}
    assert rates["oracle"] == pytest.approx(trace.unbounded_hit_rate())
    assert all(rate <= rates["oracle"] for rate in rates.values())
    assert rates["round_robin"] < rates["oracle"]


def in_flight_at(result: RunResult, backend: str, instant: float) -> int:
    return sum(
        1
        for item in result.served
        if item.backend == backend and item.arrival <= instant < item.finished
    )


def test_prefix_keeps_a_hot_prefix_within_the_load_bound() -> None:
    """Every request shares one long system prompt and they arrive faster than one replica
    serves them: the prefix spreads, and no replica ever carries more than the bound."""
    trace = synthetic_trace("shared", 4, rate=40.0, limit=120)
    config = ReplayConfig(replicas=4, cache_tokens=16_384, time_model=TimeModel(5e-5, 0.02))
    result = run_replay(trace, "prefix", config)
    assert len(result.served) == 120
    for item in result.served:
        assert item.load <= item.bound
        # The simulator's own count, checked against the served intervals.
        assert in_flight_at(result, item.backend, item.arrival) == item.load
    summary = summarise(result)
    assert any(item.load == item.bound for item in result.served)  # the bound did bind
    assert len({item.backend for item in result.served}) == 4
    assert summary.over_bound == 0
    assert summary.hit_rate > 0.8


def test_synthetic_replay_is_broken_down_by_shape() -> None:
    trace = synthetic_trace("mixed", 2, rate=20.0, think_seconds=0.1, scale=0.2)
    config = ReplayConfig(replicas=4, cache_tokens=16_384, time_model=TimeModel(5e-5, 2e-4))
    result = run_replay(trace, "prefix", config)
    summary = summarise(result)
    shapes = {item.shape: item for item in summary.shapes}
    assert set(shapes) == {"shared", "customers", "conversation", "rag"}
    assert sum(item.requests for item in shapes.values()) == summary.requests
    assert sum(item.prompt_tokens for item in shapes.values()) == summary.prompt_tokens
    assert sum(item.cached_tokens for item in shapes.values()) == summary.cached_tokens
    for shape, item in shapes.items():
        for name, count in zip(result.replicas, item.per_replica, strict=True):
            served = [one for one in result.served if one.shape == shape and one.backend == name]
            assert len(served) == count
        waits = sorted(one.ttft for one in result.served if one.shape == shape)
        assert item.ttft_p99 == waits[min(len(waits) - 1, int(0.99 * len(waits)))]
    # Each turn re-sends the history its replica cached; RAG passages come in a new order.
    assert shapes["conversation"].hit_rate > 0.8 > shapes["rag"].hit_rate
    table = render_table("mixed", [summary])
    conversation = shapes["conversation"]
    assert (
        f"| prefix | conversation | {conversation.requests:,} | {conversation.hit_rate:.1%} "
        f"| {conversation.prompt_tokens - conversation.cached_tokens:,} "
        f"| {conversation.ttft_p99 * 1000:,.1f} |"
    ) in table


def test_cli_prints_the_table(tmp_path: Path) -> None:
    trace = conversation_trace(
        tmp_path / "trace.jsonl", seed=1, conversations=6, turns=3, gap_ms=500
    )
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefix_gateway",
            "replay",
            str(trace),
            "--replicas",
            "2",
            "--policy",
            "prefix",
            "--policy",
            "oracle",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    rows = [line for line in completed.stdout.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows] == ["| policy", "| prefix", "| oracle"]
    assert "18 requests, 2 replicas" in completed.stdout
    assert "| shape |" not in completed.stdout  # a trace file has no shapes


def test_cli_rejects_what_it_cannot_replay(tmp_path: Path) -> None:
    broken = tmp_path / "broken.jsonl"
    broken.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{'
    )
    completed = subprocess.run(
        [sys.executable, "-m", "prefix_gateway", "replay", str(broken)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 2
    assert f"{broken}:2: not JSON" in completed.stderr
