"""Prefix index, sticky sessions, tenants' budgets and requests in flight shared through Redis,
the local stores answering whenever Redis cannot (docs/redis.md).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from prefix_gateway.config import Settings
from prefix_gateway.metrics import Metrics
from prefix_gateway.state.index import InMemoryPrefixIndex
from prefix_gateway.state.redis.agreement import (
    AGREE_SCRIPT,
    COMPUTING_SCRIPT,
    PREFILL_SCRIPT,
    FallbackAgreement,
    RedisAgreement,
)
from prefix_gateway.state.redis.budgets import BUDGET_SCRIPT, BudgetAmount, RedisBudgets
from prefix_gateway.state.redis.connection import RedisLink, RedisUnavailable, open_client
from prefix_gateway.state.redis.fallback import FallbackPrefixIndex, FallbackSessionStore
from prefix_gateway.state.redis.index import RedisPrefixIndex
from prefix_gateway.state.redis.keys import KeySpace
from prefix_gateway.state.redis.scripts import FORGET_SCRIPT, MATCH_SCRIPT, RECORD_SCRIPT
from prefix_gateway.state.redis.sessions import RedisSessionStore
from prefix_gateway.state.redis.slots import SLOTS_SCRIPT, RedisSlots
from prefix_gateway.state.sessions import InMemorySessionStore


@dataclass
class SharedState:
    link: RedisLink
    index: FallbackPrefixIndex
    sessions: FallbackSessionStore
    responses: FallbackSessionStore
    """The replica that stored each response, by its id's hash."""
    keys: KeySpace
    agreement: FallbackAgreement
    budgets: RedisBudgets
    """The tenants' budgets per minute (docs/tenants.md); the tenants' gate falls back."""
    slots: RedisSlots
    """The tenants' requests in flight, this process's under an id of its own."""


def connect(
    settings: Settings,
    metrics: Metrics,
    index: InMemoryPrefixIndex,
    sessions: InMemorySessionStore,
    responses: InMemorySessionStore,
) -> SharedState:
    """Build (without I/O) the link and the Redis-backed stores; `link.start()` connects."""
    client = open_client(settings.redis_url, settings.redis_timeout, settings.redis_max_connections)
    # Half the connections at most carry background writes: lookups always find one free.
    link = RedisLink(client, settings.redis_timeout, metrics, settings.redis_max_connections // 2)
    link.preload(MATCH_SCRIPT, RECORD_SCRIPT, FORGET_SCRIPT, AGREE_SCRIPT, BUDGET_SCRIPT)
    link.preload(SLOTS_SCRIPT, PREFILL_SCRIPT, COMPUTING_SCRIPT)
    keys = KeySpace(settings.redis_prefix)
    shared_index = RedisPrefixIndex(client, keys, settings.affinity_ttl)
    shared_sessions = RedisSessionStore(client, keys, settings.affinity_ttl)
    shared_responses = RedisSessionStore(
        client, keys, settings.affinity_ttl, key_of=KeySpace.response
    )
    return SharedState(
        link,
        FallbackPrefixIndex(index, shared_index, link, settings.affinity_ttl),
        FallbackSessionStore(sessions, shared_sessions, link),
        FallbackSessionStore(responses, shared_responses, link, "response", patient=True),
        keys,
        FallbackAgreement(
            RedisAgreement(
                client,
                keys,
                settings.claim_ttl,
                settings.recent_half_life,
                prefill_wait=settings.prefill_wait if "prefills" in settings.fleet_share else 0.0,
            ),
            link,
        ),
        RedisBudgets(client, keys),
        RedisSlots(client, keys, secrets.token_hex(8), settings.tenant_slots_ttl),
    )


__all__ = [
    "BudgetAmount",
    "FallbackAgreement",
    "FallbackPrefixIndex",
    "FallbackSessionStore",
    "KeySpace",
    "RedisAgreement",
    "RedisBudgets",
    "RedisLink",
    "RedisPrefixIndex",
    "RedisSessionStore",
    "RedisSlots",
    "RedisUnavailable",
    "SharedState",
    "connect",
    "open_client",
]
