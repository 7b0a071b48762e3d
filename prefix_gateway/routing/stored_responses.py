"""Stored responses: only the replica that produced a response can answer a request naming it
(a follow-up's `previous_response_id`, or `GET`/`DELETE`/`cancel` of the response), so which
replica that was is remembered by the id's hash for the affinity TTL, in the session store's
kind of store (memory, and Redis when shared). No HTTP here.
"""

from __future__ import annotations

from prefix_gateway.backends.backend import Backend
from prefix_gateway.backends.pool import BackendPool
from prefix_gateway.errors import NotFound
from prefix_gateway.prompt.responses_api import response_key
from prefix_gateway.state.sessions import SessionStore


class ResponseHolders:
    def __init__(self, pool: BackendPool, store: SessionStore) -> None:
        self._pool = pool
        self._store = store

    async def remember(self, response_id: str, owner: str | None, backend: str) -> None:
        """`backend` produced (and may have stored) `response_id` for `owner`."""
        await self._store.put(response_key(response_id, owner), backend)

    async def holder(self, response_id: str, owner: str | None, param: str) -> Backend | None:
        """The replica holding `response_id`, whatever its load or health; None when no
        gateway saw it produced for `owner` (or it expired: another owner's id is unknown
        alike); a 404 naming `param` when that replica has left the pool, since no other one
        can answer for it."""
        name = await self._store.get(response_key(response_id, owner))
        if name is None:
            return None
        backend = self._pool.get(name)
        if backend is None:
            raise NotFound(
                f"Response with id '{response_id}' was stored by a replica that is no longer"
                " served by this gateway; send the conversation again in `input`, without"
                " `previous_response_id`",
                param=param,
                code="response_replica_gone",
            )
        return backend


def not_found(response_id: str, param: str) -> NotFound:
    """vLLM's answer for a response it does not hold, for one no gateway saw produced."""
    return NotFound(
        f"Response with id '{response_id}' not found.", param=param, code="response_not_found"
    )
