"""Replay traces from the synthetic workloads, in the emulator's own tokens, blocks and
answers, sessions arriving as a seeded Poisson process (docs/replay.md).
"""

from __future__ import annotations

import random
from array import array

from prefix_gateway.emulator.adapters import adapter_salt
from prefix_gateway.emulator.prefix_cache import block_hashes
from prefix_gateway.emulator.prompts import chat_prompt_ids
from prefix_gateway.emulator.sampler import Sampler
from prefix_gateway.emulator.tokenizer import encode, token_ids
from prefix_gateway.prompt.hashing import key_hash
from prefix_gateway.replay.traces import Trace, TraceRequest
from prefix_gateway.workloads import build_workload


def synthetic_trace(
    shape: str,
    seed: int,
    *,
    block_tokens: int = 16,
    scale: float = 1.0,
    rate: float = 2.0,
    think_seconds: float = 3.0,
    time_scale: float = 1.0,
    affinity_tokens: int = 256,
    limit: int | None = None,
    adapters: int = 0,
) -> Trace:
    """The requests of workload `shape`, sessions starting at `rate` per second on average;
    with `adapters`, each session names one of that many LoRA adapters (Zipf weights: a few
    popular ones, a long tail), whose key its blocks carry as the engine's do."""
    if rate <= 0 or think_seconds < 0:
        raise ValueError("the session rate must be positive and the think time not negative")
    sessions = build_workload(shape, seed, scale)
    arrivals = random.Random(f"replay:{shape}:{seed}")
    sampler = Sampler(seed)
    requests: list[TraceRequest] = []
    name = (
        f"synthetic:{shape}:{seed} (sessions at {rate:g}/s, think time {think_seconds:g} s, "
        f"scale {scale:g})"
    )
    if adapters:
        name += f", {adapters} LoRA adapters"
    names = [f"adapter-{number}" for number in range(adapters)]
    weights = [1 / (rank + 1) for rank in range(adapters)]
    started = 0.0
    for session in sessions:
        started += arrivals.expovariate(rate)
        adapter = arrivals.choices(names, weights)[0] if adapters else ""
        salt = adapter_salt(adapter or None, None)
        system_tokens = len(encode(session.system))
        messages = [{"role": "system", "content": session.system}]
        previous: int | None = None
        known: list[int] = []
        for question in session.questions:
            messages.append({"role": "user", "content": question})
            prompt = chat_prompt_ids(messages, None, "plain")
            hashes = block_hashes(prompt, block_tokens, known, salt)
            answer = sampler.sample(prompt, session.max_tokens)
            answer_ids = token_ids(answer)
            answered = block_hashes([*prompt, *answer_ids], block_tokens, hashes)
            held = block_hashes([*prompt, *answer_ids[:-1]], block_tokens, hashes)
            key_tokens = prompt[system_tokens : system_tokens + affinity_tokens]
            arrival = started if previous is None else _think(arrivals, think_seconds)
            requests.append(
                TraceRequest(
                    arrival=arrival * time_scale,
                    prompt_tokens=len(prompt),
                    output_tokens=session.max_tokens,
                    hashes=tuple(hashes),
                    affinity_key=key_hash(array("I", key_tokens).tobytes()),
                    private_from=system_tokens // block_tokens,
                    after=previous,
                    answered=tuple(answered),
                    held=tuple(held),
                    shape=session.shape,
                    first_turn=previous is None,
                    adapter=adapter,
                )
            )
            if limit is not None and len(requests) >= limit:
                return Trace(name, requests, block_tokens, synthetic=True)
            previous = len(requests) - 1
            known = answered
            messages.append({"role": "assistant", "content": "".join(answer)})
    return Trace(name, requests, block_tokens, synthetic=True)


def _think(rng: random.Random, mean: float) -> float:
    return rng.expovariate(1.0 / mean) if mean > 0 else 0.0
