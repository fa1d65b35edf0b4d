"""Who counts as backlogged in a window: a request outstanding throughout (the benches'
measure), or waiting in the gateway's queue throughout (VTC's)."""

from __future__ import annotations

from loadtest.bench.client import Result
from loadtest.bench.stats import backlogged, queued


def request(user: str, sent: float, end: float, wait: float | None, status: int = 200
            ) -> Result:
    result = Result(user, "t", 100, sent, end_s=end, status=status)
    result.queue_wait_s = wait
    if status == 200:
        result.first_token_s = sent + (wait or 0.0) + 0.01
    return result


def test_a_user_whose_requests_run_at_once_is_outstanding_but_not_waiting() -> None:
    results = [request("busy", 0.0, 6.0, 0.001), request("busy", 5.9, 12.0, 0.001),
               request("queued", 0.0, 7.0, 6.0), request("queued", 5.0, 13.0, 7.0)]
    assert backlogged(results, 1.0, 11.0) == {"busy", "queued"}
    assert queued(results, 1.0, 11.0) == {"queued"}, queued(results, 1.0, 11.0)


def test_a_gap_in_the_queue_ends_the_waiting() -> None:
    results = [request("u", 0.0, 9.0, 4.0), request("u", 5.0, 12.0, 6.0)]  # empty 4–5 s
    assert queued(results, 1.0, 11.0) == set()
    assert queued(results, 5.5, 10.5) == {"u"}


def test_a_request_cut_off_before_any_answer_waited_to_its_end() -> None:
    results = [request("u", 0.0, 12.0, None, status=0),  # the run ended while it queued
               request("direct", 0.0, 12.0, None)]  # answered without a gateway: no queue
    assert queued(results, 1.0, 11.0) == {"u"}
