"""Asking a replica for the usage of a stream whose client did not ask for it.

With `--observe-usage`, a streamed request without `stream_options.include_usage` goes
upstream with it, so that its cached tokens feed the index and the hit-rate metrics; the
usage-only event is taken out of the stream again on its way back (`StreamObserver`).
Every other request goes upstream byte for byte.
"""

from __future__ import annotations

import orjson

_OPTION = b'"stream_options"'
_SPLICED = b',"stream_options":{"include_usage":true}}'


def request_usage(body: bytes) -> bytes:
    """`body`, a JSON object, asking for usage in its stream.

    Without `stream_options` the option is spliced in before the closing brace (no parse);
    with it (to keep its other keys) the object is parsed and written again.
    """
    if _OPTION not in body:
        end = body.rstrip()
        if end.endswith(b"}") and end.lstrip().startswith(b"{") and end[:-1].rstrip() != b"{":
            return end[:-1] + _SPLICED
    payload = orjson.loads(body)
    options = payload.get("stream_options")
    payload["stream_options"] = {**(options or {}), "include_usage": True}
    return orjson.dumps(payload)
