"""The `tenants:` list of the YAML file given with `--config`: who shares the fleet, with which
key, priority, share and limits. Read once at start-up; a bad entry is an error that names it.

    tenants:
      - name: search              # metrics and logs use it; the key is never logged
        api_key_env: SEARCH_KEY   # or api_key: "sk-..." (a Secret's variable is better)
        priority: 1               # higher is served first (default 0)
        weight: 2                 # share under contention (default 1)
        requests_per_minute: 600  # absent or 0: no limit
        tokens_per_minute: 200000
        max_concurrency: 32
        priority_range: [0, 10]   # may set vLLM's `priority` itself within it (absent: may not)
        models: [llama-3-8b, sql-lora]  # the models and adapters it may use (absent: all)
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prefix_gateway.config.errors import ConfigError
from prefix_gateway.config.redaction import refuse_placeholder

ANONYMOUS = "anonymous"
"""The label of every request no named tenant sent: keys from `--api-key`, or no key at all."""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_FIELDS = frozenset(
    {
        "name",
        "api_key",
        "api_key_env",
        "priority",
        "weight",
        "requests_per_minute",
        "tokens_per_minute",
        "max_concurrency",
        "priority_range",
        "models",
    }
)
_LIMITS = ("requests_per_minute", "tokens_per_minute", "max_concurrency")


@dataclass(frozen=True)
class TenantSpec:
    name: str
    api_key: str = field(repr=False)
    api_key_env: str = ""
    """The variable the key was read from (empty: the file gave the key itself)."""
    priority: int = 0
    weight: float = 1.0
    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    max_concurrency: int = 0
    """0 for any of the three limits: none."""
    priority_range: tuple[int, int] | None = None
    """The lowest and highest `priority` it may send the engine itself, in vLLM's terms (lower
    is served first); None: the client's own priority is not passed on."""
    models: frozenset[str] | None = None
    """The models and adapters it may use; None: every one."""

    @property
    def limited(self) -> bool:
        return bool(self.requests_per_minute or self.tokens_per_minute or self.max_concurrency)


def parse_tenants(raw: object, environ: Mapping[str, str]) -> tuple[TenantSpec, ...]:
    """The tenants a YAML `tenants:` value describes; `ConfigError` naming the first bad one."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError("tenants must be a list of tenants")
    specs: list[TenantSpec] = []
    names: set[str] = set()
    keys: set[str] = set()
    for position, entry in enumerate(raw):
        spec = _tenant(position, entry, environ)
        where = f"tenants[{position}] ({spec.name})"
        if spec.name in names:
            raise ConfigError(f"{where}: the name is given twice")
        if spec.api_key in keys:
            raise ConfigError(f"{where}: its key is another tenant's too")
        names.add(spec.name)
        keys.add(spec.api_key)
        specs.append(spec)
    return tuple(specs)


def check_tenants(
    tenants: tuple[TenantSpec, ...], api_keys: tuple[str, ...], isolate: bool
) -> None:
    """The tenants beside the other client settings."""
    if isolate and not (api_keys or tenants):
        raise ConfigError("isolate_tenants needs client API keys (--api-key or tenants)")
    shared = {tenant.name for tenant in tenants if tenant.api_key in api_keys}
    if shared:
        raise ConfigError(f"tenants {sorted(shared)}: a key given with --api-key is theirs too")


def _tenant(position: int, entry: object, environ: Mapping[str, str]) -> TenantSpec:
    where = f"tenants[{position}]"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a mapping with name and api_key or api_key_env")
    name = entry.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name == ANONYMOUS:
        raise ConfigError(
            f"{where}: name must be 1-64 letters, digits, '_', '.' or '-' (and not"
            f" {ANONYMOUS!r}), not {name!r}"
        )
    where = f"{where} ({name})"
    unknown = set(entry) - _FIELDS
    if unknown:
        raise ConfigError(f"{where}: unknown fields {sorted(unknown)}")
    variable = entry.get("api_key_env")
    return TenantSpec(
        name=name,
        api_key=_key(where, entry, environ),
        api_key_env=variable if isinstance(variable, str) else "",
        priority=_integer(where, entry, "priority", 0, minimum=None),
        weight=_weight(where, entry.get("weight", 1)),
        **{limit: _integer(where, entry, limit, 0, minimum=0) for limit in _LIMITS},
        priority_range=_priority_range(where, entry.get("priority_range")),
        models=_models(where, entry.get("models")),
    )


def _key(where: str, entry: dict[str, Any], environ: Mapping[str, str]) -> str:
    given, variable = entry.get("api_key"), entry.get("api_key_env")
    if (given is None) == (variable is None):
        raise ConfigError(f"{where}: give exactly one of api_key and api_key_env")
    if variable is not None:
        if not isinstance(variable, str) or not variable:
            raise ConfigError(f"{where}: api_key_env must name an environment variable")
        given = environ.get(variable)
        if not given:
            raise ConfigError(f"{where}: the environment variable {variable} is not set")
    if not isinstance(given, str) or not given.strip() or given != given.strip():
        raise ConfigError(f"{where}: api_key must be a non-empty string without spaces around")
    refuse_placeholder(f"{where}: api_key", given)
    return given


def _integer(
    where: str, entry: dict[str, Any], name: str, default: int, minimum: int | None
) -> int:
    value = entry.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: {name} must be an integer, not {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{where}: {name} must be at least {minimum}, not {value}")
    return value


_ENGINE_PRIORITY = (-(2**63), 2**63 - 1)
"""vLLM's `priority` is a 64-bit integer."""


def _priority_range(where: str, value: object) -> tuple[int, int] | None:
    if value is None:
        return None
    if (
        not isinstance(value, list)
        or len(value) != 2
        or any(isinstance(bound, bool) or not isinstance(bound, int) for bound in value)
        or value[0] > value[1]
        or value[0] < _ENGINE_PRIORITY[0]
        or value[1] > _ENGINE_PRIORITY[1]
    ):
        raise ConfigError(
            f"{where}: priority_range must be [lowest, highest], two 64-bit integers in order,"
            f" not {value!r}"
        )
    return value[0], value[1]


def _models(where: str, value: object) -> frozenset[str] | None:
    if value is None:
        return None
    if (
        not isinstance(value, list)
        or not value
        or any(not isinstance(model, str) or not model for model in value)
    ):
        raise ConfigError(f"{where}: models must be a list of model names, not {value!r}")
    return frozenset(value)


def _weight(where: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"{where}: weight must be a positive number, not {value!r}")
    return float(value)
