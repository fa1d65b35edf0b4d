"""Prefix locality: a prompt's chain of block hashes, and which queued head a backend
takes when fairness leaves a choice (``routing: locality``).

**The chain.** A prompt's text (chat messages in order, each its role and content; a
completion prompt; an embeddings/Responses input after its instructions) is cut into
chunks of :data:`BLOCK_CHARS` characters (≈ 64 tokens, four of vLLM's 16-token blocks);
each chunk's hash covers its bytes and the previous hash, so two prompts share the first
``n`` hashes exactly when their first ``n`` chunks are equal, as vLLM's chained block
hashes do. Only full chunks count (vLLM caches only full blocks), and only the first
:data:`MAX_BLOCKS` (≈ 2k tokens: enough to tell sessions' system prompts and early turns
apart, bounded in Redis). These hashes are consistent only with themselves: they are not
vLLM's hashes (fairgate does not tokenize), they only predict where an equal prefix went.

**The routing.** ``routing: locality`` is what a model with two or more backends gets by
default (``auto``, :func:`routing_for`); ``least_loaded`` stays an option, and a model
with one backend has nothing to choose.

**The choice** (:func:`choose`, mirrored by ``gateway/storage/lua/dispatch.lua``): when a backend
can take a request of a class, the users whose fairness score is within ``slack`` of the
smallest (at most ``candidates`` of them, in fairness order) are considered, each with the
first few requests of its queue (``lookahead``, 4: a user's own requests may pass each
other, users may not); the request whose chain has the longest prefix in the backend's
index is served, ties to the fairness order (then to the user's oldest). A request with
nothing cached here whose first block another backend holds is left to that backend
unless it is busier than this one by more than ``locality_max_imbalance`` in-flight
requests (bounded-load affinity); a backend that does not take the request (its prompt
range in another length pool, an adapter it lacks) is never waited for. When every
request within the slack is left so, the backend takes none of that class now.
``slack`` 0 is the strict fairness order (each user's oldest request first). A user more
than ``slack`` above the smallest score is never served before the least-served user, so
the fairness bound of the policy grows by ``slack`` at most (``policies/fairness.py``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from policies.request import Prompt

BLOCK_CHARS = 256
DISPATCH_REASONS = ("cache_hit", "load", "fairness_order")
"""Why a dispatched request went to its backend (``gateway/storage/lua/dispatch.lua``): its prefix
index held the prompt's first blocks; placed by load (``routing: least_loaded``, or the
backend holding its prefix was busier than ``locality_max_imbalance`` allows); nothing
cached anywhere, so the fairness order's next request to a backend with room."""
MAX_BLOCKS = 32
HASH_BYTES = 8  # 16 hex characters per block hash


def routing_for(configured: str, backends: int) -> str:
    """How a model with ``backends`` backends routes: ``locality`` or ``least_loaded`` as
    configured; ``auto`` (the default) is locality where there is a choice (two or more
    backends) and least_loaded for one backend (its index would only cost Redis work)."""
    if configured == "auto":
        return "locality" if backends >= 2 else "least_loaded"
    return configured


def _pieces(value: Any) -> Iterator[str]:
    """Text of a prompt, message content or input, in order (content parts, nesting)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, list):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            stack.append(item.get("content", ""))
            stack.append(item.get("text", ""))
        elif isinstance(item, int):
            yield f"{item} "  # token ids: equal ids, equal text


def _prompt_pieces(prompt: Prompt) -> Iterator[str]:
    if prompt.roles:  # a chat: each message's role, then its content
        for role, content in zip(prompt.roles, prompt.text, strict=False):
            yield f"\x1e{role}\x1f"
            yield from _pieces(content)
        return
    if prompt.preamble is not None:
        yield prompt.preamble
    yield from _pieces(prompt.text)


def prompt_text(prompt: Prompt, limit: int = BLOCK_CHARS * MAX_BLOCKS) -> str:
    """The first ``limit`` characters of a request's prompt."""
    out: list[str] = []
    size = 0
    for piece in _prompt_pieces(prompt):
        out.append(piece[: limit - size])
        size += len(out[-1])
        if size >= limit:
            break
    return "".join(out)


def chain(text: str, max_blocks: int = MAX_BLOCKS) -> tuple[str, ...]:
    """Chained hashes of the text's full :data:`BLOCK_CHARS`-character chunks (at most
    ``max_blocks``), each a hex string; a stable function of the text alone."""
    hashes: list[str] = []
    previous = b""
    # chunks by characters, not bytes: equal text prefixes give equal chunks
    for i in range(min(len(text) // BLOCK_CHARS, max_blocks)):
        chunk = text[i * BLOCK_CHARS:(i + 1) * BLOCK_CHARS].encode("utf-8", "surrogatepass")
        previous = hashlib.blake2b(previous + chunk, digest_size=HASH_BYTES).digest()
        hashes.append(previous.hex())
    return tuple(hashes)


def prefix_chain(prompt: Prompt) -> tuple[str, ...]:
    """The block-hash chain of a request's prompt (computed once, at admission)."""
    return chain(prompt_text(prompt))


def matched(hashes: Sequence[str], cached: Container[str]) -> int:
    """How many leading hashes of a chain a backend's index holds."""
    n = 0
    for h in hashes:
        if h not in cached:
            break
        n += 1
    return n


def held_elsewhere(hashes: Sequence[str], others: Sequence[tuple[Container[str], int]],
                   load: int, max_imbalance: int) -> bool:
    """Whether another backend holds the chain's first block and is not busier than this
    one (``load``: its dispatched, unsettled requests) by more than ``max_imbalance``:
    then the request is left for it (bounded-load affinity, as SGLang's router does)."""
    return bool(hashes) and any(hashes[0] in index and other_load <= load + max_imbalance
                                for index, other_load in others)


def choose(users: Sequence[tuple[float, Sequence[Sequence[str]]]], cached: Container[str],
           slack: float, candidates: int,
           elsewhere: Callable[[Sequence[str]], bool] = lambda _: False
           ) -> tuple[int, int] | None:
    """(user, request) to serve among ``users`` — each (score, the chains of the first
    requests of its queue, oldest first) in fairness order, smallest score first — or
    None when every request within the slack is better left to another backend
    (``elsewhere``: see :func:`held_elsewhere`). (0, 0) is the strict fairness choice.
    One level (each user its own tenant) of :func:`within_slack` and :func:`best_cached`,
    which ``policies/fairness.py`` TwoLevel.pick applies at two."""
    if not users or slack <= 0:
        return (0, 0) if users else None

    def reading(request: tuple[int, Sequence[str]]) -> tuple[int, bool]:
        length = matched(request[1], cached)
        return length, length == 0 and elsewhere(request[1])

    near = within_slack([(score, [(0.0, i)]) for i, (score, _) in enumerate(users)], slack,
                        candidates)
    found = best_cached(((i, list(enumerate(users[i][1]))) for i in near), reading)
    return None if found is None else (found[0], found[1][0])


T = TypeVar("T")
R = TypeVar("R")


def within_slack(tenants: Sequence[tuple[float, Sequence[tuple[float, T]]]], slack: float,
                 candidates: int) -> list[T]:
    """The users locality compares under tenants (``gateway/storage/lua/dispatch.lua`` pick()):
    ``tenants`` in fairness order, each (its score, its users in fairness order, each
    (score, user)). The tenants within ``slack`` of the least-served one, and in each the
    users within ``slack`` of its least-served user, at most ``candidates`` users in all,
    in that order; :func:`choose` then picks among them (with no tenants configured each
    tenant has one user and these are the users within the slack, as before)."""
    if not tenants:
        return []
    floor = tenants[0][0]
    found: list[T] = []
    for score, users in tenants[:candidates]:
        if score > floor + slack:
            break
        if not users:
            continue
        least = users[0][0]
        found += [user for s, user in users[:candidates - len(found)] if s <= least + slack]
        if len(found) >= candidates:
            break
    return found


def best_cached(candidates: Iterable[tuple[T, Sequence[R]]],
                reading: Callable[[R], tuple[int, bool]],
                takes: Callable[[R, int], bool] = lambda _, __: True
                ) -> tuple[T, R, int] | None:
    """(candidate, request, its held blocks) to serve among the candidates' requests —
    each candidate (a user within the slack, in fairness order) with the first requests
    of its queue, oldest first: the one whose prefix the backend holds longest
    (``reading``: (held blocks, held elsewhere) as :meth:`LocalityView.matched`), ties to
    the fairness order, then the user's oldest; a request held elsewhere is passed over,
    and so is one the backend does not take (``takes``, given its held blocks). None
    when no request is left."""
    best: tuple[T, R, int] | None = None
    for who, requests in candidates:
        for request in requests:
            length, elsewhere = reading(request)
            if not elsewhere and (best is None or length > best[2]) and takes(request, length):
                best = (who, request, length)
    return best


@dataclass(frozen=True, slots=True)
class LocalityView:
    """What ``gateway/storage/lua/lib/locality.lua`` reads when one backend dispatches: the
    fairness slack (0: strict order) and how many users within it are compared, how many
    requests of each user's queue (``lookahead``), the backend's prefix index, the
    queued requests' chains (a request not listed has none), and for bounded-load
    affinity the other backends' indexes with their requests in flight, this one's, and
    the imbalance a request waits out."""

    slack: float = 0.0
    compared: int = 0
    lookahead: int = 1
    index: Container[str] = frozenset()
    chains: Mapping[str, Sequence[str]] = field(default_factory=dict)
    others: Sequence[tuple[Container[str], int]] = ()
    load: int = 0
    max_imbalance: int = 0
    # whether the other backend at an index of ``others`` takes a request (its prompt
    # range, its adapters; None: each takes any): one that does not is never waited for
    other_takes: Callable[[int, str], bool] | None = None

    def matched(self, request_id: str) -> tuple[int, bool]:
        """(leading blocks of the request's chain the index holds, whether it is left to
        another backend that takes it: nothing held here, its first block there, see
        :func:`held_elsewhere`)."""
        hashes = self.chains.get(request_id, ())
        length = matched(hashes, self.index)
        if length > 0:
            return length, False
        takes = self.other_takes
        others = self.others if takes is None else [
            other for i, other in enumerate(self.others) if takes(i, request_id)]
        return 0, held_elsewhere(hashes, others, self.load, self.max_imbalance)


@dataclass(slots=True)
class PrefixIndex:
    """One backend's prefix index (``gateway/storage/lua/lib/locality.lua``): the block hashes of
    the prompts sent to it, each with its last use (s); at most ``size`` hashes (0: no
    index, ``routing: least_loaded``), each forgotten ``ttl_s`` after its last use."""

    size: int
    ttl_s: float
    used: dict[str, float] = field(default_factory=dict)

    def record(self, hashes: Sequence[str] | None, now: float, slack: float,
               others: Sequence[Container[str]] = ()) -> tuple[int, int, str]:
        """Record a granted prompt's chain (``None``: not hashed) as used ``now``; returns
        what the index held before (leading blocks, blocks of the chain) and why the
        request went here (:data:`DISPATCH_REASONS`; ``others``: the other backends'
        indexes, one holding its first block means it went here by load)."""
        if self.size <= 0 or hashes is None:
            return 0, 0, "load"
        held = 0
        for i, h in enumerate(hashes):
            if h in self.used and held == i:
                held += 1
            self.used[h] = now
        if held > 0:
            return held, len(hashes), "cache_hit"
        if slack > 0 and not (hashes and any(hashes[0] in o for o in others)):
            return 0, len(hashes), "fairness_order"
        return 0, len(hashes), "load"

    def trim(self, now: float) -> None:
        """Forget the hashes unused for ``ttl_s``, then all but the ``size`` most recently
        used (ties: the greater hash kept, as a Redis zset ranks them)."""
        if self.size <= 0:
            return
        kept = sorted((t, h) for h, t in self.used.items() if t > now - self.ttl_s)
        self.used = {h: t for t, h in kept[-self.size:]}
