"""The daemon as a whole: one task group with the HTTP server, the dispatcher, channels
and heartbeat jobs, driven through real HTTP and the fake OpenAI server."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import anyio.abc
import pytest

from gateway.channel import Submit
from gateway.config import Settings
from gateway.daemon import Daemon, Gateway
from gateway.messages import InboundMessage, OutboundMessage
from gateway.sessions.keys import encode_key
from tests.fakes.openai_server import FakeOpenAI
from tests.gateway_process import GatewayProcess, base_env
from tests.test_metrics import documented_label_values, parse_exposition, scraped_label_values

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parents[1]
TOKEN = "test-api-token-123"


class RecordingChannel:
    """A stand-in platform: submits what a test feeds it, records what it is sent."""

    def __init__(
        self, name: str = "telegram", *, crash_times: int = 0, return_times: int = 0
    ) -> None:
        self.name = name
        self.sent: list[OutboundMessage] = []
        self.submit: Submit | None = None
        self.starts = 0
        self._crash_times = crash_times
        self._return_times = return_times

    async def run(
        self, submit: Submit, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        self.starts += 1
        self.submit = submit
        task_status.started()
        if self.starts <= self._crash_times:
            raise ConnectionError("platform went away")
        if self.starts <= self._crash_times + self._return_times:
            return  # e.g. polling stopped quietly
        await anyio.sleep_forever()

    async def send(self, message: OutboundMessage) -> None:
        self.sent.append(message)

    async def wait_sent(self, count: int) -> list[OutboundMessage]:
        while len(self.sent) < count:  # noqa: ASYNC110 (polling a test recorder)
            await anyio.sleep(0.01)
        return self.sent


@asynccontextmanager
async def running(daemon: Daemon) -> AsyncIterator[str]:
    async with anyio.create_task_group() as tg:
        port = await tg.start(daemon.run)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            daemon.stop()


def daemon_settings(
    make_settings: Callable[..., Settings], fake: FakeOpenAI, **kw: Any
) -> Settings:
    return make_settings(fake, http__port=0, http__token=TOKEN, **kw)


async def test_api_chat_probes_and_metrics(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = daemon_settings(make_settings, fake_openai)
    daemon = Daemon(Gateway.build(settings), interactive=False)
    async with running(daemon) as url, aiohttp.ClientSession() as http:
        async with http.get(f"{url}/readyz") as resp:
            assert resp.status == 200
        headers = {"Authorization": f"Bearer {TOKEN}"}
        body = {"session": "work", "text": "hello over http"}
        async with http.post(f"{url}/api/chat", json=body, headers=headers) as resp:
            assert resp.status == 200
            data = await resp.json()
        assert data["reply"] == "echo: hello over http" and data["session"] == "api:work"
        async with http.post(f"{url}/api/chat", json=body) as resp:
            assert resp.status == 401
        async with http.post(f"{url}/api/chat", data=b"{nope", headers=headers) as resp:
            assert resp.status in (400, 415)
        big = {"session": "work", "text": "x" * 200_000}
        async with http.post(f"{url}/api/chat", json=big, headers=headers) as resp:
            assert resp.status == 413
        async with http.get(f"{url}/metrics") as resp:
            text = await resp.text()
        assert 'gateway_turns_total{channel="api",outcome="ok"} 1.0' in text
        assert "gateway_cache_misses_total" in text


async def test_a_scrape_shows_exactly_the_documented_label_values(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    """gateway/http/metrics.py's docstring lists each label's values; a running daemon's
    scrape, after turns of every outcome, shows those and no others."""
    settings = daemon_settings(make_settings, fake_openai)
    daemon = Daemon(Gateway.build(settings), interactive=False)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    question = "What is the boiling point of water at sea level in Celsius?"
    async with running(daemon) as url, aiohttp.ClientSession() as http:

        async def chat(session: str, text: str) -> None:
            body = {"session": session, "text": text}
            async with http.post(f"{url}/api/chat", json=body, headers=headers) as resp:
                assert resp.status == 200, await resp.text()

        await chat("one", question)  # ok
        await chat("two", question)  # cached: the same standalone question
        await chat("one", "/help")  # command
        fake_openai.add_error(400)
        await chat("three", "this one fails")  # error
        async with http.get(f"{url}/metrics") as resp:
            families = parse_exposition(await resp.text())
    turns = families["gateway_turns_total"]
    assert {
        outcome: turns.value(channel="api", outcome=outcome)
        for outcome in ("ok", "cached", "command", "error")
    } == {"ok": 1, "cached": 1, "command": 1, "error": 1}
    assert families["gateway_llm_errors_total"].value(kind="LLMError") == 1
    assert scraped_label_values(families) == documented_label_values()


async def test_api_refuses_a_session_name_too_long_to_store_before_any_turn(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = daemon_settings(make_settings, fake_openai)
    daemon = Daemon(Gateway.build(settings), interactive=False)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with running(daemon) as url, aiohttp.ClientSession() as http:
        body = {"session": "n" * 200, "text": "hello"}
        async with http.post(f"{url}/api/chat", json=body, headers=headers) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
        assert "too long" in error and "limit is 194" in error
        assert fake_openai.chat_requests == []

        longest = {"session": "n" * 194, "text": "hello"}
        async with http.post(f"{url}/api/chat", json=longest, headers=headers) as resp:
            assert resp.status == 200
            data = await resp.json()
        assert (data["reply"], data["error"]) == ("echo: hello", False)
    assert (settings.sessions_dir / (encode_key("api:" + "n" * 194) + ".jsonl")).exists()


@contextmanager
def unwritable(folder: Path) -> Iterator[None]:
    """`folder` refuses new files meanwhile, for root too (chmod does not stop root; an
    immutable folder does)."""
    if os.geteuid() != 0:
        os.chmod(folder, 0o500)
        try:
            yield
        finally:
            os.chmod(folder, 0o700)
        return
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("running as root where chattr +i is not available")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


async def readiness(http: aiohttp.ClientSession, url: str, ready: bool) -> dict[str, Any]:
    """The /readyz body, once it says `ready` (or not)."""
    with anyio.fail_after(5):
        while True:
            async with http.get(f"{url}/readyz") as resp:
                if (resp.status == 200) is ready:
                    body: dict[str, Any] = await resp.json()
                    return body
            await anyio.sleep(0.02)


async def test_readyz_is_503_while_sessions_cannot_be_written(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = daemon_settings(make_settings, fake_openai)
    daemon = Daemon(Gateway.build(settings), interactive=False)
    daemon.STORAGE_CHECK_INTERVAL = 0.05
    async with running(daemon) as url, aiohttp.ClientSession() as http:
        healthy = await readiness(http, url, ready=True)
        assert healthy["components"]["sessions"] == {"healthy": True, "detail": ""}
        with unwritable(settings.sessions_dir):
            body = await readiness(http, url, ready=False)
        sessions = body["components"]["sessions"]
        assert body["status"] == "unhealthy" and not sessions["healthy"]
        assert sessions["detail"].startswith(f"cannot write in {settings.sessions_dir} (")
        assert sessions["detail"].endswith(
            "; make it writable for the gateway's user; check free space"
        )
        await readiness(http, url, ready=True)  # writable again: ready again


async def test_a_redis_outage_is_shown_on_readyz_but_answers_still_come(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings = daemon_settings(make_settings, fake_openai, cache__url=f"redis://127.0.0.1:{port}/0")
    daemon = Daemon(Gateway.build(settings), interactive=False)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with running(daemon) as url, aiohttp.ClientSession() as http:
        await readiness(http, url, ready=True)
        body = {"session": "x", "text": "still answered?"}
        async with http.post(f"{url}/api/chat", json=body, headers=headers) as resp:
            reply = await resp.json()
        async with http.get(f"{url}/readyz") as resp:
            status, readyz = resp.status, await resp.json()
        async with http.get(f"{url}/metrics") as resp:
            scrape = await resp.text()
    assert 'gateway_component_healthy{component="cache"} 0.0' in scrape
    assert reply["reply"] == "echo: still answered?"  # no cache, but the turn works
    cache = readyz["components"]["cache"]
    assert status == 200 and readyz["reasons"] == []
    assert readyz["degraded"] == [f"cache: {cache['detail']}"] and not cache["healthy"]
    assert cache["detail"].startswith(f"redis cache at 127.0.0.1:{port}: ConnectionError")
    assert cache["detail"].endswith(
        "start Redis, or point cache.url (GATEWAY_CACHE__URL) at a running one"
    )


async def test_readyz_shows_a_model_server_that_does_not_answer_as_degraded(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    """The gateway stays ready (the load balancer keeps it: another replica would not
    bring the model back) but /readyz and /metrics say the model server is down; one
    that answers is shown healthy."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings = daemon_settings(
        make_settings, fake_openai, llm__base_url=f"http://127.0.0.1:{port}/v1"
    )
    assert settings.llm.base_url == f"http://127.0.0.1:{port}/v1"
    daemon = Daemon(Gateway.build(settings), interactive=False)
    daemon.MODEL_CHECK_INTERVAL = 0.2
    async with running(daemon) as url, aiohttp.ClientSession() as http:
        with anyio.fail_after(10):
            while not (body := await readiness(http, url, ready=True))["degraded"]:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        assert body["degraded"] == [
            f"model: the model server at http://127.0.0.1:{port}/v1 does not answer "
            f"({body['components']['model']['detail'].split('(', 1)[1]}"
        ]
        assert body["components"]["model"]["detail"].endswith(
            "start it, or fix OPENAI_BASE_URL; `gateway doctor` checks it"
        )
        async with http.get(f"{url}/metrics") as resp:
            assert 'gateway_component_healthy{component="model"} 0.0' in await resp.text()
    daemon = Daemon(Gateway.build(daemon_settings(make_settings, fake_openai)), interactive=False)
    async with running(daemon) as url, aiohttp.ClientSession() as http:
        with anyio.fail_after(10):
            while "model" not in (body := await readiness(http, url, ready=True))["components"]:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        assert body["degraded"] == [] and body["components"]["model"]["healthy"]


async def test_readyz_flips_while_draining_and_the_turn_finishes(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = daemon_settings(make_settings, fake_openai)
    fake_openai.add_delay(1.0, "slow but complete")
    daemon = Daemon(Gateway.build(settings), interactive=False)
    replies: list[dict[str, Any]] = []
    async with anyio.create_task_group() as tg:
        port = await tg.start(daemon.run)
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as http:

            async def ask() -> None:
                headers = {"Authorization": f"Bearer {TOKEN}"}
                body = {"session": "drain", "text": "take your time"}
                async with http.post(f"{url}/api/chat", json=body, headers=headers) as resp:
                    replies.append(await resp.json())

            async with anyio.create_task_group() as client:
                client.start_soon(ask)
                await fake_openai.wait_for_requests_async(1)
                daemon.stop()
                with anyio.fail_after(2):
                    while True:
                        async with http.get(f"{url}/readyz") as resp:
                            if resp.status == 503:
                                assert "draining" in await resp.text()
                                break
                        await anyio.sleep(0.02)
    assert replies == [{"session": "api:drain", "reply": "slow but complete", "error": False}]
    path = settings.sessions_dir / f"{encode_key('api:drain')}.jsonl"
    assert "slow but complete" in path.read_text()


async def test_redelivered_message_is_answered_once_also_after_restart(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = daemon_settings(make_settings, fake_openai, channels__telegram__dm_policy="open")
    update = InboundMessage(
        channel="telegram", chat_id="5", sender_id="5", text="hi", message_id="77"
    )
    for _ in range(2):  # two daemon lifetimes on one workspace
        channel = RecordingChannel()
        daemon = Daemon(Gateway.build(settings), interactive=False)
        daemon.add_channel(channel)
        async with running(daemon):
            await anyio.sleep(0.05)
            assert channel.submit is not None
            await (await channel.submit(update)).reply()
            await (await channel.submit(update)).reply()
            await anyio.sleep(0.1)
        if not channel.sent:
            continue
        assert [m.text for m in channel.sent] == ["echo: hi"]
    assert len(fake_openai.chat_requests) == 1


async def test_a_channel_that_stops_by_itself_is_restarted(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = daemon_settings(make_settings, fake_openai)
    channel = RecordingChannel(return_times=1)
    daemon = Daemon(Gateway.build(settings), interactive=False)
    daemon.BACKOFF_MAX = 0.2
    daemon.add_channel(channel)
    async with running(daemon):
        with anyio.fail_after(5):
            while channel.starts < 2:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        assert not daemon._stop.is_set()  # only the terminal chat ends the gateway


async def test_crashing_channel_is_restarted_and_reported(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = daemon_settings(make_settings, fake_openai, channels__telegram__dm_policy="open")
    channel = RecordingChannel(crash_times=1)
    daemon = Daemon(Gateway.build(settings), interactive=False)
    daemon.BACKOFF_MAX = 0.2
    daemon.add_channel(channel)
    async with running(daemon) as url, aiohttp.ClientSession() as http:
        with anyio.fail_after(5):
            while channel.starts < 2:  # noqa: ASYNC110
                await anyio.sleep(0.05)
            while True:
                async with http.get(f"{url}/readyz") as resp:
                    if resp.status == 200:
                        break
                await anyio.sleep(0.05)
        assert channel.submit is not None
        await (
            await channel.submit(
                InboundMessage(channel="telegram", chat_id="1", sender_id="1", text="up?")
            )
        ).reply()
        with anyio.fail_after(5):
            assert [m.text for m in await channel.wait_sent(1)] == ["echo: up?"]


async def test_heartbeat_suppresses_all_is_well_and_delivers_the_rest(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    settings = daemon_settings(
        make_settings,
        fake_openai,
        heartbeat__jobs__disk__every="1s",
        heartbeat__jobs__disk__prompt="Check the disks. Reply HEARTBEAT_OK if fine.",
        heartbeat__jobs__disk__deliver_to="telegram:42",
    )
    fake_openai.add_reply("HEARTBEAT_OK")
    fake_openai.add_reply("Disk /var is 97% full!")
    telegram = RecordingChannel()
    daemon = Daemon(Gateway.build(settings), interactive=False)
    daemon.add_channel(telegram)
    async with running(daemon):
        with anyio.fail_after(6):
            sent = await telegram.wait_sent(1)
    assert [(m.chat_id, m.text) for m in sent] == [("42", "Disk /var is 97% full!")]
    first = fake_openai.chat_requests[0]
    assert first.last_user_text == "Check the disks. Reply HEARTBEAT_OK if fine."
    hb = settings.sessions_dir / f"{encode_key('system:heartbeat:disk')}.jsonl"
    assert "HEARTBEAT_OK" in hb.read_text()
    # Only the heartbeat's own session was written.
    assert sorted(p.name for p in settings.sessions_dir.glob("*.jsonl")) == [hb.name]
    state = json.loads((settings.workspace_path / "heartbeat-state.json").read_text())
    assert "disk" in state


@contextmanager
def _gateway_mid_turn(
    tmp_path: Path,
    fake: FakeOpenAI,
    *,
    delay: float,
    reply: str,
    env: dict[str, str] | None = None,
) -> Iterator[tuple[GatewayProcess, threading.Thread, dict[str, Any]]]:
    """A `gateway run` whose model is answering `POST /api/chat` (session "sig", "long
    job") after `delay` seconds; yields it with the asking thread and, once that
    thread ends, the JSON answer."""
    fake.add_delay(delay, reply)
    gateway = GatewayProcess(
        base_env(tmp_path / "ws", fake)
        | {"GATEWAY_HTTP__TOKEN": TOKEN, "GATEWAY_HTTP__PORT": "0"}
        | (env or {}),
        tmp_path,
    )
    result: dict[str, Any] = {}
    try:
        port = gateway.wait_ready()

        def ask() -> None:
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/api/chat",
                data=json.dumps({"session": "sig", "text": "long job"}).encode(),
                headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=20) as resp:
                result.update(json.loads(resp.read()))

        asker = threading.Thread(target=ask)
        asker.start()
        fake.wait_for_requests(1, timeout=10)
        yield gateway, asker, result
    finally:
        gateway.stop()


@pytest.mark.parametrize(("event_loop", "runs_on"), [("auto", "uvloop"), ("asyncio", "asyncio")])
def test_sigterm_during_a_turn_finishes_and_persists_it(
    tmp_path: Path, fake_openai_thread: FakeOpenAI, event_loop: str, runs_on: str
) -> None:
    """On either event loop (`event_loop`): the signal handler, the drain and the turn's
    appends are the loop-specific parts of a run."""
    reply = "finished after SIGTERM"
    with _gateway_mid_turn(
        tmp_path,
        fake_openai_thread,
        delay=1.5,
        reply=reply,
        env={"GATEWAY_EVENT_LOOP": event_loop},
    ) as running:
        gateway, asker, result = running
        assert any(f"event loop: {runs_on}" in line for line in gateway.log)
        gateway.proc.send_signal(signal.SIGTERM)
        asker.join(20)
        assert gateway.proc.wait(20) == 0
    assert result.get("reply") == reply
    session = tmp_path / "ws" / "sessions" / f"{encode_key('api:sig')}.jsonl"
    assert reply in session.read_text()


async def test_pairing_end_to_end(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    settings = daemon_settings(make_settings, fake_openai)  # telegram dm_policy: pairing
    telegram = RecordingChannel()
    daemon = Daemon(Gateway.build(settings), interactive=False)
    daemon.add_channel(telegram)
    stranger = InboundMessage(
        channel="telegram", chat_id="900", sender_id="900", text="hello?", message_id="900:1"
    )
    async with running(daemon):
        await anyio.sleep(0.05)
        assert telegram.submit is not None
        await (await telegram.submit(stranger)).reply()
        with anyio.fail_after(5):
            [notice] = await telegram.wait_sent(1)
        code = notice.text.split("pairing code is ", 1)[1].split()[0]
        assert fake_openai.chat_requests == []  # nothing reached the LLM
        await (await telegram.submit(stranger)).reply()  # the platform redelivers it
        await anyio.sleep(0.1)
        assert len(telegram.sent) == 1  # a duplicate, not a second notice
        again = InboundMessage(
            channel="telegram", chat_id="900", sender_id="900", text="hi", message_id="900:2"
        )
        await (await telegram.submit(again)).reply()
        await anyio.sleep(0.1)
        assert len(telegram.sent) == 1  # the code went out moments ago: not re-sent yet

        env = {k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "OPENAI_"))}
        env |= {"PYTHONPATH": str(ROOT), "GATEWAY_WORKSPACE": str(settings.workspace_path)}
        wrong = await anyio.run_process(
            [sys.executable, "-m", "gateway.cli", "pairing", "approve", "telegram", "NOPE1234"],
            env=env,
            check=False,
        )
        assert wrong.returncode == 1 and b"no pending request" in wrong.stderr
        approved = await anyio.run_process(
            [sys.executable, "-m", "gateway.cli", "pairing", "approve", "telegram", code],
            env=env,
        )
        assert b"Approved" in approved.stdout

        third = InboundMessage(
            channel="telegram", chat_id="900", sender_id="900", text="now?", message_id="900:3"
        )
        await (await telegram.submit(third)).reply()
        with anyio.fail_after(5):
            sent = await telegram.wait_sent(2)
        assert sent[1].text == "echo: now?"
        assert len(fake_openai.chat_requests) == 1

        listing = await anyio.run_process(
            [sys.executable, "-m", "gateway.cli", "pairing", "list", "telegram"], env=env
        )
        assert b"900" in listing.stdout
        await anyio.run_process(
            [sys.executable, "-m", "gateway.cli", "pairing", "revoke", "telegram", "900"], env=env
        )
        fourth = InboundMessage(
            channel="telegram", chat_id="900", sender_id="900", text="still?", message_id="900:4"
        )
        await (await telegram.submit(fourth)).reply()
        with anyio.fail_after(5):
            sent = await telegram.wait_sent(3)
        assert "pairing code" in sent[2].text and code not in sent[2].text  # a new one
    assert len(fake_openai.chat_requests) == 1


async def test_groups_answer_only_when_mentioned(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    from gateway.messages import META_IS_GROUP, META_MENTIONED

    settings = daemon_settings(
        make_settings, fake_openai, channels__telegram__allow_from='["-100"]'
    )
    telegram = RecordingChannel()
    daemon = Daemon(Gateway.build(settings), interactive=False)
    daemon.add_channel(telegram)

    def group_msg(text: str, mentioned: bool, mid: str) -> InboundMessage:
        meta = {META_IS_GROUP: True, META_MENTIONED: mentioned}
        return InboundMessage(
            channel="telegram",
            chat_id="-100",
            sender_id="7",
            text=text,
            message_id=mid,
            metadata=meta,
        )

    async with running(daemon):
        await anyio.sleep(0.05)
        assert telegram.submit is not None
        await (await telegram.submit(group_msg("chatter", False, "1"))).reply()
        await (await telegram.submit(group_msg("bot, help", True, "2"))).reply()
        with anyio.fail_after(5):
            sent = await telegram.wait_sent(1)
    assert [m.text for m in sent] == ["echo: bot, help"]
    assert len(fake_openai.chat_requests) == 1


async def test_heartbeat_never_overlaps_itself_and_makes_up_missed_runs_once(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    from datetime import UTC, datetime, timedelta

    settings = daemon_settings(
        make_settings,
        fake_openai,
        heartbeat__jobs__slow__every="1h",
        heartbeat__jobs__slow__prompt="Anything new?",
    )
    settings.workspace_path.mkdir(parents=True, exist_ok=True)
    three_days_ago = (datetime.now(UTC) - timedelta(days=3)).isoformat()
    (settings.workspace_path / "heartbeat-state.json").write_text(
        json.dumps({"slow": three_days_ago})
    )
    fake_openai.add_delay(1.0, "HEARTBEAT_OK")
    daemon = Daemon(Gateway.build(settings), interactive=False)
    async with running(daemon):
        await fake_openai.wait_for_requests_async(1)  # the missed runs, made up once
        await anyio.sleep(1.5)
    assert len(fake_openai.chat_requests) == 1
    state = json.loads((settings.workspace_path / "heartbeat-state.json").read_text())
    assert datetime.fromisoformat(state["slow"]) > datetime.now(UTC) - timedelta(minutes=1)


async def test_a_running_heartbeat_is_not_started_again(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = daemon_settings(
        make_settings,
        fake_openai,
        heartbeat__jobs__busy__every="1s",
        heartbeat__jobs__busy__prompt="Slow check",
    )
    fake_openai.add_delay(2.5, "HEARTBEAT_OK")
    daemon = Daemon(Gateway.build(settings), interactive=False)
    async with running(daemon):
        with anyio.fail_after(10):
            await fake_openai.wait_for_requests_async(2)
    first, second = fake_openai.chat_requests[:2]
    # Due every second, but the second run starts only after the first one finished.
    assert second.timestamp - first.timestamp >= 2.4


def test_two_sigints_end_the_drain_once_without_a_traceback(
    tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    with _gateway_mid_turn(tmp_path, fake_openai_thread, delay=10, reply="too late") as running:
        gateway, asker, result = running
        gateway.proc.send_signal(signal.SIGINT)
        gateway.wait_for_line("draining:")
        gateway.proc.send_signal(signal.SIGINT)
        # Well within the 30 s grace: the second SIGINT ended it.
        assert gateway.proc.wait(10) == 0  # what one SIGINT (or SIGTERM) exits with
        asker.join(10)
    log = "".join(gateway.log)
    assert "Traceback" not in log and "unhandled exception" not in log
    assert log.count("draining:") == 1 and log.count("drained in") == 1
    assert log.count("second SIGINT") == 1
    assert result.get("error") is True and "send it again" in result["reply"]
    session = tmp_path / "ws" / "sessions" / f"{encode_key('api:sig')}.jsonl"
    assert "long job" in session.read_text()  # what the user said is kept


async def test_every_channel_s_undeliverable_replies_are_listed(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    """Two channels that keep undeliverable replies (WhatsApp's held ones, LINE's given up
    for the quota) both show on the admin page: the second one registered used to
    replace the first one's list."""
    settings = daemon_settings(make_settings, fake_openai)
    daemon = Daemon(Gateway.build(settings), interactive=False)

    def listing(*rows: str) -> Callable[[], Any]:
        async def source() -> list[str]:
            return list(rows)

        return source

    daemon._services("first").admin.undeliverable(listing("held 1", "held 2"))
    daemon._services("second").admin.undeliverable(listing("given up"))
    source = daemon.admin.sources.undeliverable
    assert source is not None
    assert await source() == ["held 1", "held 2", "given up"]
