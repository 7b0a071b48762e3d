"""What a hostile tenant gets out of the gateway, row by row: budgets, the fair queue, memory.

Each row starts emulated replicas of this checkout and a fresh gateway in front of them (this
checkout's, or another checkout's with `--checkout`: only the gateway differs), sends what its
row says, and prints what it measured. Everything listens on 127.0.0.1; every process started
is stopped. A figure the gateway does not report is printed as "-".

    python loadtest/tenant_abuse.py
    python loadtest/tenant_abuse.py --checkout ../other-checkout
    python loadtest/tenant_abuse.py --rows cut-before-usage,burst-max-completion

Tokens "processed" are what the replicas' engines counted over the row (the change in
`vllm:prompt_tokens_total` plus `vllm:generation_tokens_total`); "allowed" is the most a budget
of 3,000 tokens a minute lets through in the same window: a full bucket plus 50 a second.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import math
import multiprocessing
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import httpx
import orjson
import yaml
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest import tenants as neighbours
from prefix_gateway.emulator.replicas import EmulatedReplicas
from tests.support import GatewayProcess, metric_value, stall

ROOT = Path(__file__).resolve().parents[1]
MODEL = neighbours.MODEL
TOKENS_PER_MINUTE = 3000
LIMITED = [{"name": "abuser", "api_key": "abuser-key", "tokens_per_minute": TOKENS_PER_MINUTE}]
TWO_TENANTS = [{"name": "a", "api_key": "a-key"}, {"name": "b", "api_key": "b-key"}]
MB = 1_000_000
MIB = 2**20

Quiet = TypeVar("Quiet")
Flooded = TypeVar("Flooded")


@dataclass(frozen=True)
class Options:
    checkout: str | None
    """The checkout whose gateway runs (None: this one)."""
    prefill_us: float
    """Microseconds of prefill per prompt token in the quiet-tail row's replicas."""
    document_words: int = 0
    """Words of a document of its own in each of B's questions in the quiet-tail row."""


@dataclass(frozen=True)
class Row:
    name: str
    sends: str
    measure: Callable[[Options], str]
    """Runs the row; what it measured."""


# --- processes -------------------------------------------------------------------------------


@contextlib.contextmanager
def fleet(
    count: int,
    emulator: Sequence[str],
    tenants: list[dict[str, Any]],
    checkout: str | None,
    *gateway_args: str,
) -> Iterator[tuple[EmulatedReplicas, GatewayProcess]]:
    """`count` emulated replicas of this checkout, and a gateway of `checkout` with `tenants`
    in front of them; both stopped on leaving."""
    with contextlib.ExitStack() as stack:
        replicas = stack.enter_context(EmulatedReplicas(count, MODEL, emulator))
        folder = stack.enter_context(tempfile.TemporaryDirectory())
        config = Path(folder) / "gateway.yaml"
        config.write_text(yaml.safe_dump({"tenants": tenants}))
        gateway = GatewayProcess(
            replicas.urls, "--config", str(config), *gateway_args, checkout=checkout
        )
        yield replicas, stack.enter_context(gateway)


def engine_tokens(replicas: EmulatedReplicas) -> float:
    """Prompt and generated tokens the replicas' engines have processed so far."""
    total = 0.0
    for replica in replicas.replicas:
        text = replica.metrics_text()
        total += metric_value(text, "vllm:prompt_tokens_total")
        total += metric_value(text, "vllm:generation_tokens_total")
    return total


def engine_requests(replicas: EmulatedReplicas) -> Counter[str]:
    """Requests the replicas' engines have finished so far, by finished reason: "abort" for
    those cut short, while running or waiting in the engine."""
    found: Counter[str] = Counter()
    for replica in replicas.replicas:
        for reason in ("stop", "length", "abort"):
            value = replica.metric("vllm:request_success_total", finished_reason=reason)
            found[reason] += int(value)
    return found


def wait_idle(replicas: EmulatedReplicas, seconds: float = 30.0) -> None:
    """Until no engine runs or queues anything (what was cut short has been aborted)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        busy = 0.0
        for replica in replicas.replicas:
            text = replica.metrics_text()
            busy += metric_value(text, "vllm:num_requests_running")
            busy += metric_value(text, "vllm:num_requests_waiting")
        if not busy:
            return
        time.sleep(0.1)


def rejections(gateway: GatewayProcess) -> Counter[str]:
    """What the gateway answered on its own account so far, by status and error code."""
    found: Counter[str] = Counter()
    for family in text_string_to_metric_families(gateway.metrics_text()):
        for sample in family.samples:
            if sample.name == "gateway_rejected_requests_total" and sample.value:
                labels = sample.labels
                found[f"{labels.get('status')} {labels.get('code')}"] += int(sample.value)
    return found


def tenant_of(gateway: GatewayProcess, name: str) -> dict[str, Any]:
    """Tenant `name` as `/admin/tenants` shows it (empty if it is not shown)."""
    try:
        answer = httpx.get(gateway.url + "/admin/tenants", timeout=30)
    except httpx.HTTPError:
        return {}
    if answer.status_code != 200:
        return {}
    for tenant in answer.json().get("data", []):
        if tenant.get("name") == name:
            found: dict[str, Any] = tenant
            return found
    return {}


def field(view: dict[str, Any], *path: str) -> Any:
    """`view[path[0]][path[1]]...`, or None where the gateway does not report it."""
    value: Any = view
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def vm_kib(pid: int, name: str) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {name} in /proc/{pid}/status")


# --- formatting ------------------------------------------------------------------------------


def number(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def tally(counts: Counter[str]) -> str:
    return ", ".join(f"{key} ×{count:,}" for key, count in sorted(counts.items())) or "none"


def budget_figures(processed: float, seconds: float) -> str:
    allowed = TOKENS_PER_MINUTE + TOKENS_PER_MINUTE / 60 * seconds
    return (
        f"processed {number(processed)} tokens in {seconds:.1f} s against {number(allowed)}"
        f" allowed: **{processed / allowed:.2f}x**"
    )


def tenant_figures(view: dict[str, Any]) -> str:
    """The tenant's remaining token budget and token counters, as the gateway shows them."""
    remaining = field(view, "budgets", "tokens", "remaining")
    counted = [field(view, "tokens", kind) for kind in ("prompt", "cached", "completion")]
    counters = "-" if None in counted else "/".join(number(value) for value in counted)
    return f"budget left {number(remaining)}; counted prompt/cached/completion {counters}"


def percentile(values: list[float], share: float) -> float:
    """The nearest-rank percentile (`share` in 0..1) of `values`, not empty."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


def latencies(values: list[float]) -> str:
    if not values:
        return "n 0"
    p50 = statistics.median(values) * 1000
    p99 = percentile(values, 0.99) * 1000
    return f"n {len(values)}, p50 {p50:,.0f} ms, p99 {p99:,.0f} ms"


# --- clients ---------------------------------------------------------------------------------


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def http_client() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=300)
    )


async def refused_wait(response: aiohttp.ClientResponse) -> None:
    """A client that honours Retry-After (capped at a second, so the row keeps trying)."""
    await response.read()
    wait = response.headers.get("retry-after-ms")
    await asyncio.sleep(min(1.0, int(wait) / 1000) if wait and wait.isdigit() else 0.2)


async def chat_loop(
    url: str, body_of: Callable[[int], dict[str, Any]], seconds: float, stop_after: int | None
) -> tuple[Counter[str], float]:
    """One client sending streamed chat requests one after another for `seconds`, reading each
    to its end or (`stop_after`) hanging up after that many content events: the statuses, and
    the seconds from the first request to the end of the last."""
    statuses: Counter[str] = Counter()
    began = time.monotonic()
    turn = 0
    async with http_client() as client:
        while time.monotonic() - began < seconds:
            url_path = url + "/v1/chat/completions"
            async with client.post(url_path, json=body_of(turn), headers=auth("abuser-key")) as r:
                statuses[str(r.status)] += 1
                if r.status != 200:
                    await refused_wait(r)
                else:
                    events = 0
                    async for line in r.content:
                        if line.startswith(b"data: {") and b'"content"' in line:
                            events += 1
                            if stop_after is not None and events >= stop_after:
                                r.close()  # the client hangs up: no usage chunk read
                                break
            turn += 1
    return statuses, time.monotonic() - began


async def burst(url: str, bodies: list[dict[str, Any]]) -> tuple[Counter[str], list[str], float]:
    """`bodies` sent at once as non-streamed chat requests: their statuses, the error messages
    of those refused, and the seconds until the last answer."""
    began = time.monotonic()
    async with http_client() as client:

        async def one(body: dict[str, Any]) -> tuple[str, str]:
            url_path = url + "/v1/chat/completions"
            async with client.post(url_path, json=body, headers=auth("abuser-key")) as r:
                text = await r.text()
                message = ""
                if r.status != 200:
                    with contextlib.suppress(ValueError):
                        message = str(field(orjson.loads(text), "error", "message") or "")
                return str(r.status), message

        answers = await asyncio.gather(*(one(body) for body in bodies))
    statuses = Counter(status for status, _ in answers)
    return statuses, [message for _, message in answers if message], time.monotonic() - began


async def first_token(client: aiohttp.ClientSession, url: str, key: str, turn: int) -> float:
    """Seconds to the first content of a short streamed question; read to its end."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"quick question {turn}?"}],
        "max_tokens": 16,
        "stream": True,
    }
    began = time.perf_counter()
    waited = 0.0
    async with client.post(url + "/v1/chat/completions", json=body, headers=auth(key)) as r:
        if r.status != 200:
            await r.read()
            raise RuntimeError(str(r.status))
        async for line in r.content:
            if not waited and line.startswith(b"data: {") and b'"content"' in line:
                waited = time.perf_counter() - began
    return waited


async def quiet(url: str, key: str, seconds: float, timeout: float) -> list[tuple[str, float]]:
    """One short question at a time, 0.2 s apart, for `seconds`: each one's outcome ("200",
    another status, "timeout", "error") and time to first token (0 unless answered)."""
    found: list[tuple[str, float]] = []
    turn = 0
    until = time.monotonic() + seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as client:
        while time.monotonic() < until:
            try:
                found.append(("200", await first_token(client, url, key, turn)))
            except RuntimeError as refusal:
                found.append((str(refusal), 0.0))
            except TimeoutError:
                found.append(("timeout", 0.0))
            except aiohttp.ClientError:
                found.append(("error", 0.0))
            turn += 1
            await asyncio.sleep(0.2)
    return found


def quiet_client(url: str, key: str, seconds: float, timeout: float) -> list[tuple[str, float]]:
    """`quiet` in the process it is called in: a second tenant's client is a program of its
    own, so reading the first tenant's answers does not delay the reading of its own."""
    return asyncio.run(quiet(url, key, seconds, timeout))


@contextlib.contextmanager
def client_process() -> Iterator[ProcessPoolExecutor]:
    """A process for the quiet tenant's client, already started (it takes a second)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        pool.submit(os.getpid).result()
        yield pool


# --- rows: budgets ---------------------------------------------------------------------------


def cut_before_usage(options: Options) -> str:
    checkout = options.checkout
    emulator = ["--decode-ms-per-token", "5"]
    with fleet(1, emulator, LIMITED, checkout) as (replicas, gateway):

        def body(turn: int) -> dict[str, Any]:
            return {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"story {turn}: tell me one"}],
                "max_tokens": 200,
                "stream": True,
                "stream_options": {"include_usage": True},
            }

        before = engine_tokens(replicas)
        statuses, seconds = asyncio.run(chat_loop(gateway.url, body, 15.0, 3))
        wait_idle(replicas)
        processed = engine_tokens(replicas) - before
        view = tenant_of(gateway, "abuser")
    return f"{budget_figures(processed, seconds)}; {tenant_figures(view)}; {tally(statuses)}"


def no_include_usage(options: Options) -> str:
    checkout = options.checkout
    # A context of 2,048 tokens, and no default of the emulator's own below it: as vLLM, a
    # request without a limit generates until the context is full.
    emulator = ["--cache-blocks", "128", "--default-max-tokens", "1000000"]
    with fleet(1, emulator, LIMITED, checkout) as (replicas, gateway):

        def body(turn: int) -> dict[str, Any]:
            content = f"essay {turn}: write a long one"
            return {"model": MODEL, "messages": [{"role": "user", "content": content}],
                    "stream": True}  # fmt: skip

        before = engine_tokens(replicas)
        statuses, seconds = asyncio.run(chat_loop(gateway.url, body, 6.0, None))
        wait_idle(replicas)
        processed = engine_tokens(replicas) - before
        view = tenant_of(gateway, "abuser")
    return f"{budget_figures(processed, seconds)}; {tenant_figures(view)}; {tally(statuses)}"


def limited_burst(checkout: str | None, bodies: list[dict[str, Any]]) -> str:
    """`bodies` at once from a tenant with a full budget: the statuses, what the refusals
    said was requested, and the tokens processed against those allowed."""
    with fleet(1, [], LIMITED, checkout) as (replicas, gateway):
        before = engine_tokens(replicas)
        statuses, messages, seconds = asyncio.run(burst(gateway.url, bodies))
        wait_idle(replicas)
        processed = engine_tokens(replicas) - before
        view = tenant_of(gateway, "abuser")
    requested = sorted(
        {int(found) for m in messages for found in re.findall(r"requested (\d+)", m)}
    )
    asked = ", ".join(f"{value:,}" for value in requested) or "-"
    others = sorted({m for m in messages if "requested" not in m})
    said = f"; replica said: {others[0][:80]}" if others else ""
    return (
        f"{tally(statuses)}; reservation in the 429 message: {asked}{said};"
        f" {budget_figures(processed, seconds)}; {tenant_figures(view)}"
    )


def question(turn: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"report {turn}: write it"}]


def burst_max_completion(options: Options) -> str:
    checkout = options.checkout
    bodies = [
        {"model": MODEL, "messages": question(turn), "max_tokens": 1,
         "max_completion_tokens": 2000}
        for turn in range(24)
    ]  # fmt: skip
    return limited_burst(checkout, bodies)


def lenient_limits(options: Options) -> str:
    checkout = options.checkout
    found = []
    for label, limits in (
        ('`max_tokens: "2000"`', {"max_tokens": "2000"}),
        ("`max_tokens: 2000.0`", {"max_tokens": 2000.0}),
        ("`max_tokens: 600, n: 4`", {"max_tokens": 600, "n": 4}),
    ):
        bodies = [{"model": MODEL, "messages": question(turn), **limits} for turn in range(8)]
        found.append(f"{label}: {limited_burst(checkout, bodies)}")
    return "<br>".join(found)


# --- rows: the fair queue --------------------------------------------------------------------


async def stored_roots(client: aiohttp.ClientSession, url: str) -> list[str]:
    """Responses stored by tenant A, on as many replicas as will hold one (up to 16 tries)."""
    by_replica: dict[str, str] = {}
    for turn in range(16):
        body = {"model": MODEL, "input": f"shop {turn}: which aisle?", "max_output_tokens": 16}
        async with client.post(url + "/v1/responses", json=body, headers=auth("a-key")) as r:
            answer = await r.json()
            by_replica.setdefault(r.headers.get("x-gateway-backend", ""), answer["id"])
        if len(by_replica) >= 2:
            break
    return list(by_replica.values())


async def follow_ups(url: str, width: int, stop: asyncio.Event) -> tuple[Counter[str], int]:
    """`width` loops of tenant A sending follow-ups of its stored responses until `stop`: their
    statuses, and on how many replicas the responses they follow are stored."""
    statuses: Counter[str] = Counter()
    rng = random.Random(1)
    async with http_client() as client:
        roots = await stored_roots(client, url)

        async def lane(number: int) -> None:
            turn = 0
            while not stop.is_set():
                body = {
                    "model": MODEL,
                    "previous_response_id": roots[(number + turn) % len(roots)],
                    "input": f"and aisle {number}.{turn}?",
                    "max_output_tokens": rng.randint(64, 256),
                    "store": False,  # the stored root stays among the responses a replica keeps
                }
                async with client.post(
                    url + "/v1/responses", json=body, headers=auth("a-key")
                ) as r:
                    await r.read()
                    statuses[str(r.status)] += 1
                turn += 1

        await asyncio.gather(*(lane(number) for number in range(width)))
    return statuses, len(roots)


async def beside(
    pool: ProcessPoolExecutor,
    quiet_run: Callable[[], list[Quiet]],
    flood: Callable[[asyncio.Event], Coroutine[Any, Any, Flooded]],
) -> tuple[list[Quiet], Flooded]:
    """B's client (`quiet_run`, in its own process) started 2 s into `flood(stop)`, so that
    the flood has filled the replicas first; the flood stopped once B is done."""
    stop = asyncio.Event()
    flooding = asyncio.create_task(flood(stop))
    await asyncio.sleep(2)
    found = await asyncio.get_running_loop().run_in_executor(pool, quiet_run)
    stop.set()
    return found, await flooding


def follow_up_flood(options: Options) -> str:
    checkout = options.checkout
    emulator = ["--max-running", "8", "--decode-ms-per-token", "4"]
    gateway_args = ["--max-inflight-per-replica", "8", "--queue-timeout", "600"]
    gateway_args += ["--max-queue", "4096", "--max-concurrency", "4096"]
    with (
        fleet(2, emulator, TWO_TENANTS, checkout, *gateway_args) as (_, gateway),
        client_process() as pool,
    ):
        alone = pool.submit(quiet_client, gateway.url, "b-key", 8.0, 60.0).result()

        async def flood(stop: asyncio.Event) -> tuple[Counter[str], int]:
            return await follow_ups(gateway.url, 128, stop)

        quiet_run = functools.partial(quiet_client, gateway.url, "b-key", 12.0, 60.0)
        found, (statuses, roots) = asyncio.run(beside(pool, quiet_run, flood))
    return (
        f"B alone: {latencies([t for s, t in alone if s == '200'])};"
        f" beside A's follow-ups: **{latencies([t for s, t in found if s == '200'])}**;"
        f" B not answered {sum(s != '200' for s, _ in found)}; A's follow-ups {tally(statuses)},"
        f" of responses stored on {roots} replicas"
    )


def quiet_tail(options: Options) -> str:
    checkout = options.checkout
    emulator = ["--max-running", str(neighbours.SLOTS), "--decode-ms-per-token", "4"]
    emulator += ["--prefill-us-per-token", str(options.prefill_us)]
    gateway_args = ["--max-inflight-per-replica", str(neighbours.SLOTS), "--queue-timeout", "600"]
    gateway_args += ["--max-queue", "4096", "--max-concurrency", "4096"]
    width, seconds = 8 * 2 * neighbours.SLOTS, 15.0
    with (
        fleet(2, emulator, TWO_TENANTS, checkout, *gateway_args) as (_, gateway),
        client_process() as pool,
    ):
        document = options.document_words
        alone = pool.submit(
            neighbours.steady_client, gateway.url, "b-key", seconds, document
        ).result()

        async def flood(stop: asyncio.Event) -> None:
            async with http_client() as client:
                # tenants.py's flood runs to a deadline: past B's last request, then
                # stopped when B is done.
                until = time.monotonic() + 2 + seconds + 30
                flooding = asyncio.create_task(
                    neighbours.flood(client, gateway.url, "a-key", width, until, 1)
                )
                await stop.wait()
                flooding.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await flooding

        quiet_run = functools.partial(
            neighbours.steady_client, gateway.url, "b-key", seconds, document
        )
        near, _ = asyncio.run(beside(pool, quiet_run, flood))
    ratio = percentile(near, 0.99) / percentile(alone, 0.99)
    return (
        f"prefill {options.prefill_us:g} µs a prompt token, B's question about a document of"
        f" {options.document_words} words; B alone: {latencies(alone)};"
        f" beside A ({width} in flight): {latencies(near)}; p99 beside / alone **{ratio:.2f}x**"
    )


# --- rows: memory and the queue's dead ------------------------------------------------------


async def send_and_hold(
    host: str, port: int, payload: bytes, release: asyncio.Event, sent: asyncio.Event
) -> str:
    """`payload` sent on a connection of its own (`sent` set once it is written), then the
    connection held until an answer comes or `release`: the status answered, "held" if none
    came, "closed" if the gateway closed the connection without an answer that could be read.
    """
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        sent.set()
        return "not connected"
    try:
        with contextlib.suppress(ConnectionError):
            # Refused before the body was in, the answer may still be there to read.
            writer.write(payload)
            await writer.drain()
        sent.set()
        answer = asyncio.ensure_future(reader.read(64))
        released = asyncio.ensure_future(release.wait())
        await asyncio.wait((answer, released), return_when=asyncio.FIRST_COMPLETED)
        released.cancel()
        if not answer.done():
            answer.cancel()
            return "held"
        head = answer.result()
        return head.split(b" ", 2)[1].decode() if head.startswith(b"HTTP/1.1 ") else "closed"
    except ConnectionError:
        return "closed"
    finally:
        sent.set()
        writer.close()


def raw_request(body: bytes, key: str) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json"
        b"\r\nauthorization: Bearer %s\r\ncontent-length: %d\r\n\r\n" % (key.encode(), len(body))
    ) + body


def queued_bodies(options: Options) -> str:
    checkout = options.checkout
    gateway_args = ["--max-inflight-per-replica", "1", "--max-pending-body-bytes", str(32 * MIB)]
    # The held request never gets a token: not a stall to act on, here.
    gateway_args += ["--queue-timeout", "60", "--stall-seconds", "600"]
    small = orjson.dumps({"model": MODEL, "messages": question(0), "max_tokens": 8})
    # 7 MB of JSON whitespace in a valid request: read and held, cheap to parse.
    padding = 7 * MB - len(small)
    large = raw_request(small[:-1] + b" " * padding + b"}", "a-key")
    with fleet(1, [], TWO_TENANTS, checkout, *gateway_args) as (replicas, gateway):
        replica = replicas.replicas[0]
        stall(replica, True)
        try:
            host, port = gateway.host, gateway.port

            async def attack() -> tuple[Counter[str], Counter[str], float, float]:
                release = asyncio.Event()
                holding = send_and_hold(
                    host, port, raw_request(small, "b-key"), release, asyncio.Event()
                )
                holder = asyncio.create_task(holding)
                while not replica.metric("vllm:num_requests_running"):
                    await asyncio.sleep(0.05)
                rejected = rejections(gateway)
                before = vm_kib(gateway.pid, "VmRSS")
                with open(f"/proc/{gateway.pid}/clear_refs", "w", encoding="ascii") as refs:
                    refs.write("5")  # VmHWM starts again from VmRSS
                began = time.monotonic()
                bodies = []
                for _ in range(60):
                    # One after another, as a client with one connection per body would:
                    # each body is read whole before most of the next is.
                    sent = asyncio.Event()
                    bodies.append(
                        asyncio.create_task(send_and_hold(host, port, large, release, sent))
                    )
                    await sent.wait()
                seconds = time.monotonic() - began
                await asyncio.sleep(3)  # the gateway reads what is still in the sockets
                refusals = rejections(gateway) - rejected
                release.set()
                statuses = Counter(await asyncio.gather(*bodies))
                await asyncio.sleep(1)
                growth = (vm_kib(gateway.pid, "VmHWM") - before) / 1024
                await holder
                return statuses, refusals, growth, seconds

            statuses, refusals, growth, seconds = asyncio.run(attack())
        finally:
            stall(replica, False)
    return (
        f"peak RSS growth **{growth:,.0f} MiB**; sent in {seconds:.1f} s; what each got"
        f" before it was closed 3 s after the last: {tally(statuses)}; refused by the gateway's"
        f" count: {tally(refusals)}"
    )


async def abandoning(host: str, port: int, rate: float, seconds: float) -> Counter[str]:
    """Requests of tenant C at `rate` a second for `seconds`, each connection closed as soon as
    its request is sent."""
    body = orjson.dumps({"model": MODEL, "messages": question(0), "max_tokens": 64})
    payload = raw_request(body, "c-key")
    outcomes: Counter[str] = Counter()

    async def one() -> None:
        try:
            _, writer = await asyncio.open_connection(host, port)
            writer.write(payload)
            await writer.drain()
            writer.close()
            outcomes["sent"] += 1
        except OSError:
            outcomes["not sent"] += 1

    began = time.monotonic()
    sending: list[asyncio.Task[None]] = []
    for number in range(round(rate * seconds)):
        await asyncio.sleep(max(0.0, began + number / rate - time.monotonic()))
        sending.append(asyncio.create_task(one()))
    await asyncio.gather(*sending)
    return outcomes


async def filling(url: str, width: int, stop: asyncio.Event) -> Counter[str]:
    """Tenant A keeping the slots busy: `width` loops of 64-token answers until `stop`."""
    statuses: Counter[str] = Counter()
    async with http_client() as client:

        async def lane(number: int) -> None:
            turn = 0
            while not stop.is_set():
                body = {"model": MODEL, "messages": question(number * 10_000 + turn),
                        "max_tokens": 64}  # fmt: skip
                async with client.post(
                    url + "/v1/chat/completions", json=body, headers=auth("a-key")
                ) as r:
                    await r.read()
                    statuses[str(r.status)] += 1
                    if r.status != 200:
                        await asyncio.sleep(0.1)
                turn += 1

        await asyncio.gather(*(lane(number) for number in range(width)))
    return statuses


def abandoned_queued(options: Options) -> str:
    checkout = options.checkout
    emulator = ["--max-running", "4", "--decode-ms-per-token", "5"]
    tenants = [*TWO_TENANTS, {"name": "c", "api_key": "c-key"}]
    # The queue's own bounds at their defaults (--max-queue 512, --queue-timeout 5).
    with (
        fleet(2, emulator, tenants, checkout, "--max-inflight-per-replica", "4") as (
            replicas,
            gateway,
        ),
        client_process() as pool,
    ):
        before = engine_requests(replicas)
        rejected = rejections(gateway)

        async def run() -> tuple[list[tuple[str, float]], Counter[str], Counter[str], int]:
            stop = asyncio.Event()
            filler = asyncio.create_task(filling(gateway.url, 16, stop))
            await asyncio.sleep(1)
            attack = asyncio.create_task(abandoning(gateway.host, gateway.port, 300, 10))
            quiet_run = functools.partial(quiet_client, gateway.url, "b-key", 9.0, 10.0)
            quiet_b = asyncio.get_running_loop().run_in_executor(pool, quiet_run)
            peak = 0
            while not attack.done():
                view = await asyncio.to_thread(tenant_of, gateway, "c")
                peak = max(peak, int(view.get("waiting") or 0))
                await asyncio.sleep(0.5)
            found = await quiet_b
            stop.set()
            return found, await filler, await attack, peak

        found, filled, sent, peak_waiting = asyncio.run(run())
        wait_idle(replicas)
        ended = engine_requests(replicas) - before
        refusals = rejections(gateway) - rejected
    answered_b = sum(status == "200" for status, _ in found)
    # Every request that reached an engine ends there once: answered whole ("length"), or cut
    # short or dropped while it waited there ("abort"). The filler's and B's were all read
    # whole; the rest are the attacker's.
    ran = ended["length"] + ended["stop"] - filled["200"] - answered_b
    return (
        f"B answered within 10 s: **{answered_b}/{len(found)}**"
        f" ({tally(Counter(status for status, _ in found))}); abandoned requests {tally(sent)},"
        f" reaching a replica: **{number(ran + ended['abort'])}** (run to their end {ran:,},"
        f" cut {ended['abort']:,}); C waiting at most {peak_waiting:,} (sampled every 0.5 s);"
        f" the gateway's refusals: {tally(refusals)}; A (keeping the slots busy): {tally(filled)}"
    )


ROWS = [
    Row(
        "cut-before-usage",
        f"{TOKENS_PER_MINUTE:,} tokens/min; for 15 s one client sends streams with"
        " `include_usage` and `max_tokens: 200`, reads 3 content events and hangs up before the"
        " usage chunk (5 ms a token)",
        cut_before_usage,
    ),
    Row(
        "no-include-usage",
        f"{TOKENS_PER_MINUTE:,} tokens/min; for 6 s one client sends streams without"
        " `include_usage` and without `max_tokens`, read to the end (context 2,048 tokens, which"
        " the engine fills as vLLM does)",
        no_include_usage,
    ),
    Row(
        "burst-max-completion",
        f"{TOKENS_PER_MINUTE:,} tokens/min; 24 requests at once with `max_tokens: 1` and"
        " `max_completion_tokens: 2000`",
        burst_max_completion,
    ),
    Row(
        "lenient-limits",
        f"{TOKENS_PER_MINUTE:,} tokens/min; 8 requests at once, each variant on a fresh gateway"
        " (the emulated engine serves n=1 only: it answers `n: 4` with a 400)",
        lenient_limits,
    ),
    Row(
        "follow-up-flood",
        "2 replicas × 8 slots, 4 ms a token, `--max-inflight-per-replica 8`; A: 128 loops of"
        " `previous_response_id` follow-ups (64–256 tokens); B: one short streamed question at a"
        " time from its own process (8 s alone, 12 s beside)",
        follow_up_flood,
    ),
    Row(
        "queued-bodies",
        "`--max-pending-body-bytes` 32 MiB, `--max-inflight-per-replica 1`, its slot held by a"
        " request on a stalled replica; 60 bodies of 7 MB sent one after another, each on a"
        " connection of its own, all closed 3 s after the last",
        queued_bodies,
    ),
    Row(
        "abandoned-queued",
        "2 replicas × 4 slots, 5 ms a token, `--max-inflight-per-replica 4`, queue defaults;"
        " A keeps 16 requests of 64 tokens going; C sends 300 requests/s for 10 s, each"
        " connection closed once sent; B one question at a time (10 s timeout)",
        abandoned_queued,
    ),
    Row(
        "quiet-tail",
        "loadtest/tenants.py's noisy neighbour: 2 replicas × 8 slots, 4 ms a token, flow"
        " control at 8; A keeps 128 streams (64–256 tokens) in flight, B one short question at"
        " a time from its own process, 15 s alone and 15 s beside",
        quiet_tail,
    ),
]


def describe(checkout: str) -> str:
    """The commit a checkout is at, and whether its tracked files were changed since."""

    def git(*args: str) -> str:
        found = subprocess.run(["git", "-C", checkout, *args], capture_output=True, text=True)
        return found.stdout.strip()

    changed = git("status", "--porcelain", "--untracked-files=no")
    return f"{git('rev-parse', '--short', 'HEAD')}{' with uncommitted changes' if changed else ''}"


def load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkout", help="run this checkout's gateway (default: this one's)")
    parser.add_argument("--rows", default=",".join(row.name for row in ROWS))
    parser.add_argument(
        "--prefill-us-per-token",
        type=float,
        default=0.0,
        help="quiet-tail: the replicas' prefill cost per prompt token (default: none, as in"
        " loadtest/tenants.py)",
    )
    parser.add_argument(
        "--document-words",
        type=int,
        default=0,
        help="quiet-tail: each of B's questions carries a document of this many words of its"
        " own (default: none)",
    )
    given = parser.parse_args()
    chosen = given.rows.split(",")
    unknown = set(chosen) - {row.name for row in ROWS}
    if unknown:
        parser.error(f"unknown rows: {', '.join(sorted(unknown))}")
    checkout = str(Path(given.checkout).resolve()) if given.checkout else None
    options = Options(checkout, given.prefill_us_per_token, given.document_words)
    # The replicas (and, without --checkout, the gateway) run from this checkout.
    os.chdir(ROOT)
    print(f"    python loadtest/tenant_abuse.py {' '.join(sys.argv[1:])}".rstrip())
    print(
        f"\ngateway: {checkout or ROOT} at {describe(checkout or str(ROOT))}; replicas: this"
        f" checkout at {describe(str(ROOT))}; {os.cpu_count()} cores; load average {load()}\n"
    )
    print("| row | what was sent | measured | load average before |")
    print("| --- | --- | --- | --- |")
    for row in ROWS:
        if row.name in chosen:
            before = load()
            try:
                measured = row.measure(options)
            except Exception as failure:  # the other rows are still worth measuring
                measured = f"failed: {type(failure).__name__}: {failure}"
            print(f"| {row.name} | {row.sends} | {measured} | {before} |", flush=True)
    print(f"\nload average at the end: {load()}")


if __name__ == "__main__":
    main()
