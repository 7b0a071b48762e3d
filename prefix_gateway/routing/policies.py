"""Routing policies, by name. An unknown name is a start-up error, never a silent default."""

from __future__ import annotations

import random
from collections.abc import Callable

from prefix_gateway.config import ConfigError, Settings
from prefix_gateway.routing.baselines import (
    ConsistentHashPolicy,
    LeastLoadedPolicy,
    RandomPolicy,
    RoundRobinPolicy,
)
from prefix_gateway.routing.prefix_policy import PrefixPolicy
from prefix_gateway.routing.types import Decision, Policy, Route, RoutingState

PolicyFactory = Callable[[Settings, random.Random], Policy]

POLICIES: dict[str, PolicyFactory] = {
    "prefix": lambda settings, rng: PrefixPolicy(settings),
    "consistent_hash": lambda settings, rng: ConsistentHashPolicy(
        settings.load_factor, settings.load_floor
    ),
    "least_loaded": lambda settings, rng: LeastLoadedPolicy(),
    "round_robin": lambda settings, rng: RoundRobinPolicy(),
    "random": lambda settings, rng: RandomPolicy(rng),
}


def build_policy(settings: Settings, rng: random.Random | None = None) -> Policy:
    factory = POLICIES.get(settings.policy)
    if factory is None:
        raise ConfigError(
            f"unknown policy {settings.policy!r}; choose one of {', '.join(POLICIES)}"
        )
    return factory(settings, rng or random.Random())


__all__ = ["POLICIES", "Decision", "Policy", "Route", "RoutingState", "build_policy"]
