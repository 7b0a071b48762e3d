"""Key names in Redis (docs/redis.md): blocks, claims and prompt counts under a hash tag of model
and first block, so a lookup's keys share one Redis Cluster slot; sessions; stored responses'
replicas; the fleet's load hash; the tenants' budgets and requests in flight.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefix_gateway.prompt.hashing import key_hash

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

    def claim(self, prefix: bytes, claim_key: int) -> bytes:
        """The claim of a new prompt, in its first block's slot (one byte longer than a block
        key, so never one)."""
        return prefix + b"c" + claim_key.to_bytes(HASH_BYTES, "big")

    def prompt_count(self, prefix: bytes, prompt_key: int) -> bytes:
        """A shared prompt's count of recent requests, in its first block's slot."""
        return prefix + b"n" + prompt_key.to_bytes(HASH_BYTES, "big")

    def prefills(self, prefix: bytes, prompt_key: int) -> bytes:
        """The backends computing a shared prompt now, in its first block's slot."""
        return prefix + b"p" + prompt_key.to_bytes(HASH_BYTES, "big")

    def session(self, key: str) -> str:
        return f"{self.namespace}:s:{key_hash(key):016x}"

    def response(self, key: str) -> str:
        """Where the replica holding a stored response is kept (`key`: its id's hash)."""
        return f"{self.namespace}:r:{key_hash(key):016x}"

    def fleet_load(self) -> str:
        return f"{self.namespace}:load"

    def budget(self, tenant: str, kind: str) -> str:
        """A tenant's budget per minute (`requests`, `tokens`): the tenant's budgets share its
        name's slot, so one script charges them all. The name is the configured one (bounded,
        no braces), never its key."""
        return f"{self.namespace}:t:{{{tenant}}}:{kind}"

    def slots(self, tenant: str) -> str:
        """A tenant's requests in flight, per gateway process, in its budgets' slot."""
        return f"{self.namespace}:t:{{{tenant}}}:in_flight"
