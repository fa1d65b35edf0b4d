"""An exact index of the KV blocks each backend caches, from its KV events (pure: no I/O).

A vLLM server started with ``--kv-events-config`` publishes numbered batches of events
(``docs/vllm-pd-and-kv-events.md``): ``BlockStored`` (blocks now findable by their hash),
``BlockRemoved`` (evicted) and ``AllBlocksCleared`` (prefix cache reset). The gateway's
subscriber decodes them (``gateway/backends/kv_events.py``) into the plain events below
and hands each batch to :meth:`KVBlockIndex.receive` with its sequence number.

**What is held.** A hash may be cached in two physical blocks at once (two requests with
the same prefix computed concurrently); vLLM publishes one ``BlockStored`` and one
``BlockRemoved`` per physical block, so the index counts holders per hash and a hash is
held while its count is above zero. Only the device tier (``medium`` ``GPU`` or unset) of
KV-cache group 0 (full attention) is indexed: an offloading tier's events describe
another cache, and a hybrid model's other groups hash other blocks.

**Knowing versus guessing.** Each backend's view is in one of three states:

- ``exact``: every batch from the publisher's first (sequence 0), or since a cache reset,
  was applied in order: the held set is the server's.
- ``unknown``: a batch is missing (a gap in the sequence numbers, or the subscriber joined
  after the first batch). Later batches are kept, up to ``max_pending``, and nothing is
  scored until the missing ones arrive (:meth:`KVBlockIndex.replay_from` says where the
  server's replay socket should start) or an ``AllBlocksCleared`` makes the past
  irrelevant.
- ``partial``: the replay could not fill the gap (:meth:`KVBlockIndex.replay_done`, or too
  many batches kept): the index forgets everything and learns forward. A block it then
  holds is certainly cached (a lower bound: a removal of a block it never saw stored is
  ignored), so scores stay safe to use; blocks stored before are missed.

A batch numbered 0 that is not a replay means the publisher started again (the server
restarted): the view is emptied and ``exact`` again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

BlockHash = int | bytes  # vLLM's ExternalBlockHash: a 64-bit int by default, else bytes
State = Literal["exact", "unknown", "partial"]
DEVICE_MEDIA = frozenset({None, "GPU"})
DEFAULT_MAX_PENDING = 4096


@dataclass(frozen=True, slots=True)
class Stored:
    """``BlockStored``: ``hashes`` (a chain: each block's parent is the previous one, the
    first one's is ``parent``) now cached, holding ``token_ids``."""

    hashes: tuple[BlockHash, ...]
    parent: BlockHash | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int = 16
    lora_name: str | None = None
    medium: str | None = None
    group: int | None = None


@dataclass(frozen=True, slots=True)
class Removed:
    """``BlockRemoved``: one physical block of each of ``hashes`` evicted."""

    hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group: int | None = None


@dataclass(frozen=True, slots=True)
class Cleared:
    """``AllBlocksCleared``: the prefix cache was reset."""


Event = Stored | Removed | Cleared


def indexed(event: Stored | Removed) -> bool:
    """True for the events of the device tier's full-attention group."""
    return event.medium in DEVICE_MEDIA and event.group in (None, 0)


@dataclass(slots=True)
class BackendView:
    """One backend's held blocks and where its event stream stands."""

    state: State = "exact"
    next_seq: int = 0  # the sequence number of the next batch to apply
    holders: dict[BlockHash, int] = field(default_factory=dict)
    pending: dict[int, tuple[Event, ...]] = field(default_factory=dict)
    block_size: int | None = None
    state_before_gap: State = "exact"

    def apply(self, events: Iterable[Event]) -> None:
        """Apply one batch's events in order."""
        holders = self.holders
        for event in events:
            if isinstance(event, Cleared):
                holders.clear()
            elif not indexed(event):
                continue
            elif isinstance(event, Stored):
                for block_hash in event.hashes:
                    holders[block_hash] = holders.get(block_hash, 0) + 1
                if len(event.token_ids) == event.block_size * len(event.hashes):
                    self.block_size = event.block_size  # full blocks: the server's size
            else:
                for block_hash in event.hashes:
                    count = holders.get(block_hash, 0)
                    if count > 1:
                        holders[block_hash] = count - 1
                    elif count == 1:
                        del holders[block_hash]

    def held_run(self, hashes: Sequence[BlockHash]) -> int:
        """How many of ``hashes``, from the first, are held without a break."""
        holders = self.holders
        run = 0
        for block_hash in hashes:
            if block_hash not in holders:
                break
            run += 1
        return run


class KVBlockIndex:
    """Backends' held blocks, kept exact from their numbered event batches."""

    def __init__(self, max_pending: int = DEFAULT_MAX_PENDING) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        self.max_pending = max_pending
        self._views: dict[str, BackendView] = {}

    def backends(self) -> list[str]:
        """Backends with a view."""
        return list(self._views)

    def view(self, backend: str) -> BackendView | None:
        """``backend``'s view (None before its first batch)."""
        return self._views.get(backend)

    def state(self, backend: str) -> State | None:
        """``backend``'s state (None before its first batch)."""
        view = self._views.get(backend)
        return None if view is None else view.state

    def receive(
        self, backend: str, seq: int, events: Sequence[Event], *, replayed: bool = False
    ) -> None:
        """Apply batch ``seq`` of ``backend``'s stream (``replayed``: it came from the
        replay socket, so a 0 there is not a restart)."""
        view = self._views.setdefault(backend, BackendView())
        batch = tuple(events)
        if seq == 0 and not replayed and view.next_seq > 0:
            self._views[backend] = view = BackendView()  # the publisher started again
        if seq < view.next_seq:
            return  # already applied (a replay overlapping the live stream)
        if seq > view.next_seq:
            self._hold(view, seq, batch, replayed)
            return
        view.apply(batch)
        view.next_seq = seq + 1
        self._drain(view)

    def replay_from(self, backend: str) -> int | None:
        """The first sequence number ``backend``'s replay socket should send, while its
        view waits for missing batches; None otherwise."""
        view = self._views.get(backend)
        if view is None or view.state != "unknown":
            return None
        return view.next_seq

    def replay_done(self, backend: str) -> None:
        """The replay ended: a gap it did not fill can no longer be filled, so the view
        forgets what it held and learns forward (``partial``)."""
        view = self._views.get(backend)
        if view is not None and view.state == "unknown":
            self._give_up(view, min(view.pending, default=view.next_seq))

    def reset(self, backend: str) -> None:
        """``backend`` restarted with an empty cache (seen by other means): ``exact``,
        empty, expecting its publisher's first batch."""
        self._views[backend] = BackendView()

    def forget(self, backend: str) -> None:
        """Drop ``backend``'s view (it left the pool, or its subscription ended)."""
        self._views.pop(backend, None)

    def held_blocks(self, backend: str, hashes: Sequence[BlockHash]) -> int | None:
        """The longest run of ``hashes`` (a prompt's block hashes, from its first block)
        that ``backend`` holds; None when its view is ``unknown`` or absent."""
        view = self._views.get(backend)
        if view is None or view.state == "unknown":
            return None
        return view.held_run(hashes)

    def cached_tokens(
        self, hashes_for: Callable[[int], Sequence[BlockHash]], backends: Iterable[str]
    ) -> dict[str, int | None]:
        """Prompt tokens each of ``backends`` holds from the start of a prompt whose block
        hashes at a block size are ``hashes_for(block_size)`` (computed once per size);
        None for a backend whose view is unknown or that has not told its block size."""
        by_size: dict[int, Sequence[BlockHash]] = {}
        scores: dict[str, int | None] = {}
        for backend in backends:
            view = self._views.get(backend)
            size = None if view is None else view.block_size
            if view is None or view.state == "unknown" or size is None:
                scores[backend] = None
                continue
            if size not in by_size:
                by_size[size] = hashes_for(size)
            scores[backend] = view.held_run(by_size[size]) * size
        return scores

    def _hold(self, view: BackendView, seq: int, batch: tuple[Event, ...], replayed: bool) -> None:
        view.pending[seq] = batch
        if replayed:
            # the replay starts after the batch we need: the server no longer has it
            self._give_up(view, min(view.pending))
            return
        if view.state != "unknown":
            view.state_before_gap, view.state = view.state, "unknown"
        if any(isinstance(event, Cleared) for event in batch):
            self._restart_at_clear(view, seq, batch)
        elif len(view.pending) > self.max_pending:
            self._give_up(view, min(view.pending))

    @staticmethod
    def _restart_at_clear(view: BackendView, seq: int, batch: tuple[Event, ...]) -> None:
        """A reset inside batch ``seq`` makes every earlier batch irrelevant: the view is
        exact again from there."""
        last_clear = max(i for i, event in enumerate(batch) if isinstance(event, Cleared))
        for stale in [s for s in view.pending if s <= seq]:
            del view.pending[stale]
        view.holders.clear()
        view.apply(batch[last_clear:])
        view.next_seq = seq + 1
        view.state, view.state_before_gap = "unknown", "exact"
        KVBlockIndex._drain(view)

    @staticmethod
    def _give_up(view: BackendView, resume_at: int) -> None:
        view.holders.clear()
        view.state, view.state_before_gap = "unknown", "partial"
        view.next_seq = resume_at
        KVBlockIndex._drain(view)

    @staticmethod
    def _drain(view: BackendView) -> None:
        pending = view.pending
        while view.next_seq in pending:
            view.apply(pending.pop(view.next_seq))
            view.next_seq += 1
        if view.state == "unknown" and not pending:
            view.state = view.state_before_gap


def held_by(index: KVBlockIndex, backends: Iterable[str]) -> Mapping[str, frozenset[BlockHash]]:
    """Each backend's held hashes (for tests and the admin view)."""
    result: dict[str, frozenset[BlockHash]] = {}
    for backend in backends:
        view = index.view(backend)
        result[backend] = frozenset() if view is None else frozenset(view.holders)
    return result
