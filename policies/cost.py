"""What a request costs before a backend has tokenized anything, in two measures, and the
weighted token cost that VTC fairness and the service metrics both count.

- :func:`estimate_prompt_tokens` — the prompt's *estimate*: what fairness charges at
  dispatch (corrected by the real count at the settle), the length-aware pools route by
  and the prefill gate counts. Exact for token ids and an upper bound for every non-ASCII
  script (a token per UTF-8 byte), about right for ordinary ASCII text (4 characters a
  token): routing English by its bytes would send prompts of a quarter of a short pool's
  limit to the long pool.
- :class:`TokenCost` — VTC's weighted token cost, with its optional KV-occupancy term
  (:func:`kv_token_seconds`, off by default).
- :func:`max_cost_tokens` — the *most* a request can cost: what limits and budgets reserve
  (refunded to the real cost at the end). Its prompt part, :func:`prompt_token_bound`, is a
  token per UTF-8 byte for every script, ASCII too (a byte-level BPE tokenizer never emits
  more), and its output part the effective output bound (``Output.bound``, enforced
  on the backend by ``gateway/proxy/completion_request.parse_body``) times the sequences
  generated.

Each reads a request's typed parts (``policies/request.py``), never its body.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from policies.request import Output, Prompt

CHARS_PER_TOKEN = 4
MESSAGE_OVERHEAD_TOKENS = 4
# the bound's allowance for a chat template's own text: per message or Responses input
# item (role header, end of turn) and per request (begin of text, the generation prompt,
# a template's default system text)
TEMPLATE_TOKENS_PER_MESSAGE = 8
TEMPLATE_TOKENS_PER_REQUEST = 32
SPECIAL_TOKENS_PER_PROMPT = 2


@dataclass(frozen=True, slots=True)
class TokenCost:
    """VTC's cost of service: prompt tokens × ``w_in`` + output tokens × ``w_out``, plus,
    optionally (``w_kv`` > 0; 0 by default), the KV cache the request held: its
    :func:`kv_token_seconds` × ``w_kv``."""

    w_in: float = 1.0
    w_out: float = 2.0
    w_kv: float = 0.0  # per token-second of KV cache held (0: not counted)

    def of(self, prompt_tokens: int, output_tokens: int, weight: float = 1.0,
           kv_token_s: float = 0.0) -> float:
        return (prompt_tokens * self.w_in + output_tokens * self.w_out
                + kv_token_s * self.w_kv) / weight


def kv_token_seconds(context_tokens: int, output_tokens: int, held_s: float) -> float:
    """The KV cache a request held, in token-seconds, over the ``held_s`` seconds it ran
    on its backend (from its first token, or its dispatch when that is not known, to its
    end): every one of its ``context_tokens`` prompt tokens for all of it, and its
    ``output_tokens``, generated evenly, each for half of it on average. What a long
    context costs besides its tokens: a 30k-token prompt streaming for a minute keeps
    GPU memory from other requests all that time."""
    held = max(0.0, held_s)
    return context_tokens * held + output_tokens * held / 2


def _units(text: str) -> int:
    """A text's size in quarter tokens: an ASCII character is a quarter (a text's ASCII
    part rounded up to whole tokens), every UTF-8 byte of any other character a token."""
    ascii_chars = len(text) if text.isascii() else len(text.encode("ascii", "ignore"))
    other_bytes = (0 if ascii_chars == len(text)
                   else len(text.encode("utf-8", "surrogatepass")) - ascii_chars)
    return -(-ascii_chars // CHARS_PER_TOKEN) * CHARS_PER_TOKEN + CHARS_PER_TOKEN * other_bytes


def _prompt_units(value: Any) -> int:
    """Quarter tokens of a prompt or message content: its text (:func:`_units`) and its
    token ids, one token each (iterative: any nesting depth)."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += _units(item)
        elif isinstance(item, list):
            if item and all(type(t) is int for t in item):  # token ids, at C speed
                total += CHARS_PER_TOKEN * len(item)
            else:
                stack.extend(item)
        elif isinstance(item, dict):
            stack.append(item.get("text", ""))
            stack.append(item.get("content", ""))
        elif type(item) is int:
            total += CHARS_PER_TOKEN
    return total


def _tokens(value: Any, floor: int = 1) -> int:
    return max(floor, _prompt_units(value) // CHARS_PER_TOKEN)


def estimate_prompt_tokens(prompt: Prompt) -> int:
    """The prompt's tokens before a backend tokenized it; corrected by real usage at
    completion.

    Counted as: a token per token id (at any nesting: ``[[ids], …]`` too), a token per
    UTF-8 byte of every non-ASCII character, a quarter token per ASCII character, and 4
    per chat message or Responses input item. Never below the real count for token ids
    and for any non-ASCII script (a byte-level BPE tokenizer emits at most one token per
    byte: emoji, CJK and the like cannot be made to look short), nor for ASCII text of
    about 4 or more characters a token (natural language, code); ASCII crafted to
    tokenize denser can be up to 4x over it. Not what limits reserve:
    :func:`prompt_token_bound` is.
    """
    return (_tokens(prompt.text, prompt.least) + _tokens(prompt.preamble, 0)
            + MESSAGE_OVERHEAD_TOKENS * (len(prompt.roles) + prompt.items))


def prompt_token_bound(prompt: Prompt) -> int:
    """The most tokens the prompt can be.

    A byte-level BPE tokenizer (Llama 3, Qwen, GPT-2/4-style, Mistral's tekken) emits at
    most one token per UTF-8 byte, whatever the script: so every byte of every string the
    prompt renders from counts a token (and those of its keys and its numbers), every
    token id a token; a chat (``messages``) or Responses ``input`` adds its template's own
    text, ``TEMPLATE_TOKENS_PER_MESSAGE`` per message or item and
    ``TEMPLATE_TOKENS_PER_REQUEST``, a completion's prompt ``SPECIAL_TOKENS_PER_PROMPT``
    each (begin and end of text), and what the template renders besides the prompt field
    (``tools`` and ``documents``; a Responses call's ``instructions`` and ``tools``).
    """
    total = sum(_bytes(value) for value in prompt.rendered)
    if prompt.template_items is None:  # each prompt may get a begin (and end) of text token
        return total + SPECIAL_TOKENS_PER_PROMPT * prompt.prompts
    return (total + TEMPLATE_TOKENS_PER_MESSAGE * prompt.template_items
            + TEMPLATE_TOKENS_PER_REQUEST)


def _bytes(value: Any) -> int:
    """A token per UTF-8 byte of the strings (and dict keys) in ``value`` and of its
    numbers as JSON writes them, a token per token id (a list of integers), at any
    nesting (iterative)."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item.encode("utf-8", "surrogatepass"))
        elif isinstance(item, list):
            if item and all(type(t) is int for t in item):  # token ids, at C speed
                total += len(item)
            else:
                stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif item is not None:  # numbers and booleans as JSON writes them
            total += len(str(item))
        else:
            total += 4  # null
    return total


def sequences(prompt: Prompt, output: Output) -> int:
    """The sequences a request generates: the larger of ``n`` and ``best_of`` for each of
    its prompts (a completion's ``prompt`` may list several: strings or lists of ids)."""
    return output.sequences * prompt.prompts


def max_cost_tokens(prompt: Prompt, output: Output, context_tokens: int) -> int:
    """What a request can cost at most, in tokens: what limits and budgets reserve before
    the backend reports the real count.

    Its :func:`prompt_token_bound`, plus its output bound — ``output.bound`` (the
    smallest output-token field it sets of those its endpoint honours), else
    ``context_tokens`` (the model's context length), never more than that — times its
    :func:`sequences` (``n``/``best_of``, for each prompt). An endpoint without output
    (embeddings) costs its prompt.
    """
    return prompt_token_bound(prompt) + output_token_bound(prompt, output, context_tokens)


def output_token_bound(prompt: Prompt, output: Output, context_tokens: int) -> int:
    """The most output tokens a request can generate: :func:`max_cost_tokens`' output
    part — its output bound (else ``context_tokens``, never more than that) times its
    :func:`sequences`; 0 for an endpoint without output. What a whole (non-streamed)
    answer cut before its usage came is charged as its output: the backend may have
    generated up to this much before it was aborted."""
    if not output.produces:
        return 0
    bound = context_tokens if output.bound is None else min(output.bound, context_tokens)
    return max(0, bound) * sequences(prompt, output)
