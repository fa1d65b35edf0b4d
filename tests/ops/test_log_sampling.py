"""Per-request log lines sampled above a rate (``log_sample_above_per_s``): whole requests
are kept or left out, errors and rejections never are. The clock is a plain counter so the
rate is exact; the lines go through structlog as the gateway configures it."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import structlog

from gateway.core.logs import RequestLogSampler, configure_logging


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def request_lines(sampler: RequestLogSampler, clock: Clock, requests: int, per_s: float,
                  first: int = 0) -> list[dict[str, object]]:
    """``requests`` requests (queued, dispatched, finished) spread over the seconds at
    ``per_s`` requests a second; returns the lines kept."""
    kept: list[dict[str, object]] = []
    for i in range(first, first + requests):
        clock.now = i / per_s
        for event in ("queued", "dispatched", "finished"):
            line = {"event": event, "request_id": f"r{i}", "completed": True}
            if event != "finished":
                del line["completed"]
            try:
                kept.append(dict(sampler(None, "info", line)))
            except structlog.DropEvent:
                pass
    return kept


def test_below_the_rate_every_line_is_kept() -> None:
    clock = Clock()
    sampler = RequestLogSampler(300, clock)
    kept = request_lines(sampler, clock, 500, per_s=100)  # 300 lines a second: at the rate
    assert len(kept) == 1500
    assert not any("sampled_one_in" in line for line in kept)


def test_above_the_rate_about_the_rate_is_kept_in_whole_requests() -> None:
    clock = Clock()
    sampler = RequestLogSampler(300, clock)
    kept = request_lines(sampler, clock, 10_000, per_s=1000)  # 3000 lines a second
    after_first_second = [line for line in kept if int(str(line["request_id"])[1:]) >= 1000]
    # 9 s at one request in 10 (3000 / 300): about 2,700 lines, whole requests only
    assert 2_000 < len(after_first_second) < 3_400
    per_request = Counter(str(line["request_id"]) for line in after_first_second)
    assert set(per_request.values()) == {3}
    assert all(line["sampled_one_in"] == 10 for line in after_first_second)
    assert sampler.left_out == 30_000 - len(kept)
    # the load goes away: the next second keeps everything again
    kept = request_lines(sampler, clock, 50, per_s=50, first=20_000)
    assert len(kept) == 150


@pytest.mark.parametrize("method,line", [
    ("info", {"event": "rejected", "status": 429}),
    ("info", {"event": "client_disconnected", "request_id": "x"}),
    ("info", {"event": "finished", "request_id": "x", "completed": False}),
    ("warning", {"event": "backend_unreachable_retry", "request_id": "x"}),
    ("error", {"event": "unhandled_error", "request_id": "x"}),
])
def test_errors_and_rejections_are_never_sampled(method: str, line: dict[str, object]) -> None:
    clock = Clock()
    sampler = RequestLogSampler(1, clock)
    request_lines(sampler, clock, 1000, per_s=1000)  # one second far above the rate
    clock.now = 1.5
    request_lines(sampler, clock, 10, per_s=1000, first=1500)
    assert sampler.one_in > 1
    for _ in range(100):
        assert sampler(None, method, dict(line)) == line


def test_configured_sampling_drops_lines_from_the_log(capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    configure_logging("info", sample_above_per_s=10, cache=False)
    try:
        (sampler,) = [p for p in structlog.get_config()["processors"]
                      if isinstance(p, RequestLogSampler)]
        clock = Clock()
        sampler.clock = clock
        sampler.window_start = 0.0
        log = structlog.get_logger("fairgate.test")
        for i in range(2000):  # 1000 requests a second for 2 s
            clock.now = i / 1000
            log.info("finished", request_id=f"r{i}", completed=True)
            log.info("rejected", status=429)
        lines = [json.loads(x) for x in capsys.readouterr().err.splitlines()]
    finally:
        configure_logging("info", cache=False)
    assert sum(1 for x in lines if x["event"] == "rejected") == 2000
    finished = [x for x in lines if x["event"] == "finished"]
    # the first second in full, then about 10 a second (one request in 100)
    assert 1000 < len(finished) < 1030
    assert all(x["sampled_one_in"] == 100 for x in finished[1000:])
    configure_logging("info", cache=False)
    assert not any(isinstance(p, RequestLogSampler)
                   for p in structlog.get_config()["processors"])
