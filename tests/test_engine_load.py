from __future__ import annotations

import asyncio

import httpx
import openai

from prefix_gateway.backends.backend import Backend
from prefix_gateway.backends.engine_load import (
    EngineLoad,
    EngineLoadScraper,
    others_load,
    parse_engine_load,
)
from prefix_gateway.backends.pool import BackendPool
from prefix_gateway.emulator.process import EmulatorProcess
from tests.support import PATIENCE_SECONDS, eventually, stall

VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.42
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 1000.0
"""

SGLANG = """sglang:num_running_reqs{model_name="m"} 4
sglang:num_queue_reqs{model_name="m"} 1
sglang:token_usage{model_name="m"} 0.5
"""


def test_parses_vllm_and_sglang_names() -> None:
    assert parse_engine_load(VLLM) == EngineLoad(3.0, 2.0, 0.42)
    assert parse_engine_load(SGLANG) == EngineLoad(4.0, 1.0, 0.5)
    assert parse_engine_load("other_metric 5\n") is None


def test_a_sample_timestamp_is_not_its_value() -> None:
    stamped = 'vllm:num_requests_running{model_name="m"} 3 1700000000000\n'
    assert parse_engine_load(stamped) == EngineLoad(3.0, 0.0, None)
    assert parse_engine_load('vllm:num_requests_running{model_name="m" 3\n') is None


def test_only_the_load_others_sent_is_added() -> None:
    assert others_load(EngineLoad(3, 2), own_in_flight=1) == 4
    assert others_load(EngineLoad(1, 0), own_in_flight=3) == 0


def test_scrapes_a_live_replica_under_load() -> None:
    with (
        EmulatorProcess("--max-running", "1", "--decode-ms-per-token", "50", name="m") as replica,
        openai.OpenAI(base_url=replica.url + "/v1", api_key="x", max_retries=0) as client,
    ):
        backend = Backend(name="r", url=replica.url, healthy=True, models=frozenset({"m"}))
        pool = BackendPool()
        pool.add(backend)

        async def scenario() -> None:
            loop = asyncio.get_running_loop()
            # Three requests that another gateway sent: one runs, two wait, all held there
            # while the replica is stalled.
            stall(replica, True)
            calls = [
                loop.run_in_executor(
                    None,
                    lambda: client.completions.create(model="m", prompt="x y", max_tokens=5),
                )
                for _ in range(3)
            ]
            try:
                await eventually(
                    lambda: (
                        replica.metric("vllm:num_requests_running") == 1
                        and replica.metric("vllm:num_requests_waiting") == 2
                    ),
                    "the replica holding all three",
                )
                async with httpx.AsyncClient(timeout=PATIENCE_SECONDS) as http:
                    scraper = EngineLoadScraper(pool, http, interval=0)
                    await scraper.scrape_all()
                    assert backend.queued == 0  # one scrape could be a request just ending
                    await scraper.scrape_all()
                    assert backend.queued == 3
                    assert backend.load == 3
                    assert scraper.kv_cache_usage["r"] > 0
            finally:
                stall(replica, False)
            await asyncio.gather(*calls)

        asyncio.run(scenario())
