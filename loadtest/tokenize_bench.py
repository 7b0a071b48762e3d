"""What `--tokenizer` adds to parsing a request: CPU microseconds per chat request, parsed
without and with the engine's tokenizer (the tiny model's byte-level BPE, made here), by
prompt size, for a system prompt seen before and a new user message (`warm`: the system
prompt's tokens come from the piece cache) and for text never seen (`cold`). A second table
shows what the event loop feels while never-seen prompts are parsed: parsed on the loop, or on
the gateway's tokenizing thread as bodies from 4 KiB are (`encode_batch` releases the GIL), the
longest and the 99th-percentile gap between the 1 ms ticks of a task beside them.

    python loadtest/tokenize_bench.py
    python loadtest/tokenize_bench.py --tokens 1000,8000 --samples 200
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engines.tiny_model import Shape, corpus, make_tokenizer
from prefix_gateway.prompt.parsing import Endpoint, parse_request
from prefix_gateway.prompt.tokens import TOKEN_BYTES, EngineTokenizer


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


def loop_gaps(bodies: list[bytes], engine: EngineTokenizer, beside: bool) -> list[float]:
    """Milliseconds between the ticks of a 1 ms ticker while `bodies` are parsed one after
    another, on the event loop or on one tokenizing thread."""

    def parsed(body: bytes) -> object:
        return parse_request(Endpoint.CHAT, body, None, tokenizer=engine)

    async def scenario() -> list[float]:
        gaps: list[float] = []
        done = asyncio.Event()

        async def ticker() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append((now - last) * 1000)
                last = now

        ticking = asyncio.create_task(ticker())
        await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(1) as thread:
            for body in bodies:
                if beside:
                    await loop.run_in_executor(thread, parsed, body)
                else:
                    parsed(body)
                    await asyncio.sleep(0)
        done.set()
        await ticking
        return gaps

    return asyncio.run(scenario())


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
    stalls: list[tuple[int, list[bytes]]] = []
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
        stalls.append((tokens, cold_bodies))

    print()
    print(
        "| prompt tokens | never-seen prompts parsed | on the loop: longest gap ms | p99 ms "
        "| on the tokenizing thread: longest gap ms | p99 ms |"
    )
    print("|---|---|---|---|---|---|")
    for tokens, bodies in stalls:
        fresh = [body.replace(b'"?"', f'"{index}"'.encode()) for index, body in enumerate(bodies)]
        count = min(len(fresh), 20)
        row = [f"{tokens:,}", str(count)]
        for beside, chosen in ((False, fresh[:count]), (True, fresh[-count:])):
            engine = EngineTokenizer.load(folder)  # an empty piece cache: every prompt is new
            gaps = sorted(loop_gaps(chosen, engine, beside))
            row += [f"{gaps[-1]:.1f}", f"{gaps[int(len(gaps) * 0.99)]:.1f}"]
        print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
