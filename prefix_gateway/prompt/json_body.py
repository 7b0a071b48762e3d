"""A request body parsed as a JSON object within bounds: its values counted before it is
parsed, its depth checked before it is walked."""

from __future__ import annotations

import gc
from typing import Any

import orjson

from prefix_gateway.errors import BadRequest


def json_object(body: bytes, max_values: int, max_depth: int) -> dict[str, Any]:
    """`body` parsed, once its values are counted; refused past the limits or unless an object."""
    containers = body.count(b"[") + body.count(b"{")
    if containers + body.count(b",") > max_values:
        raise BadRequest(
            f"request body holds more than {max_values} values", code="too_many_values"
        )
    # A parsed body holds no cycles: the collector, run again and again while millions of
    # objects are made, would only slow the parse (and the event loop) down.
    collecting = gc.isenabled()
    gc.disable()
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    finally:
        if collecting:
            gc.enable()
    if not isinstance(payload, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_type")
    if containers > max_depth:  # fewer brackets than the limit cannot nest deeper
        _check_depth(payload, max_depth)
    return payload


def _check_depth(payload: dict[str, Any], limit: int) -> None:
    """Refuse a body nested deeper than `limit` arrays and objects, level by level."""
    level: list[Any] = [payload]
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            raise BadRequest(f"request body is nested deeper than {limit} levels", code="too_deep")
        inner: list[Any] = []
        for node in level:
            for child in node.values() if isinstance(node, dict) else node:
                if isinstance(child, dict | list):
                    inner.append(child)
        level = inner
