"""Prefix hashing: a canonical stream's full blocks hashed as a chain, so equal hashes at depth
i mean equal prefixes (a partial last block could never match a later request).
"""

from __future__ import annotations

import xxhash

_hash = xxhash.xxh3_64_intdigest


def chain_hashes(
    data: bytes, block_chars: int, seed: int = 0, start: int = 0, limit: int | None = None
) -> list[int]:
    """Chained hashes of the full blocks of `data` from byte `start`, continuing from `seed`;
    at most `limit` of them."""
    view = memoryview(data)
    hashes: list[int] = []
    append = hashes.append
    prev = seed
    end = len(data) - block_chars + 1
    if limit is not None:
        end = min(end, start + limit * block_chars)
    for offset in range(start, end, block_chars):
        prev = _hash(view[offset : offset + block_chars], prev)
        append(prev)
    return hashes


def extend_hashes(
    prefix_hashes: list[int], data: bytes, block_chars: int, seed: int = 0, limit: int | None = None
) -> list[int]:
    """The chain of `data`, reusing `prefix_hashes` already computed for its beginning; at
    most `limit` blocks in all."""
    done = len(prefix_hashes)
    last = prefix_hashes[-1] if done else seed
    more = None if limit is None else max(0, limit - done)
    return prefix_hashes + chain_hashes(data, block_chars, last, done * block_chars, more)


def key_hash(data: bytes | str) -> int:
    """A 64-bit hash for affinity keys and session keys."""
    return _hash(data.encode() if isinstance(data, str) else data)


def chain_seed(cache_salt: str | None) -> int:
    """Where a prompt's chain starts: as in the engine, a salted prompt (a tenant's, or a
    client's own `cache_salt`) shares no block with the same prompt under another salt."""
    return 0 if cache_salt is None else key_hash(cache_salt)
