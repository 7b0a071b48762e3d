"""docs/metrics.md documents exactly the metrics a live gateway exports, with their types."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import MODEL
from tests.support import GatewayProcess, free_port
from tests.test_dashboards import exported_families

DOCS = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"
_ROW = re.compile(r"^\| `(?P<name>[a-z_:][a-z0-9_:]*)` \| (?P<type>counter|gauge|histogram) \|")


def documented() -> dict[str, str]:
    rows = {}
    for line in DOCS.read_text().splitlines():
        found = _ROW.match(line)
        if found:
            assert found["name"] not in rows, f"{found['name']} documented twice"
            rows[found["name"]] = found["type"]
    return rows


def test_the_documented_metrics_are_the_exported_ones() -> None:
    with GatewayProcess([f"{MODEL}=http://127.0.0.1:{free_port()}"]) as gateway:
        exported = exported_families(gateway.metrics())
    docs = documented()
    assert sorted(set(exported) - set(docs)) == [], "exported but not documented"
    assert sorted(set(docs) - set(exported)) == [], "documented but not exported"
    assert docs == exported  # and with the same types
    assert not any(name.endswith("_created") for name in exported)
