"""The emulated replica under realistic use: conversations that reuse the prefix cache,
eviction, queueing, prefill time and clients that go away. Real processes, real clients.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from prefix_gateway.emulator.process import EmulatorProcess
from tests.support import PATIENCE_SECONDS, wait_until

MODEL = "emulated-model"
SYSTEM_TOKENS, QUESTION_TOKENS, ANSWER_TOKENS = 1000, 100, 300


@pytest.fixture(scope="module")
def replica() -> Iterator[EmulatorProcess]:
    with EmulatorProcess(name=MODEL) as process:
        yield process


def api(process: EmulatorProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=process.url + "/v1", api_key="unused", max_retries=0)


def words(count: int, tag: str) -> str:
    """`count` tokens: words of at most six characters."""
    return " ".join(f"{tag}{index}" for index in range(count))


def conversation(process: EmulatorProcess, turns: int, tag: str) -> list[tuple[int, int]]:
    """Each turn re-sends the whole history; returns (prompt_tokens, cached_tokens) per turn."""
    history: list[Any] = [{"role": "system", "content": words(SYSTEM_TOKENS, tag)}]
    usages = []
    with api(process) as client:
        for turn in range(turns):
            history.append({"role": "user", "content": words(QUESTION_TOKENS, f"{tag}{turn}q")})
            reply = client.chat.completions.create(
                model=MODEL, messages=history, max_tokens=ANSWER_TOKENS
            )
            usage = reply.usage
            assert usage is not None and usage.prompt_tokens_details is not None
            assert usage.completion_tokens == ANSWER_TOKENS
            cached = usage.prompt_tokens_details.cached_tokens
            assert cached is not None
            usages.append((usage.prompt_tokens, cached))
            history.append({"role": "assistant", "content": reply.choices[0].message.content})
    return usages


def test_six_turn_conversation_computes_1640_prompt_tokens_instead_of_12600(
    replica: EmulatorProcess,
) -> None:
    queried_before = replica.metric("vllm:prefix_cache_queries_total")
    hits_before = replica.metric("vllm:prefix_cache_hits_total")
    usages = conversation(replica, 6, "a")
    prompts = [prompt for prompt, _ in usages]
    computed = [prompt - cached for prompt, cached in usages]
    assert prompts == [1100, 1500, 1900, 2300, 2700, 3100]
    # A turn reuses all but the last answer token and the question: 1 + 300 + 100 rounded up
    # to the block after the shared 1392 + 400 (n - 2) tokens.
    assert computed == [1100, 108, 108, 108, 108, 108]
    assert (sum(computed), sum(prompts)) == (1640, 12600)
    assert replica.metric("vllm:prefix_cache_queries_total") - queried_before == 12600
    assert replica.metric("vllm:prefix_cache_hits_total") - hits_before == 12600 - 1640


def test_twenty_turn_conversation_prefills_31_times_less(replica: EmulatorProcess) -> None:
    usages = conversation(replica, 20, "b")
    prompts = [prompt for prompt, _ in usages]
    computed = [prompt - cached for prompt, cached in usages]
    assert prompts == [1100 + 400 * turn for turn in range(20)]
    assert computed == [1100] + [108] * 19
    assert (sum(computed), sum(prompts)) == (3152, 98000)
    assert sum(prompts) / sum(computed) > 31


def test_a_small_cache_evicts_least_recently_used_blocks_tail_first() -> None:
    with EmulatorProcess("--cache-blocks", "64", name=MODEL) as process, api(process) as client:

        def cached(prompt: str) -> int:
            reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            tokens = reply.usage.prompt_tokens_details.cached_tokens
            assert tokens is not None
            return tokens

        prompt_a, prompt_b = words(480, "a"), words(640, "b")
        assert cached(prompt_a) == 0
        assert cached(prompt_a) == 464  # 29 of A's 30 blocks: one token is always computed
        assert cached(prompt_b) == 0  # B needs 40 blocks: 34 empty, 6 taken from A's tail
        assert cached(prompt_a) == 384  # A's 24 leading blocks are left
        assert process.metric("vllm:kv_cache_usage_perc") == 0.0


def test_requests_beyond_max_running_wait_in_the_queue() -> None:
    args = ("--max-running", "1", "--decode-ms-per-token", "10")
    with EmulatorProcess(*args, name=MODEL) as process:
        # 3,000 tokens take 30 s: the first request holds the only slot until its client leaves.
        body = {"model": MODEL, "prompt": "hold the slot", "max_tokens": 3000, "stream": True}
        answers: list[httpx.Response] = []
        with httpx.stream(
            "POST", process.url + "/v1/completions", json=body, timeout=PATIENCE_SECONDS
        ) as first:
            lines = first.iter_lines()  # kept: collected, it would close the stream
            next(lines)
            waiting = threading.Thread(
                target=lambda: answers.append(
                    httpx.post(
                        process.url + "/v1/completions",
                        json={"model": MODEL, "prompt": "queued", "max_tokens": 2},
                        timeout=60,
                    )
                )
            )
            waiting.start()
            wait_until(
                lambda: process.metric("vllm:num_requests_waiting") == 1,
                "the second request waiting",
            )
            assert process.metric("vllm:num_requests_running") == 1
            assert not answers
        waiting.join(60)  # the slot freed by the first is handed to the one waiting
        assert [answer.status_code for answer in answers] == [200]
        assert process.metric("vllm:num_requests_waiting") == 0
        assert process.metric("vllm:request_success_total", finished_reason="abort") == 1
        assert process.metric("vllm:request_success_total", finished_reason="length") == 1


def test_uncached_prefills_run_one_at_a_time() -> None:
    # 2 ms a token: 150 uncached tokens take 0.3 s, and the second prefill waits for the first.
    with EmulatorProcess("--prefill-us-per-token", "2000", name=MODEL) as process:
        finished: list[float] = []
        started = time.monotonic()

        def ask(tag: str) -> None:
            body = {"model": MODEL, "prompt": words(150, tag), "max_tokens": 1}
            httpx.post(process.url + "/v1/completions", json=body, timeout=10)
            finished.append(time.monotonic() - started)

        threads = [threading.Thread(target=ask, args=(tag,)) for tag in "xy"]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert len(finished) == 2
        assert finished[0] >= 0.3 and finished[1] >= 0.6
        body = {"model": MODEL, "prompt": words(150, "x"), "max_tokens": 1}
        reply = httpx.post(process.url + "/v1/completions", json=body, timeout=10).json()
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 144  # 6 to compute


def wait_until_idle(process: EmulatorProcess) -> None:
    wait_until(lambda: process.metric("vllm:num_requests_running") == 0, "no sequence running")


def test_a_client_leaving_mid_stream_aborts_its_sequence_at_once() -> None:
    # 1,000 tokens take 20 s: a sequence that was not aborted would end as "length".
    with EmulatorProcess("--decode-ms-per-token", "20", name=MODEL) as process:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "stream": True}
        body["max_tokens"] = 1000
        with httpx.stream(
            "POST", process.url + "/v1/chat/completions", json=body, timeout=PATIENCE_SECONDS
        ) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            assert process.metric("vllm:num_requests_running") == 1
        wait_until_idle(process)
        assert process.metric("vllm:request_success_total", finished_reason="abort") == 1
        assert process.metric("vllm:request_success_total", finished_reason="length") == 0
        assert process.metric("vllm:kv_cache_usage_perc") == 0.0

        with pytest.raises(httpx.ReadTimeout):
            httpx.post(process.url + "/v1/chat/completions", json={**body, "stream": False},
                       timeout=0.3)  # fmt: skip
        wait_until_idle(process)
        assert process.metric("vllm:request_success_total", finished_reason="abort") == 2
        assert process.metric("vllm:request_success_total", finished_reason="length") == 0


def test_sigterm_lets_a_request_in_flight_finish() -> None:
    process = EmulatorProcess("--decode-ms-per-token", "10", name=MODEL)
    process.start()
    try:
        body = {"model": MODEL, "prompt": "finish me", "max_tokens": 30, "stream": True}
        with httpx.stream(
            "POST", process.url + "/v1/completions", json=body, timeout=PATIENCE_SECONDS
        ) as stream:
            lines = stream.iter_lines()
            next(lines)
            statuses: list[int | None] = []
            stopping = threading.Thread(target=lambda: statuses.append(process.stop()))
            stopping.start()
            rest = [line for line in lines if line]
        stopping.join(10)
        assert rest[-1] == "data: [DONE]" and len(rest) == 30
        # Shut down cleanly, then ended by the re-raised SIGTERM (uvicorn's way); not killed.
        assert statuses in ([0], [-signal.SIGTERM])
    finally:
        process.stop()
