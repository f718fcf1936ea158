"""The web chat across replicas (real PostgreSQL): a visitor whose requests reach either of
two replicas (as behind a load balancer) and whose page reads its log on one of them gets
every reply once and in order, whichever replica took the message and whichever ran the
turn; when a replica is killed, the pages of the other go on and its messages are
answered, nothing lost and nothing twice."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import aiohttp
import pytest

from tests.fakes.openai_server import FakeOpenAI
from tests.gateway_process import GatewayProcess, base_env
from tests.webchat_client import Browser, Browsers, Outgoing

pytestmark = pytest.mark.kill


def _replies(browser: Browser) -> list[str]:
    return [str(e["text"]) for e in browser.replies()]


@pytest.mark.timeout(180)
def test_a_visitor_on_two_replicas_gets_every_reply_once(
    migrated_pg_url: str, tmp_path: Path
) -> None:
    with FakeOpenAI.in_thread() as llm:
        env = base_env(tmp_path / "unused", llm) | {
            "GATEWAY_HTTP__PORT": "0",
            "GATEWAY_CHANNELS__WEB__ENABLED": "true",
            "GATEWAY_CHANNELS__WEB__DM_POLICY": "open",
            "GATEWAY_STORAGE__URL": migrated_pg_url,
        }
        replicas: list[GatewayProcess] = []
        browsers = Browsers()
        try:
            urls = []
            for i in range(2):
                proc = GatewayProcess(
                    env | {"GATEWAY_WORKSPACE": str(tmp_path / f"ws{i}")}, tmp_path
                )
                replicas.append(proc)
                port = proc.wait_ready(timeout=90)
                proc.wait_readyz(port, timeout=90)
                urls.append(f"http://127.0.0.1:{port}")
            # One visitor: a page reading its log on replica 1, and its messages posted to
            # either replica (the cookie the first gave, accepted by both).
            reader = browsers.open(urls[1], name="page-on-1")

            async def writers() -> list[Browser]:
                cookie = next(
                    c.value for c in reader.session.cookie_jar if c.key == "gateway_webchat"
                )
                found = []
                for url in urls:
                    writer = Browser(url, name=f"post-to-{url[-5:]}")
                    writer._session = aiohttp.ClientSession(cookies={"gateway_webchat": cookie})
                    await writer.load_state()
                    assert writer.visitor == reader.visitor
                    found.append(writer)
                return found

            posting = browsers.call(writers)
            browsers.all.extend(posting)
            texts = [f"message {n}" for n in range(8)]

            async def post(writer: Browser, text: str) -> None:
                """As the page does: the same message again until a 200."""
                item = Outgoing(uuid.uuid4().hex, text)
                for _ in range(100):
                    if await writer.post(item):
                        return
                    await asyncio.sleep(0.2)
                raise AssertionError(f"{text!r} never taken: {item.statuses}")

            async def post_all(batch: list[str]) -> None:
                for n, text in enumerate(batch):
                    await post(posting[n % 2], text)

            browsers.call(lambda: post_all(texts))
            browsers.call(
                lambda: reader.wait_for(lambda b: len(b.replies()) >= len(texts), 60, "replies")
            )
            assert _replies(reader) == [f"echo: {t}" for t in texts]

            # Replica 0 dies; the page on replica 1 goes on, posting there.
            replicas[0].kill()
            more = [f"after the kill {n}" for n in range(4)]

            async def post_to_one() -> None:
                for text in more:
                    await post(posting[1], text)

            browsers.call(post_to_one)
            browsers.call(
                lambda: reader.wait_for(
                    lambda b: len(b.replies()) >= len(texts) + len(more), 90, "the later replies"
                )
            )
            asyncio.run(asyncio.sleep(1.5))  # nothing comes twice
            assert _replies(reader) == [f"echo: {t}" for t in [*texts, *more]]
            assert max(reader.deliveries.values()) == 1
            assert replicas[1].terminate() == 0
        finally:
            browsers.close()
            for proc in replicas:
                proc.stop()
