"""The settings' page, `serve --help` and the Makefile's installs, checked against their
sources."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

import pytest

from prefix_gateway.cli import build_parser
from prefix_gateway.config import Settings
from prefix_gateway.config.reference import markdown
from prefix_gateway.config.sections import SECTIONS, sectioned_fields
from tests.support import ROOT


def test_docs_configuration_md_is_written_from_the_settings() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == markdown(), (
        "docs/configuration.md is stale: run"
        " `python -m prefix_gateway.config.reference > docs/configuration.md`"
    )


def test_every_setting_is_in_exactly_one_section() -> None:
    placed = [f.name for _, fields in sectioned_fields() for f in fields]
    assert sorted(placed) == sorted(f.name for f in dataclasses.fields(Settings))
    named = [name for _, names in SECTIONS for name in names]
    assert len(named) == len(set(named)), "a setting named by two sections"


def test_serve_help_shows_the_flags_under_their_sections(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help_text = capsys.readouterr().out
    titles = [title for title, _ in SECTIONS]
    positions = [help_text.index(f"\n{title}:\n") for title in titles]
    assert positions == sorted(positions)
    routing = help_text[positions[titles.index("Routing")] :]
    assert routing.index("--load-factor") < routing.index("\nTokens and")


def dry_run(target: str, venv: Path) -> str:
    """The commands `make TARGET` would run for a checkout with nothing installed in `venv`."""
    ran = subprocess.run(
        ["make", "--dry-run", f"VENV={venv}", target],
        cwd=ROOT,
        env={**os.environ, "MAKEFLAGS": ""},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return ran.stdout


def test_make_run_installs_the_runtime_and_make_install_the_test_extra(tmp_path: Path) -> None:
    run = dry_run("run", tmp_path)
    assert "pip install --quiet -e .\n" in run
    assert "[test]" not in run
    assert "prefix-gateway serve" in run
    install = dry_run("install", tmp_path)
    assert "pip install --quiet -e '.[test]'" in install
    assert "[test]" in dry_run("lint", tmp_path)


def test_a_setting_no_section_names_joins_the_section_of_the_setting_before_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from prefix_gateway.config import sections

    without = tuple(
        (title, tuple(name for name in names if name != "retry_backoff"))
        for title, names in SECTIONS
    )
    monkeypatch.setattr(sections, "SECTIONS", without)
    placed = {f.name: title for title, fields in sections.sectioned_fields() for f in fields}
    # In Settings, retry_backoff follows request_timeout.
    assert placed["retry_backoff"] == placed["request_timeout"] == "Timeouts and retries"
