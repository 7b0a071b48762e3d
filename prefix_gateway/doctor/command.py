"""`prefix-gateway doctor`: the checks run once against every replica the same flags as
`serve` name (static, or discovered once through DNS or Kubernetes), one line per check and
replica, exit 0 when none failed."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import shlex
import sys
from typing import TextIO

from prefix_gateway import config as gateway_config
from prefix_gateway.backends.backend import Backend
from prefix_gateway.backends.discovery import Discovery
from prefix_gateway.backends.kv_events import KVEventFeeds
from prefix_gateway.backends.pool import BackendPool
from prefix_gateway.components import probe_client
from prefix_gateway.config import Settings
from prefix_gateway.doctor.examination import Doctor
from prefix_gateway.doctor.verdicts import CheckResult, Status
from prefix_gateway.emulator.replicas import EmulatedReplicas
from prefix_gateway.metrics import Metrics
from prefix_gateway.prompt.tokens import EngineTokenizer

DESCRIPTION = """\
Probe every replica as `serve` with the same flags would route to it, and print one line per
check and replica:
  reachable               GET /health answers 200
  models                  /v1/models lists a model (the one given as MODEL=URL, if so)
  load-metrics            /metrics has the engine series the gateway reads (running and waiting
                          requests, KV-cache usage, generated tokens)
  prefix-caching          a repeated prompt is served from the engine's prefix cache
  cached-tokens-reported  answers carry usage.prompt_tokens_details.cached_tokens
  token-agreement         the cached tokens routing predicts for a repeated prompt are those the
                          engine reports; else which of tokenizer, chat template or block size
                          differs
  kv-events               (with --kv-events) the engine's event feed tells of the probe's blocks
  cache-salt              (with --isolate-tenants) a repeat under another cache_salt is no hit
Exit status: 0 when no check failed, 1 otherwise, 2 for unusable flags. The probes go to the
replicas directly; each costs a few short prompts of one generated token. Replicas are those of
--backend, --backend-dns and --k8s-service, and --emulate N starts N emulated ones (with
--emulate-model and --emulate-args) for the doctor to examine and stop. See docs/doctor.md."""


def main(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    try:
        settings = gateway_config.load_settings(args)
        tokenizer = EngineTokenizer.load(settings.tokenizer) if settings.tokenizer else None
    except (gateway_config.ConfigError, OSError) as exc:
        print(f"prefix-gateway: {exc}", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        if settings.emulate > 0:
            fleet = stack.enter_context(_emulated(settings))
            settings = dataclasses.replace(settings, backend=(*settings.backend, *fleet.urls))
        examined = asyncio.run(examine_fleet(settings, tokenizer))
    if not examined:
        print("no replica to examine: none given, none discovered", file=out)
        return 1
    width = max(len(backend.name) for backend, _ in examined)
    failures = 0
    for backend, results in examined:
        for result in results:
            failures += result.status is Status.FAIL
            print(format_line(backend.name, result, width), file=out)
    checks = sum(len(results) for _, results in examined)
    if failures:
        print(f"{failures} of {checks} checks failed", file=out)
        return 1
    replicas = f"{len(examined)} replica{'s' if len(examined) > 1 else ''}"
    print(f"no check failed ({checks} on {replicas})", file=out)
    return 0


def format_line(backend: str, result: CheckResult, width: int) -> str:
    status = result.status.value.upper()
    return f"{status:<4}  {backend:<{width}}  {result.check.value:<22}  {result.detail}"


async def examine_fleet(
    settings: Settings, tokenizer: EngineTokenizer | None
) -> list[tuple[Backend, list[CheckResult]]]:
    pool = BackendPool.from_specs(settings.backend)
    discovery = Discovery.build(settings, pool, _no_probe)
    await discovery.start()
    await discovery.stop()
    async with probe_client(settings) as client:
        feeds = None
        if settings.kv_events:
            feeds = KVEventFeeds(pool, client, settings.block_tokens, Metrics(), _ignored)
            feeds.start()
        try:
            doctor = Doctor(settings, client, tokenizer, feeds)
            examined = await asyncio.gather(*(doctor.examine(item) for item in pool.backends))
        finally:
            if feeds is not None:
                await feeds.stop()
    return list(zip(pool.backends, examined, strict=True))


def _emulated(settings: Settings) -> EmulatedReplicas:
    return EmulatedReplicas(
        settings.emulate,
        settings.emulate_model,
        shlex.split(settings.emulate_args),
        end_with_parent=True,
    )


async def _no_probe(backend: Backend) -> None:
    return None


def _ignored(backend: str, blocks: object) -> None:
    return None
