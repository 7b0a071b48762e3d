"""The emulated engine's tokenizer.

A token is a run of at most six non-blank characters together with the blanks before it, or
a run of trailing blanks; longer words split into six-character pieces. A token's id is the
32-bit xxhash of its text, so ids are stable across processes and need no vocabulary file.
Joining the tokens of a text gives the text back, which is what makes generated answers,
sent back as assistant messages, tokenize to exactly the tokens that were generated.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import xxhash

_TOKEN = re.compile(r"\s*\S{1,6}|\s+")


def split_tokens(text: str) -> list[str]:
    return _TOKEN.findall(text)


def token_id(token: str) -> int:
    result: int = xxhash.xxh32_intdigest(token)
    return result


def encode(text: str) -> list[int]:
    return token_ids(split_tokens(text))


def token_ids(tokens: Iterable[str]) -> list[int]:
    return list(map(xxhash.xxh32_intdigest, tokens))
