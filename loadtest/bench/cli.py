"""``fairgate bench SCENARIO``: run a benchmark, direct vs through fairgate.

Results go to ``--out`` (default ``results/bench/<scenario>``): ``report.json``,
``report.md`` and PNG plots. ``all`` runs every scenario at its default size.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from loadtest.bench.client import ENDPOINTS
from loadtest.bench.env import Options
from loadtest.bench.peers import NAMES as PEER_NAMES

SCENARIOS = ("newcomer", "overhead", "utilization", "mixed", "fairness", "scheduler", "deadlines",
             "locality", "tenants", "pacing", "replicas", "shards", "fleet", "preemption",
             "autoscale", "sessions", "adapters", "fair_preemption")


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``bench`` on the ``fairgate`` subparsers."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "bench", help="benchmarks: direct to the backend vs through fairgate",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", choices=(*SCENARIOS, "all"))
    parser.add_argument("--out", type=Path, default=None,
                        help="results directory (default results/bench/<scenario>)")
    parser.add_argument("--backend", default=None,
                        help="URL of a running vLLM (default: a simulated H100 per phase)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes (a smoke test): numbers printed, not judged "
                             "against the full-size targets")
    parser.add_argument("--size", type=int, default=None,
                        help="scenario size (flood length, queued requests, …)")
    parser.add_argument("--duration", type=float, default=None,
                        help="seconds per measured run (closed/open-loop scenarios)")
    parser.add_argument("--endpoint", choices=(*ENDPOINTS, "both"), default="both",
                        help="newcomer, mixed and fair_preemption: run on /v1/chat/completions, "
                             "/v1/completions or both (default both)")
    parser.add_argument("--redis-url", default=None, help="default: an embedded Valkey")
    parser.add_argument("--workers", type=int, default=1,
                        help="gateway processes (fairgate serve --workers); overhead measures "
                             "one worker and N workers too (N > 1; default 2 for overhead, "
                             "1 elsewhere)")
    parser.add_argument("--peers", default=None,
                        help="overhead: the proxies measured beside fairgate, comma-separated "
                             f"({', '.join(PEER_NAMES)}; default all, 'none' for none); one "
                             "not installed is reported skipped")
    parser.add_argument("--profile", action="store_true",
                        help="overhead: py-spy on the one-worker gateway at saturation, "
                             "streamed and not (speedscope, SVG flame graph and a text "
                             "summary under <out>/profile)")
    parser.add_argument("--baseline-tree", type=Path, default=None,
                        help="overhead: also measure fairgate served from this source tree "
                             "(e.g. a git worktree of an earlier commit), one worker, in the "
                             "same run: before and after as ratios of one run")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(run=run)
    return parser


def options(args: argparse.Namespace, scenario: str) -> Options:
    out = args.out if args.out is not None else Path("results/bench") / scenario
    if args.scenario == "all" and args.out is not None:
        out = args.out / scenario
    return Options(out=out, backend=args.backend, quick=args.quick, size=args.size,
                   duration_s=args.duration, progress=not args.no_progress,
                   redis_url=args.redis_url, workers=max(1, args.workers),
                   peers=_peers(args.peers), profile=args.profile,
                   baseline_tree=args.baseline_tree and args.baseline_tree.resolve(),
                   endpoints=tuple(ENDPOINTS) if args.endpoint == "both" else (args.endpoint,),
                   command="fairgate bench " + shlex.join(sys.argv[2:] if len(sys.argv) > 2
                                                          else [scenario]))


def _peers(value: str | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    names = tuple(n.strip() for n in value.split(",") if n.strip() and n.strip() != "none")
    unknown = [n for n in names if n not in PEER_NAMES]
    if unknown:
        raise SystemExit(f"--peers: unknown {', '.join(unknown)} (known: "
                         f"{', '.join(PEER_NAMES)})")
    return names


def run_scenario(name: str, opts: Options) -> dict[str, Any]:
    module = importlib.import_module(f"loadtest.bench.{name}")
    result: dict[str, Any] = asyncio.run(module.run(opts))
    return result


def run(args: argparse.Namespace) -> int:
    names = SCENARIOS if args.scenario == "all" else (args.scenario,)
    for name in names:
        opts = options(args, name)
        started = time.monotonic()
        print(f"== bench {name} → {opts.out}", file=sys.stderr, flush=True)
        report = run_scenario(name, opts)
        print((opts.out / "report.md").read_text(), flush=True)
        print(f"({name}: {time.monotonic() - started:.0f} s, {len(report['headline'])} "
              "headline rows)", file=sys.stderr, flush=True)
    return 0
