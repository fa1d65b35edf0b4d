"""Continuation of the stream kinds that need more than token ids: ``stop`` strings,
log probabilities, ``echo``, ``suffix``, on plain data (no server, no I/O).

Stop strings: a reference stream from the simulator's framer (vLLM 0.32's shapes and its
held-back text, ``loadtest/sim/stops.py``) cut after any token and continued by token ids
ends with exactly the reference's text, ``finish_reason``, ``stop_reason`` and usage. Log
probabilities and echo: frames recorded from a real vLLM 0.32 (the tiny model)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.proxy.completion_request import parse_body
from gateway.proxy.continuation import Progress, not_continuable
from gateway.proxy.endpoints import CHAT, COMPLETIONS, Frames
from gateway.proxy.relay import FrameFilter
from gateway.proxy.stop_strings import SeamText, StopStrings, seam_tail
from loadtest.sim import tokenizer
from tests.gateway.test_continuation import MODEL, frames, token_frames

# stop strings within one filler word and across two (the filler words cycle in order:
# " the model is simulated and every token costs time on an imaginary GPU while …")
STOPS = ("GPU", "d a", "s t", "ime on a", "ry", " model is", "while fair q", "zzz")


def answer(events: list[dict[str, Any]], chat: bool) -> tuple[str, Any, Any, Any]:
    """(text, finish_reason, stop_reason, usage) of a stream's events."""
    text, finish, stop_reason, usage = "", None, None, None
    for event in events:
        for choice in event["choices"]:
            piece = choice.get("delta", {}).get("content") if chat else choice.get("text")
            text += piece or ""
            if choice.get("finish_reason") is not None:
                finish, stop_reason = choice["finish_reason"], choice.get("stop_reason")
        usage = event.get("usage") or usage
    return text, finish, stop_reason, usage


def continue_after(progress: Progress, creq: Any) -> list[dict[str, Any]]:
    """The continuation's events re-framed, as the relay writes them: its seam learnt
    from the simulator's ``/detokenize``, its rest dropped once fairgate cut it."""
    prompt_ids, all_ids = progress.seam_ids()
    assert progress.seam_at(tokenizer.decode(prompt_ids), tokenizer.decode(all_ids))
    out = []
    for event in frames(progress.continuation_body(creq, True), chat=False):
        out.append(progress.continued(event))
        if progress.cut:
            out += progress.closing(True)
            break
    return out


@settings(max_examples=150, deadline=None)
@given(chat=st.booleans(), include=st.booleans(), limit=st.integers(1, 40),
       stops=st.lists(st.sampled_from(STOPS), min_size=1, max_size=3, unique=True),
       prompt=st.text(min_size=1, max_size=20), cut=st.floats(0, 1, exclude_max=True))
def test_a_stop_string_stream_cut_anywhere_ends_as_the_reference(
        chat: bool, include: bool, limit: int, stops: list[str], prompt: str,
        cut: float) -> None:
    body: dict[str, Any] = {"max_tokens": limit, "ignore_eos": True, "temperature": 0,
                            "stop": stops, "include_stop_str_in_output": include}
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat
                else {"prompt": prompt})
    reference = frames(body, chat)
    creq = parse_body({**body, "model": MODEL}, CHAT if chat else COMPLETIONS)
    progress = Progress.of(creq)
    assert progress is not None, not_continuable(creq)
    k = int(cut * token_frames(reference))
    split = k + (1 if chat else 0)
    got = [progress.original(json.loads(json.dumps(e))) for e in reference[:split]]
    if not progress.resumable:
        return  # nothing came before the cut: the request is sent again as it was
    got += continue_after(progress, creq)
    want = answer(reference, chat)
    assert answer(got, chat) == want, (k, stops, answer(got, chat), want)


def test_a_stop_string_across_the_seam_ends_the_answer_there() -> None:
    """The client got " the model" (" is" held back for "is s"): the continuation's own
    vLLM sees only " simulated …" and would miss the stop; fairgate ends the answer."""
    stops = StopStrings(("is s",), include=False)
    seam = SeamText(stops, " the model is", len(" the model"), 3)
    piece = seam.feed(" simulated", 1, None, None)
    assert (piece.text, piece.finish_reason, piece.stop_reason, piece.cut) == (
        " ", "stop", "is s", True), piece
    assert seam.text == " the model ", seam.text


def test_text_is_held_back_as_vllm_holds_it() -> None:
    seam = SeamText(StopStrings(("xyz",), include=False), "ab", 2, 1)
    assert seam.feed("cdef", 1, None, None).text == "cd"  # "ef" could start "xyz"
    assert seam.feed("gh", 1, "length", None).text == "efgh"  # the end releases all


def test_a_stop_token_s_text_is_left_out_unless_asked() -> None:
    seam = SeamText(StopStrings(("xyz",), include=False), "", 0, 0)
    assert seam.feed("</s>", 1, "stop", None).text == ""
    seam = SeamText(StopStrings(("xyz",), include=True), "", 0, 0)
    assert seam.feed("</s>", 1, "stop", None).text == "</s>"


def test_a_stop_across_the_seam_counts_only_after_min_tokens() -> None:
    seam = SeamText(StopStrings(("ab",), include=False, min_tokens=3), "xa", 1, 2)
    assert seam.feed("b", 1, None, None).finish_reason is None  # 3 tokens: not > 3
    seam = SeamText(StopStrings(("ab",), include=False, min_tokens=2), "xa", 1, 2)
    piece = seam.feed("b", 1, None, None)
    assert (piece.finish_reason, piece.cut, seam.text) == ("stop", True, "x"), piece


def test_a_stop_inside_the_new_text_is_vllm_s_find() -> None:
    """The continuation (asked to keep it) ends at its stop string: fairgate cuts it off
    as the client asked, and finds no other (vLLM knows min_tokens per token)."""
    seam = SeamText(StopStrings(("xyz",), include=False, min_tokens=5), "ab", 2, 1)
    piece = seam.feed("xyzcdxyz", 6, "stop", "xyz")
    assert (piece.text, piece.finish_reason, piece.stop_reason, piece.cut) == (
        "xyzcd", "stop", "xyz", False), piece


def test_the_seam_tail_must_extend_what_the_client_got() -> None:
    assert seam_tail("PROMPT the model", "PROMPT", " the mo") == "del"
    assert seam_tail("PROMPT the model", "PROMPT", " a") is None
    assert seam_tail("OTHER the model", "PROMPT", "") is None


def test_the_continuation_asks_for_stops_with_their_text_and_log_probabilities() -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stop": "\n",
            "logprobs": True, "top_logprobs": 3, "max_tokens": 9}
    creq = parse_body(body, CHAT)
    progress = Progress.of(creq)
    assert progress is not None
    progress.prompt_ids, progress.generated = [1, 2], [5]
    cont = progress.continuation_body(creq, True)
    assert (cont["stop"], cont["include_stop_str_in_output"], cont["logprobs"]) == (
        ["\n"], True, 3), cont
    assert "top_logprobs" not in cont and "echo" not in cont, cont


# vLLM 0.32 (tiny model), ``logprobs: 2``: the stream's last frame before a cut, then a
# continuation's first frame (its text offsets start at 0)
ORIGINAL_LP = {"text_offset": [26], "token_logprobs": [-7.6246], "tokens": ["e"],
               "top_logprobs": [{"e": -7.6246, "ka": -7.6247}]}
CONTINUED_LP = {"text_offset": [0, 3], "token_logprobs": [-7.62, -7.63],
                "tokens": ["eja", " su"],
                "top_logprobs": [{"eja": -7.62, " su": -7.63, "c": -7.64},
                                 {" su": -7.63, "c": -7.64, "x": -7.65}]}


def continued_logprobs(chat: bool, top: int) -> tuple[Progress, Any, Any]:
    """The ``logprobs`` of a continuation's first two chunks, re-framed."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 9}
    if chat:
        body.update(messages=[{"role": "user", "content": "x"}], logprobs=True,
                    top_logprobs=top)
    else:
        body.update(prompt="x", logprobs=top)
    creq = parse_body(body, CHAT if chat else COMPLETIONS)
    progress = Progress.of(creq)
    assert progress is not None
    progress.original({"prompt_token_ids": [1], "choices": [
        {"text": "e", "logprobs": None if chat else ORIGINAL_LP, "prompt_token_ids": [1],
         "token_ids": [72]}]})
    assert progress.continuation_body(creq, True)["logprobs"] == top
    first = progress.continued({"choices": [{"text": "eja su", "logprobs": CONTINUED_LP,
                                             "token_ids": [650, 9]}]})
    second = progress.continued({"choices": [{"text": "c", "logprobs": {
        "text_offset": [6], "token_logprobs": [-7.0], "tokens": ["c"],
        "top_logprobs": [{"c": -7.0}]}, "token_ids": [3]}]})
    return progress, first["choices"][0]["logprobs"], second["choices"][0]["logprobs"]


def test_completion_log_probabilities_continue_their_text_offsets() -> None:
    progress, first, second = continued_logprobs(chat=False, top=2)
    assert first == {**CONTINUED_LP, "text_offset": [27, 30]}, first
    assert second["text_offset"] == [33], second
    # a second continuation goes on from where the first got
    progress.continuation_body(parse_body({"model": MODEL, "prompt": "x", "logprobs": 2},
                                          COMPLETIONS), True)
    third = progress.continued({"choices": [{"text": "d", "logprobs": {
        "text_offset": [0], "token_logprobs": [-7.0], "tokens": ["d"],
        "top_logprobs": [{"d": -7.0}]}, "token_ids": [4]}]})
    assert third["choices"][0]["logprobs"]["text_offset"] == [34], third


def test_chat_log_probabilities_are_reframed_as_chat_s() -> None:
    _, logprobs, _ = continued_logprobs(chat=True, top=2)
    assert logprobs == {"content": [
        {"token": "eja", "logprob": -7.62, "bytes": [101, 106, 97], "top_logprobs": [
            {"token": "eja", "logprob": -7.62, "bytes": [101, 106, 97]},
            {"token": " su", "logprob": -7.63, "bytes": [32, 115, 117]}]},
        {"token": " su", "logprob": -7.63, "bytes": [32, 115, 117], "top_logprobs": [
            {"token": " su", "logprob": -7.63, "bytes": [32, 115, 117]},
            {"token": "c", "logprob": -7.64, "bytes": [99]}]}]}, logprobs
    _, logprobs, _ = continued_logprobs(chat=True, top=0)
    assert [e["top_logprobs"] for e in logprobs["content"]] == [[], []], logprobs


def test_echo_is_put_back_once_and_never_repeated() -> None:
    """vLLM 0.32 echoes no prompt text when asked for ``return_token_ids``
    (``completion/serving.py``: ``if request.return_token_ids: prompt_text = ""``)."""
    creq = parse_body({"model": MODEL, "prompt": "story 1", "echo": True, "max_tokens": 4},
                      COMPLETIONS)
    progress = Progress.of(creq)
    assert progress is not None
    first = progress.original({"choices": [{"text": "eja", "prompt_token_ids": [1, 2],
                                            "token_ids": [650]}]})
    assert first["choices"][0]["text"] == "story 1eja" and progress.changed, first
    progress.changed = False
    later = progress.original({"choices": [{"text": "e", "token_ids": [72]}]})
    assert later["choices"][0]["text"] == "e" and not progress.changed, later
    assert "echo" not in progress.continuation_body(creq, True)


def test_the_client_s_own_ids_keep_vllm_s_echo() -> None:
    creq = parse_body({"model": MODEL, "prompt": "p", "echo": True, "return_token_ids": True},
                      COMPLETIONS)
    progress = Progress.of(creq)
    assert progress is not None and progress.echo is None


@pytest.mark.parametrize(("endpoint", "extra"), [
    (COMPLETIONS, {"stop": ["\n", "."], "include_stop_str_in_output": True}),
    (CHAT, {"stop": "END"}),
    (COMPLETIONS, {"logprobs": 2}),
    (CHAT, {"logprobs": True, "top_logprobs": 5}),
    (COMPLETIONS, {"echo": True}),
    (COMPLETIONS, {"echo": True, "prompt": ["one text"]}),
    (COMPLETIONS, {"suffix": "the end"}),
    (COMPLETIONS, {"prompt_logprobs": 0}),
])
def test_these_kinds_are_continued(endpoint: Any, extra: dict[str, Any]) -> None:
    body = {"model": MODEL, "prompt": "p", "messages": [{"role": "user", "content": "p"}],
            **extra}
    creq = parse_body(body, endpoint)
    assert not_continuable(creq) is None
    assert Progress.of(creq) is not None


@pytest.mark.parametrize(("endpoint", "extra"), [
    (COMPLETIONS, {"echo": True, "prompt": [1, 2, 3]}),
    (CHAT, {"echo": True}),
])
def test_echo_without_a_text_prompt_is_not_continued(endpoint: Any,
                                                     extra: dict[str, Any]) -> None:
    body = {"model": MODEL, "prompt": "p", "messages": [{"role": "user", "content": "p"}],
            **extra}
    assert not_continuable(parse_body(body, endpoint)) == "echo is set without a text prompt"


def sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def cmpl_chunk(text: str, ids: list[int], finish: str | None = None,
               stop_reason: Any = None, prompt_ids: list[int] | None = None) -> bytes:
    return sse({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL,
                "choices": [{"index": 0, "text": text, "logprobs": None,
                             "finish_reason": finish, "stop_reason": stop_reason,
                             "prompt_token_ids": prompt_ids, "token_ids": ids}]})


def test_the_relay_ends_an_answer_at_a_stop_across_the_seam() -> None:
    """The continuation's later frames never reach the client: the answer ends with its
    usage and [DONE] where the stop string completed."""
    creq = parse_body({"model": MODEL, "prompt": "p", "stop": "is s", "max_tokens": 9},
                      COMPLETIONS)
    progress = Progress.of(creq)
    assert progress is not None
    f = FrameFilter(True, Frames.CHOICES, progress)
    out = f.feed(cmpl_chunk(" the model", [1, 2], prompt_ids=[9]))  # " is" held back
    assert progress.seam_at("P", "P the model is")
    f.switch(continued=True)
    out += f.feed(cmpl_chunk(" simulated", [3], prompt_ids=[9, 1, 2]) + cmpl_chunk(
        " and", [4]) + b"data: {\"choices\":[], \"usage\": {}}\n\n")
    events = [json.loads(e[6:]) for e in out.split(b"\n\n") if e.startswith(b"data: {")]
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == " the model ", text
    assert events[-2]["choices"][0]["finish_reason"] == "stop", events
    assert events[-2]["choices"][0]["stop_reason"] == "is s", events
    assert events[-1]["usage"] == {"prompt_tokens": 1, "total_tokens": 4,
                                   "completion_tokens": 3}, events
    assert out.endswith(b"data: [DONE]\n\n") and f.cut and f.done, out
    assert f.rest() == b"", "the continuation's rest is dropped"


def test_the_relay_writes_the_echo_it_puts_back() -> None:
    creq = parse_body({"model": MODEL, "prompt": "story", "echo": True, "max_tokens": 9},
                      COMPLETIONS)
    progress = Progress.of(creq)
    assert progress is not None
    f = FrameFilter(False, Frames.CHOICES, progress)
    out = f.feed(cmpl_chunk(" a", [1], prompt_ids=[9]) + cmpl_chunk(" b", [2]))
    events = [json.loads(e[6:]) for e in out.split(b"\n\n") if e.startswith(b"data: {")]
    assert [c["text"] for e in events for c in e["choices"]] == ["story a", " b"], events
    # vLLM's echo frame carries the prompt's ids even unasked (completion/serving.py:
    # ``prompt_token_ids_to_return = prompt_token_ids`` where it echoes)
    assert [(c["prompt_token_ids"], c["token_ids"]) for e in events
            for c in e["choices"]] == [([9], None), (None, None)], events
