"""Replay traces from Mooncake-format JSONL files: each line's `hash_ids` chained into
gateway-style hashes, so ids that name block contents only still match by prefix
(docs/replay.md). A trace has no messages: no private part, no answer blocks.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson
import xxhash

_ROOT = 0
_MASK = 0xFFFF_FFFF_FFFF_FFFF


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival: float
    """Seconds from the start of the trace; with `after` set, the think time after it."""
    prompt_tokens: int
    output_tokens: int
    hashes: tuple[int, ...]
    """Chained hashes of the prompt's full blocks: what both the index and the caches see."""
    affinity_key: int
    private_from: int = 0
    """The block where the request's own part begins (after a shared system prompt)."""
    after: int | None = None
    """The request (by position in the trace) whose completion sends this one: a next turn."""
    answered: tuple[int, ...] = ()
    """Blocks of the prompt with its answer appended, indexed once the answer is complete."""
    held: tuple[int, ...] = ()
    """Blocks cached once the request finishes (prompt and answer); empty: the prompt's."""
    shape: str = ""
    """The synthetic workload shape the request belongs to; empty for a trace file."""
    first_turn: bool = False
    """A conversation's first request (known for a synthetic shape; a trace file does not
    say, so as for a plain prompt: False)."""
    adapter: str = ""
    """The LoRA adapter the request names (its blocks are keyed by it); empty: the base model."""

    @property
    def cached_at_finish(self) -> tuple[int, ...]:
        return self.held or self.hashes


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    requests: list[TraceRequest]
    block_tokens: int
    synthetic: bool = False

    def unbounded_hit_rate(self) -> float:
        """Token hit rate of one unbounded cache that served the trace in order, one at a time."""
        seen: set[int] = set()
        prompt = cached = 0
        for request in self.requests:
            hit = 0
            for block in request.hashes:
                if block not in seen:
                    break
                hit += 1
            prompt += request.prompt_tokens
            cached += min(hit, (request.prompt_tokens - 1) // self.block_tokens) * self.block_tokens
            seen.update(request.cached_at_finish)
        return cached / prompt if prompt else 0.0


class TraceError(ValueError):
    """A trace that cannot be read."""


def chain_ids(ids: Sequence[int]) -> list[int]:
    """Gateway-style chained hashes of a sequence of block ids."""
    chained: list[int] = []
    parent = _ROOT
    for block_id in ids:
        data = (block_id & _MASK).to_bytes(8, "little")
        parent = xxhash.xxh3_64_intdigest(data, seed=parent)
        chained.append(parent)
    return chained


def read_mooncake(
    path: str | Path,
    *,
    block_tokens: int = 512,
    affinity_blocks: int = 2,
    time_scale: float = 1.0,
    limit: int | None = None,
) -> Trace:
    """The requests of a Mooncake-format JSONL trace, arrivals multiplied by `time_scale`; the
    affinity key hashes `affinity_blocks` blocks, since the first alone may be shared by all."""
    requests = [
        _mooncake_request(record, where, block_tokens, affinity_blocks, time_scale)
        for where, record in _records(Path(path), limit)
    ]
    return Trace(Path(path).name, requests, block_tokens)


def _records(path: Path, limit: int | None) -> Iterator[tuple[str, dict[str, object]]]:
    count = 0
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            if limit is not None and count >= limit:
                return
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise TraceError(f"{where}: not JSON: {exc}") from exc
            if not isinstance(record, dict):
                raise TraceError(f"{where}: expected an object")
            count += 1
            yield where, record


def _mooncake_request(
    record: dict[str, object],
    where: str,
    block_tokens: int,
    affinity_blocks: int,
    time_scale: float,
) -> TraceRequest:
    timestamp = record.get("timestamp")
    input_length = record.get("input_length")
    output_length = record.get("output_length")
    ids = record.get("hash_ids")
    if not isinstance(timestamp, int | float) or timestamp < 0:
        raise TraceError(f"{where}: timestamp must be a number of milliseconds")
    if not isinstance(input_length, int) or input_length < 1:
        raise TraceError(f"{where}: input_length must be a positive integer")
    if not isinstance(output_length, int) or output_length < 0:
        raise TraceError(f"{where}: output_length must be a non-negative integer")
    if not isinstance(ids, list) or not all(isinstance(item, int) for item in ids):
        raise TraceError(f"{where}: hash_ids must be a list of integers")
    if len(ids) < math.ceil(input_length / block_tokens):
        raise TraceError(
            f"{where}: {len(ids)} hash_ids cannot cover {input_length} tokens "
            f"in blocks of {block_tokens}"
        )
    # Only full blocks are cached or indexed; a trailing partial block changes as the
    # conversation grows, so it could never match a later request.
    chained = chain_ids(ids[: input_length // block_tokens])
    key_ids = ids[: max(1, affinity_blocks)]
    key = chain_ids(key_ids)[-1] if key_ids else _ROOT
    return TraceRequest(
        arrival=timestamp / 1000.0 * time_scale,
        prompt_tokens=input_length,
        output_tokens=max(1, output_length),
        hashes=tuple(chained),
        affinity_key=key,
    )
