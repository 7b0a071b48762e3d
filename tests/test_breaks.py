"""Conversation continuity, on tables of history edits built from real OpenAI chat bodies."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from prefix_gateway.clock import ManualClock
from prefix_gateway.prompt.canonical import message_segment
from prefix_gateway.prompt.parsing import Endpoint, parse_request
from prefix_gateway.routing.conversations import (
    TRIM_ALIASES,
    AffinityMiss,
    BreakCause,
    Continuity,
    ConversationTracker,
    Fingerprint,
    answer_hash,
    classify,
    fingerprint,
    miss_cause,
)

Message = dict[str, Any]


def system(text: str = "You are terse.") -> Message:
    return {"role": "system", "content": text}


def user(text: str) -> Message:
    return {"role": "user", "content": text}


def assistant(text: str) -> Message:
    return {"role": "assistant", "content": text}


def prompt(*messages: Message, tools: list[Any] | None = None) -> Fingerprint:
    body: dict[str, Any] = {"model": "m", "messages": list(messages)}
    if tools is not None:
        body["tools"] = tools
    return fingerprint(parse_request(Endpoint.CHAT, orjson.dumps(body), None).canonical)


def written(text: str) -> bytes:
    return answer_hash(message_segment("assistant", text))


S, S2 = system(), system("You are terse. Today is 2026-11-29 10:41.")
U1, U2, U3, U4, U5 = (user(f"question {turn}") for turn in range(1, 6))
A1, A2, A3, A4 = (assistant(f"answer {turn}") for turn in range(1, 5))
THINK = "<think>the user asks twice</think>answer 1"
TOOL = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
TOOL2 = [{"type": "function", "function": {"name": "search", "parameters": {}}}]

# (case, previous prompt, answer written to it, next prompt, continuity, cause)
HISTORY_EDITS: list[
    tuple[str, tuple[Message, ...], str | None, tuple[Message, ...], Continuity, BreakCause | None]
] = [
    ("next turn", (S, U1), "answer 1", (S, U1, A1, U2), Continuity.EXTENDS, None),
    ("answer unseen", (S, U1), None, (S, U1, A4, U2), Continuity.EXTENDS, None),
    ("same prompt again", (S, U1, A1, U2), "answer 2", (S, U1, A1, U2), Continuity.EXTENDS, None),
    ("answer left out", (S, U1), "answer 1", (S, U1, U2), Continuity.EXTENDS, None),
    ("many turns later", (S, U1), "answer 1", (S, U1, A1, U2, A2, U3), Continuity.EXTENDS, None),
    ("rewind", (S, U1, A1, U2, A2, U3), None, (S, U1, A1, U2), Continuity.BRANCH, None),
    ("edited last question", (S, U1, A1, U2), None, (S, U1, A1, U3), Continuity.BRANCH, None),
    (
        "reasoning stripped from the answer",
        (S, U1),
        THINK,
        (S, U1, A1, U2),
        Continuity.BREAK,
        BreakCause.REWRITTEN_ANSWER,
    ),
    (
        "reasoning stripped from an earlier answer",
        (S, U1, assistant(THINK), U2),
        "answer 2",
        (S, U1, A1, U2, A2, U3),
        Continuity.BREAK,
        BreakCause.REWRITTEN_ANSWER,
    ),
    (
        "oldest turn dropped",
        (S, U1, A1, U2, A2, U3),
        "answer 3",
        (S, U2, A2, U3, A3, U4),
        Continuity.BREAK,
        BreakCause.FRONT_TRIM,
    ),
    (
        "two oldest turns dropped",
        (S, U1, A1, U2, A2, U3, A3, U4),
        "answer 4",
        (S, U3, A3, U4, A4, U5),
        Continuity.BREAK,
        BreakCause.FRONT_TRIM,
    ),
    (
        "oldest turn and system prompt dropped",
        (S, U1, A1, U2),
        "answer 2",
        (U2, A2, U3),
        Continuity.BREAK,
        BreakCause.FRONT_TRIM,
    ),
    (
        "oldest turn dropped, no system prompt",
        (U1, A1, U2),
        "answer 2",
        (U2, A2, U3),
        Continuity.BREAK,
        BreakCause.FRONT_TRIM,
    ),
    (
        "first question edited",
        (S, U1, A1, U2),
        "answer 2",
        (S, U5, A1, U2, A2, U3),
        Continuity.BREAK,
        BreakCause.MID_EDIT,
    ),
    (
        "middle question edited",
        (S, U1, A1, U2, A2, U3),
        "answer 3",
        (S, U1, A1, U5, A2, U3, A3, U4),
        Continuity.BREAK,
        BreakCause.MID_EDIT,
    ),
    (
        "middle turn removed",
        (S, U1, A1, U2, A2, U3),
        "answer 3",
        (S, U1, A1, U3, A3, U4),
        Continuity.BREAK,
        BreakCause.MID_EDIT,
    ),
    (
        "first turn kept, later ones trimmed",
        (S, U1, A1, U2, A2, U3, A3, U4),
        "answer 4",
        (S, U1, A1, U4, A4, U5),
        Continuity.BREAK,
        BreakCause.MID_EDIT,
    ),
    (
        "timestamp in the system prompt",
        (S, U1, A1, U2),
        "answer 2",
        (S2, U1, A1, U2, A2, U3),
        Continuity.BREAK,
        BreakCause.SYSTEM_PROMPT,
    ),
    (
        "earlier answer edited by hand",
        (S, U1, A1, U2),
        "answer 2",
        (S, U1, A3, U2, A2, U3),
        Continuity.BREAK,
        BreakCause.REWRITTEN_ANSWER,
    ),
]


@pytest.mark.parametrize(
    ("previous", "answer", "current", "continuity", "cause"),
    [case[1:] for case in HISTORY_EDITS],
    ids=[case[0] for case in HISTORY_EDITS],
)
def test_history_edits_are_classified(
    previous: tuple[Message, ...],
    answer: str | None,
    current: tuple[Message, ...],
    continuity: Continuity,
    cause: BreakCause | None,
) -> None:
    written_answer = written(answer) if answer is not None else None
    assert classify(prompt(*previous), written_answer, prompt(*current)) == (continuity, cause)


def test_changed_tools_break_like_a_system_prompt() -> None:
    before = prompt(S, U1, A1, U2, tools=TOOL)
    after = prompt(S, U1, A1, U2, A2, U3, tools=TOOL2)
    assert classify(before, written("answer 2"), after) == (
        Continuity.BREAK,
        BreakCause.SYSTEM_PROMPT,
    )
    same_tools = prompt(S, U1, A1, U2, A2, U3, tools=TOOL)
    assert classify(before, written("answer 2"), same_tools) == (Continuity.EXTENDS, None)


def test_fingerprint_is_one_hash_per_message() -> None:
    plain = prompt(S, U1, A1, U2)
    assert len(plain) == 4 and len(plain.hashes) == 32 and plain.roles == b"suau"
    assert len(prompt(S, U1, tools=TOOL)) == 3
    assert prompt(S, U1).hashes == plain.hashes[:16]
    assert plain.hash_at(2) == written("answer 1")


def tracker(clock: ManualClock, entries: int = 100) -> ConversationTracker:
    return ConversationTracker(ttl=600, max_entries=entries, clock=clock)


def test_a_conversation_is_found_by_system_prompt_and_first_question() -> None:
    conversations = tracker(ManualClock())
    first = conversations.follow(None, prompt(S, U1), "a:1")
    assert first.continuity is Continuity.NEW and not first.continues
    first.record.answer = written("answer 1")
    second = conversations.follow(None, prompt(S, U1, A1, U2), "a:2")
    assert (second.previous_backend, second.continuity) == ("a:1", Continuity.EXTENDS)
    assert second.continues
    other = conversations.follow(None, prompt(S, U3), "a:3")
    assert other.continuity is Continuity.NEW
    with_another_system = conversations.follow(None, prompt(S2, U1, A1, U2), "a:3")
    assert with_another_system.continuity is Continuity.NEW


def test_a_front_trim_is_found_without_a_session_key() -> None:
    conversations = tracker(ManualClock())
    history = [S, U1, A1, U2, A2, U3, A3, U4, A4, U5]
    conversations.follow(None, prompt(*history), "a:1")
    trimmed = conversations.follow(None, prompt(S, *history[3:], A1, U1), "a:1")
    assert (trimmed.continuity, trimmed.cause) == (Continuity.BREAK, BreakCause.FRONT_TRIM)
    assert not trimmed.continues  # no session key: a broken prompt is a new conversation


def test_trims_deeper_than_the_aliases_start_a_new_conversation() -> None:
    conversations = tracker(ManualClock())
    questions = [user(f"q{turn}") for turn in range(TRIM_ALIASES + 3)]
    history = [message for question in questions for message in (question, A1)]
    conversations.follow(None, prompt(S, *history), "a:1")
    kept = history[2 * TRIM_ALIASES :]
    assert conversations.peek(None, prompt(S, *kept)).continuity is Continuity.BREAK
    too_deep = history[2 * (TRIM_ALIASES + 1) :]
    assert conversations.peek(None, prompt(S, *too_deep)).continuity is Continuity.NEW


def test_a_session_key_follows_any_prompt() -> None:
    conversations = tracker(ManualClock())
    conversations.follow("chat-7", prompt(S, U1, A1, U2), "a:1")
    changed = conversations.follow("chat-7", prompt(S2, U1, A1, U2, A2, U3), "a:2")
    assert changed.previous_backend == "a:1"
    assert (changed.continuity, changed.cause) == (Continuity.BREAK, BreakCause.SYSTEM_PROMPT)
    assert changed.continues  # a session's request counts for affinity whatever its prompt
    completion = conversations.follow("chat-7", None, "a:3")
    assert (completion.previous_backend, completion.continuity) == ("a:2", Continuity.UNKNOWN)
    assert completion.continues
    assert conversations.follow(None, None, "a:1").continuity is Continuity.NEW


def test_entries_expire_and_stay_bounded() -> None:
    clock = ManualClock()
    conversations = tracker(clock, entries=3)
    conversations.follow(None, prompt(S, U1), "a:1")
    clock.advance(601)
    assert conversations.follow(None, prompt(S, U1, A1, U2), "a:1").continuity is Continuity.NEW
    for question in (U2, U3, U4, U5):
        conversations.follow(None, prompt(S, question), "a:1")
    assert len(conversations) == 3
    assert conversations.peek(None, prompt(S, U2, A2, U3)).continuity is Continuity.NEW
    assert conversations.peek(None, prompt(S, U5, A2, U3)).continuity is Continuity.EXTENDS


def test_peek_records_nothing() -> None:
    conversations = tracker(ManualClock())
    assert conversations.peek("s", prompt(S, U1)).continuity is Continuity.NEW
    assert conversations.peek(None, prompt(S, U1)).continuity is Continuity.NEW
    assert len(conversations) == 0


# (case, loads of the candidates, bound, matched blocks, chosen, cause)
MISSES: list[tuple[str, dict[str, int], int, dict[str, int], str, AffinityMiss]] = [
    ("previous ejected", {"b": 0}, 2, {}, "b", AffinityMiss.UNHEALTHY),
    ("previous at the bound", {"a": 2, "b": 0}, 2, {"a": 9}, "b", AffinityMiss.LOAD_BOUND),
    ("index forgot it", {"a": 0, "b": 0}, 2, {"b": 9}, "b", AffinityMiss.INDEX),
    ("deeper elsewhere", {"a": 0, "b": 0}, 2, {"a": 4, "b": 9}, "b", AffinityMiss.INDEX),
    ("spread on a tie", {"a": 1, "b": 0}, 3, {"a": 9, "b": 9}, "b", AffinityMiss.SPREAD),
    ("no bound in the policy", {"a": 7, "b": 0}, 0, {"a": 9, "b": 9}, "b", AffinityMiss.SPREAD),
]


@pytest.mark.parametrize(
    ("loads", "bound", "matched", "chosen", "cause"),
    [case[1:] for case in MISSES],
    ids=[case[0] for case in MISSES],
)
def test_affinity_miss_causes(
    loads: dict[str, int], bound: int, matched: dict[str, int], chosen: str, cause: AffinityMiss
) -> None:
    assert miss_cause("a", loads, bound, matched, chosen) is cause
