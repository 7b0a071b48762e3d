"""Prompts of an exact length in the emulated replica's tokens: one short word, one token."""

from __future__ import annotations

import itertools

_counter = itertools.count()


def words(count: int, tag: str | None = None) -> str:
    """`count` distinct words of at most six characters; a fresh tag makes the text unique."""
    tag = tag or f"t{next(_counter) % 100}"
    return " ".join(f"{tag}{index % 10000}"[:6] for index in range(count))
