"""The `prefix-gateway` command: serve, emulate, replay."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shlex
import signal
import sys
from collections.abc import Sequence

from prefix_gateway import config as gateway_config


def _serve(args: argparse.Namespace) -> int:
    try:
        settings = gateway_config.load_settings(args)
    except (gateway_config.ConfigError, OSError) as exc:
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
        print(f"prefix-gateway: {exc}", file=sys.stderr)
        if metrics_dir is not None:
            metrics_dir.remove()
        return 2
    from prefix_gateway.logs import configure_logging

    configure_logging(settings.log_level, settings.log_format)
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


def _emulate(args: argparse.Namespace) -> int:
    from prefix_gateway.emulator import config_from_args, serve

    serve(config_from_args(args))
    return 0


def _replay(args: argparse.Namespace) -> int:
    from prefix_gateway.replay.command import main as replay_main

    return replay_main(args)


def build_parser() -> argparse.ArgumentParser:
    from prefix_gateway.emulator import add_arguments as add_emulator_arguments
    from prefix_gateway.replay.command import add_arguments as add_replay_arguments

    parser = argparse.ArgumentParser(
        prog="prefix-gateway", description="Prefix-aware load-balancing gateway for LLM inference"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the gateway")
    gateway_config.add_arguments(serve)
    serve.set_defaults(handler=_serve)
    emulate = commands.add_parser("emulate", help="run one emulated vLLM-like replica")
    add_emulator_arguments(emulate)
    emulate.set_defaults(handler=_emulate)
    replay = commands.add_parser(
        "replay", help="replay a trace through every policy against simulated replicas"
    )
    add_replay_arguments(replay)
    replay.set_defaults(handler=_replay)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    raise SystemExit(args.handler(args))
