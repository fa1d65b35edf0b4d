"""``fairgate sim``: placeholder until the simulator lands."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser("sim", help="run a simulated vLLM server")
    parser.set_defaults(run=lambda args: 0)
    return parser
