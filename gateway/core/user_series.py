"""Bounded per-user views: label values for per-user series, and service shares.

Per-user series are bounded: :class:`UserLabels` gives at most ``top_users`` users a
label of their own and counts everyone else as ``other`` (see its docstring), and no label
is longer than ``MAX_LABEL_CHARS`` whatever a client names its end users.
"""

from __future__ import annotations

import hashlib
import math

OTHER_USERS = "other"
SHARE_HALF_LIFE_S = 60.0
MAX_SHARE_USERS = 1000
MAX_LABEL_CHARS = 128
_DIGEST_BYTES = 4  # 8 hex characters keep two long names that share a prefix apart


def label_value(user: str) -> str:
    """``user`` as a label value of at most ``MAX_LABEL_CHARS`` characters: a longer name
    keeps its head and ends with ``~`` and a digest of the whole name."""
    if len(user) <= MAX_LABEL_CHARS:
        return user
    digest = hashlib.blake2b(user.encode(errors="surrogatepass"),
                             digest_size=_DIGEST_BYTES).hexdigest()
    return f"{user[:MAX_LABEL_CHARS - 1 - len(digest)]}~{digest}"


class UserLabels:
    """Bounded user label values for per-user series.

    The first ``top_n`` users seen while a slot is free keep their own label; everyone
    else is ``other``. A labelled user idle for ``idle_s`` loses its slot (its series are
    removed) so a currently active user can take it. Labels are sticky while active, so
    counters stay monotonic per series.
    """

    def __init__(self, top_n: int, idle_s: float) -> None:
        self.top_n = top_n
        self.idle_s = idle_s
        self.last_seen: dict[str, float] = {}
        self._next_sweep = 0.0

    def label(self, user: str, now: float) -> tuple[str, list[str]]:
        """(label for ``user``, labels whose slot was just recycled)."""
        user = label_value(user)
        if user in self.last_seen:
            self.last_seen[user] = now
            return user, []
        expired: list[str] = []
        if len(self.last_seen) >= self.top_n and now >= self._next_sweep:
            self._next_sweep = now + 1.0  # a flood of `other` users must not scan each time
            expired = [u for u, t in self.last_seen.items() if now - t > self.idle_s]
            for u in expired:
                del self.last_seen[u]
        if len(self.last_seen) < self.top_n:
            self.last_seen[user] = now
            return user, expired
        return OTHER_USERS, expired


class ServiceShares:
    """Exponentially decayed service per user (this replica's view), for the dashboard."""

    def __init__(self, half_life_s: float = SHARE_HALF_LIFE_S) -> None:
        self.rate = math.log(2) / half_life_s
        self.values: dict[str, tuple[float, float]] = {}  # user -> (value, at)

    def add(self, user: str, amount: float, now: float) -> None:
        value, at = self.values.get(user, (0.0, now))
        self.values[user] = (value * math.exp(-self.rate * (now - at)) + amount, now)
        if len(self.values) > MAX_SHARE_USERS:
            smallest = min(self.values, key=lambda u: self.values[u][0])
            del self.values[smallest]

    def shares(self, now: float) -> dict[str, float]:
        decayed = {u: v * math.exp(-self.rate * (now - at)) for u, (v, at) in self.values.items()}
        total = sum(decayed.values())
        if total <= 0:
            return {}
        return {u: v / total for u, v in sorted(decayed.items(), key=lambda kv: -kv[1])}
