"""Failed dashboard logins per client address: the decision, without I/O.

A client that failed ``max_failures`` logins within one window of ``window_s`` (the window
opens at its first failure) is refused further tries until that window ends: a guess of
the admin key costs a wait instead of a round trip. A success does not clear the count (a
client holding one key could otherwise probe others between its own logins).

Bounded: at most ``max_clients`` addresses are remembered; when full, the windows that
ended are forgotten first, then the oldest, so a flood from many addresses costs memory
no longer than the table (and only weakens the throttle for the addresses it pushes out).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True)
class _Window:
    opened_s: float
    failures: int


class LoginFailures:
    """The failure windows of the clients seen lately (one process's: each replica and
    worker counts its own)."""

    def __init__(self, max_clients: int = 10_000) -> None:
        self.max_clients = max_clients
        self._windows: dict[str, _Window] = {}

    def retry_after_s(self, client: str, now_s: float, max_failures: int,
                      window_s: float) -> int | None:
        """Seconds until ``client`` may try again, or None: it may now."""
        window = self._windows.get(client)
        if window is None or now_s - window.opened_s >= window_s:
            return None
        if window.failures < max_failures:
            return None
        return max(1, math.ceil(window.opened_s + window_s - now_s))

    def failed(self, client: str, now_s: float, window_s: float) -> None:
        window = self._windows.get(client)
        if window is not None and now_s - window.opened_s < window_s:
            window.failures += 1
            return
        self._windows.pop(client, None)  # re-inserted last: the table stays oldest first
        if len(self._windows) >= self.max_clients:
            self._forget(now_s, window_s)
        self._windows[client] = _Window(now_s, 1)

    def _forget(self, now_s: float, window_s: float) -> None:
        ended = [c for c, w in self._windows.items() if now_s - w.opened_s >= window_s]
        for client in ended:
            del self._windows[client]
        while len(self._windows) >= self.max_clients:
            del self._windows[next(iter(self._windows))]

    def __len__(self) -> int:
        return len(self._windows)
