"""Key names in Redis: every key under one namespace, every lookup's keys in one slot.

    <ns>:{<model id>:<tag>}<block hash>   one prefix block (the hash as 8 raw bytes)
    <ns>:s:<session key hash>             one sticky session
    <ns>:load                             every gateway's requests in flight (`loads.py`)

`<model id>` is 8 hex digits of the model name's hash (names may be long or hold braces) and
`<tag>` 4 hex digits of the prompt's first block hash. The hash tag `{model id:tag}` puts every
block of one prompt — and of every prompt that begins with the same block — in one Redis
Cluster slot, so one lookup is one script on one node, while prompts with different
beginnings spread over all 16,384 slots.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.prompt.hashing import key_hash

HASH_BYTES = 8


def model_id(model: str) -> str:
    return f"{key_hash(model) & 0xFFFFFFFF:08x}"


class KeySpace:
    def __init__(self, namespace: str) -> None:
        if not namespace or any(char in namespace for char in "{} \n"):
            raise ValueError(f"Redis key prefix {namespace!r} must be non-empty, without braces")
        self.namespace = namespace

    def block_prefix(self, model: str, first_block: int) -> bytes:
        """What every block key of a chain starting with `first_block` begins with."""
        return f"{self.namespace}:{{{model_id(model)}:{first_block >> 48:04x}}}".encode()

    def block_keys(self, prefix: bytes, hashes: Sequence[int]) -> bytes:
        """The keys of `hashes` under `prefix`, concatenated: the scripts cut them apart."""
        return prefix + prefix.join([block.to_bytes(HASH_BYTES, "big") for block in hashes])

    def session(self, key: str) -> str:
        return f"{self.namespace}:s:{key_hash(key):016x}"

    def fleet_load(self) -> str:
        return f"{self.namespace}:load"
