"""The step planner: vLLM V1's scheduling loop as plain, synchronous code.

No clock, no I/O: ``schedule()`` decides what the next step computes and ``update()``
applies its result, so tests can drive the engine one step at a time.

Per step (as in ``vllm/v1/core/sched/scheduler.py``):

1. Running requests first, in running-list order: each takes what it still needs
   (1 token for a decode, a chunk for a prefill), capped by the token budget. When it
   cannot get a KV block, a victim is preempted by recompute — under ``priority`` the
   running request with the largest ``(priority, arrival)``, under ``fcfs`` the last of
   the running list — until the block fits or the request itself was the victim. A victim
   frees all its blocks, forgets its progress and goes back to the front of the waiting
   queue; later it recomputes its prompt plus the tokens it already generated.
2. Only if nothing was preempted: waiting requests, in queue order (``fcfs``: arrival;
   ``priority``: ``(priority, arrival)``), get (chunked) prefill with the budget left,
   while ``len(running) < max_num_seqs`` and their blocks fit. With prefix caching
   (``loadtest/sim/prefix_cache.py``) a request admitted with nothing computed first
   reuses the longest cached prefix of its prompt: those tokens count as computed and
   only the tail is scheduled.
3. With LoRA (``max_loras`` > 0, vLLM's ``--max-loras``): a step runs requests of at
   most ``max_loras`` distinct adapters. The adapters of the running requests scheduled
   in the step take slots first; a waiting request whose adapter would need one more slot
   than there are is skipped (the requests behind it may still be admitted) and goes
   back to the queue at its place after the step, as vLLM's ``skip_request`` does.
"""

from __future__ import annotations

from dataclasses import dataclass

from loadtest.sim.prefix_cache import BlockPool
from loadtest.sim.sequence import Sequence
from loadtest.sim.waiting import FcfsQueue, PriorityQueue, WaitingQueue

POLICIES = ("fcfs", "priority")


@dataclass(frozen=True, slots=True)
class Chunk:
    """Work for one request in one step."""

    seq: Sequence
    num_tokens: int
    context_tokens: int
    first_schedule: bool


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one step computes, and which requests were preempted to make room."""

    chunks: tuple[Chunk, ...]
    preempted: tuple[Sequence, ...]

    @property
    def batch_tokens(self) -> int:
        """Tokens computed in the step (decodes plus prefill chunks)."""
        return sum(c.num_tokens for c in self.chunks)

    @property
    def loras(self) -> frozenset[str]:
        """The distinct LoRA adapters the step runs."""
        return frozenset(c.seq.lora for c in self.chunks if c.seq.lora is not None)

    @property
    def context_tokens(self) -> int:
        """KV entries read by attention in the step."""
        return sum(c.context_tokens for c in self.chunks)

    def tokens_for(self, request_id: str) -> int:
        """Tokens scheduled for ``request_id`` in this step (0 if none)."""
        return sum(c.num_tokens for c in self.chunks if c.seq.request_id == request_id)


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    """The vLLM flags the planner honours."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    policy: str = "fcfs"
    kv_blocks: int = 25_000
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_loras: int = 0  # distinct LoRA adapters per step (0: LoRA off)
    kv_cache_events: bool = False  # the block pool records KV events

    def blocks_for(self, num_tokens: int) -> int:
        """KV blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)


class Scheduler:
    """Waiting queue, running list and paged KV-block accounting."""

    def __init__(self, limits: SchedulerLimits) -> None:
        if limits.policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {POLICIES}, got {limits.policy!r}")
        self.limits = limits
        self.waiting: WaitingQueue = PriorityQueue() if limits.policy == "priority" else FcfsQueue()
        self.running: list[Sequence] = []
        self.pool = BlockPool(
            limits.kv_blocks, limits.block_size, limits.enable_prefix_caching,
            enable_kv_cache_events=limits.kv_cache_events,
        )  # fmt: skip
        self._live: dict[str, Sequence] = {}

    @property
    def free_blocks(self) -> int:
        """KV blocks no request holds (cached free blocks included: they are evictable)."""
        return self.pool.num_free_blocks

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use (0..1)."""
        return self.pool.usage

    def has_work(self) -> bool:
        """True when a step would compute something."""
        return bool(self.running) or len(self.waiting) > 0

    def add(self, seq: Sequence) -> None:
        """Queue a new request."""
        if seq.request_id in self._live:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        need = self.limits.blocks_for(seq.prompt_tokens + seq.target_output_tokens)
        if need > self.limits.kv_blocks:
            raise ValueError(f"request needs {need} KV blocks, cache has {self.limits.kv_blocks}")
        self._live[seq.request_id] = seq
        self.waiting.add(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Drop a request wherever it is and free its blocks."""
        seq = self._live.pop(request_id, None)
        if seq is None:
            return None
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._free(seq)
        return seq

    def schedule(self) -> StepPlan:
        """Plan the next step (mutates queues and block accounting, never sleeps)."""
        budget = self.limits.max_num_batched_tokens
        scheduled: dict[Sequence, int] = {}
        first: set[Sequence] = set()
        preempted: list[Sequence] = []
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_tokens - seq.num_computed, budget)
            fitted = True
            while not self._allocate(seq, seq.num_computed + num_new):
                victim = self._pick_victim()
                if victim in scheduled:
                    budget += scheduled.pop(victim)
                    index -= 1
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    fitted = False
                    break
            if not fitted:
                break
            scheduled[seq] = num_new
            budget -= num_new
            index += 1
        if not preempted:
            budget = self._admit_waiting(budget, scheduled, first)
        chunks = tuple(
            Chunk(seq, n, seq.num_computed + n, seq in first) for seq, n in scheduled.items()
        )
        return StepPlan(chunks, tuple(preempted))

    def update(self, plan: StepPlan) -> list[Sequence]:
        """Apply a finished step; return the requests that sampled a token in it.

        Requests aborted while the step ran are skipped. Finished requests leave the
        running list and free their blocks.
        """
        sampled: list[Sequence] = []
        for chunk in plan.chunks:
            seq = chunk.seq
            if self._live.get(seq.request_id) is not seq:
                continue
            seq.num_computed += chunk.num_tokens
            if seq.num_computed < seq.num_tokens:
                continue
            seq.output_tokens += 1
            sampled.append(seq)
            if seq.output_tokens >= seq.target_output_tokens:
                self.running.remove(seq)
                del self._live[seq.request_id]
                self._free(seq)
        return sampled

    def _admit_waiting(
        self, budget: int, scheduled: dict[Sequence, int], first: set[Sequence]
    ) -> int:
        loras = {seq.lora for seq in scheduled if seq.lora is not None}
        skipped: list[Sequence] = []
        while budget > 0 and len(self.waiting) > 0:
            if len(self.running) >= self.limits.max_num_seqs:
                break
            seq = self.waiting.peek()
            if seq.lora is not None and seq.lora not in loras:
                if len(loras) >= self.limits.max_loras:
                    skipped.append(self.waiting.pop())
                    continue
            hit = self.pool.find_hit(seq.table.hashes, seq.num_tokens)
            num_cached = len(hit) * self.limits.block_size
            # KV pulled from a prefill server counts as computed at first admission
            computed = num_cached if seq.ever_scheduled else max(num_cached, seq.remote_tokens)
            num_new = min(seq.num_tokens - computed, budget)
            if not self.pool.allocate(seq.table, computed + num_new, hit):
                break
            seq.num_computed = computed
            self.waiting.pop()
            self.running.append(seq)
            if not seq.ever_scheduled:
                seq.ever_scheduled = True
                seq.num_cached_tokens = num_cached
                first.add(seq)
            if seq.num_preemptions == 0:
                self.pool.record(seq.num_tokens, num_cached)
            scheduled[seq] = num_new
            budget -= num_new
            if seq.lora is not None:
                loras.add(seq.lora)
        for seq in reversed(skipped):
            self.waiting.prepend(seq)
        return budget

    def lora_activity(self) -> dict[str, tuple[int, int]]:
        """Adapters with live requests: name -> (waiting, running), in first-arrival order
        of the live requests (what vLLM's ``LoRARequestStates`` holds)."""
        activity: dict[str, tuple[int, int]] = {}
        running = set(self.running)
        for seq in sorted(self._live.values(), key=lambda s: s.arrival_s):
            if seq.lora is None:
                continue
            waiting_n, running_n = activity.get(seq.lora, (0, 0))
            if seq in running:
                activity[seq.lora] = (waiting_n, running_n + 1)
            else:
                activity[seq.lora] = (waiting_n + 1, running_n)
        return activity

    def _pick_victim(self) -> Sequence:
        if self.limits.policy == "priority":
            victim = max(self.running, key=lambda s: (s.priority, s.arrival_s))
            self.running.remove(victim)
            return victim
        return self.running.pop()

    def _preempt(self, seq: Sequence) -> None:
        self._free(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.waiting.prepend(seq)

    def _allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.pool.allocate(seq.table, num_tokens)

    def _free(self, seq: Sequence) -> None:
        self.pool.free(seq.table)
