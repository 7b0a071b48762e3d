"""The checks every `Settings` passes at start-up, before anything is built from it."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING

from prefix_gateway.config.backend_specs import read_backend_spec
from prefix_gateway.config.errors import ConfigError
from prefix_gateway.config.redaction import refuse_placeholders
from prefix_gateway.config.tenants import check_tenants
from prefix_gateway.logs import LOG_FORMATS

ENGINE_CONTROLS = ("priority", "request_id", "kv_transfer_params", "data_parallel_rank")
"""What a client may be allowed to steer in the engine (`--engine-control`)."""
BACKEND_HEADERS = ("name", "address", "off")

if TYPE_CHECKING:
    from prefix_gateway.config.settings import Settings


def validated(settings: Settings) -> Settings:
    """`settings`, checked (`ConfigError` for the first that cannot be used), with
    `--engine-block-size` applied."""
    if settings.workers < 1:
        raise ConfigError("workers must be at least 1")
    if not 0 <= settings.metrics_port <= 65535 or 0 < settings.metrics_port == settings.port:
        raise ConfigError("metrics_port must be 0 (none) or a TCP port other than port")
    if settings.log_format not in LOG_FORMATS:
        raise ConfigError(f"log_format must be {' or '.join(LOG_FORMATS)}")
    if settings.load_factor < 1.0:
        raise ConfigError("load_factor must be at least 1.0")
    _check_policy(settings)
    unknown = set(settings.engine_control) - set(ENGINE_CONTROLS)
    if unknown:
        raise ConfigError(
            f"engine_control: unknown {sorted(unknown)}; known: {', '.join(ENGINE_CONTROLS)}"
        )
    if settings.backend_header not in BACKEND_HEADERS:
        raise ConfigError(f"backend_header must be {', '.join(BACKEND_HEADERS)}")
    if settings.lora_idle_unload < 0:
        raise ConfigError("lora_idle_unload must not be negative")
    if settings.block_tokens < 1 or settings.chars_per_token <= 0:
        raise ConfigError("block_tokens and chars_per_token must be positive")
    if settings.engine_block_size < 0:
        raise ConfigError("engine_block_size must not be negative")
    if settings.kv_events and (not settings.tokenizer or settings.isolate_tenants):
        raise ConfigError(
            "kv_events needs --tokenizer (events carry token ids), and tenants' chains are"
            " seeded apart from the engine's (no --isolate-tenants)"
        )
    if settings.tokenizer and not os.path.exists(settings.tokenizer):
        raise ConfigError(f"tokenizer {settings.tokenizer!r} is neither a folder nor a file")
    if (
        not (settings.backend or settings.backend_dns or settings.k8s_service)
        and settings.emulate <= 0
    ):
        raise ConfigError(
            "no backends: give --backend URL (or GATEWAY_BACKENDS), --backend-dns HOST:PORT,"
            " --k8s-service NAME or --emulate N"
        )
    for spec in settings.backend:
        read_backend_spec(spec)
    if settings.doctor_interval < 0:
        raise ConfigError("doctor_interval must not be negative (0: off)")
    if settings.discovery_interval <= 0 or settings.drain_timeout < 0:
        raise ConfigError("discovery_interval must be positive, drain_timeout not negative")
    unknown = set(settings.fleet_share) - {"claims", "traffic", "prompts", "prefills", "none"}
    if unknown:
        raise ConfigError(
            f"fleet_share: unknown {', '.join(sorted(unknown))}; choose claims, traffic,"
            " prompts, prefills or none"
        )
    if settings.redis_timeout <= 0 or settings.redis_max_connections < 2 or settings.claim_ttl <= 0:
        raise ConfigError(
            "redis_timeout and claim_ttl must be positive, redis_max_connections at least 2"
        )
    if settings.tenant_slots_ttl <= 0:
        raise ConfigError("tenant_slots_ttl must be positive")
    _check_reliability(settings)
    refuse_placeholders(settings)
    if settings.engine_block_size:
        return replace(settings, block_tokens=settings.engine_block_size)
    return settings


def _check_policy(settings: Settings) -> None:
    if settings.recent_cap < 1.0 or settings.recent_slack < 0 or settings.recent_half_life <= 0:
        raise ConfigError(
            "recent_cap must be at least 1.0, recent_slack not negative and"
            " recent_half_life positive"
        )
    if settings.ttft_half_life <= 0 or settings.ttft_margin < 1.0:
        raise ConfigError("ttft_half_life must be positive and ttft_margin at least 1.0")
    if min(settings.owner_margin_blocks, settings.ring_choices, settings.shared_prompts_max) < 1:
        raise ConfigError(
            "owner_margin_blocks, ring_choices and shared_prompts_max must be at least 1"
        )


def _check_reliability(settings: Settings) -> None:
    timeouts = (
        settings.head_timeout,
        settings.body_timeout,
        settings.connect_timeout,
        settings.first_byte_timeout,
        settings.stream_idle_timeout,
        settings.client_write_timeout,
        settings.request_timeout,
        settings.health_timeout,
    )
    if min(timeouts) <= 0:
        raise ConfigError("every timeout must be positive")
    counts = (
        settings.max_attempts,
        settings.unhealthy_threshold,
        settings.healthy_threshold,
        settings.failure_threshold,
        settings.max_concurrency,
        settings.max_connections,
        settings.max_headers,
    )
    if min(counts) < 1:
        raise ConfigError(
            "max_attempts, thresholds, max_concurrency, max_connections and max_headers"
            " must be at least 1"
        )
    if settings.max_connections_per_client < 0:
        raise ConfigError("max_connections_per_client must be 0 (no cap) or more")
    waits = (
        settings.max_queue,
        settings.queue_timeout,
        settings.retry_backoff,
        settings.retry_after_cap,
        settings.shutdown_delay,
        settings.shutdown_grace,
    )
    if min(waits) < 0:
        raise ConfigError("queue sizes, backoff and shutdown periods must not be negative")
    if settings.stall_seconds <= 0 or settings.stall_factor < 1:
        raise ConfigError("stall_seconds must be positive and stall_factor at least 1")
    if settings.max_header_bytes < 1024 or settings.max_json_depth < 2:
        raise ConfigError("max_header_bytes must be at least 1024, max_json_depth at least 2")
    limits = (
        settings.max_json_values,
        settings.max_messages,
        settings.max_batch_prompts,
        settings.max_session_key_bytes,
        settings.max_prompt_tokens,
        settings.whole_reply_bytes,
    )
    if min(limits) < 1:
        raise ConfigError("every max_* limit must be at least 1")
    check_tenants(settings.tenants, settings.api_key, settings.isolate_tenants)
    if settings.max_inflight_per_replica < 0:
        raise ConfigError("max_inflight_per_replica must be 0 (off) or more")
    if settings.forward_priority:
        _check_forwarded_priorities(settings)
    if not 0 <= settings.cached_token_cost <= 1 or settings.budget_max_tokens < 1:
        raise ConfigError("cached_token_cost must be in [0, 1], budget_max_tokens positive")
    if settings.max_pending_body_bytes < settings.max_body_bytes:
        raise ConfigError("max_pending_body_bytes must be at least max_body_bytes")
    if settings.upstream_ca_file and not os.path.isfile(settings.upstream_ca_file):
        raise ConfigError(f"upstream_ca_file {settings.upstream_ca_file!r} is not a file")


_ENGINE_PRIORITY_LIMIT = 2**63 - 1
"""vLLM takes a signed 64-bit `priority`; a tenant's is sent negated, so both signs must fit."""


def _check_forwarded_priorities(settings: Settings) -> None:
    for position, tenant in enumerate(settings.tenants):
        if abs(tenant.priority) > _ENGINE_PRIORITY_LIMIT:
            raise ConfigError(
                f"tenants[{position}] ({tenant.name}): with forward_priority, priority must be"
                f" within -{_ENGINE_PRIORITY_LIMIT}..{_ENGINE_PRIORITY_LIMIT} (vLLM's 64-bit"
                f" range), not {tenant.priority}"
            )
