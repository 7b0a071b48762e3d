"""End to end against real vLLM: two CPU replicas of a tiny model, the gateway in front.

The replicas (vLLM's CPU build, installed on first use by engines.venv) are
the session's, shared with the LoRA module (tests/real_fleet.py), pinned to different cores;
this module's gateway runs as a real process (tests.support.GatewayProcess) and is driven with
the official `openai` client. Replica 0 serves `tiny-llama` and `tiny-llama-a`, replica 1
`tiny-llama` and `tiny-llama-b`: the gateway must learn those pools from their `/v1/models`.

Assertions are about behaviour and order, never sub-second timings: CI runs on a busy 2-core
machine. `pytest --skip-real-vllm` (or SKIP_REAL_VLLM=1) skips this module; by default it runs.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import openai
import pytest

from engines.fleet import model_folder
from engines.kv_events import DEFAULT_SEED, KVEventSubscriber, block_hashes
from tests.real_fleet import BLOCK, MODEL, ONLY, RealFleet, RealReplicas
from tests.support import GatewayProcess, metric_value, wait_until
from tests.test_doctor import CHECKS as DOCTOR_CHECKS
from tests.test_doctor import by_check, doctor
from tests.test_messages import converse
from tests.test_responses import WEATHER_TOOL

pytestmark = pytest.mark.real_vllm

# Long enough to fill several blocks of 32 tokens with the tiny model's tokenizer.
SHOP = (
    "You are a patient assistant for a hardware shop. Answer questions about tools, "
    "paint, timber and fixings. Keep answers short, name the aisle where the item is kept, "
    "and never recommend a product the shop does not sell. "
) * 2


def system_prompt(test: str) -> str:
    """The shop's system prompt, begun with words of one test's own: no other test's requests
    share a block of it, so what a gateway knows of where it is cached comes from that test
    alone, whatever ran before (a replica restarted by another test leaves a gateway without
    KV events believing it still holds what it held)."""
    return f"At the {test} desk. {SHOP}"


# fmt: off
VOCABULARY = (
    "the", "a", "and", "of", "to", "in", "on", "for", "with", "hammer", "drill", "screw", "nail",
    "paint", "brush", "timber", "plank", "saw", "level", "tape", "glue", "sand", "bolt", "nut",
    "washer", "hinge", "lock", "shelf", "bracket", "clamp", "chisel", "how", "what", "which",
    "where", "why", "can", "should", "would", "big", "small", "long", "short", "red", "blue",
)
# fmt: on


def text(words: int, seed: str) -> str:
    """Deterministic English-looking text: the same seed gives the same words."""
    vocabulary = VOCABULARY
    rng = random.Random(seed)
    return " ".join(rng.choice(vocabulary) for _ in range(words)) + "?"


def gateway_models(gateway: GatewayProcess) -> set[str]:
    try:
        listing = httpx.get(gateway.url + "/v1/models", timeout=5).json()
    except httpx.HTTPError:
        return set()
    return {entry["id"] for entry in listing.get("data", [])}


@pytest.fixture(scope="module")
def real(real_replicas: RealReplicas) -> Iterator[RealFleet]:
    with GatewayProcess(real_replicas.urls) as gateway:
        wanted = {MODEL, *ONLY}
        wait_until(lambda: gateway_models(gateway) >= wanted, f"the gateway serves {wanted}", 60)
        yield RealFleet(real_replicas, gateway)


@pytest.fixture
def client(real: RealFleet) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=real.gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120
    ) as api:
        yield api


def ask(
    client: openai.OpenAI,
    messages: list[dict[str, str]],
    model: str = MODEL,
    max_tokens: int = 8,
    **extra: Any,
) -> tuple[Any, str]:
    """One non-streamed chat completion (8 tokens); the reply and the replica that answered."""
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        extra_body={"ignore_eos": True, **extra},
    )
    return raw.parse(), raw.headers["x-gateway-backend"]


def cached(reply: Any) -> int:
    details = reply.usage.prompt_tokens_details
    return int(details.cached_tokens or 0) if details is not None else 0


def test_models_list_has_every_served_name(client: openai.OpenAI) -> None:
    assert {model.id for model in client.models.list()} >= {MODEL, *ONLY}


def test_chat_completion(client: openai.OpenAI) -> None:
    reply, backend = ask(client, [{"role": "user", "content": text(20, "chat")}])
    assert reply.object == "chat.completion"
    assert reply.model == MODEL
    assert isinstance(reply.choices[0].message.content, str)
    assert reply.choices[0].finish_reason == "length"  # ignore_eos: all 8 tokens
    assert reply.usage.completion_tokens == 8
    assert reply.usage.prompt_tokens > 20
    assert backend


def test_chat_stream_ends_with_a_usage_chunk(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": text(20, "stream")}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    with_choices = [chunk for chunk in chunks if chunk.choices]
    assert with_choices, "no content chunks"
    assert chunks[-1].choices == []  # the usage chunk comes last, with no choices
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert all(chunk.usage is None for chunk in chunks[:-1])
    assert with_choices[-1].choices[0].finish_reason == "length"
    content = "".join(chunk.choices[0].delta.content or "" for chunk in with_choices)
    assert content


def _stream_to_done(url: str, question: str) -> tuple[int, int]:
    """A stream read as the official sync client reads it: the connection closed at
    `data: [DONE]`; the prompt and cached tokens the replica reported in its usage chunk."""
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": system_prompt("done")},
            {"role": "user", "content": question},
        ],
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    usage: dict[str, Any] = {}
    with (
        httpx.Client(base_url=url, timeout=120) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        for line in response.iter_lines():
            if line == "data: [DONE]":
                break  # leaving the block closes the connection: nothing more is read
            if line.startswith("data: ") and '"usage":{' in line.replace(" ", ""):
                usage = json.loads(line[6:])["usage"] or usage
    assert usage, "the replica sent its usage before [DONE]"
    details = usage.get("prompt_tokens_details") or {}
    return int(usage["prompt_tokens"]), int(details.get("cached_tokens") or 0)


def test_streams_closed_at_done_lose_no_reported_tokens(real: RealFleet) -> None:
    gateway = real.gateway

    def counted() -> tuple[float, float]:
        scrape = gateway.metrics()
        return (
            metric_value(scrape, "gateway_upstream_prompt_tokens_total"),
            metric_value(scrape, "gateway_upstream_cached_tokens_total"),
        )

    before = counted()
    seen = [_stream_to_done(gateway.url, text(12, "done-first"))]  # the system prompt cached
    with ThreadPoolExecutor(8) as pool:
        questions = [text(12, f"done-{n}") for n in range(8)]
        seen += pool.map(lambda question: _stream_to_done(gateway.url, question), questions)
    prompt, cached_tokens = (sum(column) for column in zip(*seen, strict=True))
    assert cached_tokens > 0
    expected = (before[0] + prompt, before[1] + cached_tokens)
    what = f"{prompt} prompt and {cached_tokens} cached tokens counted"
    wait_until(lambda: counted() == expected, what)


def test_completion(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model=MODEL, prompt=text(30, "completion"), max_tokens=6, extra_body={"ignore_eos": True}
    )
    assert reply.object == "text_completion"
    assert isinstance(reply.choices[0].text, str)
    assert reply.usage is not None and reply.usage.completion_tokens == 6


def test_unknown_model_is_a_clean_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert raised.value.status_code == 404
    body = raised.value.response.json()
    assert "no-such-model" in json.dumps(body)


def test_six_turn_conversation_stays_on_one_replica_and_hits_its_cache(
    client: openai.OpenAI,
) -> None:
    messages = [{"role": "system", "content": system_prompt("conversation")}]
    backends: list[str] = []
    prompts: list[int] = []
    hits: list[int] = []
    for turn in range(6):
        messages.append({"role": "user", "content": text(25, f"conversation-{turn}")})
        reply, backend = ask(client, messages)
        backends.append(backend)
        prompts.append(reply.usage.prompt_tokens)
        hits.append(cached(reply))
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    assert len(set(backends)) == 1, backends
    assert all(hit > 0 for hit in hits[1:]), hits
    for previous, hit in zip(prompts, hits[1:], strict=False):
        # The previous turn's prompt is a prefix of this one's: all its full blocks are hit.
        assert hit >= (previous - 1) // BLOCK * BLOCK, (prompts, hits)
    assert all(hit % BLOCK == 0 for hit in hits)


def test_cached_tokens_are_the_prompt_rounded_down_to_blocks(client: openai.OpenAI) -> None:
    messages = [
        {"role": "system", "content": system_prompt("rounding")},
        {"role": "user", "content": "rounding"},
    ]
    _, backend = ask(client, messages)
    again, backend_again = ask(client, messages)
    assert backend_again == backend
    prompt = again.usage.prompt_tokens
    assert cached(again) == (prompt - 1) // BLOCK * BLOCK


def test_client_that_hangs_up_mid_stream_aborts_generation(real: RealFleet) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text(20, "hang-up")}],
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    before = {
        replica.port: replica.metric("vllm:generation_tokens_total") for replica in real.replicas
    }
    with (
        httpx.Client(timeout=120) as http,
        http.stream("POST", real.gateway.url + "/v1/chat/completions", json=body) as reply,
    ):
        assert reply.status_code == 200
        replica = real.replica_named(reply.headers["x-gateway-backend"])
        # Tokens flowing through the gateway: the replica is generating when the client leaves.
        chunks = (line for line in reply.iter_lines() if line.startswith("data:"))
        received = [next(chunks) for _ in range(40)]
        assert "[DONE]" not in received[-1]
    # The client has hung up: the replica must abort the request, not generate 3000 tokens.
    counts: list[float] = []

    def stopped() -> bool:
        counts.append(replica.metric("vllm:generation_tokens_total"))
        idle = replica.metric("vllm:num_requests_running") == 0
        return idle and len(counts) >= 5 and counts[-1] == counts[-5]  # still for a second

    wait_until(stopped, "vllm:num_requests_running back to 0, no more tokens generated", 60)
    # Counted (at least what the client received) and not finished but aborted. (vLLM does not
    # count requests aborted by a client in vllm:request_success_total{abort}.)
    generated = counts[-1] - before[replica.port]
    assert len(received) - 1 <= generated < 3000


def test_gateway_metrics_count_upstream_cached_tokens(
    real: RealFleet, client: openai.OpenAI
) -> None:
    messages = [
        {"role": "system", "content": system_prompt("metrics")},
        {"role": "user", "content": "metrics"},
    ]
    ask(client, messages)
    again, _ = ask(client, messages)
    assert cached(again) > 0
    total = metric_value(real.gateway.metrics(), "gateway_upstream_cached_tokens_total")
    assert total >= cached(again)


def test_per_model_pools_learned_from_served_model_names(
    real: RealFleet, client: openai.OpenAI
) -> None:
    for index, model in enumerate(ONLY):
        for attempt in range(3):
            reply, backend = ask(
                client, [{"role": "user", "content": text(10, f"pool-{model}-{attempt}")}], model
            )
            assert reply.model == MODEL  # vLLM's replies name its first --served-model-name
            assert real.replica_named(backend) is real.replicas[index]
    # The shared name is served by both: different system prompts spread over the two.
    seen = set()
    for attempt in range(16):
        system = text(40, f"spread-{attempt}")
        _, backend = ask(
            client, [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
        )
        seen.add(backend)
    assert seen == {r.address for r in real.replicas}


def test_cache_salt_passes_through_and_isolates_the_prefix_cache(client: openai.OpenAI) -> None:
    messages = [
        {"role": "system", "content": system_prompt("salted")},
        {"role": "user", "content": "salted"},
    ]
    first, backend = ask(client, messages, cache_salt="tenant-one")
    same, backend_same = ask(client, messages, cache_salt="tenant-one")
    other, _ = ask(client, messages, cache_salt="tenant-two")
    assert cached(first) == 0
    assert backend_same == backend and cached(same) > 0
    assert cached(other) == 0  # another salt never reuses tenant-one's blocks


def test_kv_events_carry_block_hashes_reproducible_from_token_ids(real: RealFleet) -> None:
    replica = real.replicas[0]
    rng = random.Random("kv-events")
    prompt = [rng.randrange(100, 4000) for _ in range(3 * BLOCK + 5)]

    def complete(tokens: list[int]) -> None:
        reply = httpx.post(
            replica.url + "/v1/completions",
            json={"model": MODEL, "prompt": tokens, "max_tokens": 2, "ignore_eos": True},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text

    with KVEventSubscriber(real.endpoints[0]) as subscriber:
        # A SUB socket misses what is published before it has connected: prompts of a block
        # of their own go first, until their events arrive.
        def subscribed() -> bool:
            complete([rng.randrange(100, 4000) for _ in range(BLOCK + 1)])
            return any(event["type"] == "BlockStored" for event in subscriber.events())

        wait_until(subscribed, "the subscriber receives the replica's events")
        complete(prompt)
        # The replicas inherit this environment: PYTHONHASHSEED, when set, seeds their hashes.
        expected = block_hashes(prompt, BLOCK, seed=os.environ.get("PYTHONHASHSEED", DEFAULT_SEED))
        events = subscriber.wait_for(
            lambda events: any(
                e["type"] == "BlockStored" and e["block_hashes"] == expected for e in events
            ),
            60,
        )
    stored = next(e for e in events if e["type"] == "BlockStored" and e["block_hashes"] == expected)
    assert stored["parent_block_hash"] is None
    assert stored["token_ids"] == prompt[: 3 * BLOCK]
    assert stored["block_size"] == BLOCK


def test_kv_event_sources_names_each_replicas_publisher(real: RealFleet) -> None:
    for replica, endpoint in zip(real.replicas, real.endpoints, strict=True):
        sources = json.loads(replica.get("/kv_event_sources"))
        assert sources["0"]["endpoint"] == endpoint  # keyed by data-parallel rank
        assert sources["0"]["publisher"] == "zmq" and sources["0"]["topic"] == "kv-events"


def test_replicas_report_their_block_size(real: RealFleet) -> None:
    for replica in real.replicas:
        assert replica.metric("vllm:cache_config_info", block_size=str(BLOCK)) == 1


def test_responses_api_through_the_replica(real: RealFleet) -> None:
    """Recorded, not the gateway's: vLLM's /v1/responses answers for this model."""
    reply = httpx.post(
        real.replicas[0].url + "/v1/responses",
        json={"model": MODEL, "input": "hello there", "max_output_tokens": 4},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "response"
    assert body["usage"]["output_tokens"] == 4
    assert "cached_tokens" in body["usage"]["input_tokens_details"]


def respond(client: openai.OpenAI, **fields: Any) -> tuple[Any, str, str]:
    """One response of at most 4 tokens: the object, its replica and the gateway's route."""
    raw = client.responses.with_raw_response.create(
        model=MODEL, instructions=system_prompt("responses"), max_output_tokens=4, **fields
    )
    headers = raw.headers
    parsed = raw.parse()
    if fields.get("stream"):
        events = list(parsed)
        assert events[0].type == "response.created" and events[-1].type == "response.completed"
        parsed = events[-1].response
    return parsed, headers["x-gateway-backend"], headers["x-gateway-route"]


def test_responses_through_the_gateway_and_a_chain_on_the_storing_replica(
    client: openai.OpenAI, real: RealFleet
) -> None:
    """Plain, streamed and with tools; then five follow-ups by previous_response_id, each on
    the replica that stored its predecessor (only it can answer), hitting its cache; then the
    stored response's own routes at that replica."""
    plain, _, _ = respond(client, input=text(12, "responses plain"))
    assert plain.object == "response" and plain.usage.output_tokens >= 1
    streamed, _, _ = respond(client, input=text(12, "responses streamed"), stream=True)
    assert streamed.usage is not None and streamed.usage.input_tokens > 0
    tooled, _, _ = respond(client, input=text(12, "responses tools"), tools=[WEATHER_TOOL])
    assert tooled.status in ("completed", "incomplete")
    response, first, _ = respond(client, input=text(12, "responses chain"))
    for turn in range(5):
        previous = response.id
        response, backend, route = respond(
            client, previous_response_id=previous, input=text(6, f"turn {turn}"), stream=turn == 2
        )
        assert (backend, route) == (first, "previous_response"), turn
        assert response.previous_response_id == previous
        # At least the instructions' full blocks were cached where the chain is stored.
        assert response.usage.input_tokens_details.cached_tokens >= BLOCK
    assert client.responses.retrieve(response.id).id == response.id
    url = f"{real.gateway.url}/v1/responses/{response.id}"
    answers = {method: httpx.request(method, url, timeout=60) for method in ("GET", "DELETE")}
    answers["cancel"] = httpx.post(url + "/cancel", timeout=60)
    assert {method: answer.headers["x-gateway-backend"] for method, answer in answers.items()} == {
        "GET": first,
        "DELETE": first,
        "cancel": first,
    }
    # vLLM 0.32 has no DELETE for responses, and cancels only background ones.
    assert [answers[name].status_code for name in ("GET", "DELETE", "cancel")] == [200, 405, 400]


def anthropic_client(gateway: GatewayProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0, timeout=120)


def test_messages_plain_streamed_and_a_conversation_on_one_replica(real: RealFleet) -> None:
    """vLLM's Anthropic endpoints through the gateway, with the official client: a
    conversation (its second turn streamed) stays on one replica and reads its cache, in whole
    blocks; count_tokens answers."""
    system = system_prompt("messages")
    history: list[Any] = []
    backends, hits = [], []
    with anthropic_client(real.gateway) as client:
        for turn in range(3):
            history.append({"role": "user", "content": text(25, f"messages-{turn}")})
            message, backend = converse(
                client, turn == 1, model=MODEL, max_tokens=8, system=system, messages=history
            )
            assert message.type == "message" and message.usage.output_tokens >= 1
            backends.append(backend)
            hits.append(message.usage.cache_read_input_tokens)
            history.append({"role": "assistant", "content": message.content})
        counted = client.messages.count_tokens(model=MODEL, system=system, messages=history[:1])
    assert len(set(backends)) == 1, backends
    assert all(hit > 0 and hit % BLOCK == 0 for hit in hits[1:]), hits
    assert counted.input_tokens > 0


@pytest.fixture(scope="module")
def tokens_gateway(real: RealFleet) -> Iterator[GatewayProcess]:
    """A second gateway in front of the same replicas, tokenizing as they do and following
    their KV-cache events (learned from their /kv_event_sources)."""
    args = ("--tokenizer", str(model_folder()), "--engine-block-size", str(BLOCK), "--kv-events")
    with GatewayProcess(real.urls, *args, "--doctor-interval", "600") as gateway:
        backends = [replica.address for replica in real.replicas]

        def live() -> bool:
            text = gateway.metrics()
            return all(
                metric_value(text, "gateway_kv_events_live", backend=name) == 1 for name in backends
            )

        wait_until(live, "both replicas' events flow into the gateway", 60)
        # Its examination's requests (`/tokenize` among them) over before a test begins: one
        # in flight fails at a replica a test restarts, which logs it as an error.
        wait_until(lambda: None not in examined(gateway).values(), "both replicas examined", 120)
        yield gateway


def examined(gateway: GatewayProcess) -> dict[str, Any]:
    """The doctor's checks of each replica, as /admin/backends shows them (None until made)."""
    listed = httpx.get(gateway.url + "/admin/backends", timeout=10).json()["data"]
    return {row["name"]: row["checks"] for row in listed}


def assert_predicted_within_5_percent(before: str, after: str, hits: list[int]) -> None:
    """The gateway's predicted matched tokens between two metric scrapes are within 5% of the
    cached tokens the replicas reported, which are the `hits` its client saw."""

    def grown(name: str) -> float:
        return metric_value(after, name) - metric_value(before, name)

    predicted = grown("gateway_matched_tokens_predicted_total")
    reported = grown("gateway_upstream_cached_tokens_total")
    assert reported == sum(hits) > 0
    assert abs(predicted - reported) <= 0.05 * reported, (predicted, reported, hits)


@pytest.mark.parametrize("system_words", [120, 800], ids=["on-the-loop", "beside-the-loop"])
def test_with_the_tokenizer_predicted_matched_tokens_are_the_cached_tokens(
    tokens_gateway: GatewayProcess, system_words: int
) -> None:
    # From 4 KiB a body is tokenized on the gateway's tokenizing thread, below on its loop.
    url = tokens_gateway.url + "/v1"
    before = tokens_gateway.metrics()
    # A seed of each length's own: the shorter text would be the longer one's beginning, cached
    # already where the other ran (before a gateway that did not see it, in another order).
    system = text(system_words, f"tokenizer-system-{system_words}")
    messages = [{"role": "system", "content": system}]
    hits = []
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0) as client:
        for turn in range(5):
            question = text(30, f"tokenizer-{system_words}-{turn}")
            messages.append({"role": "user", "content": question})
            reply, _ = ask(client, messages, max_tokens=40)
            hits.append(cached(reply))
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    assert_predicted_within_5_percent(before, tokens_gateway.metrics(), hits)


def test_with_the_tokenizer_a_responses_conversation_predicts_the_cached_tokens(
    tokens_gateway: GatewayProcess,
) -> None:
    # The engine renders instructions and input items as chat messages: so must the gateway.
    before = tokens_gateway.metrics()
    instructions = text(200, "responses-tokenizer-system")
    items: list[dict[str, Any]] = []
    hits = []
    with openai.OpenAI(
        base_url=tokens_gateway.url + "/v1", api_key="unused", max_retries=0
    ) as client:
        for turn in range(4):
            question = text(30, f"responses-tokenizer-{turn}")
            items.append({"role": "user", "content": [{"type": "input_text", "text": question}]})
            response = client.responses.create(
                model=MODEL,
                instructions=instructions,
                input=items,  # type: ignore[arg-type]
                max_output_tokens=20,
                store=False,
            )
            assert response.usage is not None
            hits.append(int(response.usage.input_tokens_details.cached_tokens or 0))
            items.append({"role": "assistant", "content": response.output_text})
    assert_predicted_within_5_percent(before, tokens_gateway.metrics(), hits)


def test_with_the_tokenizer_a_messages_conversation_predicts_the_cached_tokens(
    tokens_gateway: GatewayProcess,
) -> None:
    # The engine renders the system blocks and content blocks as chat messages: so must the
    # gateway; the second turn is streamed, its usage read from `message_delta`.
    before = tokens_gateway.metrics()
    system = [{"type": "text", "text": text(200, "messages-tokenizer-system")}]
    history: list[Any] = []
    hits = []
    with anthropic_client(tokens_gateway) as client:
        for turn in range(4):
            question = text(30, f"messages-tokenizer-{turn}")
            history.append({"role": "user", "content": [{"type": "text", "text": question}]})
            message, _ = converse(
                client, turn == 1, model=MODEL, max_tokens=20, system=system, messages=history
            )
            hits.append(int(message.usage.cache_read_input_tokens or 0))
            history.append({"role": "assistant", "content": message.content})
    assert_predicted_within_5_percent(before, tokens_gateway.metrics(), hits)


def test_kv_events_show_blocks_the_gateway_never_sent(
    real: RealFleet, tokens_gateway: GatewayProcess
) -> None:
    # Sent to one replica directly: only its events can tell the gateway it holds the prompt.
    replica = real.replicas[1]
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text(150, "behind-the-gateway")}],
        "max_tokens": 1,
    }
    reply = httpx.post(replica.url + "/v1/chat/completions", json=body, timeout=60).json()
    full_blocks = reply["usage"]["prompt_tokens"] // BLOCK
    assert full_blocks >= 4
    name = replica.address

    def matched() -> dict[str, int]:
        explained = httpx.post(tokens_gateway.url + "/admin/explain", json=body, timeout=10)
        return {row["backend"]: row["matched_blocks"] for row in explained.json()["candidates"]}

    wait_until(lambda: matched().get(name) == full_blocks, f"{name} holds {full_blocks}")
    assert sum(matched().values()) == full_blocks  # the other replica holds none of it


def test_doctor_passes_real_replicas_routed_on_their_tokens(real: RealFleet) -> None:
    flags = ("--tokenizer", str(model_folder()), "--engine-block-size", str(BLOCK), "--kv-events")
    status, rows = doctor(*(part for url in real.urls for part in ("--backend", url)), *flags)
    for replica in real.replicas:
        checks = by_check(rows, replica.address)
        assert list(checks) == [*DOCTOR_CHECKS, "token-agreement", "kv-events"]
        assert {verdict for verdict, _ in checks.values()} == {"PASS"}, rows
        assert "tokens counted with --tokenizer, blocks of 32" in checks["token-agreement"][1]
    assert status == 0


def test_serve_runs_the_doctors_checks_on_real_replicas(tokens_gateway: GatewayProcess) -> None:
    for name, checks in examined(tokens_gateway).items():
        results = {check: result["status"] for check, result in checks["results"].items()}
        assert results == dict.fromkeys([*DOCTOR_CHECKS, "token-agreement", "kv-events"], "pass")
        assert (
            metric_value(
                tokens_gateway.metrics(), "gateway_backend_check", backend=name, check="kv-events"
            )
            == 1
        )


def test_doctor_names_the_block_size_the_engine_caches_in(real: RealFleet) -> None:
    replica = real.replicas[0]
    flags = ("--tokenizer", str(model_folder()), "--engine-block-size", "64")
    status, rows = doctor("--backend", replica.url, *flags)
    verdict, detail = by_check(rows, replica.address)["token-agreement"]
    assert verdict == "FAIL"
    assert "as blocks of 32 tokens would; the gateway hashes blocks of 64" in detail, detail
    assert status == 1


def test_doctor_tells_a_chat_template_from_a_tokenizer(
    real: RealFleet, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    source = model_folder()
    config = json.loads((source / "tokenizer_config.json").read_text())
    template = tmp_path_factory.mktemp("other-template")
    shutil.copy(source / "tokenizer.json", template / "tokenizer.json")
    other = {**config, "chat_template": "Conversation:\n" + config["chat_template"]}
    (template / "tokenizer_config.json").write_text(json.dumps(other))
    tokenizer = tmp_path_factory.mktemp("other-tokenizer")
    words = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(tokenizer / "tokenizer.json"))
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(config))

    replica = real.replicas[0]
    for folder, differs in ((template, "chat template differs"), (tokenizer, "tokenizer differs")):
        status, rows = doctor("--backend", replica.url, "--tokenizer", str(folder))
        verdict, detail = by_check(rows, replica.address)["token-agreement"]
        assert verdict == "FAIL" and detail.split(": ", 1)[1].startswith(differs), detail
        assert status == 1


def test_a_restarted_replicas_events_are_followed_again(
    real: RealFleet, tokens_gateway: GatewayProcess
) -> None:
    """It restarts replica 1, whose cache is then empty: no other test relies on what that
    cache held before it."""
    replica = real.replicas[1]
    name = replica.address

    def feed() -> dict[str, Any]:
        listed = httpx.get(tokens_gateway.url + "/admin/backends", timeout=10).json()["data"]
        found: dict[str, Any] = next(row["kv_events"] for row in listed if row["name"] == name)
        return found

    def live() -> bool:
        text = tokens_gateway.metrics()
        return metric_value(text, "gateway_kv_events_live", backend=name) == 1

    wait_until(live, f"{name}'s events flow", 60)
    before = feed()
    assert before["connected"] and before["endpoint"] == real.endpoints[1]
    replica.restart()
    disconnects = metric_value(
        tokens_gateway.metrics(),
        "gateway_kv_events_fallbacks_total",
        backend=name,
        reason="disconnected",
    )
    assert disconnects >= 1
    wait_until(live, f"{name}'s events flow again after its restart")
    assert feed()["live"] and feed()["connected"]

    # A prompt sent to the restarted replica directly is matched there from its new events.
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text(150, "after-the-restart")}],
        "max_tokens": 1,
    }
    reply = httpx.post(replica.url + "/v1/chat/completions", json=body, timeout=60).json()
    full_blocks = reply["usage"]["prompt_tokens"] // BLOCK

    def matched() -> dict[str, int]:
        explained = httpx.post(tokens_gateway.url + "/admin/explain", json=body, timeout=10)
        return {row["backend"]: row["matched_blocks"] for row in explained.json()["candidates"]}

    wait_until(lambda: matched().get(name) == full_blocks, f"{name} holds {full_blocks}")
    after = feed()
    assert after["live"] and after["last_sequence"] is not None and after["blocks"] >= full_blocks
    # Repeated through the gateway, the prompt goes where its blocks are, once the replica is
    # back in routing (its events may flow again before its probes pass).
    wait_until(
        lambda: tokens_gateway.metric("gateway_backend_healthy", backend=name) == 1,
        f"{name} healthy again",
        60,
    )
    again = httpx.post(tokens_gateway.url + "/v1/chat/completions", json=body, timeout=60)
    assert again.status_code == 200
    assert again.headers["x-gateway-backend"] == name, again.headers["x-gateway-route"]
