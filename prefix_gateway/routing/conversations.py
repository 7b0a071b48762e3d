"""Conversation continuity: whether a chat prompt extends its conversation's previous one.

Each request leaves a fingerprint (a hash and a role byte per message). The next one
*extends* it (starts with the previous prompt and answer), *branches* (agrees as far as it
goes, or changes only the last question) or *breaks*, classified by the first message that
differs (`BreakCause`); O(messages). A conversation is keyed by its session key, else by its
system prompt and first user message plus `TRIM_ALIASES` later ones, which find a history
trimmed from the front. Plain values and a bounded dict: no I/O, no metrics.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

import xxhash

from prefix_gateway.clock import Clock, monotonic
from prefix_gateway.prompt.canonical import MESSAGE, message_spans

_hash = xxhash.xxh3_64_intdigest
_HASH_BYTES = 8
_USER = ord("u")
_ASSISTANT = ord("a")
# Front trims that drop up to this many user turns at once are recognised without a session key.
TRIM_ALIASES = 4


class Continuity(Enum):
    NEW = "new"
    """No previous request of this conversation is known."""
    EXTENDS = "extends"
    BRANCH = "branch"
    BREAK = "break"
    UNKNOWN = "unknown"
    """A previous request is known by session key, but there are no messages to compare."""


class BreakCause(Enum):
    FRONT_TRIM = "front_trim"
    SYSTEM_PROMPT = "system_prompt"
    REWRITTEN_ANSWER = "rewritten_answer"
    MID_EDIT = "mid_edit"


class AffinityMiss(Enum):
    """Why a request that continues a conversation left the replica of its previous request."""

    UNHEALTHY = "unhealthy"
    """The previous replica was no longer a candidate (ejected, removed or draining)."""
    LOAD_BOUND = "load_bound"
    INDEX = "index"
    """The index held less of the prompt on the previous replica (expired, evicted or pruned)."""
    SPREAD = "spread"
    """Within the bound and as deep as the chosen one: the policy spread it (recent-traffic cap)."""
    FAILOVER = "failover"
    """The previous replica was tried for this request and failed before its first byte."""


@dataclass(slots=True)
class Fingerprint:
    hashes: bytes
    """One 64-bit hash per message, packed."""
    roles: bytes
    """The first byte of each message's role (`s`, `u`, `a`, `t`...; 0x1d for the tools block)."""

    def __len__(self) -> int:
        return len(self.roles)

    def hash_at(self, position: int) -> bytes:
        return self.hashes[position * _HASH_BYTES : (position + 1) * _HASH_BYTES]

    def keys(self, aliases: int = TRIM_ALIASES) -> list[int]:
        """The conversation's key (system prompt + first user message), then its trim aliases."""
        roles = self.roles
        first_user = roles.find(_USER)
        if first_user < 0:
            return []
        system = self.hashes[: first_user * _HASH_BYTES]
        keys = [_hash(self.hashes[: (first_user + 1) * _HASH_BYTES])]
        position = first_user
        while len(keys) <= aliases:
            position = roles.find(_USER, position + 1)
            if position < 0:
                break
            keys.append(_hash(system + self.hash_at(position)))
        return keys


def fingerprint(canonical: bytes) -> Fingerprint:
    """The fingerprint of a chat request's canonical stream (`prefix_gateway.prompt.canonical`)."""
    # Over a memoryview: slicing the bytes would copy the whole prompt, and for long prompts
    # that copy cost more than all the hashing.
    view = memoryview(canonical)
    hashes = array("Q")
    roles = bytearray()
    for start, stop in message_spans(canonical):
        hashes.append(_hash(view[start:stop]))
        roles.append(canonical[start] if stop > start else 0)
    return Fingerprint(hashes.tobytes(), bytes(roles))


def answer_hash(segment: bytes) -> bytes:
    """The packed hash of the answer's canonical message segment, comparable to `hash_at`."""
    return array("Q", (_hash(segment.removeprefix(MESSAGE)),)).tobytes()


@dataclass(slots=True)
class Record:
    """What is remembered of a conversation's latest request."""

    backend: str
    prompt: Fingerprint | None
    answer: bytes | None = None
    touched: float = 0.0


def classify(
    previous: Fingerprint, answer: bytes | None, current: Fingerprint
) -> tuple[Continuity, BreakCause | None]:
    """How `current` relates to the previous prompt and the answer written to it."""
    count = len(previous)
    if current.hashes.startswith(previous.hashes):
        if answer is None or len(current) == count or current.hash_at(count) == answer:
            return Continuity.EXTENDS, None
        if current.roles[count] == _ASSISTANT:
            return Continuity.BREAK, BreakCause.REWRITTEN_ANSWER
        return Continuity.EXTENDS, None  # the answer was left out; the prompt still extends
    differs = _first_difference(previous, current)
    if differs == len(current) or (differs == count - 1 and previous.roles[differs] == _USER):
        return Continuity.BRANCH, None
    return Continuity.BREAK, _break_cause(previous, current, differs)


def _first_difference(previous: Fingerprint, current: Fingerprint) -> int:
    for position in range(min(len(previous), len(current))):
        if previous.hash_at(position) != current.hash_at(position):
            return position
    return min(len(previous), len(current))


def _break_cause(previous: Fingerprint, current: Fingerprint, differs: int) -> BreakCause:
    first_user = previous.roles.find(_USER)
    if differs <= first_user:
        # The history now starts at a message that came later: the oldest turns were dropped.
        moved = current.hash_at(differs)
        if any(previous.hash_at(later) == moved for later in range(differs + 1, len(previous))):
            return BreakCause.FRONT_TRIM
    if differs < first_user:
        return BreakCause.SYSTEM_PROMPT
    if previous.roles[differs] == _ASSISTANT and current.roles[differs] == _ASSISTANT:
        return BreakCause.REWRITTEN_ANSWER
    return BreakCause.MID_EDIT


def miss_cause(
    previous: str,
    candidates: Mapping[str, int],
    bound: int,
    matched: Mapping[str, int],
    chosen: str,
) -> AffinityMiss:
    """Why `chosen` and not `previous`, from the loads, the bound and the index's matches."""
    if previous not in candidates:
        return AffinityMiss.UNHEALTHY
    if bound and candidates[previous] + 1 > bound:
        return AffinityMiss.LOAD_BOUND
    if matched.get(previous, 0) < matched.get(chosen, 0) or not matched.get(previous, 0):
        return AffinityMiss.INDEX
    return AffinityMiss.SPREAD


@dataclass(slots=True)
class Turn:
    """One request's place in its conversation, decided when it is routed."""

    record: Record
    previous_backend: str | None = None
    continuity: Continuity = Continuity.NEW
    cause: BreakCause | None = None
    miss: AffinityMiss | None = field(default=None)
    by_session: bool = False
    """Found by an explicit session key: it continues the session whatever its prompt."""

    @property
    def continues(self) -> bool:
        """Whether it counts for affinity: a known session's, or extending or branching."""
        if self.previous_backend is None:
            return False
        return self.by_session or self.continuity is not Continuity.BREAK


class ConversationTracker:
    """A bounded, TTL'd map from conversation keys to the latest request's record."""

    def __init__(self, ttl: float, max_entries: int, clock: Clock = monotonic) -> None:
        self._ttl = ttl
        self._max = max_entries
        self._clock = clock
        self._entries: OrderedDict[int | str, Record] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def follow(self, session_key: str | None, prompt: Fingerprint | None, backend: str) -> Turn:
        """Compare with the conversation's previous request, then file this one in its place."""
        keys: list[int | str]
        if session_key is not None:
            keys = [session_key]
        else:
            keys = list(prompt.keys()) if prompt is not None else []
        if not keys:
            return Turn(Record(backend, prompt))
        now = self._clock()
        turn = self._compare(keys[0], prompt, backend, now)
        entries = self._entries
        for key in keys:
            entries[key] = turn.record
            entries.move_to_end(key)
        self._trim(now)
        return turn

    def peek(self, session_key: str | None, prompt: Fingerprint | None) -> Turn:
        """What `follow` would find, recording nothing."""
        key: int | str | None = session_key
        if key is None and prompt is not None:
            key = next(iter(prompt.keys()), None)
        if key is None:
            return Turn(Record("", prompt))
        return self._compare(key, prompt, "", self._clock())

    def _compare(
        self, key: int | str, prompt: Fingerprint | None, backend: str, now: float
    ) -> Turn:
        turn = Turn(Record(backend, prompt, touched=now), by_session=isinstance(key, str))
        previous = self._entries.get(key)
        if previous is None or previous.touched < now - self._ttl:
            return turn
        turn.previous_backend = previous.backend
        if prompt is None or previous.prompt is None:
            turn.continuity = Continuity.UNKNOWN
        else:
            turn.continuity, turn.cause = classify(previous.prompt, previous.answer, prompt)
        return turn

    def _trim(self, now: float) -> None:
        entries = self._entries
        while len(entries) > self._max:
            entries.popitem(last=False)
        oldest = now - self._ttl
        while entries:
            record = next(iter(entries.values()))
            if record.touched >= oldest:
                break
            entries.popitem(last=False)
