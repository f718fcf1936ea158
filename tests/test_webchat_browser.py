"""The web chat in a real browser: Debian's headless Chromium, driven by Selenium as the
admin page's tests do, against one real `gateway run` (the web chat on, the fake OpenAI
server streaming its answers), reached through a TCP proxy that a test cuts to drop the
network. Two other sites are local pages too: one allowed to embed the widget
(http://localhost:<port>, another site than 127.0.0.1) and one not, which also tries to
post into the chat (CSRF).

Each test saves screenshots in its tmp folder; with GATEWAY_WEBCHAT_SHOTS=<folder> the
ones docs/webchat.md shows are written there as small PNGs.

Marked `browser`; under CI=true a missing chromium fails these tests instead of skipping
them (scripts/ensure-browser.sh installs it)."""

from __future__ import annotations

import io
import os
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.fakes._serving import free_port
from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.tcp_proxy import TcpProxy
from tests.gateway_process import GatewayProcess, base_env, wait_until
from tests.test_admin_browser import CHROMEDRIVER, CHROMIUM, _require_browser

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

WAIT = 30  # seconds: generous, several test runs share two cores
HOSTILE = (
    "Here: <script>window.pwned = 1; document.title = 'pwned'</script>\n\n"
    '<img src=x onerror="window.pwned = 2"> <iframe src="https://evil.example"></iframe>\n\n'
    "[click me](javascript:window.pwned=3) [data](data:text/html,<script>alert(1)</script>) "
    '[ok](https://example.org/ "t" onmouseover="window.pwned=4")\n\n'
    "![pixel](https://tracker.example/p.gif)\n\n"
    '```js" onclick="window.pwned=5\nwindow.pwned = 6 // code, not run\n```\n\n'
    "| a | b |\n|---|---|\n| <b onclick=x>b</b> | &lt;i&gt; |"
)
SHOWCASE = (
    "## Train times\n\nThe **fastest** way from Porto to Lisbon is the *Alfa Pendular*:\n\n"
    "- about 2 h 50 min\n- every hour from Campanhã\n\n"
    "```python\ndef fare(km: int) -> float:\n    # a flat rate, for the example\n"
    '    return round(0.08 * km, 2)  # "euros"\n```\n\n'
    "| train | time |\n|---|---|\n| AP 130 | 07:39 |\n| IC 520 | 08:52 |"
)


@dataclass
class Site:
    chat: str  # the chat page, through the proxy
    llm: FakeOpenAI
    gateway: GatewayProcess
    proxy: TcpProxy
    host: str  # a site allowed to embed the widget
    stranger: str  # a site that is not, on another port of the same names
    gateway_port: int


def _pages(chat: str) -> web.Application:
    """The other sites' pages: the widget embedded, and a page posting into the chat."""
    widget = (
        '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>Shop</title></head>'
        "<body><h1>A shop</h1><p>Questions? Ask below.</p>"
        f'<script src="{chat}/webchat/widget.js" data-title="Help" async></script></body></html>'
    )
    attack = (
        "<!doctype html><html><body>"
        f'<form id="f" method="POST" action="{chat}/webchat/api/messages" enctype="text/plain">'
        '<input name=\'{"id":"attack-form-01","text":"pwned by form","files":[],"x":"\' '
        "value='\"}'></form><script>"
        f"fetch('{chat}/webchat/api/messages', {{method: 'POST', mode: 'no-cors', "
        "credentials: 'include', headers: {'Content-Type': 'text/plain'}, body: "
        "JSON.stringify({id: 'attack-fetch-01', text: 'pwned by fetch', files: []})})"
        ".finally(() => document.getElementById('f').submit());</script></body></html>"
    )
    app = web.Application()
    bodies = {"widget.html": widget, "attack.html": attack}

    async def page(request: web.Request) -> web.Response:
        return web.Response(text=bodies[request.match_info["name"]], content_type="text/html")

    app.router.add_get("/{name}", page)
    return app


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    import asyncio

    _require_browser()
    folder = tmp_path_factory.mktemp("webchat-site")
    port, host_port, stranger_port = free_port(), free_port(), free_port()
    proxy = TcpProxy("127.0.0.1", port)
    proxy.restore()
    chat = f"http://127.0.0.1:{proxy.port}"
    loop = asyncio.new_event_loop()
    runners: list[web.AppRunner] = []

    async def serve(listen: int) -> None:
        runner = web.AppRunner(_pages(chat))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", listen).start()
        runners.append(runner)

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    for listen in (host_port, stranger_port):
        asyncio.run_coroutine_threadsafe(serve(listen), loop).result(10)
    with FakeOpenAI.in_thread() as llm:
        env = base_env(folder / "ws", llm) | {
            "GATEWAY_HTTP__PORT": str(port),
            "GATEWAY_LLM__STREAM": "true",
            "GATEWAY_CHANNELS__WEB__ENABLED": "true",
            "GATEWAY_CHANNELS__WEB__DM_POLICY": "open",
            "GATEWAY_CHANNELS__WEB__TITLE": "Ask the gateway",
            "GATEWAY_CHANNELS__WEB__ALLOWED_ORIGINS": f'["http://localhost:{host_port}"]',
        }
        gateway = GatewayProcess(env, folder)
        try:
            gateway.wait_readyz(gateway.wait_ready(timeout=90), timeout=90)
            yield Site(
                chat,
                llm,
                gateway,
                proxy,
                f"http://localhost:{host_port}",
                f"http://localhost:{stranger_port}",
                port,
            )
        finally:
            gateway.stop()
            (folder / "gateway.log").write_text("".join(gateway.log))
            for runner in runners:
                asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
            proxy.close()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    _require_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1000,860",
        "--lang=en-US",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(
        service=Service(executable_path=CHROMEDRIVER, log_output=str(tmp_path / "driver.log")),
        options=options,
    )
    driver.set_page_load_timeout(WAIT)
    driver.set_script_timeout(WAIT)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(tmp_path / "chromium-profile", ignore_errors=True)


# -- helpers -------------------------------------------------------------------------------


def _until(driver: Any, script: str, what: str, *args: Any) -> Any:
    """Wait until `script` (a JavaScript expression's body, `return ...`) is truthy."""
    found: list[Any] = []

    def check() -> bool:
        value = driver.execute_script(script, *args)
        found[:] = [value]
        return bool(value)

    wait_until(check, WAIT, what)
    return found[0]


def _entries(driver: Any) -> list[dict[str, Any]]:
    """The log as shown: each entry's kind, ids and text."""
    entries: list[dict[str, Any]] = driver.execute_script(
        "return Array.from(document.querySelectorAll('#log > li')).map(li => ({"
        "kind: li.classList.contains('mine') ? 'mine' : 'theirs', id: li.dataset.id || '',"
        "pending: !!li.dataset.pending, draft: !!li.dataset.draftFor,"
        "replyTo: li.dataset.replyTo || '', text: li.querySelector('.bubble').innerText}))"
    )
    return entries


def _open(driver: Any, site: Site) -> None:
    driver.get(f"{site.chat}/webchat/")
    _until(driver, "return !document.getElementById('composer').hidden", "the composer")


def _say(driver: Any, text: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    box = driver.find_element(By.ID, "message")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def _answered(driver: Any, text: str, count: int = 1) -> None:
    """Wait until `text` is in exactly `count` logged replies (never more)."""

    def shown() -> int:
        return sum(
            1 for e in _entries(driver) if e["kind"] == "theirs" and e["id"] and text in e["text"]
        )

    wait_until(lambda: shown() >= count, WAIT, f"{count} repl(y/ies) holding {text!r}")
    assert shown() == count


def _logged_once(driver: Any, text: str) -> None:
    mine = [e for e in _entries(driver) if e["kind"] == "mine" and e["text"].strip() == text]
    assert len(mine) == 1 and mine[0]["id"] and not mine[0]["pending"], mine


def _shot(driver: Any, tmp_path: Path, name: str, *, docs: bool = False) -> None:
    """A screenshot in the test's folder; with GATEWAY_WEBCHAT_SHOTS, also a small PNG
    (a palette of 128 colours) there, for docs/webchat.md."""
    path = tmp_path / f"{name}.png"
    driver.save_screenshot(str(path))
    folder = os.environ.get("GATEWAY_WEBCHAT_SHOTS")
    if docs and folder:
        from PIL import Image

        with Image.open(path) as image:
            small = image.convert("RGB").quantize(colors=128, dither=Image.Dither.NONE)
            out = io.BytesIO()
            small.save(out, format="PNG", optimize=True)
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"webchat-{name}.png").write_bytes(out.getvalue())


# -- the tests -----------------------------------------------------------------------------


def test_a_conversation_renders_markdown_and_highlights_code(
    browser: Any, site: Site, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    _open(browser, site)
    assert browser.execute_script("return document.title") == "Ask the gateway"
    # Labelled controls, a live region for new messages.
    log = browser.find_element(By.ID, "log")
    assert log.get_attribute("role") == "log" and log.get_attribute("aria-live") == "polite"
    label = browser.find_element(By.CSS_SELECTOR, "label[for=message]")
    assert label.get_attribute("textContent") == "Message"
    site.llm.add_reply(SHOWCASE, chunk_delay=0.02)
    _say(browser, "How do I get from Porto to Lisbon?")
    _answered(browser, "Alfa Pendular")
    _logged_once(browser, "How do I get from Porto to Lisbon?")
    assert browser.find_elements(By.CSS_SELECTOR, "#log h2")
    assert browser.find_elements(By.CSS_SELECTOR, "#log code.language-python .tok-keyword")
    assert browser.find_elements(By.CSS_SELECTOR, "#log code .tok-comment")
    assert browser.find_elements(By.CSS_SELECTOR, "#log table td")
    assert browser.switch_to.active_element == browser.find_element(By.ID, "message")
    _shot(browser, tmp_path, "desktop", docs=True)
    # A phone-sized screen: nothing wider than the screen.
    browser.set_window_size(390, 800)
    time.sleep(0.3)
    wide = browser.execute_script(
        "return document.documentElement.scrollWidth - document.documentElement.clientWidth"
    )
    assert wide <= 0
    _shot(browser, tmp_path, "phone", docs=True)


def test_a_hostile_reply_runs_nothing_and_loads_nothing(
    browser: Any, site: Site, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    _open(browser, site)
    site.llm.add_reply(HOSTILE)
    _say(browser, "say something nasty")
    _answered(browser, "Here:")
    reply = browser.find_elements(By.CSS_SELECTOR, "#log li.theirs[data-id]")[-1]
    assert "window.pwned = 1" in reply.text  # the script, as text
    assert browser.execute_script("return window.pwned") is None
    assert browser.title != "pwned"
    assert not reply.find_elements(By.CSS_SELECTOR, "script, img, iframe, style, [onerror]")
    hrefs = [a.get_attribute("href") for a in reply.find_elements(By.TAG_NAME, "a")]
    assert all(h.startswith("https://") for h in hrefs), hrefs
    for link in reply.find_elements(By.TAG_NAME, "a"):
        assert link.get_attribute("rel") == "noopener noreferrer nofollow"
        assert link.get_attribute("onmouseover") is None
    code = reply.find_element(By.CSS_SELECTOR, "pre code")
    assert code.get_attribute("onclick") is None and "window.pwned = 6" in code.text
    _shot(browser, tmp_path, "hostile")


def test_two_tabs_of_one_visitor_show_each_message_and_reply_once(
    browser: Any, site: Site, tmp_path: Path
) -> None:
    _open(browser, site)
    first = browser.current_window_handle
    browser.switch_to.new_window("tab")
    _open(browser, site)
    _say(browser, "written in the second tab")
    _answered(browser, "echo: written in the second tab")
    _logged_once(browser, "written in the second tab")
    browser.switch_to.window(first)
    _answered(browser, "echo: written in the second tab")
    _logged_once(browser, "written in the second tab")
    _say(browser, "and now the first")
    _answered(browser, "echo: and now the first")
    browser.switch_to.window(browser.window_handles[1])
    _answered(browser, "echo: and now the first")
    _logged_once(browser, "and now the first")
    _shot(browser, tmp_path, "two-tabs")


def test_a_reload_mid_stream_shows_the_reply_once(browser: Any, site: Site, tmp_path: Path) -> None:
    story = " ".join(f"word{n}" for n in range(60)) + " THE END"
    site.llm.add_reply(story, chunk_delay=0.1)  # about 6 s of streaming
    _open(browser, site)
    _say(browser, "tell me a long story")
    _until(
        browser,
        "const d = document.querySelector('#log li.draft');"
        "return d && d.innerText.includes('word12')",
        "a draft being written",
    )
    _shot(browser, tmp_path, "streaming", docs=True)
    browser.refresh()
    _until(browser, "return !document.getElementById('composer').hidden", "the page again")
    _answered(browser, "THE END")
    _logged_once(browser, "tell me a long story")
    assert not [e for e in _entries(browser) if e["draft"] or e["pending"]]


def test_the_network_dropped_and_restored_loses_nothing_and_repeats_nothing(
    browser: Any, site: Site, tmp_path: Path
) -> None:
    site.llm.add_reply("the answer that met the cut", delay=3.0)
    _open(browser, site)
    _say(browser, "a question before the cut")
    _until(
        browser,
        "return Array.from(document.querySelectorAll('#log li.mine[data-id]'))"
        ".some(li => li.innerText.includes('a question before the cut'))",
        "the question logged",
    )
    site.proxy.cut()
    try:
        _until(
            browser,
            "return /Reconnecting|Offline/.test(document.getElementById('status').textContent)",
            "the page saying it lost the chat",
        )
        _say(browser, "written while offline")
        time.sleep(4)  # the first answer is written meanwhile; the second message waits here
        pending = [e for e in _entries(browser) if e["pending"]]
        assert [e["text"].strip() for e in pending] == ["written while offline"]
        _shot(browser, tmp_path, "offline", docs=True)
    finally:
        site.proxy.restore()
    _answered(browser, "the answer that met the cut")
    _answered(browser, "echo: written while offline")
    _logged_once(browser, "written while offline")
    _logged_once(browser, "a question before the cut")
    time.sleep(2)  # nothing comes twice later either
    _answered(browser, "the answer that met the cut")
    _answered(browser, "echo: written while offline")


def test_an_uploaded_image_reaches_the_model_and_comes_back(
    browser: Any, site: Site, tmp_path: Path
) -> None:
    from PIL import Image
    from selenium.webdriver.common.by import By

    picture = tmp_path / "square.png"
    Image.new("RGB", (64, 48), (200, 30, 30)).save(picture)
    _open(browser, site)
    browser.find_element(By.ID, "file").send_keys(str(picture))
    _until(
        browser,
        "return document.querySelector('#attachments .chip') && "
        "!document.querySelector('#attachments').innerText.includes('uploading')",
        "the upload done",
    )
    _say(browser, "what is in this picture?")
    _answered(browser, "[image 64x48 png]")  # the fake model saw the image
    image = browser.find_element(By.CSS_SELECTOR, "#log li.mine[data-id] img")
    _until(
        browser,
        "return arguments[0].complete && arguments[0].naturalWidth === 64",
        "the image shown",
        image,
    )
    url = image.get_attribute("src")
    # Another visitor (this browser, its cookie gone, is a new one) reads neither the file
    # nor the log; without a cookie, nobody does.
    browser.delete_all_cookies()
    browser.get(url)
    assert "who is this?" in browser.page_source
    _open(browser, site)
    assert not [e for e in _entries(browser) if "picture" in e["text"]]
    status = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "fetch(arguments[0]).then(r => done(r.status));",
        url,
    )
    assert status == 404


def test_escape_stops_the_answer(browser: Any, site: Site, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    site.llm.add_reply(" ".join(f"slow{n}" for n in range(200)), chunk_delay=0.1)
    _open(browser, site)
    _say(browser, "talk for a long time")
    _until(browser, "return !document.getElementById('stop').disabled", "the Stop button")
    _until(browser, "return document.querySelector('#log li.draft')", "the answer being written")
    browser.find_element(By.ID, "message").send_keys(Keys.ESCAPE)
    _until(
        browser,
        "return Array.from(document.querySelectorAll('#log li.mine[data-id] .bubble')).some("
        "b => b.innerText.trim() === '/stop')",
        "/stop sent",
    )
    _until(browser, "return document.getElementById('stop').disabled", "the answer stopped")
    _answered(browser, "(stopped")  # what was said so far is kept, marked
    _answered(browser, "Stopped.")  # and /stop is answered
    replies = [e for e in _entries(browser) if e["kind"] == "theirs" and e["id"]]
    assert not any("slow199" in e["text"] for e in replies), replies
    _shot(browser, tmp_path, "stopped")


def test_csrf_from_another_site_is_refused(browser: Any, site: Site, tmp_path: Path) -> None:
    _open(browser, site)
    _say(browser, "my own message")
    _answered(browser, "echo: my own message")
    asked = len(site.llm.chat_requests)
    # A page of another site (localhost) and of the same site on another port (127.0.0.1:
    # its requests carry the SameSite=Strict cookie): a form and a fetch each.
    for page in (
        f"{site.stranger}/attack.html",
        site.stranger.replace("localhost", "127.0.0.1") + "/attack.html",
    ):
        browser.get(page)
        _until(
            browser, "return document.readyState === 'complete' && location.href", "the attack ran"
        )
        time.sleep(1)
    assert site.gateway.wait_logged("refused: no valid CSRF token", timeout=WAIT)
    _open(browser, site)
    shown = " ".join(e["text"] for e in _entries(browser))
    assert "pwned" not in shown and "my own message" in shown
    assert len(site.llm.chat_requests) == asked
    assert not any("pwned" in str(r.body) for r in site.llm.chat_requests)


def test_the_widget_works_on_an_allowed_site_and_nowhere_else(
    browser: Any, site: Site, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    browser.get(f"{site.host}/widget.html")
    button = _until(browser, "return document.querySelector('button[aria-controls]')", "the widget")
    assert button.text == "Help" and button.get_attribute("aria-expanded") == "false"
    button.click()
    frame = browser.find_element(By.ID, "gateway-webchat-frame")
    browser.switch_to.frame(frame)
    _until(browser, "return !document.getElementById('composer').hidden", "the chat in the frame")
    _say(browser, "hello from the shop")
    _answered(browser, "echo: hello from the shop")
    browser.switch_to.default_content()
    assert button.get_attribute("aria-expanded") == "true"
    _shot(browser, tmp_path, "widget", docs=True)
    # The same tag on a site that is not allowed: the frame shows no chat.
    browser.get(f"{site.stranger}/widget.html")
    _until(browser, "return document.querySelector('button[aria-controls]')", "the widget").click()
    browser.switch_to.frame(browser.find_element(By.ID, "gateway-webchat-frame"))
    time.sleep(2)
    assert not browser.find_elements(By.ID, "log")
    browser.switch_to.default_content()
    site.gateway.wait_logged("the widget's frame refused", timeout=WAIT)


def test_a_new_conversation_keeps_the_old_one_in_the_list(
    browser: Any, site: Site, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    _open(browser, site)
    _say(browser, "the first conversation")
    _answered(browser, "echo: the first conversation")
    browser.find_element(By.ID, "new").click()
    _until(
        browser,
        "return !Array.from(document.querySelectorAll('#log li[data-id]'))"
        ".some(li => li.innerText.includes('the first conversation'))",
        "a fresh log",
    )
    _say(browser, "the second conversation")
    _answered(browser, "echo: the second conversation")
    browser.find_element(By.CSS_SELECTOR, "#history summary").click()
    names = [b.text for b in browser.find_elements(By.CSS_SELECTOR, "#conversations button")]
    assert names[0] == "the second conversation (current)"
    assert "the first conversation" in names
    earlier = browser.find_elements(By.CSS_SELECTOR, "#conversations button")[
        names.index("the first conversation")
    ]
    earlier.click()
    _answered(browser, "echo: the first conversation")
    assert browser.find_element(By.ID, "earlier").is_displayed()
    _shot(browser, tmp_path, "conversations")
    browser.find_element(By.ID, "back").click()
    _answered(browser, "echo: the second conversation")
    assert not browser.find_element(By.ID, "earlier").is_displayed()


OWNER_TOKEN = "owner-token-0123456789abcdefghij"


@pytest.fixture(scope="module")
def owner_site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A second gateway: a personal assistant behind a password."""
    _require_browser()
    folder = tmp_path_factory.mktemp("webchat-owner")
    with FakeOpenAI.in_thread() as llm:
        env = base_env(folder / "ws", llm) | {
            "GATEWAY_HTTP__PORT": "0",
            "GATEWAY_CHANNELS__WEB__ENABLED": "true",
            "GATEWAY_CHANNELS__WEB__DM_POLICY": "open",
            "GATEWAY_CHANNELS__WEB__PASSWORD": OWNER_TOKEN,
        }
        gateway = GatewayProcess(env, folder)
        try:
            port = gateway.wait_ready(timeout=90)
            gateway.wait_readyz(port, timeout=90)
            yield f"http://127.0.0.1:{port}"
        finally:
            gateway.stop()


def test_the_owner_signs_in_with_the_password_or_a_key_link(
    browser: Any, owner_site: str, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    browser.get(f"{owner_site}/webchat/")
    _until(browser, "return !document.getElementById('login').hidden", "the password form")
    assert browser.find_element(By.ID, "composer").get_attribute("hidden") is not None
    password = browser.find_element(By.ID, "password")
    assert browser.switch_to.active_element == password
    password.send_keys("not the password", Keys.ENTER)
    _until(
        browser,
        "return document.getElementById('login-error').textContent.includes('wrong password')",
        "the refusal",
    )
    _shot(browser, tmp_path, "login")
    password.clear()
    password.send_keys(OWNER_TOKEN, Keys.ENTER)
    _until(browser, "return !document.getElementById('composer').hidden", "the chat")
    assert browser.find_element(By.ID, "who").text == "Signed in as owner"
    _say(browser, "remember the milk")
    _answered(browser, "echo: remember the milk")
    # Another browser (no cookie) with the bookmark: signed in, the key off the screen,
    # and the same conversation: the owner is one person everywhere.
    browser.delete_all_cookies()
    browser.get("about:blank")
    browser.get(f"{owner_site}/webchat/#key={OWNER_TOKEN}")
    _until(browser, "return !document.getElementById('composer').hidden", "the chat by key")
    assert OWNER_TOKEN not in browser.current_url
    _answered(browser, "echo: remember the milk")
