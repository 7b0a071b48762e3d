"""The only changes the gateway makes to a request body on its way to a replica.

A body goes upstream byte for byte, except: with `--observe-usage`, or for a tenant with a
token budget (charged what the engine reports), a stream whose client did not ask for usage
asks for it (the usage event is taken out again on the way back); under
`--isolate-tenants`, every request carries its tenant's `cache_salt`, so that the engine keeps
each tenant's cached prefixes apart; under `--forward-priority`, every request that runs the
model carries its tenant's `priority` in the engine's terms. Each splices a key in before the
closing brace when the body does not have it (no parse), and parses and writes the body again
when it does. A key spelled with escapes (`"\\u0070riority"`) is not seen as the key, but the
member spliced after it wins: JSON parsers keep the last of duplicate keys, vLLM's included.
"""

from __future__ import annotations

from typing import Any

import orjson

_STREAM_OPTIONS = b'"stream_options"'
_CACHE_SALT = b'"cache_salt"'
_PRIORITY = b'"priority"'


def request_usage(body: bytes) -> bytes:
    """`body`, a JSON object, asking for usage in its stream."""
    if _STREAM_OPTIONS not in body:
        spliced = _splice(body, b'"stream_options":{"include_usage":true}')
        if spliced is not None:
            return spliced
    payload = orjson.loads(body)
    options = payload.get("stream_options")
    payload["stream_options"] = {**(options or {}), "include_usage": True}
    return orjson.dumps(payload)


def with_cache_salt(body: bytes, salt: str) -> bytes:
    """`body`, a JSON object, with `cache_salt` set to `salt` (whatever the client sent)."""
    if _CACHE_SALT not in body:
        spliced = _splice(body, b'"cache_salt":' + orjson.dumps(salt))
        if spliced is not None:
            return spliced
    payload: dict[str, Any] = orjson.loads(body)
    payload["cache_salt"] = salt
    return orjson.dumps(payload)


def with_priority(body: bytes, priority: int) -> bytes:
    """`body`, a JSON object, with `priority` set to `priority` (whatever the client sent)."""
    if _PRIORITY not in body:
        spliced = _splice(body, b'"priority":' + str(priority).encode())
        if spliced is not None:
            return spliced
    payload: dict[str, Any] = orjson.loads(body)
    payload["priority"] = priority
    return orjson.dumps(payload)


def _splice(body: bytes, member: bytes) -> bytes | None:
    end = body.rstrip()
    if not (end.endswith(b"}") and end.lstrip().startswith(b"{")):
        return None
    inside = end[:-1].rstrip()
    separator = b"" if inside.endswith(b"{") else b","
    return inside + separator + member + b"}"
