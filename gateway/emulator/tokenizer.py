"""The emulated engine's tokenizer: runs of at most six non-blank characters with the blanks
before them, ids the 32-bit xxhash of the text (no vocabulary). Joining a text's tokens gives
it back, so a generated answer sent back tokenizes to exactly the tokens generated.
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
