"""A benchmark report: a full-size run is judged against its targets, a ``--quick`` run
prints its numbers without a verdict (its targets named as the full-size ones)."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest.bench.env import Options
from loadtest.bench.report import QUICK_NOTE, Headline, write

ROWS = [Headline("chat: newcomer TTFT p95 (ms)", 1058.0, 223.0, 0.21, "≤ 2× direct", False),
        Headline("chat: completed", 20.0, 20.0, 1.0, "–", None)]


def report(tmp_path: Path, quick: bool) -> tuple[dict[str, object], str]:
    opts = Options(out=tmp_path / ("quick" if quick else "full"), quick=quick,
                   command="fairgate bench newcomer" + (" --quick" if quick else ""))
    written = write(opts, "newcomer", {}, {}, list(ROWS), notes=["a note"])
    on_disk = json.loads((opts.out / "report.json").read_text())
    assert on_disk == json.loads(json.dumps(written, default=str)), on_disk
    return on_disk, (opts.out / "report.md").read_text()


def test_full_size_run_is_judged(tmp_path: Path) -> None:
    data, text = report(tmp_path, quick=False)
    rows = data["headline"]
    assert isinstance(rows, list)
    assert [(r["target"], r["met"]) for r in rows] == [("≤ 2× direct", False), ("–", None)]
    assert "| 1,058 | 223 | 0.21 | ≤ 2× direct | **no** |" in text, text
    assert QUICK_NOTE not in text and "not judged" not in text, text


def test_quick_run_prints_numbers_without_a_verdict(tmp_path: Path) -> None:
    data, text = report(tmp_path, quick=True)
    rows = data["headline"]
    assert isinstance(rows, list)
    assert [(r["gateway"], r["target"], r["met"]) for r in rows] == [
        (223.0, "full size: ≤ 2× direct", None), (20.0, "–", None)], rows
    assert "**no**" not in text and "yes" not in text, text
    assert "| 1,058 | 223 | 0.21 | full size: ≤ 2× direct | – |" in text, text
    assert text.startswith("### newcomer (quick run: not judged)"), text
    assert data["notes"] == [QUICK_NOTE, "a note"], data["notes"]
