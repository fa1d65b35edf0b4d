"""One request's scheduling state in the simulated engine (the scheduler's and the waiting
queues' common currency)."""

from __future__ import annotations

from dataclasses import dataclass, field

from loadtest.sim.prefix_cache import BlockTable


@dataclass(eq=False, slots=True)
class Sequence:
    """One request's scheduling state."""

    request_id: str
    priority: int
    arrival_s: float
    prompt_tokens: int
    target_output_tokens: int
    output_tokens: int = 0
    num_computed: int = 0
    num_preemptions: int = 0
    ever_scheduled: bool = False
    table: BlockTable = field(default_factory=BlockTable)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    lora: str | None = None  # the LoRA adapter it runs with (None: the base model)
    remote_tokens: int = 0  # prompt tokens whose KV a prefill server sent (P/D)

    @property
    def num_blocks(self) -> int:
        """KV blocks the request holds."""
        return len(self.table.blocks)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: what must sit in the KV cache before sampling."""
        return self.prompt_tokens + self.output_tokens

    @property
    def is_prefilling(self) -> bool:
        """True while the step would compute more than the single decode token."""
        return self.num_tokens - self.num_computed > 1
