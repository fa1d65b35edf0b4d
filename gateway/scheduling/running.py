"""Every request this process dispatched and has not settled, and moving them on purpose.

One :class:`RunningStreams` per process, built in the composition root
(``gateway/services.py``). :class:`~gateway.scheduling.admission.Admission` registers
each dispatched request (streamed or not, from the OpenAI routes and the Batch API) for
as long as it holds its grant, and updates its backend when a continuation takes it
elsewhere. A drain (``gateway/scheduling/migrate.py``) or preemption asks it to move a
request: its current upstream response closes and the relay continues the answer on
another backend (``gateway/proxy/moving.py``) with the move's reason.

Moves on purpose have their own budget (the ``max_moves`` setting), apart from the
``continue_attempts`` of failures: a request moved that often is not moved again, so a
stream moved twice never ends with an error for want of failover attempts.

It also counts the tokens its streams served per model (:meth:`RunningStreams.served`:
prompt and generated tokens of the continuable streams, running or over), the measure
preemption's recompute budget is a part of (``policies/preemption.py``
``recompute_allowance``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gateway.proxy.moving import Mover


@dataclass(frozen=True, slots=True)
class RunningEntry:
    """What one running request looks like now (a copy: it does not change)."""

    request_id: str  # the queued request's id (the one in Redis)
    model: str
    user: str
    tenant: str
    klass: str
    backend: str  # where it runs now (a continuation's backend once it moved)
    dispatched_s: float  # monotonic
    generated: int  # tokens generated so far (continuable streams; 0 otherwise)
    moves: int  # how often it was moved on purpose
    movable: bool  # a continuation would reproduce the rest exactly, right now
    streamed: bool = False  # a continuable stream: ``generated`` is exact


@dataclass(slots=True)
class Running:
    """A registered request (the scheduler's record; :meth:`RunningStreams.entries`
    hands out copies)."""

    request_id: str
    model: str
    user: str
    tenant: str
    klass: str
    backend: str
    dispatched_s: float
    mover: Mover
    moves: int = 0  # continuation attempts of moves on purpose
    segment: str = ""  # the request id of the segment on ``backend`` ("": the original)

    def entry(self, max_moves: int) -> RunningEntry:
        return RunningEntry(self.request_id, self.model, self.user, self.tenant, self.klass,
                            self.backend, self.dispatched_s, self.mover.generated,
                            self.moves, self.movable(max_moves),
                            self.mover.progress is not None)

    def movable(self, max_moves: int) -> bool:
        return self.moves < max_moves and self.mover.movable

    @property
    def tokens(self) -> int:
        """Prompt and generated tokens of its stream so far (0: not continuable): what
        it served, and what a continuation sends again."""
        progress = self.mover.progress
        if progress is None:
            return 0
        return len(progress.prompt_ids or ()) + len(progress.generated)


class RunningStreams:
    """The running requests of this process, by request id."""

    def __init__(self, max_moves: Callable[[], int]) -> None:
        self.max_moves = max_moves  # read at each move: a reload may change it
        self._running: dict[str, Running] = {}
        self._served: dict[str, int] = {}  # model → tokens of the streams over

    def add(self, record: Running) -> None:
        self._running[record.request_id] = record

    def remove(self, record: Running) -> None:
        if self._running.get(record.request_id) is record:
            del self._running[record.request_id]
            self._served[record.model] = self._served.get(record.model, 0) + record.tokens

    def served(self, model: str) -> int:
        """Tokens this process's streams of ``model`` served (prompt and generated, of
        the continuable ones), running or over."""
        return self._served.get(model, 0) + sum(
            r.tokens for r in self._running.values() if r.model == model)

    def tokens(self, request_id: str) -> int:
        """What moving the request would send again (0: unknown here)."""
        record = self._running.get(request_id)
        return 0 if record is None else record.tokens

    def __len__(self) -> int:
        return len(self._running)

    def count(self, backend: str) -> int:
        return sum(1 for r in self._running.values() if r.backend == backend)

    def streaming(self, backend: str) -> int:
        """The requests ``backend`` streams tokens of now (:attr:`Mover.streaming`)."""
        return sum(1 for r in self._running.values()
                   if r.backend == backend and r.mover.streaming)

    def entries(self, backend: str | None = None) -> list[RunningEntry]:
        """The running requests (on ``backend`` only, when given), oldest first."""
        cap = self.max_moves()
        return sorted((r.entry(cap) for r in self._running.values()
                       if backend is None or r.backend == backend),
                      key=lambda e: e.dispatched_s)

    def move(self, request_id: str, reason: str) -> bool:
        """Ask the request to continue elsewhere (``reason``: drain or preempt); ``True``
        when it was asked, ``False`` when it is unknown, not movable now, or was moved as
        often as ``max_moves`` allows."""
        record = self._running.get(request_id)
        if record is None or not record.movable(self.max_moves()):
            return False
        return record.mover.move(reason)

    def move_backend(self, backend: str, reason: str) -> int:
        """Ask every movable request on ``backend`` to continue elsewhere; how many were
        asked."""
        return sum(self.move(r.request_id, reason) for r in list(self._running.values())
                   if r.backend == backend)
