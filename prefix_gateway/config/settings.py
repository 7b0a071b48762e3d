"""Settings: one typed object, validated once at start-up; every field `foo_bar` is the flag
`--foo-bar`, the variable `GATEWAY_FOO_BAR` and the YAML key `foo_bar` (`sources.py`).
The policy's name is checked where policies are registered (`prefix_gateway.routing.policies`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefix_gateway.config.adapters import AdapterSpec
from prefix_gateway.config.errors import ConfigError
from prefix_gateway.config.tenants import TenantSpec

__all__ = ["ConfigError", "Settings"]


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class Settings:
    host: str = _opt("127.0.0.1", "address to listen on")
    port: int = _opt(8080, "port to listen on")
    metrics_port: int = _opt(
        0,
        "also listen on this port (at --host) for GET /metrics alone, which --port then answers"
        " with a 404: a port of its own for a firewall or NetworkPolicy (0: /metrics on --port)",
    )
    workers: int = _opt(
        1,
        "worker processes accepting on the port, under one supervising process; they share"
        " the prefix index and sessions only through --redis-url",
    )
    backend: tuple[str, ...] = _opt(
        (), "replica URL, or MODEL=URL for a per-model pool; repeat for several", env="BACKENDS"
    )
    policy: str = _opt(
        "prefix",
        "routing policy: prefix, or a baseline kept for comparison (consistent_hash,"
        " least_loaded, round_robin, random; see docs/routing.md)",
    )
    emulate: int = _opt(0, "also start N emulated replicas and route to them")
    emulate_model: str = _opt("emulated-model", "model name served by emulated replicas")
    emulate_args: str = _opt(
        "", "extra flags for every emulated replica, e.g. '--cache-blocks 512'"
    )
    load_factor: float = _opt(1.25, "bounded-load factor c: no backend above ceil(c * mean load)")
    load_floor: int = _opt(2, "in-flight requests every backend may take whatever the mean")
    block_tokens: int = _opt(16, "tokens per prefix block")
    chars_per_token: float = _opt(4.0, "characters per token assumed by the block chunking")
    tokenizer: str = _opt(
        "",
        "the served model's folder (tokenizer.json, tokenizer_config.json) or tokenizer.json:"
        " prompts are tokenized as the engine does and hashed in its blocks of token ids"
        " (empty: blocks of characters, at --chars-per-token)",
    )
    engine_block_size: int = _opt(
        0,
        "the engines' KV-cache block size in tokens (vLLM's --block-size), for --tokenizer:"
        " it replaces --block-tokens (0: keep --block-tokens)",
    )
    kv_events: bool = _opt(
        False,
        "with --tokenizer: subscribe to each replica's KV-cache events (found at its"
        " /kv_event_sources) and route on the blocks it holds while they flow",
    )
    affinity_tokens: int = _opt(256, "tokens hashed into the affinity key of the hash ring")
    min_match_tokens: int = _opt(64, "shortest indexed prefix match worth routing on")
    recent_cap: float = _opt(
        1.1,
        "pass over a replica whose recent requests exceed this times the mean (or the mean plus"
        " the slack, whichever is more)",
    )
    recent_slack: float = _opt(
        2.0,
        "recent requests above the mean a replica may always have before it counts as running"
        " hot: a burst's first few requests are not yet a trend",
    )
    recent_half_life: float = _opt(
        30.0,
        "seconds in which a recent request counts half as much, for replicas' recent requests"
        " and shared prompts' share of them alike",
    )
    ttft_routing: bool = _opt(
        False,
        "learn each replica's time to first token from the streams it answers and move a"
        " request to a replica predicted to answer --ttft-margin times sooner (the prefix"
        " policy; docs/routing.md)",
    )
    ttft_half_life: float = _opt(
        3.0,
        "seconds in which an observed time to first token counts half as much in its"
        " replica's fit: how fast a slowdown, or a recovery, is followed",
    )
    ttft_margin: float = _opt(
        1.5,
        "how many times sooner another replica within the bound must be predicted to give the"
        " first token for a request to move there from the rule's choice",
    )
    owner_margin_blocks: int = _opt(
        4,
        "prefix blocks by which one replica's match must exceed every other's for it to keep"
        " the request past the load bound",
    )
    ring_choices: int = _opt(
        2,
        "replicas within the bound a new or spilled prefix may take on the hash ring: the"
        " first N clockwise from its key (a request with a session key takes the first)",
    )
    shared_prompts_max: int = _opt(
        1 << 16, "shared system prompts whose share of recent requests is counted at most"
    )
    affinity_ttl: float = _opt(600.0, "seconds an index entry or sticky session lives unused")
    index_max_blocks: int = _opt(2_000_000, "prefix blocks the in-memory index keeps at most")
    session_max: int = _opt(
        1_000_000, "sticky sessions (and stored responses' replicas) kept at most in memory"
    )
    session_from_user: bool = _opt(False, "use the request's `user` field as a session key")
    cache_feedback: bool = _opt(
        True,
        "prune index entries a backend's reported cached tokens show it has evicted",
    )
    observe_usage: bool = _opt(
        False,
        "ask replicas for usage on streams whose client did not, and strip it from the reply",
    )
    prefill_wait: float = _opt(
        2.0,
        "seconds a request may wait for its prefix being computed on its replica by an earlier"
        " stream, to find it cached instead of computing it again (0: never wait)",
    )
    default_model: str = _opt("", "model used when a request names none")
    max_body_bytes: int = _opt(
        8 * 1024 * 1024, "largest request body accepted (413 beyond; see docs/reliability.md)"
    )
    whole_reply_bytes: int = _opt(
        1024 * 1024,
        "largest non-streamed response read whole before it is sent (its answer recorded"
        " first); larger ones are passed on as they arrive, their usage read from their end",
    )
    connect_timeout: float = _opt(3.0, "seconds to connect to a replica")
    first_byte_timeout: float = _opt(
        600.0, "seconds from sending a request to a replica to its first body byte (prefill)"
    )
    max_attempts: int = _opt(3, "replicas tried for one request before giving up")
    # --- Reliability: timeouts, retries, health thresholds, overload, limits, auth, shutdown ---
    stream_idle_timeout: float = _opt(
        60.0, "seconds a response may go without a chunk from the replica"
    )
    client_write_timeout: float = _opt(
        30.0,
        "seconds a streamed chunk may wait for the client to take it; then the stream ends and"
        " the replica's request is aborted",
    )
    request_timeout: float = _opt(
        3600.0, "seconds one request may take, from its admission to its last byte"
    )
    retry_backoff: float = _opt(
        0.025, "seconds of backoff before the first retry; doubled per retry, with full jitter"
    )
    retry_after_cap: float = _opt(
        2.0, "longest Retry-After of a replica's 429 that is waited out before trying another"
    )
    health_timeout: float = _opt(2.0, "seconds a health probe may take")
    unhealthy_threshold: int = _opt(2, "consecutive failed probes that eject a replica")
    healthy_threshold: int = _opt(2, "consecutive passed probes that readmit an ejected replica")
    failure_threshold: int = _opt(
        5,
        "consecutive failed requests (5xx, timeouts, broken responses) that eject a replica;"
        " a refused connection ejects it at once",
    )
    stall_seconds: float = _opt(
        3.0,
        "a replica holding a request with no first byte this long (or stall_factor times what"
        " the fleet's prefill speed explains, if longer) while it produces nothing is stalled",
    )
    stall_factor: float = _opt(
        4.0, "how many times its expected prefill time a request may wait before a stall"
    )
    max_concurrency: int = _opt(1024, "requests proxied at once; more wait in the queue")
    max_queue: int = _opt(512, "requests waiting for a slot at most; beyond, a 429")
    queue_timeout: float = _opt(5.0, "seconds a request may wait for a slot before a 429")
    max_header_bytes: int = _opt(32768, "largest request line plus headers accepted (431 beyond)")
    max_headers: int = _opt(100, "most header lines in one request (431 beyond)")
    head_timeout: float = _opt(
        10.0,
        "seconds from a request's first byte (or a new connection) to the end of its headers"
        " (408 beyond)",
    )
    body_timeout: float = _opt(
        30.0, "seconds from the end of a request's headers to the end of its body (408 beyond)"
    )
    max_pending_body_bytes: int = _opt(
        256 * 1024 * 1024,
        "bytes of request bodies held at once, each from its first byte read until its"
        " request ends, queued or not (429 beyond)",
    )
    max_connections: int = _opt(
        4096, "client connections open at once; more are answered 503 and closed"
    )
    max_connections_per_client: int = _opt(
        256,
        "client connections open at once from one peer address; more are answered 429 and"
        " closed (0: no cap; behind a proxy every client shares its address)",
    )
    max_json_depth: int = _opt(64, "deepest nesting of arrays and objects in a request body")
    max_json_values: int = _opt(
        300_000,
        "JSON values a request body may hold, bounded before parsing by its commas and brackets",
    )
    max_messages: int = _opt(10_000, "messages a chat request may hold")
    max_batch_prompts: int = _opt(2_048, "prompts a completions or embeddings batch may hold")
    max_session_key_bytes: int = _opt(512, "longest session key (x-session-id, prompt_cache_key)")
    max_prompt_tokens: int = _opt(
        262_144,
        "prompt tokens hashed and indexed per request at most (about the longest context"
        " served); a longer prompt is routed on its beginning",
    )
    api_key: tuple[str, ...] = _opt(
        (),
        "client API key accepted as `Authorization: Bearer KEY` on /v1; repeat for several"
        " (none: no check)",
        env="API_KEYS",
        secret=True,
    )
    upstream_api_key: str = _opt(
        "",
        "sent to replicas as `Authorization: Bearer KEY` in place of the client's header",
        secret=True,
    )
    forward_client_auth: bool = _opt(False, "pass the client's Authorization header on to replicas")
    trusted_proxies: tuple[str, ...] = _opt(
        (),
        "addresses (or CIDRs) of proxies in front of the gateway whose X-Forwarded-For and"
        " X-Forwarded-Proto are believed (none: the peer is the client)",
    )
    isolate_tenants: bool = _opt(
        False,
        "give each client API key its own prefix-cache namespace: its own index entries, and"
        " vLLM's `cache_salt` added to its requests (needs --api-key or tenants)",
    )
    tenants: tuple[TenantSpec, ...] = _opt((), "the `tenants:` list (YAML only)", file_only=True)
    lora_adapters: tuple[AdapterSpec, ...] = _opt(
        (), "the `lora_adapters:` list (YAML only): adapters loaded on demand", file_only=True
    )
    lora_idle_unload: float = _opt(
        600.0,
        "seconds an adapter of `lora_adapters` may go without requests on a replica before the"
        " gateway unloads it there (0: never)",
    )
    forward_priority: bool = _opt(
        False,
        "write each request's tenant priority into vLLM's `priority` field (as -priority: vLLM"
        " serves lower values first; 0 for anonymous requests, whatever the client sent), for"
        " replicas run with --scheduling-policy priority",
    )
    engine_control: tuple[str, ...] = _opt(
        (),
        "a client's engine-control field or header passed to replicas as sent: priority (body"
        " `priority`, header X-Vllm-Priority), request_id, kv_transfer_params,"
        " data_parallel_rank (header X-Data-Parallel-Rank); repeat for several (none: each"
        " is dropped, request_id is prefixed with the request's tenant; docs/endpoints.md)",
    )
    cached_token_cost: float = _opt(
        0.1, "what a cached prompt token counts for in tenants' token budgets (1: a full token)"
    )
    max_inflight_per_replica: int = _opt(
        0,
        "flow control: requests this gateway has in flight on one replica at most (fewer where"
        " its engine reports others'); the rest wait here, by priority and fair share (0: off)",
    )
    budget_max_tokens: int = _opt(
        256,
        "completion tokens reserved against a token budget for a request that sets no"
        " completion limit, where no replica reports its model's context length",
    )
    upstream_ca_file: str = _opt(
        "",
        "PEM bundle of the certificate authorities trusted for https:// replicas, on requests and"
        " probes alike (default: the system's)",
    )
    upstream_tls_verify: bool = _opt(
        True, "verify https:// replicas' certificates and host names (off: any certificate passes)"
    )
    shutdown_delay: float = _opt(
        0.0, "seconds to keep serving after SIGTERM with /ready false, before closing the listener"
    )
    shutdown_grace: float = _opt(
        30.0, "seconds requests in flight may run once the listener closed"
    )
    health_interval: float = _opt(5.0, "seconds between active health probes of each replica")
    scrape_interval: float = _opt(
        2.0, "seconds between scrapes of each replica's queue from its /metrics (0: off)"
    )
    models_interval: float = _opt(30.0, "seconds between refreshes of each replica's model list")
    doctor_interval: float = _opt(
        300.0,
        "seconds between the doctor's checks of each replica (`prefix-gateway doctor`, run in"
        " the background: once a replica is healthy, then on this interval; a few one-token"
        " prompts each; see docs/doctor.md), exported as gateway_backend_check (0: off)",
    )
    backend_dns: tuple[str, ...] = _opt(
        (), "headless Service name whose A/AAAA records are replicas, HOST:PORT or MODEL=HOST:PORT"
    )
    k8s_service: tuple[str, ...] = _opt(
        (), "Kubernetes Service whose ready endpoints are replicas: NAME[:PORT], MODEL=NAME[:PORT]"
    )
    k8s_namespace: str = _opt("", "namespace of --k8s-service (default: the pod's own)")
    k8s_api_url: str = _opt(
        "",
        "Kubernetes API URL (default: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT)",
    )
    k8s_credentials: str = _opt(
        "/var/run/secrets/kubernetes.io/serviceaccount",
        "folder holding the service account's token, ca.crt and namespace files",
    )
    dns_nameserver: str = _opt("", "DNS server HOST:PORT for --backend-dns (default: the system's)")
    discovery_interval: float = _opt(
        10.0, "seconds between DNS lookups, and before re-opening a broken Kubernetes watch"
    )
    drain_timeout: float = _opt(
        30.0, "seconds a leaving replica's requests in flight may run before it is dropped"
    )
    redis_url: str = _opt(
        "",
        "share the prefix index and sessions through Redis: redis://HOST:PORT/DB, rediss://..., "
        "or redis+cluster://HOST:PORT for a Redis Cluster (default: in-memory only)",
    )
    redis_prefix: str = _opt("pgw", "namespace prefix of every Redis key")
    redis_timeout: float = _opt(0.05, "seconds a Redis call may take before local state answers")
    redis_max_connections: int = _opt(32, "Redis connections per gateway process at most")
    fleet_share: tuple[str, ...] = _opt(
        ("claims", "traffic", "prompts", "prefills"),
        "what gateways on one Redis tell each other besides the index, the sessions and their"
        " requests in flight: `claims` (where a shared prompt was sent first), `traffic` (pending"
        " prefill and recent requests per replica), `prompts` (each shared prompt's recent"
        " requests), `prefills` (where a stream is computing a shared prompt now, so that"
        " `--prefill-wait` holds a request for it at any gateway); `none` for none of them;"
        " repeat for several",
    )
    claim_ttl: float = _opt(
        10.0,
        "seconds a shared prompt counts as held, for every gateway on the Redis, by the backend"
        " it was first sent to, until the index shows it there",
    )
    tenant_slots_ttl: float = _opt(
        10.0,
        "seconds a gateway's requests in flight count against its tenants' max_concurrency in"
        " Redis after it last wrote them (it rewrites them at least every second): what the slots"
        " of a gateway that died stay taken for",
    )
    sticky_cookie: str = _opt(
        "", "cookie name: issue a session key as a cookie that then acts like x-session-id"
    )
    log_level: str = _opt("info", "log level")
    backend_header: str = _opt(
        "name",
        "what the x-gateway-backend response header tells clients of the replica that"
        " answered: name (its name in the pool), address (its URL's host and port) or off",
    )
    log_format: str = _opt(
        "json",
        "json (one object a line, for a log collector) or text, for every line the gateway"
        " writes: its own, uvicorn's and the access log's",
    )
    access_log: bool = _opt(
        True, "write one JSON line per request to the `prefix_gateway.access` log"
    )
    admin_token: str = _opt(
        "",
        "bearer token required by /admin endpoints (empty: the admin API answers only on a"
        " loopback listener, and only requests addressed to a loopback host)",
        secret=True,
    )
    conversations_max: int = _opt(
        250_000, "conversation keys kept for affinity and cache-break accounting"
    )

    @property
    def block_chars(self) -> int:
        return max(1, round(self.block_tokens * self.chars_per_token))

    @property
    def max_prompt_blocks(self) -> int:
        return max(1, self.max_prompt_tokens // self.block_tokens)

    @property
    def min_match_blocks(self) -> int:
        return max(1, self.min_match_tokens // self.block_tokens)

    def validate(self) -> Settings:
        from prefix_gateway.config.validation import (
            validated,  # it checks a Settings: imported late
        )

        return validated(self)
