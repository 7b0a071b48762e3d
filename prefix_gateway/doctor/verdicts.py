"""The doctor's checks, their results, and the arithmetic that judges a replica's cached-token
report against the gateway's prediction: plain functions of plain numbers.

An engine caches whole blocks and always computes a prompt's last token, so a prompt of `P`
tokens repeated at once is served `(P - 1) // B * B` tokens from cache under a block size of
`B`. The probe prompt's length is chosen so that this count differs between the gateway's
block size and every other size an engine is commonly run with: the count the engine reports
then names its block size.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Check(Enum):
    REACHABLE = "reachable"
    MODELS = "models"
    LOAD_METRICS = "load-metrics"
    PREFIX_CACHING = "prefix-caching"
    CACHED_TOKENS_REPORTED = "cached-tokens-reported"
    TOKEN_AGREEMENT = "token-agreement"
    KV_EVENTS = "kv-events"
    CACHE_SALT = "cache-salt"


class Status(Enum):
    PASS = "pass"
    FAIL = "fail"
    SKIP = "skip"
    """Not run: a check it depends on failed, or the replica gives nothing to judge it by."""


@dataclass(frozen=True)
class CheckResult:
    check: Check
    status: Status
    detail: str

    @property
    def passed(self) -> bool:
        return self.status is Status.PASS


def passed(check: Check, detail: str) -> CheckResult:
    return CheckResult(check, Status.PASS, detail)


def failed(check: Check, detail: str) -> CheckResult:
    return CheckResult(check, Status.FAIL, detail)


def skipped(check: Check, detail: str) -> CheckResult:
    return CheckResult(check, Status.SKIP, detail)


COMMON_BLOCK_SIZES = (1, 8, 16, 32, 48, 64, 96, 128, 256)
"""Block sizes tried when the engine's cached count does not fit the gateway's: vLLM's on GPUs
(1 to 128, 16 by default), multiples of 32 on CPUs, SGLang's page sizes."""
_SHORTEST_PROBE = 256
_LONGEST_PROBE = 640
_AIM_SLACK = 2
"""Tokens by which the probe may miss its aim and still tell the block sizes apart."""


def cached_at(prompt_tokens: int, block_size: int) -> int:
    """Tokens an engine caching blocks of `block_size` serves from cache for a repeated prompt."""
    return max(0, prompt_tokens - 1) // block_size * block_size


def sizes_reproducing(prompt_tokens: int, cached_tokens: int, also: int) -> list[int]:
    """The block sizes (common ones and `also`) under which `cached_tokens` is what a repeated
    prompt of `prompt_tokens` would be served from cache."""
    sizes = sorted({*COMMON_BLOCK_SIZES, also})
    return [size for size in sizes if cached_at(prompt_tokens, size) == cached_tokens]


def probe_tokens(block_size: int) -> int:
    """The prompt length to aim the probe at: under `block_size` its repeat is cached to a
    count that no other common block size gives, even a couple of tokens off the aim, and the
    prompt is not a whole number of blocks (whose last block an engine never serves from
    cache, though the gateway counts it)."""
    others = [size for size in COMMON_BLOCK_SIZES if size != block_size]
    best, best_score = _SHORTEST_PROBE, (-1, -1)
    for tokens in range(_SHORTEST_PROBE, _LONGEST_PROBE):
        nearby = range(tokens - _AIM_SLACK, tokens + _AIM_SLACK + 1)
        if any(length % block_size == 0 for length in nearby):
            continue
        telling = sum(
            all(cached_at(length, size) != cached_at(length, block_size) for length in nearby)
            for size in others
        )
        distinct = len({cached_at(tokens, size) for size in COMMON_BLOCK_SIZES})
        if (telling, distinct) > best_score:
            best, best_score = tokens, (telling, distinct)
    return best


def block_size_verdict(prompt_tokens: int, cached_tokens: int, block_size: int) -> str | None:
    """Why the engine's count shows another block size than `block_size`; None when it fits."""
    if cached_at(prompt_tokens, block_size) == cached_tokens:
        return None
    fits = sizes_reproducing(prompt_tokens, cached_tokens, block_size)
    if not fits:
        return (
            f"the engine served {cached_tokens} of {prompt_tokens} tokens from cache, which no"
            f" block size explains (blocks of {block_size} would give"
            f" {cached_at(prompt_tokens, block_size)}): part of the prompt was evicted or"
            " computed again"
        )
    named = " or ".join(str(size) for size in fits)
    return (
        f"block size differs: the engine served {cached_tokens} of {prompt_tokens} tokens from"
        f" cache, as blocks of {named} tokens would; the gateway hashes blocks of {block_size}"
        " (set --engine-block-size, or --block-tokens without --tokenizer, to the engine's"
        " --block-size)"
    )
