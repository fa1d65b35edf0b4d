"""Every process adopts every published snapshot (a fleet's: hundreds a second), so a
snapshot sets the backend, gate and pacing gauges only where a value changed since this
process last set them. What /metrics shows must stay what the latest snapshot says: after
an unchanged snapshot, a change, a failed scrape, a drain, and a backend forgotten and
added again."""

from __future__ import annotations

import aiohttp

from gateway.backends.published import Published
from gateway.core.metrics import GatewayMetrics
from gateway.core.settings import SettingsHolder, load_settings
from gateway.services import build_pool
from gateway.storage.fleet_store import FleetStore
from gateway.storage.redis_client import connect
from policies.classes import CLASS_ORDER
from policies.gates import BackendSnapshot, Gate
from policies.pacing import Pacing

M = "m"


def _published(gates: dict[str, Gate], allowance: float) -> Published:
    return Published(gates, {c: Pacing(allowance) for c in CLASS_ORDER}, 4, None, None, {},
                     None, True)


async def test_the_gauges_follow_every_snapshot_though_unchanged_ones_are_not_set_again(
        redis_url: str, redis: object) -> None:
    settings = load_settings(None, backends=[{"name": "b0", "url": "http://127.0.0.1:1",
                                              "model": M}])
    metrics = GatewayMetrics()
    client = connect(redis_url)
    try:
        async with aiohttp.ClientSession() as session:
            pool = build_pool(SettingsHolder(settings), session, FleetStore(client), metrics)
            snapshots, handle = pool.snapshots, pool.handles["b0"]
            reg = metrics.registry

            def gauge(name: str, **labels: str) -> float | None:
                return reg.get_sample_value(name, {"backend": "b0", **labels})

            def seen() -> dict[str, float | None]:
                return {"running": gauge("fairgate_backend_running_requests"),
                        "healthy": gauge("fairgate_backend_healthy"),
                        "drained": gauge("fairgate_backend_drained"),
                        "open": gauge("fairgate_gate_open", priority_class="interactive"),
                        "tpot": gauge("fairgate_gate_closed_reason",
                                      priority_class="interactive", reason="tpot"),
                        "stale": gauge("fairgate_gate_closed_reason",
                                       priority_class="interactive", reason="stale"),
                        "allowance": gauge("fairgate_pacing_allowance",
                                           priority_class="interactive")}

            open_ = dict.fromkeys(CLASS_ORDER, Gate(10))
            closed = {**open_, "interactive": Gate(0, "tpot")}
            for at, (running, gates, allowance) in enumerate([
                    (3, open_, 5.0), (3, open_, 5.0), (7, closed, 2.0), (7, closed, 2.0),
                    (3, open_, 5.0)], start=1):
                snapshots.apply(handle, BackendSnapshot(0, running, 0.1, None, float(at)),
                                _published(gates, allowance))
                got = seen()
                want = {"running": running, "healthy": 1, "drained": 0,
                        "open": 0 if gates is closed else 1,
                        "tpot": 1 if gates is closed else 0, "stale": 0,
                        "allowance": allowance}
                assert got == want, f"snapshot {at}: {got} != {want}"

            snapshots.failed(handle, RuntimeError("scrape failed"))
            snapshots.failed(handle, RuntimeError("scrape failed"))
            snapshots.failed(handle, RuntimeError("scrape failed"))
            assert (seen()["healthy"], seen()["open"], seen()["stale"]) == (0, 0, 1), seen()
            # the same numbers as before the failures: every gauge is set again
            snapshots.apply(handle, BackendSnapshot(0, 3, 0.1, None, 10.0),
                            _published(open_, 5.0))
            assert seen() == {"running": 3, "healthy": 1, "drained": 0, "open": 1, "tpot": 0,
                              "stale": 0, "allowance": 5.0}, seen()

            snapshots.set_drained(handle, True)
            snapshots.apply(handle, BackendSnapshot(0, 3, 0.1, None, 11.0),
                            _published(open_, 5.0))
            assert (seen()["drained"], seen()["open"]) == (1, 0), seen()
            snapshots.set_drained(handle, False)
            snapshots.apply(handle, BackendSnapshot(0, 3, 0.1, None, 11.5),
                            _published(open_, 5.0))
            assert (seen()["drained"], seen()["open"]) == (0, 1), seen()

            # forgotten (a backend removed), then the same snapshot again: all back
            metrics.forget_backend("b0")
            assert seen()["running"] is None and seen()["allowance"] is None, seen()
            handle.recorded = None  # a backend added again is a new handle
            snapshots.apply(handle, BackendSnapshot(0, 3, 0.1, None, 12.0),
                            _published(open_, 5.0))
            assert seen() == {"running": 3, "healthy": 1, "drained": 0, "open": 1, "tpot": 0,
                              "stale": 0, "allowance": 5.0}, seen()
    finally:
        await client.aclose()
