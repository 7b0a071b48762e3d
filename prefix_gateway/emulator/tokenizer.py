"""The emulated engine's tokenizer: runs of at most six non-blank characters with the blanks
before them, ids the 32-bit xxhash of the text (no vocabulary). Joining a text's tokens gives
it back, so a generated answer sent back tokenizes to exactly the tokens generated. A hash
cannot be read back: `decode` knows only the tokens the engine generates.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import xxhash

from prefix_gateway.emulator.sampler import VOCABULARY

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


def decode(ids: Iterable[int]) -> str:
    """The text of `ids`, for the tokens the engine generates (its words, bare or after a
    space); any other id decodes to nothing, as a Hugging Face tokenizer decodes an id it does
    not know."""
    return "".join(_GENERATED.get(token, "") for token in ids)


_GENERATED = {token_id(text): text for word in VOCABULARY for text in (word, " " + word)}
