"""Synthetic workloads in the shapes of prefix sharing (`shared`, `customers`, `conversation`,
`rag`, `mixed`; docs/benchmarks.md), generated from a seed. A session is a system prompt and
its user turns, in short words that are one emulator token each.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Session:
    shape: str
    system: str
    questions: tuple[str, ...]
    max_tokens: int


def text(rng: random.Random, words: int) -> str:
    letters = string.ascii_lowercase
    return " ".join("".join(rng.choices(letters, k=rng.randint(2, 6))) for _ in range(words))


def shared_prompt(rng: random.Random, scale: float = 1.0) -> list[Session]:
    system = text(rng, 1000)
    return [
        Session("shared", system, (text(rng, rng.randint(50, 150)),), 32)
        for _ in range(round(160 * scale))
    ]


def customers(rng: random.Random, scale: float = 1.0) -> list[Session]:
    prompts = [text(rng, 1200) for _ in range(48)]
    weights = [1.0 / (rank + 1) ** 1.1 for rank in range(len(prompts))]
    chosen = rng.choices(prompts, weights=weights, k=round(240 * scale))
    return [Session("customers", system, (text(rng, 50),), 16) for system in chosen]


def conversations(rng: random.Random, scale: float = 1.0) -> list[Session]:
    system = text(rng, 1000)
    return [
        Session("conversation", system, tuple(text(rng, 100) for _ in range(6)), 300)
        for _ in range(round(32 * scale))
    ]


def rag(rng: random.Random, scale: float = 1.0) -> list[Session]:
    instructions = text(rng, 800)
    passages = [text(rng, 300) for _ in range(40)]
    sessions = []
    for _ in range(round(160 * scale)):
        picked = rng.sample(passages, 5)
        prompt = "\n\n".join([*picked, text(rng, 50)])
        sessions.append(Session("rag", instructions, (prompt,), 32))
    return sessions


def mixed(rng: random.Random, scale: float = 1.0) -> list[Session]:
    sessions = [
        *shared_prompt(rng, scale / 2),
        *customers(rng, scale / 2),
        *conversations(rng, scale / 2),
        *rag(rng, scale / 2),
    ]
    rng.shuffle(sessions)
    return sessions


SHAPES: dict[str, Callable[[random.Random, float], list[Session]]] = {
    "shared": shared_prompt,
    "customers": customers,
    "conversation": conversations,
    "rag": rag,
    "mixed": mixed,
}


def build_workload(name: str, seed: int, scale: float = 1.0) -> list[Session]:
    if name not in SHAPES:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(SHAPES)}")
    return SHAPES[name](random.Random(f"{name}:{seed}"), scale)
