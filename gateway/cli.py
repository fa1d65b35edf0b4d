"""``fairgate serve``: the gateway's own command line.

The ``fairgate`` console script (``loadtest.cli``) adds the test rig's subcommands
(``demo``, ``sim``, ``bench``) through ``build_parser(*commands)``; this module knows only
the gateway, so ``python -m gateway.cli serve`` runs without the rig installed.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from gateway.logs import configure_logging
from gateway.server import serve_forever
from gateway.settings import load_settings

DESCRIPTION = "fairgate: a fair-scheduling, OpenAI-compatible gateway in front of vLLM."

AddCommand = Callable[[Any], object]
"""Registers one subcommand on an argparse subparsers object."""


def _serve(args: argparse.Namespace) -> int:
    settings = load_settings(args.config)
    configure_logging(settings.log_level)
    asyncio.run(serve_forever(settings))
    return 0


def add_serve(sub: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(
        "serve", help="run the gateway (config: --config or FAIRGATE_CONFIG)")
    parser.add_argument("--config", help="YAML config file; FAIRGATE_* env vars override it")
    parser.set_defaults(run=_serve)
    return parser


def build_parser(*commands: AddCommand) -> argparse.ArgumentParser:
    """``fairgate serve`` plus ``commands``, in that order."""
    parser = argparse.ArgumentParser(prog="fairgate", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve(sub)
    for add in commands:
        add(sub)
    return parser


def run(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen subcommand."""
    args = parser.parse_args(argv)
    configure_logging()
    result: int = args.run(args)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
