"""The two waiting queues of vLLM V1 (``vllm/v1/core/sched/request_queue.py``).

``FcfsQueue`` serves in arrival order and puts preempted requests back at the front;
``PriorityQueue`` is a heap on ``(priority, arrival)`` (lower first), so a preempted
request simply re-enters at its original rank.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from loadtest.sim.sequence import Sequence


class WaitingQueue(Protocol):
    """What the scheduler needs from a waiting queue."""

    def add(self, seq: Sequence) -> None: ...
    def prepend(self, seq: Sequence) -> None: ...
    def peek(self) -> Sequence: ...
    def pop(self) -> Sequence: ...
    def remove(self, seq: Sequence) -> None: ...
    def __len__(self) -> int: ...
    def ordered(self) -> list[Sequence]: ...


class FcfsQueue:
    """First come, first served; priority is ignored."""

    def __init__(self) -> None:
        self._items: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        """Append at the back."""
        self._items.append(seq)

    def prepend(self, seq: Sequence) -> None:
        """Put a preempted request at the front."""
        self._items.appendleft(seq)

    def peek(self) -> Sequence:
        """The next request to schedule."""
        return self._items[0]

    def pop(self) -> Sequence:
        """Remove and return the next request."""
        return self._items.popleft()

    def remove(self, seq: Sequence) -> None:
        """Remove a request (abort)."""
        self._items.remove(seq)

    def __len__(self) -> int:
        return len(self._items)

    def ordered(self) -> list[Sequence]:
        """Requests in the order they would be scheduled."""
        return list(self._items)


class PriorityQueue:
    """Lowest ``(priority, arrival)`` first."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Sequence]] = []
        self._counter = itertools.count()

    def add(self, seq: Sequence) -> None:
        """Insert at its ``(priority, arrival)`` rank."""
        heapq.heappush(self._heap, (seq.priority, seq.arrival_s, next(self._counter), seq))

    def prepend(self, seq: Sequence) -> None:
        """A preempted request keeps its rank (vLLM does the same)."""
        self.add(seq)

    def peek(self) -> Sequence:
        """The next request to schedule."""
        return self._heap[0][3]

    def pop(self) -> Sequence:
        """Remove and return the next request."""
        return heapq.heappop(self._heap)[3]

    def remove(self, seq: Sequence) -> None:
        """Remove a request (abort); O(n), aborts are rare."""
        self._heap = [item for item in self._heap if item[3] is not seq]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def ordered(self) -> list[Sequence]:
        """Requests in the order they would be scheduled."""
        return [item[3] for item in sorted(self._heap, key=lambda i: i[:3])]
