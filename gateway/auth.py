"""Client API keys: `Authorization: Bearer <key>` on `/v1/...`, compared in constant time
against every key so that neither timing nor position tells a caller anything.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from gateway.errors import Unauthorized

PROTECTED_PREFIX = "/v1/"


class ApiKeys:
    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = [key.encode() for key in keys if key]

    def __bool__(self) -> bool:
        return bool(self._keys)

    def check(self, headers: list[tuple[bytes, bytes]]) -> None:
        """Raise `Unauthorized` unless the headers carry one of the keys."""
        given = None
        for name, value in headers:
            if name == b"authorization":
                given = value
                break
        if given is None:
            raise Unauthorized(
                "You didn't provide an API key: send `Authorization: Bearer <key>`.",
                code="missing_api_key",
            )
        scheme, _, token = given.partition(b" ")
        token = token.strip()
        matched = False
        for key in self._keys:
            # `|` rather than `or`: every key is compared, matched or not.
            matched |= hmac.compare_digest(token, key)
        if scheme.lower() != b"bearer" or not matched:
            raise Unauthorized("Incorrect API key provided.", code="invalid_api_key")
