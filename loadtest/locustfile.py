"""Load test for the gateway (or any OpenAI-compatible endpoint) in the three shapes of sharing.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8080
    locust -f loadtest/locustfile.py --headless -u 64 -r 8 -t 5m --host http://127.0.0.1:8080

User classes, one per shape of prefix sharing:

- `SharedPromptUser`: one long system prompt every user sends, then a question of its own.
- `ConversationUser`: multi-turn chats that re-send the whole history, answers included (the
  real answers the server returned), `LOCUST_TURNS` turns, then a new conversation.
- `RagUser`: fixed instructions, then `LOCUST_RAG_PASSAGES` of a pool of passages in varying
  order, then a question.

Besides locust's own statistics, every response's `usage.prompt_tokens_details.cached_tokens`
is counted per shape: the token hit rate (cached / prompt tokens) is printed when the test
stops, served at `/cache-stats` of the web UI, and aggregated from workers in distributed runs.

Environment variables (all optional): LOCUST_MODEL (default `emulated-model`),
LOCUST_WEIGHT_SHARED / _CONVERSATION / _RAG (relative weights, default 1 each; 0 turns a shape
off), LOCUST_MAX_TOKENS (default 32), LOCUST_TURNS (default 6), LOCUST_RAG_PASSAGES (default 4),
LOCUST_SYSTEM_WORDS (default 800), LOCUST_SESSION_HEADER (1: send `x-session-id` per
conversation), LOCUST_SEED (default 7).
"""

from __future__ import annotations

import os
import random
import string
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from locust import HttpUser, between, events, task
from locust.env import Environment
from locust.runners import LocalRunner, MasterRunner


def _setting(name: str, default: str) -> str:
    return os.environ.get(f"LOCUST_{name}", default)


MODEL = _setting("MODEL", "emulated-model")
MAX_TOKENS = int(_setting("MAX_TOKENS", "32"))
TURNS = int(_setting("TURNS", "6"))
RAG_PASSAGES = int(_setting("RAG_PASSAGES", "4"))
SYSTEM_WORDS = int(_setting("SYSTEM_WORDS", "800"))
SESSION_HEADER = _setting("SESSION_HEADER", "0") == "1"
SEED = int(_setting("SEED", "7"))


def words(rng: random.Random, count: int) -> str:
    letters = string.ascii_lowercase
    return " ".join("".join(rng.choices(letters, k=rng.randint(2, 7))) for _ in range(count))


# Shared by every user of a process, and the same in every process (one seed): what makes
# prefixes shareable at all.
_CORPUS = random.Random(SEED)
SYSTEM_PROMPT = "You are a helpful assistant. " + words(_CORPUS, SYSTEM_WORDS)
RAG_INSTRUCTIONS = "Answer from the passages below only. " + words(_CORPUS, 150)
PASSAGES = [f"Passage {n}: " + words(_CORPUS, 180) for n in range(40)]


@dataclass
class ShapeCounts:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def add(self, other: ShapeCounts) -> None:
        self.requests += other.requests
        self.prompt_tokens += other.prompt_tokens
        self.cached_tokens += other.cached_tokens


@dataclass
class CacheStats:
    """Cached-token counts per shape, from the usage of every response."""

    shapes: dict[str, ShapeCounts] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, shape: str, usage: dict[str, Any]) -> None:
        details = usage.get("prompt_tokens_details") or {}
        with self._lock:
            counts = self.shapes.setdefault(shape, ShapeCounts())
            counts.requests += 1
            counts.prompt_tokens += int(usage.get("prompt_tokens") or 0)
            counts.cached_tokens += int(details.get("cached_tokens") or 0)

    def take(self) -> dict[str, list[int]]:
        """The counts so far as plain data, reset: what a worker sends its master."""
        with self._lock:
            data = {
                shape: [counts.requests, counts.prompt_tokens, counts.cached_tokens]
                for shape, counts in self.shapes.items()
            }
            self.shapes.clear()
        return data

    def merge(self, data: dict[str, list[int]]) -> None:
        with self._lock:
            for shape, (requests, prompt_tokens, cached_tokens) in data.items():
                counts = self.shapes.setdefault(shape, ShapeCounts())
                counts.add(ShapeCounts(requests, prompt_tokens, cached_tokens))

    def total(self) -> ShapeCounts:
        total = ShapeCounts()
        for counts in self.shapes.values():
            total.add(counts)
        return total

    def as_dict(self) -> dict[str, dict[str, float]]:
        rows = {**self.shapes, "all": self.total()}
        return {
            shape: {
                "requests": counts.requests,
                "prompt_tokens": counts.prompt_tokens,
                "cached_tokens": counts.cached_tokens,
                "hit_rate": round(counts.hit_rate, 4),
            }
            for shape, counts in rows.items()
        }

    def table(self) -> str:
        lines = [
            "cache hits (usage.prompt_tokens_details.cached_tokens)",
            f"{'shape':<14}{'requests':>10}{'prompt_tokens':>15}{'cached_tokens':>15}"
            f"{'hit_rate':>10}",
        ]
        for shape, row in self.as_dict().items():
            lines.append(
                f"{shape:<14}{row['requests']:>10}{row['prompt_tokens']:>15}"
                f"{row['cached_tokens']:>15}{row['hit_rate']:>10.1%}"
            )
        return "\n".join(lines)


CACHE = CacheStats()


class _ChatUser(HttpUser):
    abstract = True
    wait_time = between(0.05, 0.5)
    shape = ""

    def chat(self, messages: list[dict[str, str]], session: str | None = None) -> str | None:
        """One chat completion; its usage is counted; returns the answer, None on failure."""
        headers = {"x-session-id": session} if SESSION_HEADER and session else {}
        body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS}
        with self.client.post(
            "/v1/chat/completions",
            json=body,
            headers=headers,
            name=self.shape,
            catch_response=True,
        ) as response:
            if response.status_code != 200:
                response.failure(f"status {response.status_code}: {response.text[:200]}")
                return None
            try:
                payload = response.json()
                usage = payload["usage"]
                answer = str(payload["choices"][0]["message"]["content"] or "")
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                response.failure(f"not a chat completion: {exc!r}")
                return None
            CACHE.record(self.shape, usage)
            return answer


class SharedPromptUser(_ChatUser):
    weight = int(_setting("WEIGHT_SHARED", "1"))
    shape = "shared"

    def on_start(self) -> None:
        self.rng = random.Random()

    @task
    def ask(self) -> None:
        self.chat(
            [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": words(self.rng, self.rng.randint(20, 80))},
            ]
        )


class ConversationUser(_ChatUser):
    weight = int(_setting("WEIGHT_CONVERSATION", "1"))
    shape = "conversation"

    def on_start(self) -> None:
        self.rng = random.Random()
        self.begin()

    def begin(self) -> None:
        self.session = uuid.uuid4().hex
        self.messages = [{"role": "system", "content": SYSTEM_PROMPT}]

    @task
    def turn(self) -> None:
        self.messages.append({"role": "user", "content": words(self.rng, 40)})
        answer = self.chat(list(self.messages), self.session)
        if answer is None:
            self.begin()
            return
        self.messages.append({"role": "assistant", "content": answer})
        if len(self.messages) >= 1 + 2 * TURNS:
            self.begin()


class RagUser(_ChatUser):
    weight = int(_setting("WEIGHT_RAG", "1"))
    shape = "rag"

    def on_start(self) -> None:
        self.rng = random.Random()

    @task
    def ask(self) -> None:
        passages = self.rng.sample(PASSAGES, RAG_PASSAGES)  # varying order, as retrieved
        context = "\n\n".join(passages)
        self.chat(
            [
                {"role": "system", "content": RAG_INSTRUCTIONS},
                {"role": "user", "content": f"{context}\n\nQuestion: {words(self.rng, 20)}"},
            ]
        )


@events.init.add_listener
def _on_init(environment: Environment, **_: Any) -> None:
    if environment.web_ui is not None:

        @environment.web_ui.app.route("/cache-stats")
        def cache_stats() -> dict[str, dict[str, float]]:
            return CACHE.as_dict()


@events.report_to_master.add_listener
def _on_report_to_master(client_id: str, data: dict[str, Any]) -> None:
    data["cache_stats"] = CACHE.take()


@events.worker_report.add_listener
def _on_worker_report(client_id: str, data: dict[str, Any]) -> None:
    CACHE.merge(data.get("cache_stats", {}))


@events.test_stop.add_listener
def _on_test_stop(environment: Environment, **_: Any) -> None:
    if isinstance(environment.runner, LocalRunner):
        print(CACHE.table(), flush=True)


@events.quitting.add_listener
def _on_quitting(environment: Environment, **_: Any) -> None:
    # A master prints last, once the workers' final reports are in.
    if isinstance(environment.runner, MasterRunner):
        print(CACHE.table(), flush=True)
