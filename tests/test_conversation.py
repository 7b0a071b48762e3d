"""End to end: the gateway in front of 4 emulated replicas, driven by the official client.

The arithmetic is the lesson's: a 1,000-token system prompt, 100-token questions and
300-token answers, block size 16. Six turns prefill 1,640 tokens instead of 12,600, and
twenty turns 31 times less — only if every turn lands where the previous one was cached.
"""

from __future__ import annotations

import openai

from tests.conftest import MODEL
from tests.words import words


def converse(client: openai.OpenAI, turns: int, tag: str) -> tuple[list[int], list[int], set[str]]:
    messages: list[dict[str, str]] = [{"role": "system", "content": words(1000, tag + "s")}]
    prompt_tokens: list[int] = []
    cached_tokens: list[int] = []
    backends: set[str] = set()
    for turn in range(turns):
        messages.append({"role": "user", "content": words(100, f"{tag}q{turn}")})
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=messages,
            max_tokens=300,  # type: ignore[arg-type]
        )
        reply = raw.parse()
        backends.add(raw.headers["x-gateway-backend"])
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        prompt_tokens.append(reply.usage.prompt_tokens)
        cached_tokens.append(reply.usage.prompt_tokens_details.cached_tokens or 0)
        answer = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": answer})
    return prompt_tokens, cached_tokens, backends


def test_six_turns_prefill_1640_tokens_instead_of_12600(client: openai.OpenAI) -> None:
    prompts, cached, backends = converse(client, 6, "cv")
    assert prompts == [1100, 1500, 1900, 2300, 2700, 3100]
    assert sum(prompts) == 12_600
    assert len(backends) == 1  # every turn on the replica that holds the history
    computed = [total - hit for total, hit in zip(prompts, cached, strict=True)]
    assert computed == [1100, 108, 108, 108, 108, 108]
    assert sum(computed) == 1640


def test_twenty_turns_prefill_31_times_less(client: openai.OpenAI) -> None:
    prompts, cached, backends = converse(client, 20, "cw")
    computed = sum(total - hit for total, hit in zip(prompts, cached, strict=True))
    assert len(backends) == 1
    assert sum(prompts) == 98_000
    assert computed == 1100 + 19 * 108
    assert sum(prompts) / computed > 31


def test_users_sharing_a_system_prompt_reuse_it(client: openai.OpenAI) -> None:
    """Each replica computes the shared prompt once: every later user sent to it hits its
    cache. Sent one after another, the users stay on one replica until its recent requests run
    well above the fleet's mean (the hot cap, which counts whatever this gateway routed
    before), then share a second one: the prompt is never computed a third time."""
    system = words(1000, "sp")
    holders: list[str] = []
    for user in range(6):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[
                {"role": "system", "content": system},
                {"role": "user", "content": words(50, f"su{user}")},
            ],
            max_tokens=5,
        )
        reply = raw.parse()
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        backend = raw.headers["x-gateway-backend"]
        # The system prompt's 62 full blocks, where this replica computed it before.
        expected = 992 if backend in holders else 0
        assert reply.usage.prompt_tokens_details.cached_tokens == expected, (user, backend)
        if backend not in holders:
            holders.append(backend)
    assert len(holders) <= 2, holders


def test_session_header_pins_a_replica(client: openai.OpenAI) -> None:
    seen = set()
    for attempt in range(5):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": words(20, f"ss{attempt}")}],
            max_tokens=2,
            extra_headers={"x-session-id": "session-42"},
        )
        seen.add(raw.headers["x-gateway-backend"])
        route = raw.headers["x-gateway-route"]
        assert route in ("hash", "session") if attempt == 0 else route == "session"
    assert len(seen) == 1
