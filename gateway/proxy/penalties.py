"""Presence and frequency penalties across a continuation's seam (pure).

vLLM counts both over the generated tokens only (``v1/sample/ops/penalties.py``:
``logits -= frequency_penalty * count + presence_penalty * (count > 0)``, the count
over the request's output), so a continuation, which sends the tokens generated so far
as its prompt, would lose them. vLLM cannot be told which prompt tokens were generated;
fairgate adds what they contributed as a ``logit_bias`` instead, which vLLM adds to the
logits before the penalties (``v1/sample/sampler.py``: logit processors, then
penalties): each token generated ``c`` times before the seam gets
``-(frequency_penalty * c + presence_penalty)`` on top of the client's own bias.

That is exact for the frequency penalty. The presence penalty is exact until a token
generated before the seam is generated again after it: from then on it is subtracted
twice for that token (once by the bias, once by vLLM), ``presence_penalty`` more than an
uninterrupted run. vLLM clamps each bias to ±100 (``sampling_params.py``), so a bias
beyond that (a token generated more than ``(100 - presence) / frequency`` times) is
clamped too: :func:`clamped` says whether that happened.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

LOGIT_BIAS_LIMIT = 100.0  # vLLM clamps every logit_bias value to ±100


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(
        value, bool) else 0.0


def _clamp(value: float) -> float:
    return min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, value))


def unclamped_bias(sampling: dict[str, Any], generated: list[int]
                   ) -> dict[int | str, float] | None:
    """Each token's bias for a continuation after ``generated`` (the client's
    ``logit_bias``, clamped as vLLM clamps it, plus the penalties so far), not yet
    clamped; ``None``: no penalty is set or nothing was generated (the client's bias as
    it is)."""
    frequency = _number(sampling.get("frequency_penalty"))
    presence = _number(sampling.get("presence_penalty"))
    if not (frequency or presence) or not generated:
        return None
    bias: dict[int | str, float] = {}
    client = sampling.get("logit_bias")
    if isinstance(client, dict):
        for key, value in client.items():  # vLLM took them as token ids
            bias[int(key) if str(key).lstrip("-").isdigit() else key] = _clamp(_number(value))
    for token, count in Counter(generated).items():
        bias[token] = bias.get(token, 0.0) - (frequency * count + presence)
    return bias


def continued_bias(sampling: dict[str, Any], generated: list[int]
                   ) -> dict[str, float] | None:
    """The ``logit_bias`` a continuation after ``generated`` sends (``None``: the
    client's as it is)."""
    bias = unclamped_bias(sampling, generated)
    if bias is None:
        return None
    return {str(token): _clamp(value) for token, value in bias.items()}


def clamped(sampling: dict[str, Any], generated: list[int]) -> bool:
    """The continuation's bias for some token goes beyond what vLLM takes (±100): from
    there on it is not the uninterrupted run's."""
    bias = unclamped_bias(sampling, generated) or {}
    return any(abs(value) > LOGIT_BIAS_LIMIT for value in bias.values())
