"""Reading traces: Mooncake JSONL into chained block hashes, synthetic shapes into chat turns."""

from __future__ import annotations

import itertools
from pathlib import Path

import orjson
import pytest

from prefix_gateway.emulator.prefix_cache import block_hashes
from prefix_gateway.emulator.prompts import chat_prompt_ids
from prefix_gateway.replay import TraceError, chain_ids, read_mooncake, synthetic_trace
from prefix_gateway.workloads import build_workload


def write(path: Path, *records: object) -> Path:
    path.write_bytes(b"".join(orjson.dumps(record) + b"\n" for record in records))
    return path


def test_chained_ids_match_only_after_equal_beginnings() -> None:
    first, second, third = chain_ids([1, 2, 3]), chain_ids([1, 2, 4]), chain_ids([9, 2, 3])
    assert first[:2] == second[:2] and first[2] != second[2]
    # The same ids after a different first block never match, whatever a trace's ids mean.
    assert not set(first) & set(third)


def test_mooncake_requests(tmp_path: Path) -> None:
    path = write(
        tmp_path / "t.jsonl",
        {"timestamp": 0, "input_length": 1100, "output_length": 0, "hash_ids": [0, 1, 2]},
        {"timestamp": 1500, "input_length": 1024, "output_length": 7, "hash_ids": [0, 1]},
        {"timestamp": 3000, "input_length": 10, "output_length": 1, "hash_ids": [5]},
    )
    first, second, third = read_mooncake(path, time_scale=0.5).requests
    # Only full blocks count: 1,100 tokens are two blocks and a partial one.
    assert first.hashes == tuple(chain_ids([0, 1]))
    assert second.hashes == first.hashes
    assert third.hashes == ()
    assert (first.arrival, second.arrival, third.arrival) == (0.0, 0.75, 1.5)
    assert first.output_tokens == 1  # a request produces at least its first token
    assert first.private_from == 0 and first.answered == () and first.after is None
    # The key covers the first two blocks, so requests sharing only a system block differ.
    assert first.affinity_key == second.affinity_key != third.affinity_key
    assert len(read_mooncake(path, limit=2).requests) == 2


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [1]}, "timestamp"),
        ({"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [1]}, "input_length"),
        ({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": "x"}, "hash_ids"),
        (
            {"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]},
            "cannot cover",
        ),
        ([1, 2], "expected an object"),
    ],
)
def test_mooncake_errors_name_the_line(tmp_path: Path, record: object, message: str) -> None:
    good = {"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}
    path = write(tmp_path / "bad.jsonl", good, record)
    with pytest.raises(TraceError, match=f"bad.jsonl:2: .*{message}"):
        read_mooncake(path)


def test_conversation_turns_resend_the_answer_the_replica_cached() -> None:
    trace = synthetic_trace("conversation", 3, limit=6)
    turns = trace.requests
    assert [turn.after for turn in turns] == [None, 0, 1, 2, 3, 4]
    for earlier, later in itertools.pairwise(turns):
        # The next prompt begins with the blocks of this prompt and its answer...
        assert later.hashes[: len(earlier.answered)] == earlier.answered
        # ...which the replica cached, all but the last answer token.
        assert earlier.held == earlier.answered[: len(earlier.held)]
        assert len(earlier.answered) - len(earlier.held) <= 1
    assert len({turn.private_from for turn in turns}) == 1 and turns[0].private_from > 0


def test_synthetic_prompts_are_the_emulators_tokens() -> None:
    trace = synthetic_trace("shared", 1, limit=3)
    session = build_workload("shared", 1)[0]
    messages = [
        {"role": "system", "content": session.system},
        {"role": "user", "content": session.questions[0]},
    ]
    prompt = chat_prompt_ids(messages, None, "plain")
    first = trace.requests[0]
    assert first.prompt_tokens == len(prompt)
    assert first.hashes == tuple(block_hashes(prompt, 16))
    # Sessions start as a Poisson process: increasing, not all at once.
    arrivals = [request.arrival for request in trace.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] < arrivals[-1]
