"""The settings in sections, for `serve --help` and docs/configuration.md: each section names
its settings; one that no section names (a setting just added) joins the section of the setting
before it in `Settings`."""

from __future__ import annotations

import dataclasses
from typing import Any

from prefix_gateway.config.settings import Settings

SECTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "Listening",
        ("host", "port", "metrics_port", "workers", "shutdown_delay", "shutdown_grace"),
    ),
    (
        "Replicas and discovery",
        (
            "backend",
            "backend_dns",
            "k8s_service",
            "k8s_namespace",
            "k8s_api_url",
            "k8s_credentials",
            "dns_nameserver",
            "discovery_interval",
            "drain_timeout",
            "default_model",
        ),
    ),
    ("Emulated replicas", ("emulate", "emulate_model", "emulate_args")),
    (
        "Routing",
        (
            "policy",
            "load_factor",
            "load_floor",
            "affinity_tokens",
            "min_match_tokens",
            "recent_cap",
            "recent_slack",
            "recent_half_life",
            "ttft_routing",
            "ttft_half_life",
            "ttft_margin",
            "owner_margin_blocks",
            "ring_choices",
            "shared_prompts_max",
            "prefill_wait",
            "affinity_ttl",
            "index_max_blocks",
            "session_max",
            "session_from_user",
            "sticky_cookie",
            "conversations_max",
        ),
    ),
    (
        "Tokens and what the replicas cached",
        (
            "block_tokens",
            "chars_per_token",
            "tokenizer",
            "engine_block_size",
            "kv_events",
            "cache_feedback",
            "observe_usage",
        ),
    ),
    (
        "Health and load of the replicas",
        (
            "health_interval",
            "health_timeout",
            "unhealthy_threshold",
            "healthy_threshold",
            "failure_threshold",
            "stall_seconds",
            "stall_factor",
            "scrape_interval",
            "models_interval",
        ),
    ),
    (
        "Timeouts and retries",
        (
            "connect_timeout",
            "first_byte_timeout",
            "stream_idle_timeout",
            "client_write_timeout",
            "request_timeout",
            "max_attempts",
            "retry_backoff",
            "retry_after_cap",
        ),
    ),
    (
        "Admission and request limits",
        (
            "max_concurrency",
            "max_queue",
            "queue_timeout",
            "max_connections",
            "max_connections_per_client",
            "max_body_bytes",
            "max_pending_body_bytes",
            "whole_reply_bytes",
            "max_header_bytes",
            "max_headers",
            "head_timeout",
            "body_timeout",
            "max_json_depth",
            "max_json_values",
            "max_messages",
            "max_batch_prompts",
            "max_session_key_bytes",
            "max_prompt_tokens",
        ),
    ),
    (
        "Keys and TLS",
        (
            "api_key",
            "admin_token",
            "upstream_api_key",
            "forward_client_auth",
            "trusted_proxies",
            "engine_control",
            "upstream_ca_file",
            "upstream_tls_verify",
        ),
    ),
    (
        "Tenants and flow control",
        (
            "isolate_tenants",
            "tenants",
            "forward_priority",
            "cached_token_cost",
            "budget_max_tokens",
            "max_inflight_per_replica",
        ),
    ),
    (
        "Several gateways: Redis",
        (
            "redis_url",
            "redis_prefix",
            "redis_timeout",
            "redis_max_connections",
            "fleet_share",
            "claim_ttl",
            "tenant_slots_ttl",
        ),
    ),
    ("Logging", ("log_level", "access_log")),
)


def sectioned_fields() -> list[tuple[str, list[dataclasses.Field[Any]]]]:
    """Every field of `Settings` once, under the title of its section, in `SECTIONS` order."""
    fields = dataclasses.fields(Settings)
    by_name = {f.name: f for f in fields}
    placed: dict[str, str] = {}
    for title, names in SECTIONS:
        for name in names:
            if name not in by_name:
                raise KeyError(f"section {title!r} names {name!r}, which is no setting")
            placed[name] = title
    extra: dict[str, list[str]] = {}
    previous = SECTIONS[0][0]
    for f in fields:
        if f.name in placed:
            previous = placed[f.name]
        else:
            extra.setdefault(previous, []).append(f.name)
    return [
        (title, [by_name[name] for name in (*names, *extra.get(title, ()))])
        for title, names in SECTIONS
    ]
