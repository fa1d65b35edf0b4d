"""One dispatch decision for one backend, on plain data: ``dispatch_for`` in
``gateway/storage/lua/lib/dispatch.lua`` composes the rules of this package in this order,
and :class:`Dispatch` states that composition (``tests/store/test_lua_dispatch_spec.py``
holds the decision, as ``dispatch.lua`` runs it, to it).

Classes are tried in service order. While the class's gate admits one more request
(``policies/gates.py`` Gate.admits: sent since the snapshot plus the starts that filled
its free slots under the burst, or fewer in flight than the occupancy bound) and fewer
than ``want`` were granted, the class's fairness engine picks (``policies/fairness.py``
TwoLevel: strict order, or the locality slack; only what the backend's prompt range
takes). A request whose replica is not alive (``policies/replicas.py``) is dropped at its
turn, charged nothing. Over the class's prefill-token limit the pick waits for a backend
with room (``policies/prefill.py``): for ``backfill_s`` after it was first held a smaller
request that fits the room may pass it, then the class stops here. A granted request is
charged the dispatch cost of its prompt tokens the backend's prefix index predicts
uncached, ranked among its user's requests in flight (``policies/priority.py``), counted
as sent and as pending prefill, and its prompt's chain is recorded in the index
(``policies/locality.py`` PrefixIndex); the index is trimmed after a decision that
granted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from policies.fairness import Pick, TwoLevel
from policies.gates import Gate
from policies.locality import LocalityView, PrefixIndex, matched
from policies.prefill import TOKENS_PER_BLOCK, Pool, PromptRange, prefill_fits, uncached_tokens
from policies.priority import InFlight

MAX_ATTEMPTS = 64  # picks per class in one decision (dropped requests count too)


@dataclass(frozen=True, slots=True)
class ClassTurn:
    """One class's turn in a decision: its gate and its prefill-token limit (0: none)."""

    name: str
    gate: Gate
    prefill_limit: int = 0


@dataclass(frozen=True, slots=True)
class Affinity:
    """The locality settings of a decision (``routing: locality``; a slack of 0: strict
    fairness order): users compared within the slack, requests looked at in each queue,
    the other backends' indexes with their requests in flight, the imbalance a request
    whose prefix another backend holds waits out."""

    slack: float = 0.0
    compared: int = 0
    lookahead: int = 1
    others: Sequence[tuple[frozenset[str], int]] = ()
    max_imbalance: int = 0


@dataclass(slots=True)
class BackendState:
    """What a decision reads and changes of one backend: its requests in flight (ranks,
    count, sent since the snapshot), those started since the snapshot, the pending
    prefill by request, its prefix index, whether it is drained."""

    inflight: InFlight = field(default_factory=InFlight)
    started: set[str] = field(default_factory=set)
    prefill: dict[str, int] = field(default_factory=dict)
    index: PrefixIndex = field(default_factory=lambda: PrefixIndex(0, 0.0))
    drained: bool = False

    def start(self, request_id: str) -> None:
        """A granted request's first token, after the snapshot: it no longer counts as
        sent, its prefill is done, it took a batch slot (``start_inflight`` in
        ``lua/lib/inflight.lua``)."""
        self.inflight.sent.discard(request_id)
        self.prefill.pop(request_id, None)
        self.started.add(request_id)

    def release(self, request_id: str, user: str) -> None:
        """A granted request settled (or was reaped): out of the in-flight state."""
        self.inflight.release(request_id, user)
        self.prefill.pop(request_id, None)
        self.started.discard(request_id)


@dataclass(frozen=True, slots=True)
class Granted:
    """A grant, with what the prefix index held of its chain before it was recorded."""

    request_id: str
    klass: str
    user: str
    rank: int
    owner: str
    charged: int  # the prompt tokens its dispatch cost charged (predicted uncached)
    held_blocks: int
    blocks: int
    reason: str


@dataclass(slots=True)
class Dispatch:
    """A model's queued requests as a decision sees them: each class's engine, and per
    request the replica holding its client, its prompt's chain and when the prefill gate
    first held it."""

    engines: dict[str, TwoLevel] = field(default_factory=dict)
    owners: dict[str, str] = field(default_factory=dict)
    chains: dict[str, list[str]] = field(default_factory=dict)
    held_at: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)  # estimated prompt tokens

    def depth(self) -> int:
        """The requests queued for the model, all classes."""
        return sum(len(q) for e in self.engines.values()
                   for q in [*e.queues.values(), *e.session_queues.values()])

    def decide(self, backend: BackendState, turns: Sequence[ClassTurn], want: int,
               now: float, alive: Callable[[str], bool], prompt_range: PromptRange,
               affinity: Affinity, backfill_s: float = 0.0) -> list[Granted]:
        """Up to ``want`` grants for the backend (none when it is drained)."""
        grants: list[Granted] = []
        if backend.drained:
            return grants
        load = backend.inflight.on_backend
        for turn in turns:
            engine = self.engines.setdefault(turn.name, TwoLevel(by_session=False))
            attempts = 0
            while (self._admits(backend, turn.gate) and len(grants) < want
                   and attempts < MAX_ATTEMPTS):
                attempts += 1
                pick = self._pick(engine, backend, prompt_range, affinity, load, None)
                if pick is None:
                    break
                valid = alive(self.owners[pick.request_id])
                room = self._hold(backend, turn, pick, now, backfill_s) if valid else None
                if room is False:
                    break
                if room is not None:
                    pick = self._pick(engine, backend, prompt_range, affinity, load, room)
                    if pick is None:
                        break
                    valid = alive(self.owners[pick.request_id])
                if not valid:
                    engine.serve(pick, charged=False)
                    continue
                grants.append(self._grant(engine, backend, turn.name, pick, now, affinity))
        if grants:
            backend.index.trim(now)
        return grants

    @staticmethod
    def _admits(backend: BackendState, gate: Gate) -> bool:
        return gate.admits(len(backend.inflight.sent), len(backend.started),
                           backend.inflight.on_backend)

    def _pick(self, engine: TwoLevel, backend: BackendState, prompt_range: PromptRange,
              affinity: Affinity, load: int, room: int | None) -> Pick | None:
        pool = Pool(prompt_range, self.tokens, TOKENS_PER_BLOCK)
        view = LocalityView(affinity.slack, affinity.compared, affinity.lookahead,
                            frozenset(backend.index.used), self.chains, affinity.others,
                            load, affinity.max_imbalance)
        return engine.pick(pool, view, room)

    def _uncached(self, backend: BackendState, pick: Pick) -> int:
        """The pick's prompt tokens the backend's prefix index predicts uncached."""
        tokens = self.tokens.get(pick.request_id, 0)
        if tokens <= 0 or backend.index.size <= 0:
            return tokens
        held = pick.held_blocks
        if held is None:
            held = matched(self.chains.get(pick.request_id, ()), backend.index.used)
        return uncached_tokens(tokens, held)

    def _hold(self, backend: BackendState, turn: ClassTurn, pick: Pick, now: float,
              backfill_s: float) -> int | bool | None:
        """None: the pick fits the prefill gate; the room a backfill may use; False: the
        class stops here (held for ``backfill_s`` already)."""
        pending = sum(backend.prefill.values())
        limit = turn.prefill_limit
        if prefill_fits(pending, self._uncached(backend, pick), limit):
            return None
        since = self.held_at.setdefault(pick.request_id, now)
        if now - since >= backfill_s:
            return False
        return limit - pending

    def _grant(self, engine: TwoLevel, backend: BackendState, klass: str, pick: Pick,
               now: float, affinity: Affinity) -> Granted:
        tokens = self._uncached(backend, pick)
        engine.serve(pick, tokens)
        rank, _ = backend.inflight.grant(pick.request_id, pick.user)
        if tokens > 0:
            backend.prefill[pick.request_id] = tokens
        chain = self.chains.get(pick.request_id)  # None: not hashed
        held, blocks, reason = backend.index.record(
            chain, now, affinity.slack, [index for index, _ in affinity.others])
        return Granted(pick.request_id, klass, pick.user, rank, self.owners[pick.request_id],
                       tokens, held, blocks, reason)
