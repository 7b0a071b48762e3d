"""The `prefix-gateway` command: serve, config, emulate, replay."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shlex
import signal
import sys
from collections.abc import Sequence

from prefix_gateway import __version__
from prefix_gateway import config as gateway_config
from prefix_gateway.config.effective import as_yaml, effective


def _warn_unknown_variables() -> None:
    for warning in gateway_config.unknown_variables(os.environ):
        print(f"prefix-gateway: warning: {warning}", file=sys.stderr, flush=True)


def _serve(args: argparse.Namespace) -> int:
    try:
        settings = gateway_config.load_settings(args)
    except (gateway_config.ConfigError, OSError) as exc:
        _warn_unknown_variables()  # a misspelt variable may be why
        print(f"prefix-gateway: {exc}", file=sys.stderr)
        return 2
    metrics_dir = None
    if settings.workers > 1:
        from prefix_gateway.workers import prepare_metrics_directory

        # Before anything imports prometheus_client, which picks its mode at import.
        metrics_dir = prepare_metrics_directory()
    try:
        from prefix_gateway.routing.policies import build_policy

        build_policy(settings)
    except (gateway_config.ConfigError, OSError) as exc:
        _warn_unknown_variables()
        print(f"prefix-gateway: {exc}", file=sys.stderr)
        if metrics_dir is not None:
            metrics_dir.remove()
        return 2
    from prefix_gateway.logs import configure_logging

    configure_logging(settings.log_level, settings.log_format)
    config_log = logging.getLogger("prefix_gateway.config")
    for warning in gateway_config.unknown_variables(os.environ):
        config_log.warning(warning)
    config_log.info("effective configuration: %s", json.dumps(effective(settings)))
    from prefix_gateway.emulator.replicas import EmulatedReplicas

    fleet = None
    # uvicorn raises the signal that stopped it once it is done: as an exception, so that the
    # emulated replicas are stopped too and the command ends without a traceback.
    for ending in (signal.SIGINT, signal.SIGTERM):
        signal.signal(ending, _stopped)
    try:
        if settings.emulate > 0:
            fleet = EmulatedReplicas(
                settings.emulate,
                settings.emulate_model,
                shlex.split(settings.emulate_args),
                end_with_parent=True,
            ).start()
            settings = dataclasses.replace(
                settings, backend=(*settings.backend, *(f"{url}" for url in fleet.urls))
            )
            logging.getLogger("prefix_gateway.cli").info(
                "emulated replicas: %s", " ".join(fleet.urls)
            )
        if metrics_dir is not None:
            from prefix_gateway.workers import run_workers

            return run_workers(settings, metrics_dir)
        from prefix_gateway.app import GatewayApp
        from prefix_gateway.server import serve

        serve(GatewayApp(settings), settings)
        return 0
    except _Stopped as stopped:
        return 128 + stopped.signal
    finally:
        if fleet is not None:
            fleet.stop()
            logging.getLogger("prefix_gateway.cli").info(
                "stopped %d emulated replicas", len(fleet.urls)
            )


class _Stopped(Exception):
    def __init__(self, number: int) -> None:
        super().__init__(signal.Signals(number).name)
        self.signal = number


def _stopped(number: int, frame: object) -> None:
    raise _Stopped(number)


def _config(args: argparse.Namespace) -> int:
    """Print the settings `serve` would run with, given the same flags, secrets redacted."""
    _warn_unknown_variables()
    try:
        settings = gateway_config.load_settings(args)
        from prefix_gateway.routing.policies import build_policy

        build_policy(settings)
    except (gateway_config.ConfigError, OSError) as exc:
        print(f"prefix-gateway: {exc}", file=sys.stderr)
        return 2
    print(as_yaml(settings), end="")
    return 0


def _emulate(args: argparse.Namespace) -> int:
    from prefix_gateway.emulator.config import config_from_args
    from prefix_gateway.emulator.server import serve

    serve(config_from_args(args))
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from prefix_gateway.doctor.command import main as doctor_main

    return doctor_main(args)


def _replay(args: argparse.Namespace) -> int:
    from prefix_gateway.replay.command import main as replay_main

    return replay_main(args)


_SETTINGS_USAGE = "prefix-gateway {} [--config FILE] [--SETTING VALUE ...]"
_SETTINGS = (
    "Every flag is also a GATEWAY_* variable and a key of the --config file; flags win over"
    " variables, variables over the file. All of them, by section: docs/configuration.md."
)


def build_parser() -> argparse.ArgumentParser:
    from prefix_gateway.emulator.config import add_arguments as add_emulator_arguments
    from prefix_gateway.replay.command import add_arguments as add_replay_arguments

    parser = argparse.ArgumentParser(
        prog="prefix-gateway", description="Prefix-aware load-balancing gateway for LLM inference"
    )
    parser.add_argument("--version", action="version", version=f"prefix-gateway {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve", help="run the gateway", usage=_SETTINGS_USAGE.format("serve"), epilog=_SETTINGS
    )
    gateway_config.add_arguments(serve)
    serve.set_defaults(handler=_serve)
    config = commands.add_parser(
        "config",
        help="print the effective configuration (YAML, secrets redacted) that serve's flags give",
        usage=_SETTINGS_USAGE.format("config"),
        epilog=_SETTINGS,
    )
    gateway_config.add_arguments(config)
    config.set_defaults(handler=_config)
    emulate = commands.add_parser("emulate", help="run one emulated vLLM-like replica")
    add_emulator_arguments(emulate)
    emulate.set_defaults(handler=_emulate)
    from prefix_gateway.doctor.command import DESCRIPTION as DOCTOR_DESCRIPTION

    doctor = commands.add_parser(
        "doctor",
        help="check that every replica serves prefix routing as configured (same flags as serve)",
        description=DOCTOR_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gateway_config.add_arguments(doctor)
    doctor.set_defaults(handler=_doctor)
    replay = commands.add_parser(
        "replay", help="replay a trace through every policy against simulated replicas"
    )
    add_replay_arguments(replay)
    replay.set_defaults(handler=_replay)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    raise SystemExit(args.handler(args))
