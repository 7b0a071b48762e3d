"""The Responses API and the engines' other endpoints through the gateway, in front of four
emulated replicas (real processes), driven with the official `openai` client: plain, streamed
and tool-calling responses, chains of follow-ups by `previous_response_id` that must reach the
replica storing their predecessor, the stored responses' own routes, a follow-up whose replica
was removed, and the endpoints routed by model alone.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from prefix_gateway.emulator.replicas import EmulatedReplicas
from tests.conftest import MODEL
from tests.support import PATIENCE_SECONDS, GatewayProcess, wait_until

TOKEN = "responses-admin-token"
INSTRUCTIONS = "You answer questions about the hardware shop in one short sentence. " * 4
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def create(client: openai.OpenAI, **fields: Any) -> tuple[Any, str, str]:
    """One response: the parsed object, the replica that answered and the gateway's route."""
    raw = client.responses.with_raw_response.create(model=MODEL, max_output_tokens=6, **fields)
    return raw.parse(), raw.headers["x-gateway-backend"], raw.headers["x-gateway-route"]


def completed(events: Any) -> Any:
    """The response a stream of events completed with."""
    return next(event for event in events if event.type == "response.completed").response


def test_plain_response(client: openai.OpenAI) -> None:
    response, backend, route = create(client, input="where are the hammers?")
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text
    assert response.usage.input_tokens > 0 and response.usage.output_tokens == 6
    assert backend and route in ("hash", "prefix", "owner", "overflow")


def test_streamed_response_relays_every_event_in_order(client: openai.OpenAI) -> None:
    raw = client.responses.with_raw_response.create(
        model=MODEL, input="and the nails?", max_output_tokens=5, stream=True
    )
    assert raw.headers["x-gateway-backend"]
    events = list(raw.parse())
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert kinds.count("response.output_text.delta") == 5
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.id == events[0].response.id
    assert final.output_text == deltas and final.usage.output_tokens == 5


def test_a_chain_of_five_follow_ups_each_reaches_its_predecessors_replica(
    client: openai.OpenAI, fleet: EmulatedReplicas
) -> None:
    for chain in range(3):
        response, backend, _ = create(
            client, instructions=INSTRUCTIONS, input=f"chain {chain}: which aisle has paint?"
        )
        first = backend
        for turn in range(5):
            previous = response.id
            response, backend, route = create(
                client,
                previous_response_id=previous,
                instructions=INSTRUCTIONS,  # not carried over: sent again, it is cached
                input=f"chain {chain}, turn {turn}: why?",
            )
            assert (backend, route) == (first, "previous_response")
            assert response.previous_response_id == previous
            # Its conversation so far is cached where it was stored.
            assert response.usage.input_tokens_details.cached_tokens > 0
        # Only that replica could have answered: another one holds no such response.
        other = next(url for url in fleet.urls if not url.endswith(first))
        direct = httpx.post(
            other + "/v1/responses",
            json={"model": MODEL, "previous_response_id": response.id, "input": "again"},
            timeout=PATIENCE_SECONDS,
        )
        assert direct.status_code == 404
        assert direct.json()["error"]["message"] == f"Response with id '{response.id}' not found."


def test_a_streamed_follow_up_also_reaches_the_replica_that_stored_its_predecessor(
    client: openai.OpenAI,
) -> None:
    raw = client.responses.with_raw_response.create(
        model=MODEL, input="what glue for timber?", max_output_tokens=4, stream=True
    )
    first = raw.headers["x-gateway-backend"]
    previous = completed(raw.parse())
    for turn in range(2):
        raw = client.responses.with_raw_response.create(
            model=MODEL,
            previous_response_id=previous.id,
            input=f"turn {turn}",
            max_output_tokens=4,
            stream=True,
        )
        assert raw.headers["x-gateway-backend"] == first
        previous = completed(raw.parse())


def test_tools_a_function_call_and_its_output_as_a_follow_up(client: openai.OpenAI) -> None:
    called, backend, _ = create(
        client,
        input="what is the weather in Lyon?",
        tools=[WEATHER_TOOL],
        tool_choice="required",
    )
    call = called.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    answer, follow_backend, route = create(
        client,
        previous_response_id=called.id,
        tools=[WEATHER_TOOL],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )
    assert (follow_backend, route) == (backend, "previous_response")
    assert answer.output[0].type == "message" and answer.output_text


def test_a_conversation_resent_whole_extends_its_prefix_on_one_replica(
    client: openai.OpenAI,
) -> None:
    """Without stored state (`store: false`) the client sends the history as items: the
    canonical bytes of turn n+1 extend turn n's prompt and answer, so it stays put."""
    history: list[dict[str, Any]] = [{"role": "user", "content": "which drill for brick walls?"}]
    backends = set()
    for turn in range(4):
        response, backend, _ = create(client, instructions=INSTRUCTIONS, input=history, store=False)
        backends.add(backend)
        history += [item.model_dump(exclude_none=True) for item in response.output]
        history.append({"role": "user", "content": f"and for turn {turn}?"})
    assert len(backends) == 1


def test_stored_responses_are_read_cancelled_and_deleted_at_their_replica(
    client: openai.OpenAI, gateway: GatewayProcess
) -> None:
    response, backend, _ = create(client, input="where is the tape?")
    url = f"{gateway.url}/v1/responses/{response.id}"
    counted = stored_requests(gateway)
    # One keep-alive connection for all of them: each answer leaves it open for the next.
    with httpx.Client(headers={"x-request-id": "stored-1"}, timeout=PATIENCE_SECONDS) as session:
        read = session.get(url)
        assert read.status_code == 200 and read.headers["x-gateway-backend"] == backend
        assert read.json()["id"] == response.id
        assert client.responses.retrieve(response.id).output_text == response.output_text
        # The replica's own answer: a response that is not running cannot be cancelled.
        cancel = session.post(url + "/cancel")
        assert cancel.status_code == 400 and cancel.headers["x-gateway-backend"] == backend
        assert cancel.json()["error"]["message"] == "Cannot cancel a synchronous response."
        deleted = session.delete(url)
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True
        gone = session.get(url)
        assert gone.status_code == 404 and gone.headers["x-gateway-backend"] == backend
    # Counted and logged like every other request, by status (the module's fixtures also
    # fail the test if the gateway or a replica logged a traceback).
    assert stored_requests(gateway, "200") - counted["200"] == 3
    assert stored_requests(gateway, "400") - counted["400"] == 1
    assert stored_requests(gateway, "404") - counted["404"] == 1

    def logged() -> list[int]:
        lines = gateway.log().splitlines()
        return [json.loads(line)["status"] for line in lines if '"request_id":"stored-1"' in line]

    wait_until(lambda: len(logged()) == 4, "an access-log line for each stored-response request")
    assert logged() == [200, 400, 200, 404]


def stored_requests(gateway: GatewayProcess, status: str | None = None) -> Any:
    """Requests routed to a stored response's replica: by status, or all three statuses."""
    name, route = "gateway_requests_total", "previous_response"
    if status is not None:
        return gateway.metric(name, route=route, status=status)
    return {code: gateway.metric(name, route=route, status=code) for code in ("200", "400", "404")}


def test_ids_the_gateway_never_saw_or_cannot_take(gateway: GatewayProcess) -> None:
    unknown = httpx.get(
        gateway.url + "/v1/responses/resp_0123456789abcdef", timeout=PATIENCE_SECONDS
    )
    assert unknown.status_code == 404 and "x-gateway-backend" not in unknown.headers
    assert unknown.json()["error"]["code"] == "response_not_found"
    for bad in ("x" * 129, "resp%20id", "resp$1"):
        refused = httpx.get(gateway.url + "/v1/responses/" + bad, timeout=PATIENCE_SECONDS)
        assert refused.status_code == 400, bad
        assert refused.json()["error"]["code"] == "invalid_response_id"
    body = {"model": MODEL, "input": "hi", "previous_response_id": "y" * 200}
    refused = httpx.post(gateway.url + "/v1/responses", json=body, timeout=PATIENCE_SECONDS)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "previous_response_id"
    wrong = httpx.put(gateway.url + "/v1/responses/resp_1", timeout=PATIENCE_SECONDS)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "GET, DELETE"
    assert (
        httpx.get(
            gateway.url + "/v1/responses/resp_1/input_items", timeout=PATIENCE_SECONDS
        ).status_code
        == 404
    )


def test_a_follow_up_naming_a_response_no_gateway_saw_gets_vllms_404_from_the_gateway(
    client: openai.OpenAI,
) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        create(client, previous_response_id="resp_never_seen", input="hello")
    error = missing.value.body
    assert isinstance(error, dict) and error["param"] == "previous_response_id"
    assert error["message"] == "Response with id 'resp_never_seen' not found."
    assert "x-gateway-backend" not in missing.value.response.headers


@pytest.fixture
def removable(fleet: EmulatedReplicas) -> Iterator[GatewayProcess]:
    with GatewayProcess(fleet.urls, "--admin-token", TOKEN) as started:
        yield started


def test_a_follow_up_whose_replica_was_removed_gets_an_openai_404(
    removable: GatewayProcess,
) -> None:
    client = openai.OpenAI(base_url=removable.url + "/v1", api_key="unused", max_retries=0)
    response, backend, _ = create(client, input="is there a saw for metal?")
    removed = httpx.delete(
        f"{removable.url}/admin/backends/{backend}",
        headers={"authorization": f"Bearer {TOKEN}"},
        timeout=PATIENCE_SECONDS,
    )
    assert removed.status_code == 200
    with pytest.raises(openai.NotFoundError) as gone:
        create(client, previous_response_id=response.id, input="and for wood?")
    error = gone.value.body
    assert isinstance(error, dict) and error["code"] == "response_replica_gone"
    assert error["param"] == "previous_response_id"
    read = httpx.get(f"{removable.url}/v1/responses/{response.id}", timeout=PATIENCE_SECONDS)
    assert read.status_code == 404 and read.json()["error"]["code"] == "response_replica_gone"
    # A new conversation is served by the replicas left.
    _, other, _ = create(client, input="is there a saw for metal?")
    assert other != backend


def test_model_only_endpoints_spread_and_reach_the_replicas(
    gateway: GatewayProcess, fleet: EmulatedReplicas
) -> None:
    answered = []
    for _ in range(len(fleet.urls)):
        reply = httpx.post(
            gateway.url + "/tokenize",
            json={"model": MODEL, "prompt": "a b c"},
            timeout=PATIENCE_SECONDS,
        )
        assert reply.status_code == 200 and reply.json()["count"] == 3
        assert reply.headers["x-gateway-route"] == "least_loaded"
        answered.append(reply.headers["x-gateway-backend"])
    assert len(set(answered)) == len(fleet.urls)
    # A generative replica has no reranker: its own 404 comes back through the gateway.
    rerank = httpx.post(
        gateway.url + "/v1/rerank",
        json={"model": MODEL, "query": "q", "documents": ["d"]},
        timeout=PATIENCE_SECONDS,
    )
    assert rerank.status_code == 404 and rerank.headers["x-gateway-backend"]
    unknown_model = httpx.post(
        gateway.url + "/tokenize", json={"model": "nope", "prompt": "a"}, timeout=PATIENCE_SECONDS
    )
    assert unknown_model.status_code == 404
    assert unknown_model.json()["error"]["code"] == "model_not_found"
    assert (
        httpx.post(
            gateway.url + "/v1/unknown", json={"model": MODEL}, timeout=PATIENCE_SECONDS
        ).status_code
        == 404
    )
    assert httpx.get(gateway.url + "/tokenize", timeout=PATIENCE_SECONDS).status_code == 405
