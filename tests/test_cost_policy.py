"""policies/cost.py: the prompt estimate, the prompt's bound and the most a request can
cost, against the simulator's tokenizer (real token counts) and a byte-level BPE's worst
case (one token per UTF-8 byte)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.errors import BadRequest
from gateway.proxy.completion_request import CompletionRequest, parse_body
from gateway.proxy.endpoints import CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES, Endpoint, Kind
from loadtest.sim import tokenizer
from policies.cost import (
    SPECIAL_TOKENS_PER_PROMPT,
    estimate_prompt_tokens,
    max_cost_tokens,
    output_token_bound,
    prompt_token_bound,
    sequences,
)

CHAT_FIELDS = CHAT.output_token_fields
# a completion's prompt with chat's output-token fields
PROMPT_CHAT = Endpoint("/x", "POST", "x", Kind.QUEUED, prompt_field="prompt",
                       output_token_fields=CHAT_FIELDS)


def typed(body: dict[str, Any], endpoint: Endpoint | None = None) -> CompletionRequest:
    """``body`` read as the edge reads it (the endpoint its prompt field names)."""
    if endpoint is None:
        endpoint = (CHAT if "messages" in body else RESPONSES if "input" in body
                    else COMPLETIONS)
    return parse_body({"model": "m", **body}, endpoint)


def estimate(body: dict[str, Any]) -> int:
    return estimate_prompt_tokens(typed(body).prompt)


def bound_of(body: dict[str, Any]) -> int:
    return prompt_token_bound(typed(body).prompt)


def max_cost(body: dict[str, Any], endpoint: Endpoint, context: int) -> int:
    creq = typed(body, endpoint)
    return max_cost_tokens(creq.prompt, creq.output, context)
SCRIPTS = {"ascii": "the quick brown fox ", "emoji": "😀", "cjk": "漢字", "accents": "é",
           "mixed": "a漢😀 é"}


def sim_tokens(body: dict[str, Any]) -> int:
    """The simulator's real count of a body's prompt (its tokenizer, ``loadtest/sim``)."""
    if "messages" in body:
        return len(tokenizer.encode_chat(body["messages"]))
    prompt = body["prompt"]
    prompts = prompt if isinstance(prompt, list) and prompt and not all(
        type(t) is int for t in prompt) else [prompt]
    return sum(len(p) if isinstance(p, list) else len(tokenizer.encode(p)) for p in prompts)


def bpe_worst(body: dict[str, Any]) -> int:
    """A byte-level BPE tokenizer's most: a token per byte of text, a begin-of-text token
    per text prompt; a chat as Llama 3's template renders it (begin of text, 5 tokens
    around each message, 4 for the generation prompt, ~25 of default system text)."""
    if "messages" in body:
        text = sum(len(tokenizer.message_text(m.get("content")).encode())
                   for m in body["messages"])
        return 1 + 25 + 5 * len(body["messages"]) + text + 4
    prompt = body["prompt"]
    prompts = prompt if isinstance(prompt, list) and prompt and not all(
        type(t) is int for t in prompt) else [prompt]
    return sum(len(p) if isinstance(p, list) else 1 + len(p.encode()) for p in prompts)


def vllm_output(body: dict[str, Any], chat: bool, context: int) -> int:
    """The output tokens vLLM may generate per sequence: a chat takes
    ``max_completion_tokens`` over ``max_tokens``; none set: up to the context."""
    value = (body.get("max_completion_tokens") or body.get("max_tokens") if chat
             else body.get("max_tokens"))
    return context if value is None else min(value, context)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_the_bound_holds_the_real_count_of_every_script(script: str) -> None:
    text = SCRIPTS[script] * 3000
    for body in ({"prompt": text}, {"messages": [{"role": "user", "content": text}]}):
        bound = bound_of(body)
        real = (sim_tokens(body), bpe_worst(body))
        assert bound >= max(real), f"{script}: bound {bound} < real {real}"


def test_the_estimate_holds_every_non_ascii_script_and_token_ids() -> None:
    # the probe's prompts, real counts from a real tokenizer: 30,007 (emoji), 22,507 (CJK)
    assert estimate({"prompt": "😀" * 30000}) >= 30007
    assert estimate({"prompt": "漢" * 30000}) >= 22507
    assert estimate({"prompt": [list(range(6000))]}) == 6000
    assert estimate({"prompt": [[1] * 40000, [2] * 10]}) == 40010
    assert estimate({"input": [[1] * 700]}) == 700
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "é" * 100}]}]}
    assert estimate(chat) == 200 + 4  # two UTF-8 bytes a character
    assert estimate({"prompt": "ab\ud800"}) == 1 + 3  # a lone surrogate
    # ordinary ASCII stays at 4 characters a token: the pools and fairness see English
    # as long as it is, not 4x (the bound is for reservations)
    assert estimate({"prompt": "x" * 4000}) == 1000
    assert estimate({"messages": [{"role": "user", "content": "x" * 400}]}
                                  ) == 104
    assert bound_of({"prompt": "x" * 4000}) == 4000 + SPECIAL_TOKENS_PER_PROMPT


def test_the_bound_counts_what_a_template_renders_and_token_ids() -> None:
    tools = [{"type": "function", "function": {"name": "f" * 500, "parameters": {}}}]
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert bound_of({**chat, "tools": tools}) >= bound_of(chat) + 500
    responses = {"input": "hi", "instructions": "漢" * 100}
    assert bound_of(responses) >= 300
    assert bound_of({"prompt": [[5] * 6000]}) == 6000 + SPECIAL_TOKENS_PER_PROMPT
    assert bound_of({"prompt": [7] * 10}) == 10 + SPECIAL_TOKENS_PER_PROMPT


@pytest.mark.parametrize(("body", "context", "output"), [
    ({"max_tokens": 100}, 8192, 100),
    ({"max_tokens": 1, "max_completion_tokens": 2000}, 8192, 1),  # chat's smallest
    ({"max_completion_tokens": 2000}, 8192, 2000),
    ({}, 8192, 8192),  # no bound: the model's context
    ({"max_tokens": 10**9}, 8192, 8192),  # never more than the context
    ({"max_tokens": 100, "n": 8}, 8192, 800),
    ({"max_tokens": 100, "n": 2, "best_of": 5}, 8192, 500),
    ({"max_tokens": 10, "n": 2, "prompt": ["a", "b", "c"]}, 50, 60),  # 3 prompts
    ({"max_tokens": 10, "prompt": [[1, 2], [3]]}, 50, 20),  # 2 token-id prompts
    ({"max_tokens": 10, "prompt": [1, 2, 3]}, 50, 10),  # one token-id prompt
])
def test_max_cost_bounds_what_a_request_can_spend(body: dict[str, Any], context: int,
                                                  output: int) -> None:
    body = {"prompt": "hello", **body}
    prompt = bound_of(body)
    got = max_cost(body, PROMPT_CHAT, context)
    assert got == prompt + output, (body, got, prompt)
    no_output = Endpoint("/x", "POST", "x", Kind.QUEUED, prompt_field="prompt")
    assert max_cost(body, no_output, context) == prompt  # no output: embeddings


def test_fields_that_are_not_numbers_of_tokens_are_refused_not_counted() -> None:
    """What the reservation cannot count is refused at the edge (once counted as 1)."""
    for fields, param in (({"max_tokens": True}, "max_tokens"), ({"n": "3"}, "n"),
                          ({"max_tokens": 0, "max_completion_tokens": 5}, "max_tokens")):
        with pytest.raises(BadRequest) as refused:
            typed({"prompt": "hello", **fields}, PROMPT_CHAT)
        assert refused.value.param == param, (fields, refused.value)


def test_every_field_says_the_effective_bound() -> None:
    body = {"model": "m", "prompt": "x", "max_tokens": 1, "max_completion_tokens": 2000}
    creq = parse_body(body, PROMPT_CHAT)
    assert creq.output.bound == 1, creq.output
    assert creq.body == {**body, "max_tokens": 1, "max_completion_tokens": 1}, creq.body
    assert body["max_completion_tokens"] == 2000  # a copy
    agreed = {"model": "m", "prompt": "x", "max_tokens": 3}
    assert parse_body(agreed, PROMPT_CHAT).body is agreed
    assert typed({"prompt": "x"}, PROMPT_CHAT).output.bound is None


TEXT = st.text(st.characters(codec="utf-8"), max_size=300)
IDS = st.lists(st.integers(0, 2**31), min_size=1, max_size=300)
PROMPT = st.one_of(TEXT.filter(bool), IDS, st.lists(TEXT.filter(bool), min_size=1, max_size=4),
                   st.lists(IDS, min_size=1, max_size=4))
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user",
                                                                     "assistant"]),
                                           "content": TEXT}), min_size=1, max_size=5)
BOUND = st.one_of(st.none(), st.integers(1, 5000))
COUNT = st.one_of(st.none(), st.integers(1, 8))


def _set(body: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {**body, **{k: v for k, v in fields.items() if v is not None}}


@settings(max_examples=400, deadline=None)
@given(st.one_of(PROMPT.map(lambda p: {"prompt": p}), MESSAGES.map(lambda m: {"messages": m})),
       BOUND, BOUND, COUNT, COUNT, st.integers(16, 20000))
def test_the_reservation_bounds_the_real_cost_of_any_request(
        base: dict[str, Any], max_tokens: int | None, max_completion: int | None,
        n: int | None, best_of: int | None, context: int) -> None:
    """Whatever fields a request combines, what it reserves holds what it can cost: its
    prompt as the simulator and as a byte-level BPE count it, plus what vLLM may
    generate for the body it is forwarded (every output field at the effective bound)
    for each of its sequences."""
    chat = "messages" in base
    body = _set(base, max_tokens=max_tokens, max_completion_tokens=max_completion, n=n,
                best_of=best_of)
    creq = typed(body)
    sent, bound = creq.body, creq.output.bound
    # the backend, whichever field it reads, generates at most the effective bound
    assert vllm_output(sent, chat, context) == (context if bound is None
                                                else min(bound, context)), sent
    reserved = max_cost_tokens(creq.prompt, creq.output, context)
    prompt = max(sim_tokens(body), bpe_worst(body))
    output = vllm_output(sent, chat, context) * max(n or 1, best_of or 1)
    real = prompt + output * (sequences(creq.prompt, creq.output) // max(n or 1, best_of or 1))
    assert reserved >= real, f"reserved {reserved} < real {real} for {body}"
    # for text, the estimate (pools, fairness) never exceeds the bound
    assert estimate_prompt_tokens(creq.prompt) <= prompt_token_bound(creq.prompt)


def test_the_output_bound_is_the_reservations_output_part() -> None:
    """``output_token_bound`` (what a cut whole answer is charged as output) is exactly
    what ``max_cost_tokens`` adds to the prompt's bound."""
    for body, expected in (({"prompt": "hi", "max_tokens": 7}, 7),
                           ({"prompt": ["a", "b"], "max_tokens": 5, "n": 3}, 30),
                           ({"messages": [{"role": "user", "content": "x"}]}, 4096),
                           ({"prompt": "hi", "max_tokens": 9000}, 4096)):
        creq = typed(body, PROMPT_CHAT if "prompt" in body else CHAT)
        out = output_token_bound(creq.prompt, creq.output, 4096)
        assert out == expected, f"{body}: {out}"
        total = max_cost_tokens(creq.prompt, creq.output, 4096)
        assert total == prompt_token_bound(creq.prompt) + out, f"{body}: {total}"
    embedding = typed({"input": "x"}, EMBEDDINGS)
    assert output_token_bound(embedding.prompt, embedding.output, 4096) == 0  # embeddings
