"""How far the index's predicted prefix depth and a replica's reported cached tokens differ
when nothing was evicted: the noise the cache feedback's tolerance has to absorb.

For pairs of prompts of the synthetic workloads (a request, then a later one sharing its
beginning: another question after the same system prompt, or a conversation's next turn), the
first is cached whole in the emulator's prefix cache, then the second is admitted. The gateway's
prediction is the depth, in index blocks, of the chains' common beginning — what the index
would match — converted to tokens with the second request's own characters per token (its
canonical length over its reported prompt tokens); the observation is the emulator's
`cached_tokens`. The table shows predicted minus observed tokens: positive is a prediction
the replica did not meet although it evicted nothing.

    .venv/bin/python loadtest/feedback_tolerance.py
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterator

import orjson

from prefix_gateway.emulator.prefix_cache import PrefixCache, block_hashes
from prefix_gateway.emulator.prompts import chat_prompt_ids
from prefix_gateway.prompt.hashing import chain_hashes
from prefix_gateway.prompt.parsing import Endpoint, parse_request
from prefix_gateway.routing.feedback import chars_per_token
from prefix_gateway.workloads import SHAPES, build_workload, text

BLOCK_TOKENS = 16
CHARS_PER_TOKEN = 4.0
BLOCK_CHARS = round(BLOCK_TOKENS * CHARS_PER_TOKEN)


def pairs(workload: str, seed: int) -> Iterator[tuple[list[dict[str, str]], list[dict[str, str]]]]:
    """(earlier messages, later messages) sharing a beginning, as the workload sends them."""
    rng = random.Random(seed)
    by_system: dict[str, list[dict[str, str]]] = {}
    for session in build_workload(workload, seed, 0.25):
        history = [{"role": "system", "content": session.system}]
        for question in session.questions:
            prompt = [*history, {"role": "user", "content": question}]
            if len(session.questions) == 1:
                earlier = by_system.get(session.system)
                if earlier is not None:
                    yield earlier, prompt
                by_system[session.system] = prompt
                continue
            # A conversation: the answer joins the history, and the next turn extends it.
            history = [*prompt, {"role": "assistant", "content": text(rng, 60)}]
            if question is not session.questions[-1]:
                yield history, [*history, {"role": "user", "content": text(rng, 100)}]


def error_tokens(
    earlier: list[dict[str, str]], later: list[dict[str, str]], template: str
) -> float:
    cache = PrefixCache(1 << 20, BLOCK_TOKENS)
    first_ids = chat_prompt_ids(earlier, None, template)
    first_hashes = block_hashes(first_ids, BLOCK_TOKENS)
    lease = cache.admit(first_hashes, len(first_ids), 1)
    assert lease is not None
    cache.publish(lease, first_hashes)
    cache.release(lease)
    second_ids = chat_prompt_ids(later, None, template)
    second = cache.admit(block_hashes(second_ids, BLOCK_TOKENS), len(second_ids), 1)
    assert second is not None
    canon = [
        parse_request(Endpoint.CHAT, orjson.dumps({"model": "m", "messages": m}), None).canonical
        for m in (earlier, later)
    ]
    first_chain = chain_hashes(canon[0], BLOCK_CHARS)
    second_chain = chain_hashes(canon[1], BLOCK_CHARS)
    depth = 0
    while depth < min(len(first_chain), len(second_chain)):
        if first_chain[depth] != second_chain[depth]:
            break
        depth += 1
    ratio = chars_per_token(len(canon[1]), len(second_ids), CHARS_PER_TOKEN)
    predicted = depth * BLOCK_CHARS / ratio
    return predicted - second.cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(f"# block {BLOCK_TOKENS} tokens, index block {BLOCK_CHARS} characters, seed {args.seed}")
    print(
        "| workload | template | pairs | min | median | p99 | max (predicted - observed tokens) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for workload in [name for name in SHAPES if name != "mixed"]:
        for template in ("plain", "chatml"):
            errors = sorted(
                error_tokens(earlier, later, template)
                for earlier, later in pairs(workload, args.seed)
            )
            if not errors:
                continue
            p99 = errors[min(len(errors) - 1, int(len(errors) * 0.99))]
            print(
                f"| {workload} | {template} | {len(errors)} | {errors[0]:.1f} | "
                f"{errors[len(errors) // 2]:.1f} | {p99:.1f} | {errors[-1]:.1f} |"
            )


if __name__ == "__main__":
    main()
