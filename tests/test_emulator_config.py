"""The emulator's settings: flags, units and checks."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from prefix_gateway.emulator.config import EmulatorConfig, add_arguments, config_from_args


def parse(*flags: str) -> EmulatorConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(flags))


def test_defaults_match_the_config_defaults() -> None:
    assert parse() == EmulatorConfig()


def test_flags_fill_every_field_and_convert_time_units() -> None:
    config = parse(
        "--host", "0.0.0.0", "--port", "9000", "--name", "m", "--cache-blocks", "128",
        "--block-size", "32", "--max-running", "4", "--prefill-us-per-token", "250",
        "--decode-ms-per-token", "12.5", "--chat-template", "chatml",
        "--default-max-tokens", "9", "--seed", "3", "--pooling",
    )  # fmt: skip
    assert config.prefill_seconds_per_token == pytest.approx(0.00025)
    assert config.decode_seconds_per_token == pytest.approx(0.0125)
    assert replace(config, prefill_seconds_per_token=0.0, decode_seconds_per_token=0.0) == (
        EmulatorConfig(
            model="m",
            host="0.0.0.0",
            port=9000,
            block_size=32,
            cache_blocks=128,
            max_running=4,
            chat_template="chatml",
            default_max_tokens=9,
            seed=3,
            pooling=True,
        )
    )
    assert config.max_model_len == 128 * 32


@pytest.mark.parametrize(
    "changes",
    [
        {"block_size": 0},
        {"cache_blocks": 0},
        {"max_running": 0},
        {"prefill_seconds_per_token": -1.0},
        {"decode_seconds_per_token": -1.0},
        {"chat_template": "llama"},
        {"default_max_tokens": 0},
        {"model": ""},
    ],
)
def test_unusable_settings_are_refused(changes: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        EmulatorConfig(**changes)  # type: ignore[arg-type]
