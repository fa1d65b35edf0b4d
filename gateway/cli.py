"""The ``fairgate`` command line: one subcommand per job."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from typing import Any

from gateway import demo
from gateway.logs import configure_logging
from gateway.server import serve_forever
from gateway.settings import load_settings
from loadtest.bench import cli as bench_cli
from loadtest.sim import cli as sim_cli


def _serve(args: argparse.Namespace) -> int:
    asyncio.run(serve_forever(load_settings(args.config)))
    return 0


def _add_serve(sub: Any) -> None:
    parser = sub.add_parser("serve", help="run the gateway (config: --config or FAIRGATE_CONFIG)")
    parser.add_argument("--config", help="YAML config file; FAIRGATE_* env vars override it")
    parser.set_defaults(run=_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fairgate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    demo.add_parser(sub)
    sim_cli.add_parser(sub)
    bench_cli.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging()
    result: int = args.run(args)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
