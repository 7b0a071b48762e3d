"""Replay on traces small enough to work out by hand: hit rates, TTFT and route reasons."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from prefix_gateway.emulator.timing import TimeModel
from prefix_gateway.replay import ReplayConfig, read_mooncake, run_replay, summarise

BLOCK = 64  # the gateway's minimum match (64 tokens) is then one block


def write_trace(path: Path, records: list[dict[str, object]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(record) + b"\n" for record in records))
    return path


@pytest.fixture
def three_requests(tmp_path: Path) -> Path:
    """Three prompts sharing two blocks, each done long before the next arrives.

    R1 [1 2 3] then R2 [1 2 4] then R3 [1 2 3 5], 64-token blocks. On R1's replica R2 reuses
    blocks 1-2 (128 tokens) and R3 blocks 1-3 (192): 320 of 640 prompt tokens. Round robin
    sends R2 to the other replica (nothing cached) and R3 back to R1's: 192 of 640.
    """
    return write_trace(
        tmp_path / "three.jsonl",
        [
            {"timestamp": 0, "input_length": 192, "output_length": 5, "hash_ids": [1, 2, 3]},
            {"timestamp": 10_000, "input_length": 192, "output_length": 5, "hash_ids": [1, 2, 4]},
            {
                "timestamp": 20_000,
                "input_length": 256,
                "output_length": 5,
                "hash_ids": [1, 2, 3, 5],
            },
        ],
    )


CONFIG = ReplayConfig(
    replicas=2, cache_tokens=64 * BLOCK, time_model=TimeModel(0.001, 0.01), seed=3
)

EXPECTED = {
    # policy: (cached tokens, route reasons)
    "prefix": (320, {"hash": 1, "prefix": 2}),
    "oracle": (320, {"hash": 1, "prefix": 2}),
    "consistent_hash": (320, {"hash": 3}),
    "least_loaded": (320, {"least_loaded": 3}),
    "round_robin": (192, {"round_robin": 3}),
}


@pytest.mark.parametrize("policy", sorted(EXPECTED))
def test_hit_rate_and_routes_by_hand(three_requests: Path, policy: str) -> None:
    trace = read_mooncake(three_requests, block_tokens=BLOCK)
    summary = summarise(run_replay(trace, policy, CONFIG))
    cached, routes = EXPECTED[policy]
    assert summary.prompt_tokens == 640
    assert summary.cached_tokens == cached
    assert summary.routes == routes


def test_ttft_is_the_uncached_prefill(three_requests: Path) -> None:
    trace = read_mooncake(three_requests, block_tokens=BLOCK)
    served = run_replay(trace, "prefix", CONFIG).served
    # 1 ms a token: R1 computes 192 tokens, R2 and R3 the 64 past their cached blocks.
    assert [round(item.ttft, 6) for item in served] == [0.192, 0.064, 0.064]
    # Four more tokens at 10 ms each after the first.
    assert [round(item.finished - item.arrival, 6) for item in served] == [0.232, 0.104, 0.104]
    assert len({item.backend for item in served}) == 1


def test_random_policy_follows_the_seed(three_requests: Path) -> None:
    trace = read_mooncake(three_requests, block_tokens=BLOCK)
    runs = [[item.backend for item in run_replay(trace, "random", CONFIG).served] for _ in range(2)]
    assert runs[0] == runs[1]
    assert summarise(run_replay(trace, "random", CONFIG)).routes == {"random": 3}


def test_concurrent_requests_queue_for_the_prefill_lane(tmp_path: Path) -> None:
    """Blocks become reusable when their prefill ends, and prefills run one at a time."""
    same = {"input_length": 192, "output_length": 1, "hash_ids": [7, 8, 9]}
    trace = read_mooncake(
        write_trace(
            tmp_path / "burst.jsonl",
            [{"timestamp": 0, **same}, {"timestamp": 100, **same}, {"timestamp": 1_000, **same}],
        ),
        block_tokens=BLOCK,
    )
    one_replica = ReplayConfig(replicas=1, cache_tokens=64 * BLOCK, time_model=TimeModel(0.001))
    served = run_replay(trace, "prefix", one_replica).served
    # R2 arrives 0.1 s in, while R1 still prefills (until 0.192 s): nothing to reuse yet, and
    # its own prefill waits for the lane. R3 reuses two blocks; the last prompt token is
    # always computed, so the third never counts.
    assert [item.cached_tokens for item in served] == [0, 0, 128]
    assert [round(item.ttft, 6) for item in served] == [0.192, 0.284, 0.064]
