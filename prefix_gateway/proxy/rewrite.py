"""The only changes the gateway makes to a request body on its way to a replica, made in one
pass (`edited`): a body that needs none goes byte for byte, untouched.

A body goes upstream byte for byte, except: with `--observe-usage`, or for a tenant with a
token budget (charged what the engine reports), a stream whose client did not ask for usage
asks for it (the usage event is taken out again on the way back); under
`--isolate-tenants`, every request carries its tenant's `cache_salt`, so that the engine keeps
each tenant's cached prefixes apart; its `priority` is the one the gateway decides (the
tenant's under `--forward-priority`, the client's only where the operator allows it); and the
engine-control fields a client may not set are dropped (`kv_transfer_params`) or made its
tenant's own (`request_id`), docs/endpoints.md. Members are spliced in before the closing
brace when the body has none of the keys set and none to drop (no parse); otherwise the body
is parsed and written again, once. A key spelled with escapes (`"\\u0070riority"`) is not seen
as the key by the splice, but the member spliced after it wins: JSON parsers keep the last of
duplicate keys, vLLM's included; a key to drop is known from the parsed body, escapes and all.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import orjson

_STREAM_OPTIONS = b'"stream_options"'
_USAGE_MEMBER = b'"stream_options":{"include_usage":true}'


def edited(
    body: bytes, setting: Mapping[str, Any], dropping: Collection[str] = (), usage: bool = False
) -> bytes:
    """`body`, a JSON object, with each member of `setting` set (whatever the client sent),
    each key of `dropping` removed, and, with `usage`, its stream asking for usage."""
    if not setting and not dropping and not usage:
        return body
    if not dropping and not (usage and _STREAM_OPTIONS in body):
        members = [
            b'"%s":%s' % (key.encode(), orjson.dumps(value)) for key, value in setting.items()
        ]
        if not any(b'"%s"' % key.encode() in body for key in setting):
            if usage:
                members.append(_USAGE_MEMBER)
            spliced = _splice(body, b",".join(members))
            if spliced is not None:
                return spliced
    payload: dict[str, Any] = orjson.loads(body)
    for key in dropping:
        payload.pop(key, None)
    if usage:
        options = payload.get("stream_options")
        payload["stream_options"] = {**(options or {}), "include_usage": True}
    payload.update(setting)
    return orjson.dumps(payload)


def request_usage(body: bytes) -> bytes:
    """`body`, a JSON object, asking for usage in its stream."""
    return edited(body, {}, usage=True)


def with_cache_salt(body: bytes, salt: str) -> bytes:
    """`body`, a JSON object, with `cache_salt` set to `salt` (whatever the client sent)."""
    return edited(body, {"cache_salt": salt})


def _splice(body: bytes, members: bytes) -> bytes | None:
    end = body.rstrip()
    if not (end.endswith(b"}") and end.lstrip().startswith(b"{")):
        return None
    inside = end[:-1].rstrip()
    separator = b"" if inside.endswith(b"{") else b","
    return inside + separator + members + b"}"
