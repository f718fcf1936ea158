"""The admin page in a real browser: Debian's headless Chromium, driven by Selenium,
against a real `gateway run` that answers through the fake OpenAI server and the fake
Telegram Bot API. Each test saves screenshots of the pages it saw in its tmp folder.

Marked `browser`; under CI=true a missing chromium fails these tests instead of
skipping them (scripts/ensure-browser.sh installs it)."""

from __future__ import annotations

import json
import os
import shutil
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gateway.http.admin import APPROVED_TEXT
from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.telegram_server import FakeTelegram
from tests.gateway_process import GatewayProcess, telegram_env, wait_until

pytestmark = [pytest.mark.browser, pytest.mark.timeout(240)]

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
TOKEN = "browser-test-token-0123456789abcdef"
USER = 4242
HOSTILE = (
    "<script>window.pwned = 1; document.title = 'pwned'</script>"
    '<img src=x onerror="window.pwned = 2">'
    "\u202egnp.exe and a long line " + "W" * 6000
)
WAIT = 30  # seconds: generous, eight test runs share two cores


def _require_browser() -> None:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if not missing:
        return
    reason = f"{', '.join(missing)} missing: run scripts/ensure-browser.sh"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI=true requires the browser tests to run")
    pytest.skip(reason)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    _require_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new",
        "--no-sandbox",  # root in a container
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1400,1000",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(
        service=Service(executable_path=CHROMEDRIVER, log_output=str(tmp_path / "driver.log")),
        options=options,
    )
    driver.set_page_load_timeout(WAIT)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(tmp_path / "chromium-profile", ignore_errors=True)


@dataclass
class Site:
    url: str
    llm: FakeOpenAI
    telegram: FakeTelegram
    gateway: GatewayProcess
    shots: Path

    def chat(self, session: str, text: str) -> dict[str, Any]:
        request = urllib.request.Request(
            f"{self.url}/api/chat",
            data=json.dumps({"session": session, "text": text}).encode(),
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=WAIT) as response:
            body: dict[str, Any] = json.loads(response.read())
            return body


def _remember(env: dict[str, str]) -> None:
    """What the gateway remembers about Telegram user 4242 before it starts (memory is
    plain files a person may also write)."""
    from gateway.config import load_settings
    from gateway.storage.seam import open_storage

    memory = open_storage(load_settings(None, environ=env)).memory()
    scope = memory.for_session(f"telegram:{USER}")
    scope.record_consolidation(
        [("user_preference", "prefers short answers"), ("learned_fact", "lives in Lisbon")],
        "asked about train times to Porto",
    )
    scope.append_history("planned a weekend in Sintra")
    scope.knowledge.add("project_decision", "use the night train")
    memory.close()


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    with (
        FakeOpenAI.in_thread() as llm,
        FakeTelegram.in_thread(bot_username="gateway_bot") as telegram,
    ):
        env = telegram_env(tmp_path / "ws", llm, telegram) | {
            "GATEWAY_HTTP__TOKEN": TOKEN,
            "GATEWAY_CHANNELS__TELEGRAM__DM_POLICY": "pairing",
            "GATEWAY_LLM__TEMPERATURE": "0",
        }
        _remember(env)
        gateway = GatewayProcess(env, tmp_path)
        try:
            # Chromium and the other tests share two cores: start-up may take a while.
            port = gateway.wait_ready(timeout=90)
            gateway.wait_readyz(port, timeout=90)
            shots = tmp_path / "screenshots"
            shots.mkdir()
            yield Site(f"http://127.0.0.1:{port}", llm, telegram, gateway, shots)
        finally:
            gateway.stop()
            (tmp_path / "gateway.log").write_text("".join(gateway.log))  # for a failure


def _wait_text(driver: Any, css: str, text: str) -> Any:
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
    from selenium.webdriver.common.by import By

    def found() -> bool:
        try:
            elements = driver.find_elements(By.CSS_SELECTOR, css)
            return any(text in e.text for e in elements)
        except StaleElementReferenceException:  # the page changed under us: look again
            return False
        except WebDriverException as exc:
            # Chromium reports an element of the page just left this way under load,
            # not as stale: the same case, anything else is a failure.
            if "does not belong to the document" in str(exc):
                return False
            raise

    wait_until(found, WAIT, f"{text!r} in {css}")
    return driver.find_element(By.CSS_SELECTOR, css)


def _log_in(driver: Any, site: Site) -> None:
    from selenium.webdriver.common.by import By

    driver.get(f"{site.url}/admin")
    assert driver.current_url.endswith("/admin/login")
    driver.save_screenshot(str(site.shots / "login.png"))
    driver.find_element(By.ID, "token").send_keys(TOKEN)
    driver.find_element(By.ID, "login").click()
    _wait_text(driver, "h1", "Overview")
    cookie = driver.get_cookie("gateway_admin")
    assert cookie is not None and cookie["httpOnly"] and cookie["secure"]
    assert cookie["sameSite"] == "Strict"
    assert driver.execute_script("return document.cookie") == ""  # HttpOnly: no script sees it


def test_an_operator_logs_in_finds_a_session_and_opens_its_tree(browser: Any, site: Site) -> None:
    from selenium.webdriver.common.by import By

    # /undo takes the second exchange back: the next message starts a second branch.
    for text in ("hello there", "what can you do?", "/undo", "tell me a joke"):
        site.chat("support-42", text)
    site.chat("other", "unrelated")
    _log_in(browser, site)
    # The last turn is counted once its reply is delivered: the live view shows it soon.
    _wait_text(browser, "#total-turns", "5")
    browser.save_screenshot(str(site.shots / "overview.png"))

    browser.find_element(By.LINK_TEXT, "Sessions").click()
    search = browser.find_element(By.ID, "q")
    search.send_keys("support")
    browser.find_element(By.ID, "search").click()
    _wait_text(browser, "#counts", "1 match")
    rows = browser.find_elements(By.CSS_SELECTOR, "#sessions tbody tr")
    assert len(rows) == 1 and "api:support-42" in rows[0].text
    browser.save_screenshot(str(site.shots / "sessions.png"))

    rows[0].find_element(By.TAG_NAME, "a").click()
    _wait_text(browser, "#session-key", "api:support-42")
    tree = browser.find_element(By.ID, "tree")
    assert "branches: 2" in tree.text and "what can you do?" in tree.text
    leaf = browser.find_element(By.CSS_SELECTOR, "#tree li.leaf")
    assert "echo: tell me a joke" in leaf.text
    transcript = browser.find_element(By.ID, "transcript").text
    assert "echo: hello there" in transcript and "echo: tell me a joke" in transcript
    assert "what can you do?" not in transcript  # taken back: off the current branch
    browser.save_screenshot(str(site.shots / "session.png"))


def test_approving_a_pairing_code_lets_the_waiting_user_in(browser: Any, site: Site) -> None:
    from selenium.webdriver.common.by import By

    telegram = site.telegram
    telegram.push_update(telegram.user_message(USER, "hi, may I talk to you?", user_id=USER))
    wait_until(lambda: telegram.sent_messages(USER), WAIT, "the pairing code sent")
    code_text = telegram.sent_messages(USER)[-1]["text"]
    assert "pairing code" in code_text
    assert not site.llm.chat_requests  # a stranger never reaches the model

    _log_in(browser, site)
    browser.find_element(By.LINK_TEXT, "Pairing").click()
    pending = _wait_text(browser, "#pending", str(USER))
    code = pending.find_element(By.CSS_SELECTOR, "code.code").text
    assert code in code_text
    browser.save_screenshot(str(site.shots / "pairing.png"))
    pending.find_element(By.CSS_SELECTOR, "button.approve").click()
    _wait_text(browser, ".notice", f"Approved {USER} on telegram")
    assert str(USER) in browser.find_element(By.ID, "approved").text
    browser.save_screenshot(str(site.shots / "pairing-approved.png"))

    wait_until(
        lambda: telegram.sent_messages(USER)[-1]["text"] == APPROVED_TEXT,
        WAIT,
        "the approval told to the user",
    )
    telegram.push_update(telegram.user_message(USER, "thanks, hello!", user_id=USER))
    wait_until(
        lambda: telegram.sent_messages(USER)[-1]["text"] == "echo: thanks, hello!",
        WAIT,
        "the approved user answered by the model",
    )


def test_a_cached_answer_is_invalidated_from_the_page(browser: Any, site: Site) -> None:
    from selenium.webdriver.common.by import By

    question = "What is the capital of France?"
    site.chat("first", question)
    asked = len(site.llm.chat_requests)
    site.chat("second", question)
    assert len(site.llm.chat_requests) == asked  # the second answer came from the cache

    _log_in(browser, site)
    browser.find_element(By.LINK_TEXT, "Cache").click()
    assert browser.find_element(By.ID, "cache-entries").text == "1"
    assert browser.find_element(By.ID, "cache-hits").text == "1"
    browser.save_screenshot(str(site.shots / "cache.png"))

    browser.get(f"{site.url}/admin/session?key=api:second")
    _wait_text(browser, "#transcript", "from cache")
    browser.find_element(By.CSS_SELECTOR, "button.invalidate").click()
    _wait_text(browser, ".notice", "Removed 1 cache entry")
    assert browser.find_element(By.ID, "cache-entries").text == "0"
    browser.save_screenshot(str(site.shots / "cache-invalidated.png"))
    site.chat("third", question)
    assert len(site.llm.chat_requests) == asked + 1  # asked the model again


def test_hostile_message_content_runs_no_script(browser: Any, site: Site) -> None:
    from selenium.webdriver.common.by import By

    site.chat("<img src=x onerror=window.pwned=3>", HOSTILE)
    _log_in(browser, site)
    browser.find_element(By.LINK_TEXT, "Sessions").click()
    link = browser.find_element(By.CSS_SELECTOR, "#sessions tbody a")
    assert link.text == "api:<img src=x onerror=window.pwned=3>"
    link.click()
    _wait_text(browser, "#transcript", "window.pwned = 1")
    body = browser.find_element(By.ID, "transcript").text
    assert "<script>" in body and "U+202E" in body and "more characters" in body
    assert browser.execute_script("return window.pwned") is None
    assert browser.title != "pwned"
    assert not browser.find_elements(By.CSS_SELECTOR, "#transcript script, #transcript img")
    browser.save_screenshot(str(site.shots / "hostile.png"))


def test_a_post_without_the_csrf_token_is_refused(browser: Any, site: Site) -> None:
    from selenium.webdriver.common.by import By

    site.chat("csrf", "remember me")
    _log_in(browser, site)
    browser.find_element(By.LINK_TEXT, "Cache").click()
    before = browser.find_element(By.ID, "cache-entries").text
    # The page's own form, its hidden token removed: refused, nothing changes.
    browser.execute_script(
        "document.querySelector('form.search input[name=csrf]').remove();"
        "document.getElementById('invalidate-what').value = 'all';"
    )
    browser.find_element(By.ID, "invalidate").click()
    _wait_text(browser, ".error", "security token is missing")
    browser.save_screenshot(str(site.shots / "csrf-refused.png"))
    status = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "fetch('/admin/cache/invalidate', {method: 'POST', body: new URLSearchParams("
        "{what: 'all'})}).then(r => done(r.status));"
    )
    assert status == 403
    browser.get(f"{site.url}/admin/cache")
    assert browser.find_element(By.ID, "cache-entries").text == before


def test_the_live_view_updates_without_a_reload(browser: Any, site: Site) -> None:
    from selenium.webdriver.common.by import By

    _log_in(browser, site)
    browser.execute_script("window.sameDocument = true")
    assert browser.find_element(By.ID, "total-turns").text == "0"
    site.chat("live", "one")
    site.chat("live", "two")
    _wait_text(browser, "#total-turns", "2")
    assert browser.execute_script("return window.sameDocument") is True
    assert "api 2" in browser.find_element(By.ID, "live").text
    browser.save_screenshot(str(site.shots / "live.png"))


def test_the_memory_of_a_scope_with_history_search(browser: Any, site: Site) -> None:
    from selenium.webdriver.common.by import By

    _log_in(browser, site)
    browser.find_element(By.LINK_TEXT, "Memory").click()
    browser.find_element(By.ID, "memory-key").send_keys(f"telegram:{USER}")
    browser.find_element(By.ID, "memory-go").click()
    facts = _wait_text(browser, "#facts", "prefers short answers")
    assert "[learned_fact] lives in Lisbon" in facts.text
    history = browser.find_element(By.ID, "history").text
    assert "Sintra" in history and "Porto" in history
    assert "use the night train" in browser.find_element(By.TAG_NAME, "main").text
    browser.save_screenshot(str(site.shots / "memory.png"))
    browser.find_element(By.ID, "history-q").send_keys("Sintra")
    browser.find_element(By.ID, "memory-go").click()
    _wait_text(browser, "h2", "History matching")
    history = browser.find_element(By.ID, "history").text
    assert "Sintra" in history and "Porto" not in history
