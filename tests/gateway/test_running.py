"""Moving running requests on purpose, on plain data: which requests are movable, the
move closes the current response with its reason, and the budget of moves."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from gateway.proxy.completion_request import parse_body
from gateway.proxy.continuation import Progress
from gateway.proxy.endpoints import CHAT
from gateway.proxy.moving import DRAIN, FAILOVER, PREEMPT, Moved, Mover
from gateway.scheduling.running import Running, RunningStreams


class FakeContent:
    def __init__(self) -> None:
        self.exception: BaseException | None = None

    def set_exception(self, exc: BaseException) -> None:
        self.exception = exc


class FakeResponse:
    def __init__(self) -> None:
        self.content = FakeContent()
        self.closed = False

    def close(self) -> None:
        self.closed = True


def stream_progress(prompt_ids: list[int] | None, generated: int = 0) -> Progress:
    progress = Progress.of(parse_body({"model": "m", "messages": [{"role": "user"}],
                                      "max_tokens": 50}, CHAT))
    assert progress is not None
    progress.prompt_ids = prompt_ids
    progress.generated = list(range(generated))
    return progress


def mover(progress: Progress | None = None, whole: bool = False,
          resp: FakeResponse | None = None) -> Mover:
    m = Mover()
    m.progress, m.whole = progress, whole
    if resp is not None:
        m.attach(resp)  # type: ignore[arg-type]
    return m


def record(request_id: str, backend: str, m: Mover, dispatched_s: float = 0.0) -> Running:
    return Running(request_id, "m", "alice", "alice", "default", backend, dispatched_s, m)


def test_a_continuable_stream_is_movable_once_its_token_ids_came() -> None:
    resp = FakeResponse()
    assert not mover(stream_progress(None), resp=resp).movable  # first frame not in yet
    assert not mover(stream_progress([1, 2])).movable  # no response being read
    assert mover(stream_progress([1, 2], 5), resp=resp).movable
    finished = stream_progress([1, 2], 5)
    finished.finish_reason = "length"  # its last token was relayed already
    assert not mover(finished, resp=resp).movable
    assert not mover(None, resp=resp).movable  # a stream that cannot be continued
    assert mover(None, whole=True, resp=resp).movable  # a whole answer is sent again


def test_a_move_closes_the_response_and_leaves_its_reason_for_the_relay() -> None:
    resp = FakeResponse()
    m = mover(stream_progress([1, 2], 3), resp=resp)
    assert m.move(DRAIN)
    assert resp.closed and isinstance(resp.content.exception, Moved), resp.content.exception
    assert isinstance(resp.content.exception, aiohttp.ClientPayloadError)  # a failed read
    assert not m.movable and not m.move(PREEMPT)  # asked once
    assert m.take() == DRAIN and m.take() is None
    with pytest.raises(ValueError, match="on purpose"):
        m.move(FAILOVER)


def test_entries_are_copies_by_backend_oldest_first() -> None:
    running = RunningStreams(lambda: 2)
    resp = FakeResponse()
    a = record("a", "b0", mover(stream_progress([1], 7), resp=resp), dispatched_s=2.0)
    b = record("b", "b1", mover(None, resp=FakeResponse()), dispatched_s=1.0)
    c = record("c", "b0", mover(None, whole=True, resp=FakeResponse()), dispatched_s=1.0)
    for r in (a, b, c):
        running.add(r)
    assert [e.request_id for e in running.entries()] == ["b", "c", "a"]
    on_b0 = running.entries("b0")
    assert [(e.request_id, e.generated, e.movable) for e in on_b0] == [
        ("c", 0, True), ("a", 7, True)], on_b0
    assert running.entries("b1")[0].movable is False
    assert running.count("b0") == 2 and len(running) == 3
    a.backend = "b1"  # a continuation took it elsewhere
    assert [e.request_id for e in running.entries("b1")] == ["b", "a"]
    assert running.count("b0") == 1
    running.remove(c)
    running.remove(c)
    assert [e.request_id for e in running.entries()] == ["b", "a"]


def test_move_backend_moves_only_the_movable_ones_there() -> None:
    running = RunningStreams(lambda: 4)
    responses = [FakeResponse() for _ in range(4)]
    running.add(record("a", "b0", mover(stream_progress([1], 3), resp=responses[0])))
    running.add(record("b", "b0", mover(None, resp=responses[1])))  # not continuable
    running.add(record("c", "b1", mover(stream_progress([1], 3), resp=responses[2])))
    running.add(record("d", "b0", mover(None, whole=True, resp=responses[3])))
    assert running.move_backend("b0", DRAIN) == 2
    assert [r.closed for r in responses] == [True, False, False, True]
    assert running.move_backend("b0", DRAIN) == 0  # asked already
    assert not running.move("nobody", PREEMPT)
    assert running.move("c", PREEMPT) and responses[2].closed


def test_a_request_moved_as_often_as_allowed_is_not_moved_again() -> None:
    cap = [1]
    running = RunningStreams(lambda: cap[0])
    r = record("a", "b0", mover(stream_progress([1], 3), resp=FakeResponse()))
    running.add(r)
    r.moves = 1  # one continuation of a move happened
    assert not running.entries()[0].movable
    assert not running.move("a", PREEMPT)
    cap[0] = 2  # a reload raised the budget
    assert running.move("a", PREEMPT)
    cap[0] = 0
    r2 = record("b", "b0", mover(stream_progress([1], 3), resp=FakeResponse()))
    running.add(r2)
    assert running.move_backend("b0", DRAIN) == 0  # max_moves 0: nothing is ever moved


async def test_a_whole_answer_waiting_for_its_status_line_is_moved_by_cancelling_it() -> None:
    pending: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    m = mover(None, whole=True)
    m.attach_pending(pending)
    assert m.movable and m.move(PREEMPT)
    assert pending.cancelled() and m.take() == PREEMPT
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    done.set_result(None)
    m.attach_pending(done)  # its answer came just now: too late to move
    assert not m.move(PREEMPT) and m.reason is None
