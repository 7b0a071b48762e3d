"""`python -m prefix_gateway.emulator`: one emulated vLLM replica."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from prefix_gateway.emulator.config import add_arguments, config_from_args
from prefix_gateway.emulator.server import serve


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m prefix_gateway.emulator",
        description="An emulated vLLM replica with a real prefix cache and a time model.",
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    serve(config)


if __name__ == "__main__":
    main()
