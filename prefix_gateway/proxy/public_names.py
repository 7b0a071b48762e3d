"""What a client is told of the replica that answered it, in `x-gateway-backend`
(`--backend-header`): by default an opaque name for it, which says nothing of the fleet's
addresses; its address (`HOST:PORT`, its name in the pool, the logs and the metrics) only where
the operator asks; or nothing.

The opaque name is a keyed hash of the replica's address under a key this gateway process
draws at start: the same replica keeps its name for the life of the process, and no client can
work back to the address by hashing guesses. The operator maps it back through the access log
(the request's `backend`, by its `x-request-id`) or `/admin/backends` (`public_name`).
"""

from __future__ import annotations

import hashlib
import os

_REMEMBERED = 4096
"""Names kept ready; past that the cache starts again (replicas come and go with discovery)."""


class PublicNames:
    __slots__ = ("_key", "_known", "mode")

    def __init__(self, mode: str, key: bytes | None = None) -> None:
        self.mode = mode
        """`name`, `address` or `off`."""
        self._key = key if key is not None else os.urandom(16)
        self._known: dict[str, bytes] = {}

    def header(self, backend: str) -> bytes | None:
        """The value of `x-gateway-backend` for the replica named `backend` (its address), or
        None: the header is not sent."""
        mode = self.mode
        if mode == "address":
            return backend.encode()
        if mode == "off":
            return None
        known = self._known.get(backend)
        if known is None:
            if len(self._known) >= _REMEMBERED:
                self._known.clear()
            known = self._known[backend] = self.name_of(backend).encode()
        return known

    def name_of(self, backend: str) -> str:
        """The opaque name of the replica whose address is `backend`."""
        digest = hashlib.blake2b(backend.encode(), digest_size=6, key=self._key).hexdigest()
        return f"replica-{digest}"
