"""Stored responses belong to the tenant that created them, with `--isolate-tenants` or
without: another tenant naming one (`GET`, a follow-up's `previous_response_id`, `DELETE`,
`cancel`, `input_items`) gets the 404 an unknown id gets, and the owner's response is still
there afterwards. Two named tenants and an anonymous key through a real gateway in front of
emulated replicas that store responses, driven with the official `openai` client.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
import yaml

from prefix_gateway.emulator.replicas import EmulatedReplicas
from tests.conftest import MODEL
from tests.support import GatewayProcess

OWNER_KEY = "owner-key"
OTHER_KEY = "other-key"
ANONYMOUS_KEY = "anonymous-key"
TENANTS = [{"name": "owner", "api_key": OWNER_KEY}, {"name": "other", "api_key": OTHER_KEY}]


@pytest.fixture(scope="module")
def fleet() -> Iterator[EmulatedReplicas]:
    with EmulatedReplicas(2, MODEL, ["--chat-template", "plain"]) as started:
        yield started


@pytest.fixture(scope="module", params=["shared", "isolated"])
def gateway(
    request: pytest.FixtureRequest,
    fleet: EmulatedReplicas,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GatewayProcess]:
    config = tmp_path_factory.mktemp("owners") / "gateway.yaml"
    config.write_text(yaml.safe_dump({"tenants": TENANTS}))
    isolation = ("--isolate-tenants",) if request.param == "isolated" else ()
    args = ("--config", str(config), "--api-key", ANONYMOUS_KEY, *isolation)
    with GatewayProcess(fleet.urls, *args) as started:
        yield started


def client(gateway: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)


def raw(gateway: GatewayProcess, key: str, method: str, path: str) -> httpx.Response:
    return httpx.request(
        method, gateway.url + path, headers={"authorization": f"Bearer {key}"}, timeout=30
    )


def not_found(answer: httpx.Response, response_id: str) -> dict[str, object]:
    """The 404 of an id its sender does not own, less the id: it must match an unknown id's."""
    assert answer.status_code == 404, answer.text
    error = dict(answer.json()["error"])
    error["message"] = str(error["message"]).replace(response_id, "ID")
    return error


@pytest.mark.parametrize("stranger", [OTHER_KEY, ANONYMOUS_KEY])
def test_another_tenants_response_id_is_unknown_to_it(
    gateway: GatewayProcess, stranger: str
) -> None:
    with client(gateway, OWNER_KEY) as owner, client(gateway, stranger) as other:
        owned_by_one_tenant(gateway, owner, other, stranger)


def owned_by_one_tenant(
    gateway: GatewayProcess, owner: openai.OpenAI, other: openai.OpenAI, stranger: str
) -> None:
    stored = owner.responses.create(model=MODEL, input="keep this between us", max_output_tokens=4)
    theirs = stored.id
    unknown = "resp_" + "0" * 32
    for method, path in (
        ("GET", "/v1/responses/{}"),
        ("DELETE", "/v1/responses/{}"),
        ("POST", "/v1/responses/{}/cancel"),
        ("GET", "/v1/responses/{}/input_items"),
    ):
        theirs_answer = raw(gateway, stranger, method, path.format(theirs))
        unknown_answer = raw(gateway, stranger, method, path.format(unknown))
        assert not_found(theirs_answer, theirs) == not_found(unknown_answer, unknown), path
    with pytest.raises(openai.NotFoundError) as follow_up:
        other.responses.create(
            model=MODEL, input="and then?", previous_response_id=theirs, max_output_tokens=4
        )
    assert follow_up.value.code == "response_not_found"
    # The owner's response was neither read, continued nor deleted by the stranger.
    again = owner.responses.retrieve(theirs)
    assert again.id == theirs and again.output_text == stored.output_text
    continued = owner.responses.create(
        model=MODEL, input="and then?", previous_response_id=theirs, max_output_tokens=4
    )
    assert continued.previous_response_id == theirs
    owner.responses.delete(theirs)
    assert raw(gateway, OWNER_KEY, "GET", f"/v1/responses/{theirs}").status_code == 404
