"""The one composition root: everything a gateway process runs, built from `Settings` in the
app's lifespan, started and stopped in dependency order.
"""

from __future__ import annotations

import random
import ssl
from collections.abc import Callable, Generator
from dataclasses import dataclass

import httpx

from prefix_gateway.backends.adapters import AdapterLoader
from prefix_gateway.backends.discovery import Discovery
from prefix_gateway.backends.engine_load import EngineLoadScraper
from prefix_gateway.backends.health import Health
from prefix_gateway.backends.kv_events import KVEventFeeds
from prefix_gateway.backends.monitor import BackendMonitor
from prefix_gateway.backends.pool import BackendPool
from prefix_gateway.backends.shared_load import LOAD_SCRIPT, SharedLoad
from prefix_gateway.backends.stalls import StallRule, StallWatch
from prefix_gateway.config import Settings
from prefix_gateway.doctor.examination import Doctor
from prefix_gateway.doctor.watch import DoctorWatch
from prefix_gateway.metrics import Metrics
from prefix_gateway.prompt.tokens import EngineTokenizer
from prefix_gateway.proxy.access_log import configure_access_logger
from prefix_gateway.proxy.forwarder import Forwarder
from prefix_gateway.proxy.handler import ProxyHandler
from prefix_gateway.proxy.http1 import client_tls
from prefix_gateway.proxy.prefills import Prefills
from prefix_gateway.proxy.tenancy import TenantFleet
from prefix_gateway.proxy.upstream import Upstream, engine_headers_dropped
from prefix_gateway.routing.policies import build_policy
from prefix_gateway.routing.recorder import Stores
from prefix_gateway.routing.router import Router
from prefix_gateway.state import redis as redis_store
from prefix_gateway.state.engine_blocks import EventFedIndex
from prefix_gateway.state.index import InMemoryPrefixIndex, PrefixIndex
from prefix_gateway.state.sessions import InMemorySessionStore, SessionStore


@dataclass
class Components:
    settings: Settings
    pool: BackendPool
    metrics: Metrics
    index: PrefixIndex
    router: Router
    upstream: Upstream
    probes: httpx.AsyncClient
    monitor: BackendMonitor
    proxy: ProxyHandler
    discovery: Discovery
    engine_load: EngineLoadScraper
    stalls: StallWatch
    redis: redis_store.RedisLink | None = None
    kv_events: KVEventFeeds | None = None
    shared_load: SharedLoad | None = None
    doctor: DoctorWatch | None = None
    adapters: AdapterLoader | None = None

    @classmethod
    def build(cls, settings: Settings, pool: BackendPool | None = None) -> Components:
        pool = pool or BackendPool.from_specs(settings.backend)
        if settings.access_log:
            configure_access_logger(settings.log_format)
        metrics = Metrics()
        pool.removed.append(metrics.forget_backend)
        local_index = InMemoryPrefixIndex(settings.affinity_ttl, settings.index_max_blocks)
        local_sessions = InMemorySessionStore(settings.affinity_ttl, settings.session_max)
        local_responses = InMemorySessionStore(settings.affinity_ttl, settings.session_max)
        index: PrefixIndex = local_index
        sessions: SessionStore = local_sessions
        responses: SessionStore = local_responses
        shared = None
        if settings.redis_url:
            shared = redis_store.connect(
                settings, metrics, local_index, local_sessions, local_responses
            )
            index, sessions, responses = shared.index, shared.sessions, shared.responses
        tls = client_tls(settings.upstream_ca_file, settings.upstream_tls_verify)
        probes = probe_client(settings, tls, pool.credentialed)
        feeds = None
        event_index = None
        routing_index = index
        if settings.kv_events:
            event_index = EventFedIndex(index)
            feeds = KVEventFeeds(pool, probes, settings.block_tokens, metrics, event_index.settle)
            event_index.live = feeds.live
            routing_index = event_index
            pool.removed.append(feeds.forget)
        tokenizer = EngineTokenizer.load(settings.tokenizer) if settings.tokenizer else None
        stores = Stores(
            routing_index,
            sessions,
            responses,
            shared.agreement if shared is not None else None,
            event_index,
        )
        policy = build_policy(settings, random.Random())
        router = Router(settings, pool, stores, policy, metrics, tokenizer)
        pool.removed.append(router.memory.traffic.recent.forget)
        if router.memory.first_token is not None:
            pool.removed.append(router.memory.first_token.forget)
        adapters = None
        if settings.lora_adapters:
            adapters = AdapterLoader(
                pool, probes, settings.lora_adapters, settings.lora_idle_unload, metrics
            )
            router.adapters = adapters
        health = Health(
            pool,
            settings.unhealthy_threshold,
            settings.healthy_threshold,
            settings.failure_threshold,
        )
        monitor = BackendMonitor(
            pool,
            probes,
            settings.health_interval,
            settings.models_interval,
            health.probed,
            health.inference_probed,
        )
        stall_rule = StallRule(
            settings.stall_seconds, settings.stall_factor, 2 * settings.scrape_interval
        )
        stalls = StallWatch(pool, health, stall_rule, metrics, settings.block_tokens)
        upstream = Upstream(
            settings.connect_timeout,
            settings.upstream_api_key,
            settings.forward_client_auth,
            tls=tls,
            on_resend=lambda reason: metrics.child(metrics.upstream_resends, reason).inc(),
            engine_headers=engine_headers_dropped(
                settings.engine_control, settings.forward_priority
            ),
        )
        fleet_prefills = None
        if shared is not None and "prefills" in settings.fleet_share:
            fleet_prefills = shared.agreement
        prefills = Prefills(settings.prefill_wait, metrics, fleet_prefills)
        forwarder = Forwarder(settings, upstream, health, metrics, prefills, stalls.speed)
        engine_load = EngineLoadScraper(pool, probes, settings.scrape_interval)
        pool.removed.append(engine_load.forget)
        shared_load = None
        tenant_fleet = None
        if shared is not None:
            link = shared.link
            link.preload(LOAD_SCRIPT)
            traffic = router.memory.traffic if "traffic" in settings.fleet_share else None
            shared_load = SharedLoad(link.client, link, shared.keys, pool, engine_load, traffic)
            link.run_while_open(shared_load.start, shared_load.stop)
            fleet = shared_load
            tenant_fleet = TenantFleet(shared, lambda: fleet.gateways)
        proxy = ProxyHandler(settings, router, forwarder, metrics, pool, tenant_fleet)
        discovery = Discovery.build(settings, pool, monitor.refresh)
        # The doctor's probes go to the replicas directly: no routing state hears of them.
        doctor = DoctorWatch(
            pool, Doctor(settings, probes, tokenizer, feeds), metrics, settings.doctor_interval
        )
        pool.removed.append(doctor.forget)
        return cls(
            settings,
            pool,
            metrics,
            index,
            router,
            upstream,
            probes,
            monitor,
            proxy,
            discovery,
            engine_load,
            stalls,
            shared.link if shared is not None else None,
            feeds,
            shared_load,
            doctor,
            adapters,
        )

    async def start(self) -> None:
        if self.redis is not None:
            await self.redis.start()
        await self.upstream.start()
        self.proxy.start()
        await self.monitor.refresh_all()
        await self.discovery.start()
        self.monitor.start()
        self.engine_load.start()
        self.stalls.start()
        if self.kv_events is not None:
            self.kv_events.start()
        if self.doctor is not None:
            self.doctor.start()
        if self.adapters is not None:
            self.adapters.start()

    async def stop(self) -> None:
        if self.adapters is not None:
            await self.adapters.stop()
        if self.doctor is not None:
            await self.doctor.stop()
        if self.kv_events is not None:
            await self.kv_events.stop()
        await self.stalls.stop()
        await self.engine_load.stop()
        await self.discovery.stop()
        await self.monitor.stop()
        await self.proxy.stop()
        await self.upstream.close()
        await self.probes.aclose()
        if self.redis is not None:
            await self.redis.close()


def probe_client(
    settings: Settings,
    tls: ssl.SSLContext | None = None,
    credentialed: Callable[[str], bool] | None = None,
) -> httpx.AsyncClient:
    """The client of health probes, model listings, scrapes, adapter loads and the doctor's
    checks. They carry `--upstream-api-key` (vLLM guards /v1/models and the rest) where
    `credentialed(url)` says the replica gets it (every URL when None: the operator gave
    them all)."""
    # Requests and probes check replicas' certificates alike, and reach them directly (no
    # proxy from the environment).
    if tls is None:
        tls = client_tls(settings.upstream_ca_file, settings.upstream_tls_verify)
    key = settings.upstream_api_key
    return httpx.AsyncClient(
        timeout=httpx.Timeout(settings.health_timeout, connect=settings.connect_timeout),
        auth=UpstreamKey(key, credentialed) if key else None,
        verify=tls,
        trust_env=False,
    )


class UpstreamKey(httpx.Auth):
    """The upstream key on requests to the replicas that get it, and on no others."""

    def __init__(self, key: str, credentialed: Callable[[str], bool] | None) -> None:
        self._header = f"Bearer {key}"
        self._credentialed = credentialed

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        if self._credentialed is None or self._credentialed(str(request.url)):
            request.headers["authorization"] = self._header
        yield request
