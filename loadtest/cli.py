"""The ``fairgate`` command: ``serve`` from the gateway, ``demo``/``sim``/``bench`` from
the test rig (``loadtest``).

The rig's subcommands are imported only when one of them is asked for: ``fairgate serve``
never loads the simulator, the benchmarks or their extras, and when the rig or an extra
is missing the command prints one line naming the extra to install and exits 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.runtime import cli as gateway_cli
from gateway.runtime.cli import AddCommand


def _load_demo() -> AddCommand:
    from loadtest import demo

    return demo.add_parser


def _load_sim() -> AddCommand:
    from loadtest.sim import cli

    return cli.add_parser


def _load_bench() -> AddCommand:
    from loadtest.bench import cli

    # The scenarios import the [bench] extra (tqdm, matplotlib): fail now, not mid-run.
    for scenario in cli.SCENARIOS:
        importlib.import_module(f"loadtest.bench.{scenario}")
    return cli.add_parser


@dataclass(frozen=True)
class Tool:
    """A subcommand of the test rig: what it needs and how to load it."""

    help: str
    needs: str
    extra: str
    load: Callable[[], AddCommand]

    def placeholder(self, name: str) -> AddCommand:
        """Names the subcommand in ``fairgate --help`` without importing it."""
        def add(sub: Any) -> object:
            return sub.add_parser(name, help=self.help)
        return add


TOOLS: dict[str, Tool] = {
    "demo": Tool("embedded Redis + two simulated backends + the gateway",
                 "the simulator", "sim", _load_demo),
    "sim": Tool("run a simulated vLLM server", "the simulator", "sim", _load_sim),
    "bench": Tool("benchmarks: direct to the backend vs through fairgate",
                  "the benchmark tools", "bench", _load_bench),
}


def build_parser(load: Iterable[str] = TOOLS) -> argparse.ArgumentParser:
    """``serve`` plus every tool: those named in ``load`` for real (importing them may
    raise ``ModuleNotFoundError``), the others as ``--help`` placeholders."""
    wanted = set(load)
    return gateway_cli.build_parser(*(
        tool.load() if name in wanted else tool.placeholder(name)
        for name, tool in TOOLS.items()
    ))


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    command = next((arg for arg in args if not arg.startswith("-")), "")
    tool = TOOLS.get(command)
    try:
        parser = build_parser([command] if tool is not None else [])
    except ModuleNotFoundError as exc:
        if tool is None:
            raise
        print(f"fairgate {command} needs {tool.needs}: pip install 'fairgate[{tool.extra}]' "
              f"(no module named {exc.name!r})", file=sys.stderr)
        return 2
    return gateway_cli.run(parser, args)
