"""How fast a real vLLM CPU replica of the tiny model is: start-up, prefill, decode, memory.

    python -m engines.timing [--layers 4 --hidden 512 ...]

starts one replica pinned to core 0 and prints, for prompts of about 1k, 2k and 3k tokens, the
time to first token cold (prefill) and warm (the same prompt again, served from the prefix
cache), the decode rate for 256 tokens, and the replica's memory (PSS of its processes). The
numbers in docs/real-engines.md come from this command. A shape other than the default makes
its own model folder under .engines/models.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engines.fleet import MODEL_NAME, model_folder
from engines.replica import VLLMReplica
from engines.tiny_model import Shape, ensure_model
from engines.venv import ROOT, VLLMVenv


def prompt_of(tokens: int, seed: int) -> list[int]:
    """A prompt of exactly `tokens` token ids (ordinary ids of the tiny vocabulary)."""
    rng = random.Random(seed)
    return [rng.randrange(100, 4000) for _ in range(tokens)]


def first_token_seconds(url: str, prompt: list[int], max_tokens: int = 1) -> tuple[float, Any]:
    """Seconds until the first streamed chunk with text; the final usage."""
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    started = time.monotonic()
    first: float | None = None
    usage: Any = None
    with urllib.request.urlopen(request, timeout=300) as reply:
        for raw in reply:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and first is None:
                first = time.monotonic() - started
            if chunk.get("usage"):
                usage = chunk["usage"]
    return (first if first is not None else time.monotonic() - started), usage


def pss_mib(pid: int) -> float:
    """Proportional set size of `pid` and its descendants in its process group, in MiB."""
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat[stat.rindex(")") + 2 :].split()[2]) != pid:
                continue
            for line in (entry / "smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) / 1024
        except (OSError, ValueError):
            continue
    return total


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="time a real vLLM CPU replica")
    defaults = Shape()
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--hidden", type=int, default=defaults.hidden_size)
    parser.add_argument("--intermediate", type=int, default=defaults.intermediate_size)
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--kv-heads", type=int, default=defaults.kv_heads)
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args(argv)
    shape = Shape(
        layers=options.layers,
        hidden_size=options.hidden,
        intermediate_size=options.intermediate,
        heads=options.heads,
        kv_heads=options.kv_heads,
    )
    venv = VLLMVenv().ensure()
    folder = (
        model_folder()
        if shape == defaults
        else ROOT / ".engines" / "models" / f"llama-l{shape.layers}-h{shape.hidden_size}"
    )
    model = ensure_model(venv.python, folder, shape)
    kv_bytes = 32 * 1024 * 1024  # room for two 4k-token prompts at any of the shapes tried
    with VLLMReplica(
        model, venv=venv, served_model_names=(MODEL_NAME,), cpu_cores="0", kv_cache_bytes=kv_bytes
    ) as replica:
        print(f"model {folder.name}: {json.dumps(shape.__dict__)}")
        print(f"start-up to /health 200: {replica.started_seconds:.1f} s")
        print(f"memory (PSS, all processes): {pss_mib(replica.pid):.0f} MiB")
        first_token_seconds(replica.url, prompt_of(64, 0), 4)  # warm-up
        print("prompt tokens | cold TTFT (prefill) | per 1k tokens | warm TTFT (cached) | cached")
        for size in (1000, 2000, 3000):
            cold: list[float] = []
            warm: list[float] = []
            hit = 0
            for repeat in range(options.repeats):
                prompt = prompt_of(size, size * 100 + repeat)
                cold.append(first_token_seconds(replica.url, prompt)[0])
                seconds, usage = first_token_seconds(replica.url, prompt)
                warm.append(seconds)
                hit = usage["prompt_tokens_details"]["cached_tokens"]
            median_cold = statistics.median(cold)
            print(
                f"{size:13d} | {median_cold:17.3f} s | {median_cold / size * 1000:11.3f} s"
                f" | {statistics.median(warm):16.3f} s | {hit}"
            )
        decode: list[float] = []
        for repeat in range(options.repeats):
            started = time.monotonic()
            first_token_seconds(replica.url, prompt_of(16, repeat), 256)
            decode.append(time.monotonic() - started)
        rate = 256 / statistics.median(decode)
        print(f"decode: 256 tokens in {statistics.median(decode):.2f} s, {rate:.0f} tokens/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
