"""The emulator's tokenizer, generated text and prompt templates."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefix_gateway.emulator.errors import InvalidRequest
from prefix_gateway.emulator.prompts import chat_prompt_ids, completion_prompts
from prefix_gateway.emulator.sampler import VOCABULARY, Sampler
from prefix_gateway.emulator.tokenizer import decode, encode, split_tokens, token_id, token_ids

token_id_lists = st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=1, max_size=50)


def words(count: int, tag: str) -> str:
    return " ".join(f"{tag}{index}" for index in range(count))


def test_tokens_are_short_words_with_their_leading_blanks() -> None:
    assert split_tokens("hello world") == ["hello", " world"]
    assert split_tokens("internationalization") == ["intern", "ationa", "lizati", "on"]
    assert split_tokens(" a  b\n\tc ") == [" a", "  b", "\n\tc", " "]
    assert split_tokens("") == []


@given(st.text())
def test_tokens_join_back_to_the_text(text: str) -> None:
    tokens = split_tokens(text)
    assert "".join(tokens) == text
    for token in tokens:
        assert len(token.lstrip()) <= 6
    assert encode(text) == token_ids(tokens)


def test_token_ids_are_stable_32_bit_hashes() -> None:
    assert token_id("hello") == token_id("hello") != token_id(" hello")
    assert all(0 <= ident < 2**32 for ident in encode(words(100, "w")))


def test_vocabulary_is_distinct_lowercase_words_of_two_to_six_letters() -> None:
    assert len(set(VOCABULARY)) == len(VOCABULARY)
    assert all(re.fullmatch(r"[a-z]{2,6}", word) for word in VOCABULARY)


@given(token_id_lists, st.integers(min_value=1, max_value=300), st.integers())
def test_generated_text_tokenizes_to_the_generated_tokens(
    prompt: list[int], count: int, seed: int
) -> None:
    tokens = Sampler(seed).sample(prompt, count)
    assert len(tokens) == count
    assert not tokens[0].startswith(" ")
    assert all(token.startswith(" ") and token[1:] in VOCABULARY for token in tokens[1:])
    assert encode("".join(tokens)) == token_ids(tokens)


@given(token_id_lists, st.integers(min_value=1, max_value=300), st.integers())
def test_generated_text_decodes_back(prompt: list[int], count: int, seed: int) -> None:
    text = "".join(Sampler(seed).sample(prompt, count))
    assert decode(encode(text)) == text


def test_ids_a_hash_cannot_give_back_decode_to_nothing() -> None:
    assert decode(encode("river zzzzzz stone")) == "river stone"
    assert decode([]) == ""


def test_generated_text_depends_on_prompt_and_seed_only() -> None:
    prompt = encode(words(40, "p"))
    assert Sampler(7).sample(prompt, 30) == Sampler(7).sample(list(prompt), 30)
    assert Sampler(7).sample(prompt, 30) != Sampler(8).sample(prompt, 30)
    assert Sampler(7).sample(prompt, 30) != Sampler(7).sample(prompt[1:], 30)
    assert Sampler(7).sample(prompt, 0) == []


def test_plain_template_concatenates_message_contents() -> None:
    messages = [
        {"role": "system", "content": words(10, "s")},
        {"role": "user", "content": "glued"},
        {"role": "user", "content": "joined"},
    ]
    prompt = chat_prompt_ids(messages, None, "plain")
    assert prompt == [*encode(words(10, "s")), *encode("glued"), *encode("joined")]
    assert len(prompt) == 12


def test_chatml_template_wraps_every_message_and_adds_the_generation_prompt() -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    prompt = chat_prompt_ids(messages, None, "chatml")
    start, end, newline = token_id("<|im_start|>"), token_id("<|im_end|>"), token_id("\n")
    assert prompt == [
        start, *encode("system"), newline, *encode("be brief"), end,
        start, *encode("user"), newline, *encode("hi"), end,
        start, *encode("assistant"), newline,
    ]  # fmt: skip


@pytest.mark.parametrize("template", ["plain", "chatml"])
def test_next_turn_extends_the_previous_prompt_and_answer(template: str) -> None:
    history: list[dict[str, object]] = [{"role": "user", "content": words(20, "q")}]
    first = chat_prompt_ids(history, None, template)
    answer = Sampler(0).sample(first, 25)
    history += [
        {"role": "assistant", "content": "".join(answer)},
        {"role": "user", "content": words(5, "r")},
    ]
    second = chat_prompt_ids(history, None, template)
    assert second[: len(first) + len(answer)] == first + token_ids(answer)


def test_content_parts_give_text_tokens_and_one_token_per_other_part() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 5000}}
    other = {"type": "image_url", "image_url": {"url": "https://example.invalid/cat.png"}}
    content = [{"type": "text", "text": "look at"}, image, {"type": "text", "text": "this"}]
    prompt = chat_prompt_ids([{"role": "user", "content": content}], None, "plain")
    assert len(prompt) == 4
    assert prompt[:2] == encode("look at") and prompt[3:] == encode("this")
    again = chat_prompt_ids([{"role": "user", "content": [image]}], None, "plain")
    different = chat_prompt_ids([{"role": "user", "content": [other]}], None, "plain")
    assert again == [prompt[2]] != different


def test_tools_are_one_leading_message_of_sorted_json() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    messages = [{"role": "user", "content": "hi"}]
    prompt = chat_prompt_ids(messages, tools, "plain")
    expected = encode('[{"function":{"name":"f","parameters":{}},"type":"function"}]')
    assert prompt == [*expected, *encode("hi")]


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hello",
        [{"content": "no role"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"text": "no type"}]}],
        [{"role": "user", "content": [{"type": "text", "text": None}]}],
        ["not an object"],
    ],
)
def test_malformed_messages_are_rejected(messages: object) -> None:
    with pytest.raises(InvalidRequest):
        chat_prompt_ids(messages, None, "plain")


def test_completion_prompts_take_text_token_ids_and_batches() -> None:
    assert completion_prompts("a b") == [encode("a b")]
    assert completion_prompts(["a", "b c"]) == [encode("a"), encode("b c")]
    assert completion_prompts([1, 2, 3]) == [[1, 2, 3]]
    assert completion_prompts([[1], [2, 3]]) == [[1], [2, 3]]
    malformed: list[object] = [[], [[]], [1, "a"], [-1], [2**32], [True], None, 3, {"a": 1}]
    for bad in malformed:
        with pytest.raises(InvalidRequest):
            completion_prompts(bad)
