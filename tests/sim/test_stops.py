"""``stop`` and ``stop_token_ids`` as vLLM honours them, through the official ``openai``
client: the answer is cut before the stop string (streamed: no partial stop string goes
out first), ``finish_reason`` "stop", ``stop_reason`` the string or token id; and a real
``created`` on ``/v1/models``."""

from __future__ import annotations

import time
from typing import Any

import openai

from loadtest.sim.server import SimServer
from tests.sim.conftest import MODEL

PROMPT = "tell me about the simulator"
LONG = 40


def client(server: SimServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def stop_reason(choice: Any) -> Any:
    return (choice.model_extra or {}).get("stop_reason")


async def unstopped(oai: openai.AsyncOpenAI) -> tuple[list[str], list[int]]:
    """The words (one per token, each with its leading space) and ids of the long answer."""
    whole = await oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=LONG,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    text = whole.choices[0].text
    words = [" " + w for w in text.split(" ")[1:]]
    assert "".join(words) == text and len(words) == LONG, f"unexpected answer {text!r}"
    ids = (whole.choices[0].model_extra or {})["token_ids"]
    return words, ids


def expected_cut(words: list[str], stop: str) -> tuple[str, int]:
    """The text before ``stop`` and the tokens generated until it was complete."""
    text = ""
    for i, word in enumerate(words):
        text += word
        if stop in text:
            return text[: text.index(stop)], i + 1
    raise AssertionError(f"{stop!r} never appears in {''.join(words)!r}")


async def test_stop_string_cuts_completion_and_chat_whole_and_streamed(
    server: SimServer,
) -> None:
    async with client(server) as oai:
        words, _ = await unstopped(oai)
        # spans two tokens: the 6th word and the 7th token's leading space
        stop = words[5] + " "
        want_text, want_tokens = expected_cut(words, stop)
        extra = {"ignore_eos": True}
        whole = await oai.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=LONG, stop=[stop], extra_body=extra
        )
        choice = whole.choices[0]
        assert choice.text == want_text, f"text {choice.text!r}, want {want_text!r}"
        assert (choice.finish_reason, stop_reason(choice)) == ("stop", stop), (
            f"finish {choice.finish_reason!r}, stop_reason {stop_reason(choice)!r}"
        )
        assert whole.usage is not None and whole.usage.completion_tokens == want_tokens, (
            f"usage {whole.usage}, want {want_tokens} completion tokens"
        )

        stream = await oai.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=LONG, stop=stop, stream=True,
            stream_options={"include_usage": True}, extra_body=extra,
        )  # fmt: skip
        chunks = [c async for c in stream]
        pieces = [c.choices[0].text for c in chunks if c.choices]
        streamed = "".join(pieces)
        assert streamed == want_text, f"streamed {streamed!r} ({pieces}), want {want_text!r}"
        last = [c.choices[0] for c in chunks if c.choices][-1]
        assert (last.finish_reason, stop_reason(last)) == ("stop", stop), (
            f"last frame {last}"
        )
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == want_tokens, f"{chunks[-1].usage}"

        messages: Any = [{"role": "user", "content": PROMPT}]
        chat_words = (await oai.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=LONG, extra_body=extra,
        )).choices[0].message.content or ""  # fmt: skip
        chat_stop = " " + chat_words.split(" ")[4]
        chat_want = chat_words[: chat_words.index(chat_stop)]
        chat = await oai.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=LONG, stop=chat_stop, extra_body=extra
        )
        reply = chat.choices[0]
        assert reply.message.content == chat_want, f"chat {reply.message.content!r}"
        assert (reply.finish_reason, stop_reason(reply)) == ("stop", chat_stop), f"{reply}"
        chat_stream = await oai.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=LONG, stop=[chat_stop], stream=True,
            extra_body=extra,
        )  # fmt: skip
        chat_chunks = [c async for c in chat_stream]
        deltas = [c.choices[0].delta.content or "" for c in chat_chunks if c.choices]
        assert "".join(deltas) == chat_want, f"chat streamed {deltas}, want {chat_want!r}"
        finals = [c.choices[0] for c in chat_chunks if c.choices and c.choices[0].finish_reason]
        assert [(f.finish_reason, stop_reason(f)) for f in finals] == [("stop", chat_stop)], (
            f"finishing frames {finals}"
        )


async def test_stream_never_sends_part_of_a_stop_string(server: SimServer) -> None:
    """A stop string of three words: each word reaches the client only once the text
    after it shows it does not begin the stop string."""
    async with client(server) as oai:
        words, _ = await unstopped(oai)
        stop = "".join(words[10:13])
        want_text, _ = expected_cut(words, stop)
        stream = await oai.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=LONG, stop=stop, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        sent = ""
        async for chunk in stream:
            sent += chunk.choices[0].text
            assert want_text.startswith(sent), (
                f"sent {sent!r} goes past {want_text!r} (a partial stop string {stop!r})"
            )
    assert sent == want_text, f"streamed {sent!r}, want {want_text!r}"


async def test_stop_token_ids_and_stop_at_the_length_cap(server: SimServer) -> None:
    async with client(server) as oai:
        words, ids = await unstopped(oai)
        extra: dict[str, Any] = {"ignore_eos": True, "stop_token_ids": [ids[4]]}
        by_id = await oai.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=LONG, extra_body=extra
        )
        choice = by_id.choices[0]
        want = "".join(words[:4])  # the stop token's own text is left out
        assert choice.text == want, f"text {choice.text!r}, want {want!r}"
        assert (choice.finish_reason, stop_reason(choice)) == ("stop", ids[4]), f"{choice}"
        assert by_id.usage is not None and by_id.usage.completion_tokens == 5, f"{by_id.usage}"

        # the stop string completes on the max_tokens-th token: a stop, not a length cut
        stop = words[7]
        capped = await oai.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=8, stop=stop,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        cut = capped.choices[0]
        assert (cut.text, cut.finish_reason, stop_reason(cut)) == (
            "".join(words[:7]), "stop", stop,
        ), f"{cut}"  # fmt: skip


async def test_empty_stop_string_is_400(server: SimServer) -> None:
    async with client(server) as oai:
        try:
            await oai.completions.create(model=MODEL, prompt=PROMPT, stop=["end", ""])
        except openai.BadRequestError as exc:
            assert "stop cannot contain an empty string" in str(exc), f"{exc}"
        else:
            raise AssertionError("an empty stop string was accepted")


async def test_models_report_a_real_created_time(server: SimServer) -> None:
    before = int(time.time())
    async with client(server) as oai:
        models = await oai.models.list()
    after = int(time.time())
    created = [m.created for m in models.data]
    assert created and all(before <= c <= after for c in created), (
        f"created {created}, want within [{before}, {after}]"
    )
