"""Prompts tokenized as the engine does (`--tokenizer`): the tiny model's own tokenizer and chat
template, made here with `tokenizers` (the same files real vLLM serves in test_real_vllm.py)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import orjson
import pytest
from tokenizers import Tokenizer

from engines.tiny_model import Shape, make_tokenizer
from prefix_gateway.backends.pool import BackendPool
from prefix_gateway.config import ConfigError, Settings
from prefix_gateway.emulator.replicas import EmulatedReplicas
from prefix_gateway.metrics import Metrics
from prefix_gateway.prompt.parsing import Endpoint, parse_request
from prefix_gateway.prompt.tokens import TOKEN_BYTES, EngineTokenizer, unpack
from prefix_gateway.routing.placement import Placement
from prefix_gateway.routing.policies import build_policy
from prefix_gateway.routing.recorder import Stores
from prefix_gateway.routing.router import Router
from prefix_gateway.routing.types import Outcome
from prefix_gateway.state.index import InMemoryPrefixIndex
from prefix_gateway.state.sessions import InMemorySessionStore
from tests.conftest import MODEL
from tests.support import GatewayProcess

SYSTEM = "You are a patient assistant for a hardware shop; name the aisle of every item. " * 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-tokenizer")
    make_tokenizer(folder, Shape(corpus_words=20_000))
    return folder


@pytest.fixture(scope="module")
def engine(folder: Path) -> EngineTokenizer:
    return EngineTokenizer.load(folder)


def plain_ids(folder: Path, text: str) -> list[int]:
    """What the tokenizer alone makes of `text`, encoded whole."""
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def test_a_chat_is_the_template_rendered_then_encoded_whole(
    folder: Path, engine: EngineTokenizer
) -> None:
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": [{"type": "text", "text": "where  is the\n\nglue?"}]},
    ]
    rendered = (
        f"<|bos|><|system|>\n{SYSTEM}<|end|>\n<|user|>\nwhere  is the\n\nglue?<|end|>\n"
        "<|assistant|>\n"
    )
    assert engine.pieces is not None
    first = engine.chat(messages, None)
    again = engine.chat(messages, None)  # from the kept pieces this time
    assert first is not None
    assert unpack(first) == plain_ids(folder, rendered)
    assert again == first
    assert engine.pieces.hits > 0


def test_a_conversation_turn_extends_the_previous_prompt_and_its_answer(
    engine: EngineTokenizer,
) -> None:
    turn_one = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "nails?"}]
    answer = "Aisle 4, next to the screws."
    turn_two = [*turn_one, {"role": "assistant", "content": answer}]
    turn_two.append({"role": "user", "content": "and glue?"})
    prompt = engine.chat(turn_one, None)
    follow_up = engine.chat(turn_two, None)
    assert prompt is not None and follow_up is not None
    history = prompt + engine.text(answer, add_special_tokens=False)
    assert follow_up.startswith(history)


def test_parsing_gives_the_tokens_of_chats_and_single_completions(
    folder: Path, engine: EngineTokenizer
) -> None:
    def parsed(endpoint: Endpoint, body: dict[str, object]) -> bytes | None:
        request = parse_request(
            endpoint, orjson.dumps({"model": "m", **body}), None, tokenizer=engine
        )
        return request.tokens

    chat = parsed(Endpoint.CHAT, {"messages": [{"role": "user", "content": "hello"}]})
    assert chat is not None and unpack(chat)[0] == plain_ids(folder, "<|bos|>")[0]
    completion = parsed(Endpoint.COMPLETIONS, {"prompt": "hello there"})
    assert completion is not None and unpack(completion) == plain_ids(folder, "hello there")
    ids = parsed(Endpoint.COMPLETIONS, {"prompt": [5, 6, 7]})
    assert ids is not None and unpack(ids) == [5, 6, 7]
    assert parsed(Endpoint.COMPLETIONS, {"prompt": ["a", "b"]}) is None  # a batch
    assert parsed(Endpoint.EMBEDDINGS, {"input": "hello"}) is None
    without = parse_request(Endpoint.CHAT, b'{"model": "m", "messages": [{"role": "user"}]}', None)
    assert without.tokens is None


def test_a_tokenizer_file_alone_has_no_template_and_chats_route_by_characters(
    folder: Path, tmp_path: Path
) -> None:
    alone = tmp_path / "tokenizer.json"
    alone.write_bytes((folder / "tokenizer.json").read_bytes())
    engine = EngineTokenizer.load(alone)
    assert not engine.has_chat_template
    assert engine.chat([{"role": "user", "content": "hi"}], None) is None
    assert unpack(engine.text("hi there")) == plain_ids(folder, "hi there")


def test_engine_block_size_replaces_block_tokens_and_a_missing_tokenizer_is_refused(
    folder: Path,
) -> None:
    settings = Settings(
        backend=("http://127.0.0.1:1",), tokenizer=str(folder), engine_block_size=32
    )
    assert settings.validate().block_tokens == 32
    with pytest.raises(ConfigError):
        Settings(backend=("http://127.0.0.1:1",), tokenizer=str(folder / "absent")).validate()
    with pytest.raises(ConfigError):
        EngineTokenizer.load(folder / "tokenizer_config.json")


def test_the_router_indexes_the_engines_blocks_and_answers_that_encode_back(
    engine: EngineTokenizer,
) -> None:
    settings = Settings(backend=("m=http://a:1",), engine_block_size=32).validate()
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "nails?"}]
    answer = "Aisle 4, next to the screws and the nails. " * 8
    answer_tokens = len(engine.text(answer, add_special_tokens=False)) // TOKEN_BYTES
    follow_up = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "?"}]

    def matched_after(generated: int) -> tuple[int, int, int]:
        """Tokens and blocks of the first prompt, and the blocks the follow-up matches once the
        first was answered with `generated` tokens (each time with a fresh index)."""
        pool = BackendPool.from_specs(settings.backend)
        pool.set_health(pool.backends[0], True)
        router = Router(
            settings,
            pool,
            Stores(InMemoryPrefixIndex(600, 100_000), InMemorySessionStore(600, 1000)),
            build_policy(settings),
            Metrics(),
            tokenizer=engine,
        )

        def route(messages: list[dict[str, str]]) -> Placement:
            body = orjson.dumps({"model": "m", "messages": messages})
            return asyncio.run(
                router.route(parse_request(Endpoint.CHAT, body, None, tokenizer=engine))
            )

        routed = route(first)
        prompt = routed.request.tokens
        assert prompt is not None
        assert len(routed.chain) == len(prompt) // TOKEN_BYTES // 32  # the engine's full blocks
        backend = (routed.backend.name,)
        outcome = Outcome(
            200,
            routed.decision,
            backend,
            answer=answer,
            completion_tokens=generated,
            accepted=backend,
        )
        asyncio.run(routed.settle(outcome))
        tokens = len(prompt) // TOKEN_BYTES
        return tokens, len(routed.chain), route(follow_up).decision.matched_blocks

    # Not as many tokens as the engine generated: its ids were others, only the prompt counts.
    _, prompt_blocks, matched = matched_after(answer_tokens + 1)
    assert matched == prompt_blocks
    # As many: the answer's blocks are the engine's too.
    prompt_tokens, prompt_blocks, matched = matched_after(answer_tokens)
    assert matched == (prompt_tokens + answer_tokens) // 32 > prompt_blocks


def test_the_piece_cache_shared_by_threads_encodes_as_a_whole_encoding_does(
    folder: Path,
) -> None:
    engine = EngineTokenizer.load(folder)  # its own cache, filled only by the threads below
    prompts = [
        [
            {"role": "system", "content": SYSTEM * (1 + index % 3)},
            {"role": "user", "content": f"where are the screws of size {index}?"},
        ]
        for index in range(48)
    ]
    with ThreadPoolExecutor(4) as threads:
        packed = list(threads.map(lambda messages: engine.chat(messages, None), prompts))
    assert engine.pieces is not None and engine.pieces.hits > 0
    for messages, ids in zip(prompts, packed, strict=True):
        assert ids is not None and unpack(ids) == plain_ids(folder, rendered_text(messages))


def rendered_text(messages: list[dict[str, str]]) -> str:
    """The tiny model's chat template, written out (the first test checks it)."""
    turns = "".join(f"<|{item['role']}|>\n{item['content']}<|end|>\n" for item in messages)
    return f"<|bos|>{turns}<|assistant|>\n"


@pytest.mark.parametrize("system_words", [40, 2000], ids=["on-the-loop", "beside-the-loop"])
def test_through_the_gateway_a_repeated_prompt_matches_its_full_blocks_of_tokens(
    folder: Path, engine: EngineTokenizer, system_words: int
) -> None:
    # Bodies of 4 KiB and more are tokenized on the gateway's tokenizing thread, smaller ones
    # on its event loop: both must give the engine's tokens.
    system = " ".join(f"aisle{index % 97} shelf{index % 13}" for index in range(system_words))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "nails?"}]
    tokens = len(engine.chat(messages, None) or b"") // TOKEN_BYTES
    body_bytes = len(orjson.dumps({"model": MODEL, "messages": messages}))
    assert (body_bytes >= 4096) == (system_words == 2000)
    args = ("--tokenizer", str(folder), "--engine-block-size", "32")
    with EmulatedReplicas(2, MODEL) as fleet, GatewayProcess(fleet.urls, *args) as gateway:
        with openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0) as client:
            answers = [
                client.chat.completions.with_raw_response.create(
                    model=MODEL,
                    messages=messages,  # type: ignore[arg-type]
                    max_tokens=2,
                )
                for _ in range(2)
            ]
        routes = [answer.headers["x-gateway-route"] for answer in answers]
        backends = {answer.headers["x-gateway-backend"] for answer in answers}
        predicted = gateway.metric("gateway_matched_tokens_predicted_total", model=MODEL)
    assert routes[0] == "hash" and routes[1] in {"owner", "prefix"} and len(backends) == 1
    assert predicted == tokens // 32 * 32 > 0
