"""Values the schema fuzzer does not reach (issue 29, item 7): numbers that do not fit —
JSON integers longer than Python converts (4,300 digits), floats beyond a double, and the
``NaN``/``Infinity`` Python's json reads but JSON has none of — anywhere in a body, on
every JSON route; ``n`` that long from a key with token limits; and prompts of token ids
in random shapes. Never a 5xx: a number that does not fit is a 400 (and a batch file
holding one is not kept); a token-id prompt is served or refused with a 400."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.http.server import GatewayServer
from tests.gateway.conftest import (
    KEYS,
    MODEL,
    GatewayFactory,
    SimFactory,
    assert_error,
    auth,
)

HUGE = "9" * 5000  # beyond sys.get_int_max_str_digits() (4,300)
# what each of these is, as JSON text: none fits a request
UNFIT = {"an integer of 5,000 digits": HUGE, "NaN": "NaN", "-Infinity": "-Infinity",
         "1e400 (beyond a double)": "1e400"}
ADMIN = "sk-admin"

# route → (key, a body as JSON text; "@" is where the huge integer goes)
ROUTES: dict[str, tuple[str, str]] = {
    "/v1/chat/completions": ("sk-alice", f'{{"model": "{MODEL}", "messages": '
                             '[{"role": "user", "content": "hi"}], "max_tokens": @}'),
    "/v1/completions": ("sk-alice", f'{{"model": "{MODEL}", "prompt": [[1, 2, @]]}}'),
    "/v1/embeddings": ("sk-alice", f'{{"model": "{MODEL}", "input": "hi", "dimensions": @}}'),
    "/v1/responses": ("sk-alice", f'{{"model": "{MODEL}", "input": "hi", "seed": @}}'),
    "/tokenize": ("sk-alice", f'{{"model": "{MODEL}", "prompt": "hi", "n": @}}'),
    "/detokenize": ("sk-alice", f'{{"model": "{MODEL}", "tokens": [@]}}'),
    "/v1/batches": ("sk-alice", '{"input_file_id": "file-x", "endpoint": '
                    '"/v1/chat/completions", "metadata": {"a": @}}'),
    "/admin/keys": (ADMIN, '{"user": "u", "weight": @}'),
}


async def _post(gw: GatewayServer, path: str, key: str, data: bytes | aiohttp.FormData
                ) -> tuple[int, dict[str, Any]]:
    headers = auth(key)
    if isinstance(data, bytes):
        headers["Content-Type"] = "application/json"
    async with aiohttp.ClientSession() as http, http.post(gw.url + path, data=data,
                                                          headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


@pytest.mark.parametrize("path", list(ROUTES))
async def test_a_number_that_does_not_fit_is_a_400_on_every_route(
        path: str, gateway: GatewayFactory, sim: SimFactory, tmp_path: Path) -> None:
    gw = await gateway([await sim(profile="instant")], data_dir=tmp_path,
                       admin_keys=[ADMIN])
    key, template = ROUTES[path]
    for what, value in UNFIT.items():
        status, answer = await _post(gw, path, key, template.replace("@", value).encode())
        assert status == 400, (path, what, status, answer)
        assert_error(answer, type_="invalid_request_error")


async def test_a_batch_file_with_a_number_that_does_not_fit_is_refused_and_not_kept(
        gateway: GatewayFactory, sim: SimFactory, tmp_path: Path) -> None:
    gw = await gateway([await sim(profile="instant")], data_dir=tmp_path)
    for what, value in UNFIT.items():
        line = ('{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", '
                f'"body": {{"model": "{MODEL}", "messages": [{{"role": "user", '
                f'"content": "hi"}}], "seed": {value}}}}}\n')
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", line.encode(), filename="in.jsonl")
        status, answer = await _post(gw, "/v1/files", "sk-alice", form)
        assert status == 400, (what, status, answer)
        assert "line 1: the line" in answer["error"]["message"], (what, answer)
        async with aiohttp.ClientSession() as http, http.get(
                gw.url + "/v1/files", headers=auth("sk-alice")) as resp:
            listing = await resp.json()
        assert listing["data"] == [], f"{what}: a file that failed validation was kept: {listing}"
        stored = list((tmp_path / "files").glob("*"))
        assert stored == [], f"{what}: {stored}"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_sequences_of_4300_digits_from_a_limited_key_are_a_400(
        path: str, gateway: GatewayFactory, sim: SimFactory) -> None:
    """``n`` parses (4,300 digits), but the reservation it multiplies has more digits than
    Python writes as text for Redis: that was a 500."""
    limited = {"key": "sk-lim", "user": "lim", "limits": {"tpm": 100_000,
                                                         "daily_tokens": 50_000}}
    gw = await gateway([await sim(profile="instant")], api_keys=[*KEYS, limited])
    prompt = ('"messages": [{"role": "user", "content": "hi"}]' if "chat" in path
              else '"prompt": "hi"')
    for name in ("n", "best_of"):
        text = f'{{"model": "{MODEL}", {prompt}, "max_tokens": 4096, "{name}": 1{"0" * 4299}}}'
        status, answer = await _post(gw, path, "sk-lim", text.encode())
        assert status == 400, (path, name, status, answer)
        assert_error(answer, type_="invalid_request_error", param=name)
    async with aiohttp.ClientSession() as http, http.get(
            gw.url + "/v1/fairgate/usage", headers=auth("sk-lim")) as resp:
        usage = await resp.json()
    assert usage["limits"][0]["tokens_remaining"] == 100_000, usage


def _token_prompt(rng: random.Random) -> Any:
    """A random token-id prompt: ids, a list of id lists, odd ids (negative, 0, huge: up
    to 4,001 digits, which parse), empty lists, mixed with text."""
    odd = [0, 1, 7, 50_000, -1, 2**31, 2**63, 10**4000]
    ids = [rng.choice(odd) for _ in range(rng.randint(0, 300))]
    shape = rng.randrange(5)
    if shape == 0:
        return ids
    if shape == 1:
        return [ids, ids[: rng.randint(0, len(ids))]]
    if shape == 2:
        return [[ids]]
    if shape == 3:
        return ["text", ids]
    return [[]]


async def test_token_id_prompts_are_served_or_refused_never_a_5xx(
        gateway: GatewayFactory, sim: SimFactory) -> None:
    gw = await gateway([await sim(profile="instant")])
    rng = random.Random(29)
    seen: dict[int, int] = {}
    async with aiohttp.ClientSession() as http:
        for _ in range(60):  # bounded in count; each request bounded by the session
            prompt = _token_prompt(rng)
            for path, field in (("/v1/completions", "prompt"), ("/v1/embeddings", "input"),
                                ("/tokenize", "prompt")):
                body = {"model": MODEL, field: prompt, "max_tokens": 1}
                if path != "/v1/completions":
                    body.pop("max_tokens")
                async with http.post(gw.url + path, json=body,
                                     headers=auth("sk-bob")) as resp:
                    answer = await resp.json(content_type=None)
                    seen[resp.status] = seen.get(resp.status, 0) + 1
                    assert resp.status < 500, (path, str(prompt)[:200], answer)
                    if resp.status >= 400:
                        assert set(answer) == {"error"}, answer
    assert seen.get(200, 0) > 0, seen
