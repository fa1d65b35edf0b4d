"""The ``fairgate`` command line: one subcommand per job."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from loadtest.sim import cli as sim_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fairgate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sim_cli.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.run(args)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
