"""Deterministic generated text: the same prompt and seed always give the same answer, in
words that are one token each, so an answer re-tokenizes to the tokens generated.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Sequence

import xxhash

VOCABULARY: tuple[str, ...] = (
    "able", "acid", "aged", "also", "area", "army", "away", "baby", "back", "ball",
    "band", "bank", "base", "bath", "bear", "beat", "been", "beer", "bell", "belt",
    "best", "bill", "bird", "blow", "blue", "boat", "body", "bomb", "bond", "bone",
    "book", "boom", "born", "boss", "both", "bowl", "bulk", "burn", "bush", "busy",
    "call", "calm", "came", "camp", "card", "care", "case", "cash", "cast", "cell",
    "chat", "chip", "city", "club", "coal", "coat", "code", "cold", "come", "cook",
    "cool", "cope", "copy", "core", "cost", "crew", "crop", "dark", "data", "date",
    "dawn", "days", "dead", "deal", "dean", "dear", "debt", "deep", "deny", "desk",
    "go", "to", "an", "of", "in", "on", "at", "by", "up", "we",
    "river", "stone", "light", "table", "plant", "water", "sound", "green", "cloud", "north",
    "garden", "silver", "bridge", "market", "pocket", "window", "forest", "planet", "signal",
    "yellow", "number", "thread", "castle", "button", "circle", "moment", "letter", "engine",
)


class Sampler:
    def __init__(self, seed: int) -> None:
        self._seed = seed & 0xFFFF_FFFF_FFFF_FFFF

    def sample(self, prompt_ids: Sequence[int], count: int) -> list[str]:
        """The `count` tokens answering a prompt, the first without a leading space."""
        if count <= 0:
            return []
        digest = xxhash.xxh3_64_intdigest(array("I", prompt_ids).tobytes(), seed=self._seed)
        words = random.Random(digest).choices(VOCABULARY, k=count)
        return [words[0], *(" " + word for word in words[1:])]
