"""What `--tokenizer` adds to parsing a request: CPU microseconds per chat request, parsed
without and with the engine's tokenizer (the tiny model's byte-level BPE, made here), by
prompt size, for a system prompt seen before and a new user message (`warm`: the system
prompt's tokens come from the piece cache) and for text never seen (`cold`).

    python loadtest/tokenize_bench.py
    python loadtest/tokenize_bench.py --tokens 1000,8000 --samples 200
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engines.tiny_model import Shape, corpus, make_tokenizer
from gateway.prompt.parsing import Endpoint, parse_request
from gateway.prompt.tokens import TOKEN_BYTES, EngineTokenizer


def words_text(rng: random.Random, lines: list[str], chars: int) -> str:
    parts: list[str] = []
    size = 0
    while size < chars:
        line = rng.choice(lines)
        parts.append(line)
        size += len(line) + 1
    return " ".join(parts)[:chars]


def cpu_us(samples: int, work: Callable[[int], object]) -> float:
    """Median CPU microseconds of `work(i)` over `samples` calls."""
    times = []
    for i in range(samples):
        began = time.process_time_ns()
        work(i)
        times.append((time.process_time_ns() - began) / 1000)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--tokens", default="1000,4000,16000")
    parser.add_argument("--samples", type=int, default=100)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="tokenize-bench-"))
    shape = Shape()
    make_tokenizer(folder, shape)
    engine = EngineTokenizer.load(folder)
    lines = corpus(shape.seed + 1, 50_000)  # text of the tokenizer's kind, not its training text
    rng = random.Random(1)
    sample = words_text(rng, lines, 20_000)
    chars_per_token = len(sample) / (len(engine.text(sample)) / TOKEN_BYTES)
    print(
        f"# tiny model tokenizer (byte-level BPE, {shape.vocab_size} tokens), "
        f"{chars_per_token:.2f} characters per token on this text; median of {args.samples}"
    )
    print("| prompt tokens | parse, no tokenizer µs | with tokenizer, warm µs | cold µs |")
    print("|---|---|---|---|")
    for tokens in (int(value) for value in args.tokens.split(",")):
        system = words_text(rng, lines, round(tokens * chars_per_token * 0.9))
        questions = [
            words_text(rng, lines, round(tokens * chars_per_token * 0.1))
            for _ in range(args.samples)
        ]
        colds = [
            words_text(rng, lines, round(tokens * chars_per_token)) for _ in range(args.samples)
        ]

        def body(system_text: str, question: str) -> bytes:
            messages = [
                {"role": "system", "content": system_text},
                {"role": "user", "content": question},
            ]
            return orjson.dumps({"model": "m", "messages": messages})

        warm_bodies = [body(system, question) for question in questions]
        cold_bodies = [body(cold, "?") for cold in colds]
        engine.chat([{"role": "system", "content": system}], None)  # the system prompt is seen

        def parse(
            bodies: list[bytes], tokenizer: EngineTokenizer | None
        ) -> Callable[[int], object]:
            return lambda i: parse_request(Endpoint.CHAT, bodies[i], None, tokenizer=tokenizer)

        plain = cpu_us(args.samples, parse(warm_bodies, None))
        warm = cpu_us(args.samples, parse(warm_bodies, engine))
        cold = cpu_us(args.samples, parse(cold_bodies, engine))
        print(f"| {tokens:,} | {plain:.0f} | {warm:.0f} | {cold:.0f} |", flush=True)


if __name__ == "__main__":
    main()
