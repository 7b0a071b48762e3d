"""The routing benchmark in front of real vLLM replicas (CPU build, the tiny model).

`--replicas` (2 by default) replicas are started once (replica i pinned to core i modulo the
cores here, finite KV caches, serving the benchmark's model name); for every workload and
router every prefix cache is emptied
(`POST /reset_prefix_cache`, which `VLLM_SERVER_DEV_MODE=1` opens), the router is started in
front and the workload driven through it with `ignore_eos` (fixed answer lengths). One table:
prompt and prefilled tokens and hit rate from the replicas' own `cached_tokens`, requests per
replica (max/mean, from `vllm:request_success_total`), TTFT p50/p99, and for our gateway the
matched tokens it predicted against the cached tokens the replicas reported.

Routers: `prefix` (characters, the default), `prefix-tokens` (`--tokenizer` with the model
and `--engine-block-size`), `prefix-events` (and `--kv-events`: the replicas publish their
cache events on ipc sockets), any other policy of ours by name, and the peers of
loadtest/peers.py (`sglang-cache_aware`, `vllm-router-cache_aware`, and `vllm-router-kv_aware`,
which reads the replicas' KV-cache events). The workloads are the emulator benchmark's shapes
with every text cut to `--words` of its words (the tiny model's context is 4,096 tokens).

    flock /tmp/real-vllm.lock python loadtest/real_benchmark.py --workloads conversation \\
        --routers prefix,prefix-tokens --kv-cache-mib 64
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import random
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engines.fleet import VLLMFleet, model_folder
from engines.kv_events import events_config
from engines.replica import MIB, VLLMReplica, metric_samples
from engines.tiny_model import ensure_model
from engines.venv import VLLMVenv
from loadtest.benchmark import MODEL, drive, percentile, summarise
from loadtest.peers import PEERS, peer_versions, start_peer
from prefix_gateway.processes import free_port
from prefix_gateway.workloads import SHAPES, Session, build_workload
from tests.support import GatewayProcess

BLOCK = 32
TOKEN_KV_BYTES = 2048
"""The tiny model's KV cache per token (4 layers, 2 KV heads of 64, bfloat16, K and V)."""
TOKENIZER_ROUTERS = {"prefix-tokens": "prefix", "prefix-events": "prefix"}


def shorten(session: Session, share: float) -> Session:
    """The session with each text cut to its first `share` of words."""

    def cut(text: str) -> str:
        words = text.split(" ")
        return " ".join(words[: max(1, round(len(words) * share))])

    return dataclasses.replace(
        session, system=cut(session.system), questions=tuple(cut(q) for q in session.questions)
    )


def gateway_args(router: str, model: Path) -> list[str]:
    policy = TOKENIZER_ROUTERS.get(router, router)
    args = ["--policy", policy]
    if router in TOKENIZER_ROUTERS:
        args += ["--tokenizer", str(model), "--engine-block-size", str(BLOCK)]
    if router == "prefix-events":
        args.append("--kv-events")
    return args


def metric_sum(text: str, name: str) -> float:
    return sum(value for _, value in metric_samples(text, name))


def reset_caches(replicas: list[VLLMReplica]) -> None:
    for replica in replicas:
        httpx.post(replica.url + "/reset_prefix_cache", timeout=30).raise_for_status()


def warm_up(replicas: list[VLLMReplica]) -> None:
    """A few prompts of growing length on every replica before anything is measured: a CPU
    engine's first batches of each size run slower, which would land on the first router."""
    rng = random.Random(0)
    for replica in replicas:
        for words in (50, 200, 500, 900):
            prompt = " ".join(rng.choice(("alpha", "beta", "gamma", "delta")) for _ in range(words))
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 8,
                "ignore_eos": True,
            }
            response = httpx.post(replica.url + "/v1/chat/completions", json=body, timeout=120)
            response.raise_for_status()


def finished(replicas: list[VLLMReplica]) -> list[float]:
    return [replica.metric("vllm:request_success_total") for replica in replicas]


def run_one(
    args: argparse.Namespace,
    replicas: list[VLLMReplica],
    kv_events: list[str],
    model: Path,
    workload: str,
    router: str,
    repetition: int,
) -> dict[str, object]:
    sessions = [
        shorten(session, args.words) for session in build_workload(workload, args.seed, args.scale)
    ]
    urls = [replica.url for replica in replicas]
    reset_caches(replicas)
    predicted = observed = None
    with contextlib.ExitStack() as stack:
        if router in PEERS:
            events = dict(zip(urls, kv_events, strict=True))
            peer = start_peer(router, urls, MODEL, kv_events=events, kv_block_size=BLOCK)
            stack.callback(peer.stop)
            url = peer.router.url
            gateway = None
        else:
            gateway = stack.enter_context(GatewayProcess(urls, *gateway_args(router, model)))
            url = gateway.url
        before = finished(replicas)
        extra: dict[str, object] = {"ignore_eos": True}
        run = asyncio.run(drive(url, sessions, args.concurrency, args.stagger, extra))
        after = finished(replicas)
        if gateway is not None:
            text = gateway.metrics()
            predicted = metric_sum(text, "gateway_matched_tokens_predicted_total")
            observed = metric_sum(text, "gateway_upstream_cached_tokens_total")
    counts = [end - start for start, end in zip(before, after, strict=True)]
    row = summarise(workload, router, run, counts)
    # With a hundred requests p99 is the slowest one: p90 says more about the rest.
    ttfts = [outcome.ttft * 1000 for outcome in run.outcomes if outcome.status == 200]
    row["ttft_p90"] = percentile(ttfts, 0.9)
    row["predicted"], row["observed"] = predicted, observed
    row["run"] = repetition
    print(f"done: {workload} / {router} (run {repetition})", file=sys.stderr, flush=True)
    return row


def print_table(rows: list[dict[str, object]]) -> None:
    print(
        "| workload | run | router | requests | failed | prompt tok | prefilled tok | hit rate "
        "| max/mean req | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms |"
    )
    print("|" + "---|" * 12)
    for row in rows:
        print(
            f"| {row['workload']} | {row['run']} | {row['policy']} | {row['requests']} "
            f"| {row['failed']} "
            f"| {row['prompt']:,} | {row['prefilled']:,} | {row['hit_rate']:.1%} "
            f"| {row['max_mean']:.2f} | {row['ttft_p50']:.0f} | {row['ttft_p90']:.0f} "
            f"| {row['ttft_p99']:.0f} |",
            flush=True,
        )


def print_predictions(rows: list[dict[str, object]]) -> None:
    print(
        "| workload | run | router | predicted matched tok | cached tok reported "
        "| predicted / reported |"
    )
    print("|" + "---|" * 6)
    for row in rows:
        predicted, observed = row["predicted"], row["observed"]
        if not isinstance(predicted, float) or not isinstance(observed, float):
            continue
        ratio = f"{predicted / observed:.3f}" if observed else "-"
        print(
            f"| {row['workload']} | {row['run']} | {row['policy']} | {predicted:,.0f} "
            f"| {observed:,.0f} "
            f"| {ratio} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(SHAPES))
    parser.add_argument("--routers", default="prefix,prefix-tokens,round_robin")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--scale", type=float, default=0.25, help="share of sessions kept")
    parser.add_argument("--words", type=float, default=0.25, help="share of words kept")
    parser.add_argument("--stagger", type=float, default=0.2)
    parser.add_argument("--kv-cache-mib", type=int, default=16)
    parser.add_argument(
        "--runs", type=int, default=1, help="repetitions; each starts the routers one later"
    )
    parser.add_argument(
        "--replicas", type=int, default=2, help="replicas, pinned to the cores in turn"
    )
    args = parser.parse_args()
    venv = VLLMVenv().ensure()
    model = ensure_model(venv.python, model_folder())
    logs = Path(tempfile.mkdtemp(prefix="real-bench-"))
    cores = os.cpu_count() or 1
    # KV events on tcp:// (vLLM's router takes no other scheme; our gateway reads either), and
    # the render endpoints vLLM's router tokenizes through (--enable-scale-out).
    events = [f"tcp://127.0.0.1:{free_port()}" for _ in range(args.replicas)]
    replicas = [
        VLLMReplica(
            model,
            venv=venv,
            served_model_names=(MODEL,),
            block_size=BLOCK,
            kv_cache_bytes=args.kv_cache_mib * MIB,
            cpu_cores=str(index % cores),
            env={"VLLM_SERVER_DEV_MODE": "1"},
            extra_args=("--kv-events-config", events_config(events[index]), "--enable-scale-out"),
            log_path=logs / f"replica-{index}.log",
        )
        for index in range(args.replicas)
    ]
    print(
        f"# {args.replicas} real vLLM replicas (tiny model, {BLOCK}-token blocks, "
        f"{args.kv_cache_mib} MiB KV "
        f"cache = {args.kv_cache_mib * MIB // TOKEN_KV_BYTES // BLOCK} blocks each); "
        f"{args.concurrency} concurrent sessions started {args.stagger} s apart; seed "
        f"{args.seed}, sessions x{args.scale}, words x{args.words}"
        + (f"; peers: {peers}" if (peers := peer_versions(args.routers.split(","))) else ""),
        flush=True,
    )
    rows = []
    workloads, routers = args.workloads.split(","), args.routers.split(",")
    with VLLMFleet(replicas) as fleet:
        warm_up(fleet.replicas)
        for workload in workloads:
            for repetition in range(1, args.runs + 1):
                # Each repetition starts one router later, so none is always first or last.
                shift = (repetition - 1) % len(routers)
                for router in routers[shift:] + routers[:shift]:
                    rows.append(
                        run_one(args, fleet.replicas, events, model, workload, router, repetition)
                    )
    rows.sort(
        key=lambda row: (workloads.index(str(row["workload"])), routers.index(str(row["policy"])))
    )
    print_table(rows)
    print()
    print_predictions(rows)


if __name__ == "__main__":
    main()
