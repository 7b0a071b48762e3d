"""docs/configuration.md, written from `Settings` and its sections:

    python -m prefix_gateway.config.reference > docs/configuration.md

A test compares the file with `markdown()`, so that the page lists every setting as it is."""

from __future__ import annotations

import dataclasses
from typing import Any

from prefix_gateway.config.sections import sectioned_fields
from prefix_gateway.config.sources import _env_name, flag_name

_PREAMBLE = """\
# Configuration

<!-- Written by `python -m prefix_gateway.config.reference > docs/configuration.md` from
prefix_gateway/config/settings.py; a test fails when the two disagree. -->

Every setting `foo_bar` is the flag `--foo-bar` of `prefix-gateway serve`, the environment
variable `GATEWAY_FOO_BAR` and the key `foo_bar` of the YAML file given with `--config` (or
`GATEWAY_CONFIG`). A flag wins over a variable, a variable over the file, the file over the
default. Lists repeat the flag (`--backend A --backend B`), separate items with commas in a
variable (`GATEWAY_BACKENDS=A,B`) and are YAML lists in the file; booleans are
`--name`/`--no-name`, and `true`/`false` (also `1`/`0`, `yes`/`no`, `on`/`off`) elsewhere.

Mistakes are reported at start: a file that is not YAML, an unknown key of the file and a value
that cannot be used are errors (exit status 2, one line); an unknown key and an unknown
`GATEWAY_*` variable (a warning) name the closest known one. `prefix-gateway config` takes the
same flags as `serve` and prints the configuration they give, as YAML the file accepts, secrets
(`api_key`, `upstream_api_key`, `admin_token`, tenants' keys, and the credentials inside any
URL: its password, a user name given alone, a query value named like a secret, as in
`redis_url`, `k8s_api_url` or a backend's URL) redacted; `serve` logs the same at start. A
tenant whose key comes from `api_key_env` is printed with its variable, so it reads back as it
was; a secret printed as `<redacted>` is refused when read back (exit status 2) until the
secret itself, or its variable, takes its place.
`prefix-gateway serve --help` lists the flags in the sections below.
"""


def markdown() -> str:
    parts = [_PREAMBLE]
    for title, fields in sectioned_fields():
        parts.append(f"\n## {title}\n\n| setting | flag | variable | default | what |\n")
        parts.append("|---|---|---|---|---|\n")
        for f in fields:
            parts.append(_row(f))
    return "".join(parts)


def _row(f: dataclasses.Field[Any]) -> str:
    if f.metadata.get("file_only"):
        flag = variable = "(file only)"
    else:
        flag, variable = f"`{flag_name(f)}`", f"`{_env_name(f)}`"
    what = str(f.metadata["help"]).replace("|", "\\|")
    return f"| `{f.name}` | {flag} | {variable} | {_default(f.default)} | {what} |\n"


def _default(value: Any) -> str:
    if isinstance(value, tuple):
        return ", ".join(f"`{item}`" for item in value) if value else "none"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if value == "":
        return "empty"
    return f"`{value}`"


if __name__ == "__main__":
    print(markdown(), end="")
