"""/dashboard: login, cookie, live numbers, the 15-minute charts, shares, and drain,
undrain and cancel from the page (confirmed in its dialog, CSRF token sent) in a real
headless Chromium (Selenium + Debian's chromium and chromedriver; nothing is downloaded).
The screenshots land in test-artifacts/ (dashboard.png, dashboard-queued.png)."""

from __future__ import annotations

import asyncio
import json
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.gateway.conftest import MODEL, GatewayFactory, SimFactory
from tests.ops.conftest import ADMIN, admin_call, require_tool, until

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--window-size=1400,1100")
WAIT_S = 20
DEPTH = f'[data-metric="depth"][data-model="{MODEL}"][data-class="interactive"]'
B0_STATE = '[data-backend="b0"] [data-metric="backend-state"]'
CHARTS = (f"queue-depth:{MODEL}", "dispatch-rate", "ttft", "gate-closed")


async def completion_status(http: aiohttp.ClientSession, url: str, key: str,
                            stream: bool = False) -> int:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 5, "ignore_eos": True,
            "stream": stream}
    async with http.post(url + "/v1/completions", json=body,
                         headers={"Authorization": f"Bearer {key}"}) as resp:
        await resp.read()
        return resp.status


def start_browser(profile: str) -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = require_tool("chromium")
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service(require_tool("chromedriver")))


def text_of(driver: webdriver.Chrome, css: str, attribute: str | None = None) -> str:
    """Read in one script call: the page redraws every second, so element handles go stale."""
    script = ("const e = document.querySelector(arguments[0]);"
              "return e ? (arguments[1] ? e.getAttribute(arguments[1]) : e.textContent) : '';")
    return str(driver.execute_script(script, css, attribute) or "")


def wait_for(driver: webdriver.Chrome, condition: Callable[[webdriver.Chrome], Any]) -> Any:
    return WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(condition)


async def test_dashboard_shows_live_state_in_chromium(sim: SimFactory,
                                                      gateway: GatewayFactory) -> None:
    require_tool("chromium")
    require_tool("chromedriver")
    backend = await sim()
    gw = await gateway([backend], admin_keys=[ADMIN])
    gw.services.inspector.history.interval_s = 0.25  # the charts fill in seconds, not minutes
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/dashboard") as resp:
            assert resp.status == 401 and 'name="key"' in await resp.text()
        async with http.get(gw.url + "/dashboard",
                            headers={"Authorization": "Bearer sk-alice"}) as resp:
            assert resp.status == 403
        # hold a small flood in the queue: the backend is drained
        assert (await admin_call(http, "POST", gw.url + "/admin/backends/b0/drain"))[0] == 200
        flood = [asyncio.create_task(completion_status(http, gw.url, key))
                 for key in ["sk-alice"] * 6 + ["sk-bob"] * 2]

        async def queued() -> bool:
            _, state = await admin_call(http, "GET", gw.url + "/admin/queues")
            return bool(state["data"][MODEL]["interactive"]["depth"] == 8)
        await until(queued, what="the flood queued")

        with tempfile.TemporaryDirectory(prefix="fairgate-chromium-") as profile:
            driver = await asyncio.to_thread(start_browser, profile)
            try:
                # every WebDriver call runs in a thread: the gateway shares this event loop
                await asyncio.to_thread(login_and_see_the_queue, driver, gw.url)
                await asyncio.to_thread(cancel_bobs_oldest_from_the_page, driver)
                await asyncio.to_thread(act_from_the_page, driver, "b0", "undrain")
                await asyncio.to_thread(wait_for, driver,
                                        lambda d: text_of(d, B0_STATE) == "healthy")
                statuses = await asyncio.gather(*flood)
                assert sorted(statuses) == [200] * 7 + [409]  # bob's cancelled one: 409
                assert await completion_status(http, gw.url, "sk-alice", stream=True) == 200
                await asyncio.to_thread(see_the_flood_served, driver)
                await asyncio.to_thread(drain_and_undrain_from_the_page, driver)
                await asyncio.to_thread(forged_cookie_gets_the_login_form, driver, gw.url)
            finally:
                await asyncio.to_thread(driver.quit)


def login_and_see_the_queue(driver: webdriver.Chrome, url: str) -> None:
    driver.get(url + "/dashboard")
    field = driver.find_element(By.NAME, "key")
    field.send_keys(ADMIN)
    field.submit()
    wait_for(driver, lambda d: text_of(d, DEPTH) == "8")
    assert driver.current_url == url + "/dashboard"  # the key does not stay in the URL
    assert text_of(driver, '[data-user="alice"] [data-metric="user-queued"]') == "6"
    assert text_of(driver, '[data-user="bob"] [data-metric="user-queued"]') == "2"
    gate = '[data-backend="b0"] [data-gate="interactive"]'
    assert text_of(driver, gate, "data-reason") == "drained"
    assert text_of(driver, gate) == "interactive: drained"
    assert text_of(driver, '[data-backend="b0"] [data-metric="backend-state"]') == "drained"
    # no prompt range: it takes any length; nothing dispatched, so no pending prefill
    assert text_of(driver, '[data-backend="b0"] [data-metric="prompt-range"]') == "any length"
    assert text_of(driver, '[data-backend="b0"] [data-metric="pending-prefill"]') == (
        "0 tok pending")
    ARTIFACTS.mkdir(exist_ok=True)
    assert driver.save_screenshot(str(ARTIFACTS / "dashboard-queued.png"))


def act_from_the_page(driver: webdriver.Chrome, target: str, action: str,
                      confirm: bool = True) -> None:
    """Click an action button (found afresh: rows are redrawn every second), then answer
    the confirmation dialog."""
    attribute = "data-request" if action == "cancel" else "data-backend"
    button = f'button[data-action="{action}"][{attribute}="{target}"]'
    wait_for(driver, lambda d: d.execute_script(
        "const b = document.querySelector(arguments[0]); if (b) b.click(); return !!b;",
        button))
    wait_for(driver, lambda d: d.execute_script(
        "return document.getElementById('confirm').open"))
    assert action in text_of(driver, "#confirm-text").lower()
    driver.find_element(By.ID, "confirm-yes" if confirm else "confirm-no").click()
    wait_for(driver, lambda d: not d.execute_script(
        "return document.getElementById('confirm').open"))


def cancel_bobs_oldest_from_the_page(driver: webdriver.Chrome) -> None:
    bob_queued = '[data-user="bob"] [data-metric="user-queued"]'
    request_id = text_of(driver, '[data-user="bob"] button[data-action="cancel"]',
                         "data-request")
    assert len(request_id) == 32
    act_from_the_page(driver, request_id, "cancel", confirm=False)  # "keep as is"
    assert text_of(driver, bob_queued) == "2" and text_of(driver, DEPTH) == "8"
    act_from_the_page(driver, request_id, "cancel")
    wait_for(driver, lambda d: text_of(d, bob_queued) == "1" and text_of(d, DEPTH) == "7")
    assert text_of(driver, "#flash") == "cancelled"


def drain_and_undrain_from_the_page(driver: webdriver.Chrome) -> None:
    act_from_the_page(driver, "b0", "drain")
    wait_for(driver, lambda d: text_of(d, B0_STATE) == "drained" and text_of(
        d, '[data-backend="b0"] [data-gate="interactive"]', "data-reason") == "drained")
    assert text_of(driver, "#flash") == "drained b0"
    act_from_the_page(driver, "b0", "undrain")
    wait_for(driver, lambda d: text_of(d, B0_STATE) == "healthy")
    assert text_of(driver, "#flash") == "undrained b0"
    # drain and move streams: the grace from the dialog's field, the time shown
    wait_for(driver, lambda d: d.execute_script(
        "const b = document.querySelector('button[data-action=\"migrate\"]"
        "[data-backend=\"b0\"]'); if (b) b.click(); return !!b;"))
    wait_for(driver, lambda d: d.execute_script(
        "return document.getElementById('confirm').open"))
    assert "migrate" in text_of(driver, "#confirm-text").lower()
    grace = driver.find_element(By.ID, "grace-s")
    assert grace.is_displayed()
    grace.clear()
    grace.send_keys("3000")
    driver.find_element(By.ID, "confirm-yes").click()
    wait_for(driver, lambda d: text_of(d, B0_STATE) == "drained" and text_of(
        d, '[data-backend="b0"] [data-metric="migrate-at"]').startswith("streams move at"))
    assert text_of(driver, "#flash") == "drained b0, streams move"
    act_from_the_page(driver, "b0", "undrain")
    wait_for(driver, lambda d: text_of(d, B0_STATE) == "healthy")
    assert not driver.find_element(By.ID, "confirm-grace").is_displayed()


def chart_points(driver: webdriver.Chrome, chart: str) -> int:
    """Values a chart plotted (0 unless its SVG holds a line or a point)."""
    return int(driver.execute_script(
        "const c = document.querySelector(`[data-chart=\"${arguments[0]}\"]`);"
        "if (!c || !c.querySelector('svg polyline, svg circle')) return 0;"
        "return Number(c.dataset.points);", chart))


def see_the_flood_served(driver: webdriver.Chrome) -> None:
    """The page follows without a reload: queue empty, dispatch rate and shares shown."""
    wait_for(driver, lambda d: (
        text_of(d, DEPTH) == "0"
        and float(text_of(d, '[data-backend="b0"] [data-metric="dispatch-rate"]') or 0) > 0
        and text_of(d, '[data-user="bob"] [data-metric="share"]') != ""))
    alice = float(text_of(driver, '[data-user="alice"] [data-metric="share"]')[:-1])
    bob = float(text_of(driver, '[data-user="bob"] [data-metric="share"]')[:-1])
    assert alice > bob > 0 and abs(alice + bob - 100) < 0.5
    # today's usage: every user is its own tenant here (no tenants configured)
    wait_for(driver, lambda d: int(text_of(d, '#usage [data-tenant="alice"] '
                                           '[data-metric="tokens"]') or 0) > 0)
    assert int(text_of(driver, '#usage [data-usage-user="bob"] [data-metric="tokens"]')) > 0
    assert driver.execute_script(  # the shares are every replica's, read from Redis
        "return [...document.querySelectorAll('h3')].some(h => /all replicas/.test(h.textContent))")
    # the charts: lines drawn from the server's samples, the TTFT one from the stream
    # TTFT has a value only in the intervals where a stream started: one here
    wait_for(driver, lambda d: all(chart_points(d, c) >= (1 if c == "ttft" else 2)
                                   for c in CHARTS))
    assert float(text_of(driver, '[data-chart="ttft"] [data-series="p50"]').split()[1]) > 0
    assert "live" in text_of(driver, "#status")
    # idle again, the batch class may fill the one free slot it gets: said in the singular
    batch = '[data-backend="b0"] [data-pacing="batch"]'
    try:
        wait_for(driver, lambda d: text_of(d, batch).endswith("+ 1 free slot"))
    except TimeoutException:
        raise AssertionError(f"batch pacing reads {text_of(driver, batch)!r}") from None
    pacing = [text_of(driver, f'[data-backend="b0"] [data-pacing="{c}"]')
              for c in ("interactive", "default", "batch")]
    for line in pacing:
        count = re.search(r"\+ (\d+) free slots?$", line)
        assert count and line.endswith("slot" if count[1] == "1" else "slots"), (
            f"pacing cell {pacing}")
    # the four charts in one row (the window is 1400 px wide): an even grid
    tops = driver.execute_script(
        "return [...document.querySelectorAll('.chart')].map(c => c.offsetTop)")
    assert len(tops) == len(CHARTS) and len(set(tops)) == 1, f"chart rows at {tops}"
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    assert driver.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000


def forged_cookie_gets_the_login_form(driver: webdriver.Chrome, url: str) -> None:
    driver.delete_all_cookies()
    driver.add_cookie({"name": "fairgate_admin", "value": "forged"})
    driver.get(url + "/dashboard")
    assert driver.find_elements(By.NAME, "key")


async def test_two_page_loads_on_two_replicas_show_one_history(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    """Each replica (or worker) adds its counts to one history in Redis: whichever process
    answers a page load, the charts show the same samples, with every replica's
    dispatches in them."""
    require_tool("chromium")
    require_tool("chromedriver")
    backend = await sim()
    replicas = [await gateway([backend], admin_keys=[ADMIN]) for _ in range(2)]
    for gw in replicas:
        gw.services.inspector.history.interval_s = 0.25  # samples in seconds, not minutes
    async with aiohttp.ClientSession() as http:
        statuses = await asyncio.gather(*(completion_status(http, gw.url, "sk-alice")
                                          for gw in replicas for _ in range(3)))
        assert statuses == [200] * 6, statuses
    with tempfile.TemporaryDirectory(prefix="fairgate-chromium-") as profile:
        driver = await asyncio.to_thread(start_browser, profile)
        try:
            first = await asyncio.to_thread(charted_history, driver, replicas[0].url)
            second = await asyncio.to_thread(charted_history, driver, replicas[1].url)
        finally:
            await asyncio.to_thread(driver.quit)
    shared = first.keys() & second.keys()
    differ = {t: (first[t], second[t]) for t in shared if first[t] != second[t]}
    assert not differ, f"two loads disagree on {len(differ)} samples: {differ}"
    dispatched = sum(rate * 0.25 for rate in (first[t]["dispatch-rate"] for t in shared))
    assert round(dispatched) == 6, (dispatched, first)


def charted_history(driver: webdriver.Chrome, url: str) -> dict[float, dict[str, Any]]:
    """Log in on ``url``'s dashboard once its charts show dispatches; every sample's
    plotted values by time: {t: {chart: value of its first series}}."""
    driver.delete_all_cookies()
    driver.get(url + "/dashboard")
    field = driver.find_element(By.NAME, "key")
    field.send_keys(ADMIN)
    field.submit()

    def values(d: webdriver.Chrome) -> dict[float, dict[str, Any]] | None:
        # both charts in one script call: the page redraws every few seconds, and two
        # calls could read the charts of two different draws (a newer sample in one only)
        names = [f"queue-depth:{MODEL}", "dispatch-rate"]
        raws = d.execute_script(
            "return arguments[0].map((name) => {"
            "  const c = document.querySelector(`[data-chart=\"${name}\"]`);"
            "  return c ? c.dataset.values : null; });", names)
        if any(raw is None for raw in raws):
            return None
        # the first series of each: [[t, value], …]
        charts = {chart: json.loads(raw)[0][1] for chart, raw in zip(names, raws, strict=True)}
        by_t: dict[float, dict[str, Any]] = {}
        for chart, points in charts.items():
            for t, value in points:
                by_t.setdefault(t, {})[chart] = value
        dispatched = sum(v.get("dispatch-rate") or 0 for v in by_t.values())
        return by_t if dispatched > 0 else None
    return wait_for(driver, values)
