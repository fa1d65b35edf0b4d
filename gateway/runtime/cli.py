"""``fairgate serve``: the gateway's own command line.

The ``fairgate`` console script (``loadtest.cli``) adds the test rig's subcommands
(``demo``, ``sim``, ``bench``) through ``build_parser(*commands)``; this module knows only
the gateway, so ``python -m gateway.runtime.cli serve`` runs without the rig installed.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from gateway.core import event_loop
from gateway.core.config_file import ConfigFileInvalid, describe, read_config_file
from gateway.core.logs import configure_logging
from gateway.core.settings import Settings, legacy, load_settings
from gateway.runtime.serve import (
    SERVE_PORT_CHANGE,
    fail,
    missing_setup,
    port_taken,
    port_taken_message,
    run_gateway,
)

DESCRIPTION = "fairgate: a fair-scheduling, OpenAI-compatible gateway in front of vLLM."

AddCommand = Callable[[Any], object]
"""Registers one subcommand on an argparse subparsers object."""


def _serve(args: argparse.Namespace) -> int:
    path = args.config or os.environ.get("FAIRGATE_CONFIG")
    if path and not Path(path).is_file():
        return fail(f"config file not found: {path}")
    try:
        with legacy.held_lines() as deprecated:  # said once the logs are set up
            settings = read_config_file(Path(path)) if path else load_settings()
    except ConfigFileInvalid as exc:
        return fail(f"config file {path!r} {exc}")
    except ValidationError as exc:  # FAIRGATE_* variables without a config file
        return fail(f"invalid settings: {describe(exc, Settings)}")
    problem = missing_setup(settings)
    if problem is not None:
        return fail(problem)
    if port_taken(settings.listen.host, settings.listen.port):
        return fail(port_taken_message(settings.listen.host, settings.listen.port,
                                       SERVE_PORT_CHANGE))
    workers = args.workers or settings.listen.workers
    if workers is None:
        from gateway.runtime.workers import default_workers

        workers = default_workers()
    configure_logging(settings.operations.log_level, settings.operations.log_sample_above_per_s)
    legacy.say(deprecated)
    if workers > 1:
        from gateway.runtime.workers import serve_workers

        return serve_workers(settings, args.config, workers)
    return event_loop.run(run_gateway(settings), settings.listen.event_loop)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def add_serve(sub: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(
        "serve", help="run the gateway (config: --config or FAIRGATE_CONFIG)")
    parser.add_argument("--config", help="YAML config file; FAIRGATE_* env vars override it")
    parser.add_argument(
        "--workers", type=_positive, default=None,
        help="gateway processes on the port (default: setting `workers`, else one per "
             "core; 1: serve in this process)")
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
