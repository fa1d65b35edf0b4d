"""One log line's parts as the gateway configures them: the timestamp, the JSON and where the
line is written."""

from __future__ import annotations

import json
from typing import Any

import pytest
import structlog

from gateway.core.logs import (
    LevelAndTime,
    bind_request,
    clear_request,
    configure_logging,
    json_line,
)


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_level_and_timestamp_to_the_microsecond_across_seconds() -> None:
    clock = Clock(1_765_127_842.5)  # 2025-12-07T17:17:22.5 UTC
    stamp = LevelAndTime(clock)
    seen = []
    for now, method in ((1_765_127_842.5, "info"), (1_765_127_842.75, "warn"),
                        (1_765_127_843.0, "exception"), (1_765_127_903.25, "debug")):
        clock.now = now
        event = stamp(None, method, {"event": "x"})
        seen.append((event["level"], event["timestamp"]))
    assert seen == [("info", "2025-12-07T17:17:22.500000Z"),
                    ("warning", "2025-12-07T17:17:22.750000Z"),
                    ("error", "2025-12-07T17:17:23.000000Z"),
                    ("debug", "2025-12-07T17:18:23.250000Z")], seen


def test_a_line_orjson_cannot_write_is_written_by_json() -> None:
    class Opaque:
        def __repr__(self) -> str:
            return "<opaque>"

    big = 2**70  # beyond 64 bits: orjson refuses it
    event: dict[Any, Any] = {"event": "x", "n": big, "o": Opaque(), 3: "k"}
    line = json_line(None, "info", event)
    assert line.endswith(b"\n") and line.count(b"\n") == 1, line
    assert json.loads(line) == {"event": "x", "n": big, "o": "<opaque>", "3": "k"}, line
    assert json_line(None, "info", {"event": "y", "o": Opaque()}) == \
        b'{"event":"y","o":"<opaque>"}\n'


def test_lines_reach_a_swapped_stderr_with_the_request_fields(
        capsys: pytest.CaptureFixture[str]) -> None:
    """pytest's capture stands in sys.stderr: the lines go there, one JSON object each,
    with the fields bound for the request until they are cleared."""
    configure_logging("info", cache=False)
    log = structlog.get_logger("fairgate.test")
    bind_request(request_id="r1", user="alice")
    bind_request(model="m")
    log.info("finished", backend="b1", user="line's own")
    log.debug("queued")  # below the level
    clear_request()
    log.warning("after")
    lines = [json.loads(x) for x in capsys.readouterr().err.splitlines()]
    assert [(x["event"], x["level"]) for x in lines] == [("finished", "info"),
                                                          ("after", "warning")], lines
    assert {k: lines[0][k] for k in ("request_id", "user", "model", "backend")} == \
        {"request_id": "r1", "user": "line's own", "model": "m", "backend": "b1"}, lines
    assert "request_id" not in lines[1], lines
