from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from prefix_gateway.backends.pool import parse_backend_spec
from prefix_gateway.config import ConfigError, add_arguments, load_settings


def parse(argv: list[str], env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return load_settings(parser.parse_args(argv), env or {})


def test_flags_beat_env_beat_file_beat_defaults(tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text("port: 7000\npolicy: round_robin\nload_factor: 1.5\nbackend: [a:1]\n")
    settings = parse(
        ["--config", str(config), "--port", "9000"],
        {"GATEWAY_POLICY": "random", "GATEWAY_BACKENDS": "b:1,c:1"},
    )
    assert settings.port == 9000
    assert settings.policy == "random"
    assert settings.backend == ("b:1", "c:1")
    assert settings.load_factor == 1.5
    assert settings.affinity_ttl == 600.0


def test_repeated_backend_flags() -> None:
    settings = parse(["--backend", "http://a:1", "--backend", "m=http://b:2"])
    assert settings.backend == ("http://a:1", "m=http://b:2")


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--backend", "a:1", "--port", "x"],
        ["--backend", "a:1", "--ring-choices", "0"],
        ["--backend", "a:1", "--recent-half-life", "0"],
        ["--backend", "a:1", "--recent-cap", "0.5"],
        ["--backend", "a:1", "--port", "9000", "--metrics-port", "9000"],
        ["--backend", "a:1", "--metrics-port", "65536"],
        ["--backend", "a:1", "--metrics-port", "-1"],
    ],
)
def test_bad_settings_fail_at_start(argv: list[str]) -> None:
    with pytest.raises(ConfigError):
        parse(argv)


def test_the_metrics_port_is_off_unless_given() -> None:
    assert parse(["--backend", "a:1"]).metrics_port == 0
    assert parse(["--backend", "a:1"], {"GATEWAY_METRICS_PORT": "9090"}).metrics_port == 9090


def test_unknown_file_keys_fail(tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text("backend: [a:1]\nlaod_factor: 2\n")
    with pytest.raises(ConfigError, match="laod_factor"):
        parse(["--config", str(config)])


def test_backend_specs() -> None:
    plain = parse_backend_spec("http://10.0.0.1:8000/v1/")
    assert (plain.name, plain.url, plain.models) == (
        "10.0.0.1:8000",
        "http://10.0.0.1:8000",
        frozenset(),
    )
    pinned = parse_backend_spec("llama=10.0.0.2:8000")
    assert (pinned.url, pinned.models) == ("http://10.0.0.2:8000", frozenset({"llama"}))
    with pytest.raises(ConfigError):
        parse_backend_spec("ftp://x")
