"""/dashboard: login, cookie, and live numbers in a real headless Chromium (Selenium +
Debian's chromium and chromedriver; nothing is downloaded). The screenshot lands in
test-artifacts/dashboard.png."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.gateway.conftest import MODEL, GatewayFactory, SimFactory, complete
from tests.ops.conftest import ADMIN, admin_call, require_tool, until

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--window-size=1400,1100")
WAIT_S = 20
DEPTH = f'[data-metric="depth"][data-model="{MODEL}"][data-class="interactive"]'


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
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/dashboard") as resp:
            assert resp.status == 401 and 'name="key"' in await resp.text()
        async with http.get(gw.url + "/dashboard",
                            headers={"Authorization": "Bearer sk-alice"}) as resp:
            assert resp.status == 403
        # hold a small flood in the queue: the backend is drained
        assert (await admin_call(http, "POST", gw.url + "/admin/backends/b0/drain"))[0] == 200
        flood = [asyncio.create_task(complete(http, gw.url, key, 5))
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
                assert (await admin_call(
                    http, "POST", gw.url + "/admin/backends/b0/undrain"))[0] == 200
                await asyncio.gather(*flood)
                await asyncio.to_thread(see_the_flood_served, driver)
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
    ARTIFACTS.mkdir(exist_ok=True)
    assert driver.save_screenshot(str(ARTIFACTS / "dashboard-queued.png"))


def see_the_flood_served(driver: webdriver.Chrome) -> None:
    """The page follows without a reload: queue empty, dispatch rate and shares shown."""
    wait_for(driver, lambda d: (
        text_of(d, DEPTH) == "0"
        and float(text_of(d, '[data-backend="b0"] [data-metric="dispatch-rate"]') or 0) > 0
        and text_of(d, '[data-user="bob"] [data-metric="share"]') != ""))
    alice = float(text_of(driver, '[data-user="alice"] [data-metric="share"]')[:-1])
    bob = float(text_of(driver, '[data-user="bob"] [data-metric="share"]')[:-1])
    assert alice > bob > 0 and abs(alice + bob - 100) < 0.5
    assert "live" in text_of(driver, "#status")
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    assert driver.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000


def forged_cookie_gets_the_login_form(driver: webdriver.Chrome, url: str) -> None:
    driver.delete_all_cookies()
    driver.add_cookie({"name": "fairgate_admin", "value": "forged"})
    driver.get(url + "/dashboard")
    assert driver.find_elements(By.NAME, "key")
