"""The largest request bodies the gateway accepts with its default limits (the attacks'
`largest_body_*` rows), and what one parse of each costs in CPU (`attacks.py --parse-cost`)."""

from __future__ import annotations

import contextlib
import statistics
import time

from loadtest.attack_harness import MODEL
from prefix_gateway.config import Settings
from prefix_gateway.errors import GatewayError
from prefix_gateway.prompt.parsing import BodyLimits, Endpoint, parse_request

DEFAULTS = Settings()


def body_at_limit(containers: int) -> bytes:
    """A chat body of exactly the default body limit, holding as many values as the gateway
    accepts: `containers` empty arrays, then strings as short as the value cap allows, in a
    `metadata` array the gateway does not read (its parser still builds every element)."""
    head = b'{"model":"' + MODEL.encode() + b'","max_tokens":1,'
    head += b'"messages":[{"role":"user","content":"hi"}],"metadata":['
    # Commas and brackets of the envelope, then two per empty array (`[` and its comma).
    budget = DEFAULTS.max_json_values - (head.count(b",") + head.count(b"[") + head.count(b"{"))
    items = b"[]," * containers
    count = budget - 2 * containers - 1
    room = DEFAULTS.max_body_bytes - len(head) - len(items) - 2
    width = max(1, room // count - 3)  # `"` + text + `",`
    filler = b'"' + b"a" * width + b'",'
    body = head + items + (filler * count)[:-1] + b"]}"
    return body + b" " * (DEFAULTS.max_body_bytes - len(body))


def arrays_then_strings() -> bytes:
    return body_at_limit(DEFAULTS.max_json_values // 4)


def strings() -> bytes:
    return body_at_limit(0)


def messages() -> bytes:
    """As many messages as the message cap allows, sharing the body limit between them."""
    head = b'{"model":"' + MODEL.encode() + b'","max_tokens":1,"messages":['
    empty = b'{"role":"user","content":""},'
    count = DEFAULTS.max_messages
    content = (DEFAULTS.max_body_bytes - len(head) - 2 - count * len(empty)) // count
    message = empty.replace(b'""', b'"' + b"m" * content + b'"')
    body = head + (message * count)[:-1] + b"]}"
    return body + b" " * (DEFAULTS.max_body_bytes - len(body))


def parse_cost(repeats: int = 7) -> None:
    """CPU time, not wall time, so that a busy machine does not inflate it."""
    limits = BodyLimits.of(DEFAULTS)
    print("| body | bytes | CPU ms per parse (median) | each run |")
    print("|---|---|---|---|")
    for name, make in (
        ("arrays, then strings", arrays_then_strings),
        ("strings", strings),
        ("messages", messages),
    ):
        body, runs = make(), []
        for _ in range(repeats):
            began = time.process_time()
            with contextlib.suppress(GatewayError):
                parse_request(Endpoint.CHAT, body, None, limits=limits)
            runs.append((time.process_time() - began) * 1000)
        each = ", ".join(f"{run:.0f}" for run in runs)
        print(f"| {name} | {len(body):,} | {statistics.median(runs):.0f} | {each} |")
