"""``fairgate bench shards`` at ``--quick`` size: both topologies ran, every decision
granted a request, and the models really spread over the three shards. No timing is
asserted (benchmarks are not tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
from redis.crc import key_slot

from gateway.storage.keys import ModelKeys
from loadtest.bench.cli import run_scenario
from loadtest.bench.env import Options
from loadtest.valkey_cluster import SLOTS


@pytest.mark.timeout(180)
def test_shards(tmp_path: Path) -> None:
    opts = Options(out=tmp_path / "shards", quick=True, progress=False,
                   command="fairgate bench shards --quick")
    report = run_scenario("shards", opts)
    p = report["params"]
    assert set(report["runs"]) == {"shards_1", "shards_3"}, report["runs"]
    for run in report["runs"].values():
        assert run["dispatched"] == p["dispatches"], run
        assert run["dispatch_per_s"] > 0, run
    models = report["runs"]["shards_3"]["models"]
    shards = {key_slot(ModelKeys(m).depth.encode()) // (SLOTS // 3) for m in models}
    assert shards == {0, 1, 2}, (models, shards)
    assert (tmp_path / "shards" / "shards_dispatch.png").read_bytes()[:4] == b"\x89PNG"
