"""Results: ``report.json`` + ``report.md`` (headline table) + PNG plots (matplotlib Agg).

A ``--quick`` run's numbers are printed as measured but not judged: its sizes are too
small for the targets, which are stated for full-size runs (``met`` is left empty).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from dataclasses import asdict, dataclass, replace
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from loadtest.bench.env import Options
from loadtest.bench.stats import round_all


@dataclass
class Headline:
    """One row of the headline table."""

    metric: str
    direct: float | None
    gateway: float | None
    ratio: float | None
    target: str
    met: bool | None


QUICK_NOTE = ("Quick run (`--quick`): tiny sizes, a smoke check that the scenario runs. "
              "The numbers are as measured, but too small a run to judge: the targets are "
              "for full-size runs (drop `--quick`), so none is marked met or not.")


def unjudged(row: Headline) -> Headline:
    """A quick run's row: its numbers, its target named as the full-size one, no verdict."""
    target = f"full size: {row.target}" if row.target not in ("", "–") else row.target
    return replace(row, target=target, met=None)


def machine() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next((ln.split(":", 1)[1].strip() for ln in handle
                        if ln.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"cpus": os.cpu_count(), "cpu": cpu,
            "loadavg_1m_at_end": round(os.getloadavg()[0], 2), "python": platform.python_version(),
            "platform": platform.platform(), "commit": commit}


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def markdown(report: dict[str, Any]) -> str:
    quick = " (quick run: not judged)" if report.get("quick") else ""
    lines = [f"### {report['scenario']}{quick}", "",
             f"`{report['command']}` — {report['date']}, {report['machine']['cpus']} CPUs "
             f"({report['machine']['cpu']}, load avg {report['machine']['loadavg_1m_at_end']} at "
             f"the end), commit {report['machine']['commit']}", "",
             "| metric | direct | gateway | ratio | target | met |",
             "|---|---:|---:|---:|---|---|"]
    for row in report["headline"]:
        lines.append(f"| {row['metric']} | {_fmt(row['direct'])} | {_fmt(row['gateway'])} | "
                     f"{_fmt(row['ratio'])} | {row['target']} | {_fmt(row['met'])} |")
    for note in report.get("notes", []):
        lines += ["", note]
    for plot in report.get("plots", []):
        lines += ["", f"![{plot}]({plot})"]
    return "\n".join(lines) + "\n"


def write(opts: Options, scenario: str, params: dict[str, Any], runs: dict[str, Any],
          headline: list[Headline], figures: dict[str, Figure] | None = None,
          notes: list[str] | None = None) -> dict[str, Any]:
    """Write the results directory; returns the JSON report."""
    opts.out.mkdir(parents=True, exist_ok=True)
    if opts.quick:
        headline = [unjudged(row) for row in headline]
        notes = [QUICK_NOTE, *(notes or [])]
    plots = []
    for name, fig in (figures or {}).items():
        fig.savefig(opts.out / name, dpi=110, bbox_inches="tight")
        plt.close(fig)
        plots.append(name)
    report = {
        "scenario": scenario,
        "command": opts.command,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "backend": opts.backend or "simulator",
        "quick": opts.quick,
        "params": params,
        "headline": [asdict(h) for h in headline],
        "runs": round_all(runs),
        "notes": notes or [],
        "plots": plots,
    }
    diagnostics = opts.out / "gateway_diagnostics.json"
    if diagnostics.exists():
        report["gateway_diagnostics"] = json.loads(diagnostics.read_text())
    (opts.out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    (opts.out / "report.md").write_text(markdown(report))
    return report


def figure(title: str, xlabel: str, ylabel: str) -> tuple[Figure, Any]:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax
