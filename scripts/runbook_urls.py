#!/usr/bin/env python3
"""Point every alert's `runbook_url` at its section of docs/runbook.md under one base address.

Alertmanager and Grafana open a `runbook_url` as it is, so it must be an absolute address. The
rules ship with the repository's own page on GitHub; a fork or a docs site of your own rewrites
them (the alerts, their unit tests and the Kubernetes component generated from them) with:

    python3 scripts/runbook_urls.py --base https://docs.example/prefix-gateway/runbook.html
    python3 scripts/runbook_urls.py --check    # exit 1 if an alert's link is not BASE#anchor

An alert's anchor is its name in lower case, the heading's anchor that GitHub and most Markdown
renderers give `## PrefixGatewayNoHealthyBackend`.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import k8s_monitoring  # beside this script, on the path of `python3 scripts/...`
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BASE = "https://github.com/prefix-gateway/prefix-gateway/blob/main/docs/runbook.md"
RULE_FILES = (k8s_monitoring.ALERTS, Path("deploy/prometheus/alerts_test.yml"))
_LINK = re.compile(
    r"^(?P<lead>[ \t]*runbook_url:[ \t]*)(?P<url>\S+?)#(?P<anchor>[a-z0-9-]+)[ \t]*$", re.M
)


def rewritten(text: str, base: str) -> str:
    """`text` with the part before `#` of every runbook_url replaced by `base`."""
    return _LINK.sub(lambda match: f"{match['lead']}{base}#{match['anchor']}", text)


def links(root: Path) -> dict[str, str]:
    """Each alert of the rule file and its runbook_url."""
    groups = yaml.safe_load((root / k8s_monitoring.ALERTS).read_text(encoding="utf-8"))["groups"]
    return {
        rule["alert"]: rule["annotations"]["runbook_url"]
        for group in groups
        for rule in group["rules"]
        if "alert" in rule
    }


def wrong(root: Path, base: str) -> list[str]:
    """The alerts whose runbook_url is not `base#<name in lower case>`."""
    return [name for name, url in links(root).items() if url != f"{base}#{name.lower()}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default=DEFAULT_BASE, help=f"default: {DEFAULT_BASE}")
    parser.add_argument("--check", action="store_true", help="only tell whether each link is")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this)")
    args = parser.parse_args(argv)
    if not re.match(r"https?://[^/\s#]+/\S*$", args.base) or "#" in args.base:
        parser.error("--base must be an absolute http(s) address without a #fragment")
    if args.check:
        for name in wrong(args.root, args.base):
            print(f"{name}: its runbook_url is not {args.base}#{name.lower()}", file=sys.stderr)
        return 1 if wrong(args.root, args.base) else 0
    for path in RULE_FILES:
        target = args.root / path
        target.write_text(rewritten(target.read_text(encoding="utf-8"), args.base), "utf-8")
        print(f"wrote {path}")
    return k8s_monitoring.main(["--root", str(args.root)])


if __name__ == "__main__":
    sys.exit(main())
