"""The simulator's tokenizer: deterministic, reversible, and consistent with the token
counts in ``loadtest/sim/protocol.py``.

- Text is its UTF-8 bytes in chunks of 4 (the last one shorter): ``ceil(bytes / 4)``
  tokens, like the prompt counts. A chunk of ``n`` bytes is the id ``n << 32 | value``
  (``value``: the bytes read as a big-endian integer), so every id decodes back to its
  bytes and any text survives ``detokenize(tokenize(text))``. A chunk may split a
  multi-byte character, as byte-level BPE does; decoding joins the bytes first.
- Special tokens have the ids 0 to 7 (see ``SPECIAL``). A chat message is
  ``<|start|> role <|sep|> content… <|end|>`` (4 tokens around the content) and the
  generation prompt is ``<|start|> assistant <|sep|>`` (3), the chat counts'
  ``CHAT_MESSAGE_OVERHEAD`` and ``CHAT_REPLY_OVERHEAD``.
- No BOS token is added: a prompt's count is exactly what the completion's usage says.
- Generated tokens are *word tokens*: one filler word each (`` the``, `` model``, …). A
  word token's id carries the state of the answer it belongs to (``WORD_FLAG | base << 40
  | natural << 20 | index``: the answer's first word, the length at which it would stop
  by itself, and the token's position), so the simulated model is a function of its
  context: after a word token comes the next word of the same answer. A prompt that ends
  with generated tokens therefore continues that answer exactly where it was cut
  (``protocol.parse_request``), as a real model does at temperature 0.
"""

from __future__ import annotations

from typing import Any

CHUNK_BYTES = 4
SPECIAL = ("<|start|>", "<|end|>", "<|sep|>", "system", "user", "assistant", "tool", "<|role|>")
START, END, SEP = 0, 1, 2
ROLE_IDS = {"system": 3, "developer": 3, "user": 4, "assistant": 5, "tool": 6}
OTHER_ROLE = 7
MAX_ID = CHUNK_BYTES << 32 | 0xFFFFFFFF
FILLER = (
    "the", "model", "is", "simulated", "and", "every", "token", "costs", "time", "on",
    "an", "imaginary", "GPU", "while", "fair", "queues", "wait", "patiently",
)  # fmt: skip
WORD_FLAG = 1 << 52  # ids stay below 2**53: exact as JSON numbers everywhere
FIELD_MASK = (1 << 20) - 1


def word_token(base: int, natural: int, index: int) -> int:
    """The id of generated token ``index`` of an answer that starts with the filler word
    ``base`` and would stop by itself after ``natural`` tokens."""
    return WORD_FLAG | base << 40 | (natural & FIELD_MASK) << 20 | (index & FIELD_MASK)


def word_state(token: int) -> tuple[int, int, int] | None:
    """``(base, natural, index)`` of a word token; ``None`` for any other id."""
    if token < WORD_FLAG or token >= WORD_FLAG << 1:
        return None
    base = (token >> 40) & 0xFFF
    if base >= len(FILLER):
        return None
    return base, (token >> 20) & FIELD_MASK, token & FIELD_MASK


def word_text(base: int, index: int) -> str:
    """The text of generated token ``index`` of an answer starting at word ``base``."""
    return " " + FILLER[(base + index) % len(FILLER)]


def encode(text: str) -> list[int]:
    """The token ids of ``text`` (none for the empty string)."""
    data = text.encode()
    return [
        len(chunk) << 32 | int.from_bytes(chunk, "big")
        for chunk in (data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES))
    ]


def token_bytes(token: int) -> bytes:
    """The bytes of one id; ``ValueError`` for an id outside the vocabulary."""
    if 0 <= token < len(SPECIAL):
        return SPECIAL[token].encode()
    state = word_state(token)
    if state is not None:
        return word_text(state[0], state[2]).encode()
    size, value = token >> 32, token & 0xFFFFFFFF
    if not 1 <= size <= CHUNK_BYTES or value >= 1 << (8 * size):
        raise ValueError(f"token id {token} is out of vocabulary")
    return value.to_bytes(size, "big")


def decode(tokens: list[int]) -> str:
    """The text of ``tokens`` (a split character is joined; invalid UTF-8 is replaced)."""
    return b"".join(token_bytes(t) for t in tokens).decode(errors="replace")


def token_str(token: int) -> str:
    """One token as text, for ``return_token_strs``."""
    return token_bytes(token).decode(errors="replace")


def message_text(content: Any) -> str:
    """A chat message's text: a string, or the ``text`` of its content parts."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def chat_text(messages: list[Any], add_generation_prompt: bool = True) -> str:
    """The chat template as text: what ``encode_chat``'s ids decode to."""
    parts = []
    for message in messages:
        fields = message if isinstance(message, dict) else {}
        role = SPECIAL[ROLE_IDS.get(str(fields.get("role")), OTHER_ROLE)]
        parts.append(f"{SPECIAL[START]}{role}{SPECIAL[SEP]}"
                     f"{message_text(fields.get('content'))}{SPECIAL[END]}")
    if add_generation_prompt:
        parts.append(f"{SPECIAL[START]}assistant{SPECIAL[SEP]}")
    return "".join(parts)


def encode_chat(messages: list[Any], add_generation_prompt: bool = True) -> list[int]:
    """The chat template's token ids (counts as in ``protocol._prompt``)."""
    tokens: list[int] = []
    for message in messages:
        fields = message if isinstance(message, dict) else {}
        role = ROLE_IDS.get(str(fields.get("role")), OTHER_ROLE)
        tokens += [START, role, SEP, *encode(message_text(fields.get("content"))), END]
    if add_generation_prompt:
        tokens += [START, ROLE_IDS["assistant"], SEP]
    return tokens
