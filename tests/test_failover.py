"""Failover across model providers: the breaker and the routes as pure policies, then
two and three fake OpenAI servers behind the real openai client (one down, one slow, one
answering 429 with Retry-After, one whose key is refused), through the configuration's
own `build_provider` and, for a whole turn, the agent. Times are measured by
bench/failover.py; the bounds here are generous."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from loguru import logger

from gateway.config import Settings, load_settings
from gateway.daemon import Gateway, build_provider
from gateway.llm import ContextOverflow, LLMError, LLMMessage
from gateway.llm.breaker import BreakerState, CircuitBreaker
from gateway.llm.failover import FailoverProvider, Route, RouteTable, Verdict, judge
from gateway.llm.types import LLMConfigError
from gateway.messages import InboundMessage
from tests.fakes.openai_server import DEFAULT_API_KEY, FakeOpenAI, Reply, estimate_prompt_tokens
from tests.fakes.tcp_proxy import TcpProxy

HELLO = [LLMMessage(role="user", content="hello")]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- the breaker ------------------------------------------------------------------------


def test_the_breaker_opens_after_three_failures_in_a_row_and_lets_one_probe_through() -> None:
    clock = Clock()
    breaker = CircuitBreaker("primary", failures_to_open=3, cooldown=30, clock=clock)
    for _ in range(2):
        assert breaker.allow()
        breaker.failure("HTTP 503")
    assert breaker.allow()
    breaker.success()  # an answer in between: the count starts again
    for _ in range(3):
        assert breaker.state is BreakerState.CLOSED and breaker.allow()
        breaker.failure("HTTP 503")
    assert breaker.state is BreakerState.OPEN
    assert not breaker.allow() and not breaker.allow()
    assert breaker.status().retry_in == 30 and breaker.skipped == 2
    clock.now += 29.9
    assert not breaker.allow()
    clock.now += 0.1
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.allow()  # the probe
    assert not breaker.allow()  # one at a time
    breaker.failure("HTTP 503")  # the probe failed: open again, for a whole cool-down
    assert breaker.state is BreakerState.OPEN and breaker.reopens_in() == 30
    clock.now += 30
    assert breaker.allow()
    breaker.release()  # the probe told nothing (stopped): the next request probes
    assert breaker.allow()
    breaker.success()
    assert breaker.state is BreakerState.CLOSED and breaker.allow() and breaker.allow()
    status = breaker.status()
    assert (status.requests, status.failures, status.opened) == (11, 6, 1)
    assert status.last_failure == "HTTP 503"


def test_a_long_retry_after_opens_the_breaker_at_once_for_that_long_within_a_bound() -> None:
    clock = Clock()
    breaker = CircuitBreaker("primary", failures_to_open=3, cooldown=30, clock=clock)
    breaker.failure("HTTP 429", open_for=600)
    assert breaker.state is BreakerState.OPEN and breaker.reopens_in() == 600
    breaker.success()
    breaker.failure("HTTP 429", open_for=5)  # shorter than the cool-down: the cool-down
    assert breaker.reopens_in() == 30
    breaker.failure("HTTP 429", open_for=10**9)  # "come back in 30 years": an hour
    assert breaker.reopens_in() == 3600


def test_only_the_first_opening_and_the_closing_are_logged() -> None:
    clock = Clock()
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="INFO")
    try:
        breaker = CircuitBreaker("primary", failures_to_open=1, cooldown=1, clock=clock)
        for _ in range(4):  # opens, then three failed probes
            breaker.allow()
            breaker.failure("refused")
            clock.now += 1
        breaker.allow()
        breaker.success()
    finally:
        logger.remove(sink)
    assert [line.split(":")[0] for line in lines] == [
        "LLM provider primary is failing (1 in a row, last",
        "LLM provider primary answers again",
    ]


@pytest.mark.parametrize(
    ("kinds", "verdict"),
    [
        (("unavailable",), Verdict.PROVIDER),
        (("timeout",), Verdict.PROVIDER),
        (("rate_limited",), Verdict.PROVIDER),
        (("auth",), Verdict.PROVIDER),
        (("denied",), Verdict.PROVIDER),
        (("quota",), Verdict.PROVIDER),
        (("wrong_path",), Verdict.PROVIDER),
        (("not_found",), Verdict.MODEL_MISSING),
        (("bad_request",), Verdict.REQUEST),
        (("not_found", "timeout"), Verdict.PROVIDER),  # a fallback model timed out
        ((), Verdict.PROVIDER),  # a provider that does not say
    ],
)
def test_which_failures_are_the_providers(kinds: tuple[str, ...], verdict: Verdict) -> None:
    assert judge(LLMError("x", kinds=kinds)) is verdict


def test_an_overflow_is_the_requests_not_the_providers() -> None:
    error = ContextOverflow("too long", context_tokens=2048, prompt_tokens=3000, server=None)
    assert judge(error) is Verdict.REQUEST


def test_routes_come_from_the_alias_or_the_chain_of_providers_that_serve_the_name() -> None:
    table = RouteTable(
        ["primary", "local"],
        aliases={"fast": [Route("primary", "gpt-4o-mini"), Route("backup", "openai/gpt-4o-mini")]},
        serves={"local": ["llama3.2"]},
    )
    assert table.routes("fast") == (
        Route("primary", "gpt-4o-mini"),
        Route("backup", "openai/gpt-4o-mini"),
    )
    assert table.routes("gpt-4o") == (Route("primary", "gpt-4o"),)
    assert table.routes("llama3.2") == (Route("primary", "llama3.2"), Route("local", "llama3.2"))
    assert table.providers == ("primary", "local", "backup")
    assert table.window_key(Route("backup", "openai/gpt-4o-mini")) == "openai/gpt-4o-mini@backup"
    alone = RouteTable(["default"])
    assert alone.window_key(Route("default", "gpt-4o-mini")) == "gpt-4o-mini"


# -- providers on fake servers ----------------------------------------------------------


def settings_for(
    tmp_path: Path,
    urls: dict[str, str],
    keys: dict[str, str] | None = None,
    **overrides: Any,
) -> Settings:
    """`[llm] chain` = the providers of `urls`, in order, each with its key (the fakes'
    unless `keys` says otherwise); no client retries, a 0.3 s cool-down; overrides are
    GATEWAY_* style dotted keys (`llm__timeout=0.3`)."""
    env = {
        "GATEWAY_WORKSPACE": str(tmp_path / "ws"),
        "GATEWAY_LLM__MAX_RETRIES": "0",
        "GATEWAY_LLM__TIMEOUT": "5",
        "GATEWAY_LLM__CHAIN": json.dumps(list(urls)),
        "GATEWAY_LLM__FAILOVER__COOLDOWN_SECONDS": "0.3",
    }
    for name, url in urls.items():
        env[f"GATEWAY_LLM__PROVIDERS__{name.upper()}__BASE_URL"] = url
        key = (keys or {}).get(name, DEFAULT_API_KEY)
        env[f"GATEWAY_LLM__PROVIDERS__{name.upper()}__API_KEY"] = key
    env |= {f"GATEWAY_{key.upper()}": str(value) for key, value in overrides.items()}
    return load_settings(None, environ=env)


@asynccontextmanager
async def failover(settings: Settings) -> AsyncIterator[FailoverProvider]:
    provider = build_provider(settings)
    try:
        yield provider
    finally:
        await provider.aclose()


@contextmanager
def proxy_to(fake: FakeOpenAI) -> Iterator[TcpProxy]:
    """A proxy in front of `fake` that a test cuts (connections refused) and restores."""
    proxy = TcpProxy("127.0.0.1", int(fake.url.rsplit(":", 1)[1]))
    proxy.restore()
    try:
        yield proxy
    finally:
        proxy.close()


def state(provider: FailoverProvider, name: str) -> BreakerState:
    return provider.breakers[name].state


@pytest.fixture
async def fakes() -> AsyncIterator[tuple[FakeOpenAI, FakeOpenAI, FakeOpenAI]]:
    async with FakeOpenAI() as one, FakeOpenAI() as two, FakeOpenAI() as three:
        yield one, two, three


Fakes = tuple[FakeOpenAI, FakeOpenAI, FakeOpenAI]


@pytest.mark.anyio
async def test_a_dead_primary_is_skipped_and_used_again_once_it_recovers(
    fakes: Fakes, tmp_path: Path
) -> None:
    primary, backup, _ = fakes
    lines: list[str] = []
    sink = logger.add(
        lambda m: lines.append(m.record["message"]),
        level="INFO",
        filter=lambda r: "breaker" in r["message"],
    )
    with proxy_to(primary) as proxy:
        url = f"http://127.0.0.1:{proxy.port}/v1"
        settings = settings_for(tmp_path, {"primary": url, "backup": backup.base_url})
        async with failover(settings) as provider:
            first = await provider.chat(HELLO)
            proxy.cut()
            answers = [await provider.chat(HELLO) for _ in range(5)]
            skipped = provider.breakers["primary"].status()
            await anyio.sleep(0.35)  # the cool-down: one probe, still refused
            probed = await provider.chat(HELLO)
            proxy.restore()
            await anyio.sleep(0.35)
            back = [await provider.chat(HELLO) for _ in range(2)]
            statuses = provider.statuses()
    logger.remove(sink)
    assert first.provider == "primary"
    assert [a.provider for a in answers] == ["backup"] * 5
    assert answers[0].message.content == "echo: hello"
    # Three refusals open it; the two requests after it are not sent to it at all.
    assert (skipped.state, skipped.requests, skipped.failures, skipped.skipped) == (
        BreakerState.OPEN,
        4,
        3,
        2,
    )
    assert probed.provider == "backup"
    assert [b.provider for b in back] == ["primary", "primary"]
    assert [s.state for s in statuses] == [BreakerState.CLOSED, BreakerState.CLOSED]
    assert len(primary.chat_requests) == 3  # the first answer and the two after it
    # One line when it opened (the failed probe says nothing more), one when it closed.
    assert [line.split(" is ")[0].split(" answers")[0] for line in lines] == [
        "LLM provider primary",
        "LLM provider primary",
    ]
    assert "its breaker is open" in lines[0] and "its breaker is closed" in lines[1]


@pytest.mark.anyio
async def test_a_slow_primary_is_left_after_its_timeout(fakes: Fakes, tmp_path: Path) -> None:
    primary, backup, _ = fakes
    primary.add_delay(10)
    settings = settings_for(
        tmp_path,
        {"primary": primary.base_url, "backup": backup.base_url},
        llm__providers__primary__timeout=0.3,
    )
    async with failover(settings) as provider:
        started = time.monotonic()
        answer = await provider.chat(HELLO)
        took = time.monotonic() - started
        status = provider.breakers["primary"].status()
    assert answer.provider == "backup" and 0.3 <= took < 3
    assert status.failures == 1 and "no answer in time" in status.last_failure
    assert status.state is BreakerState.CLOSED  # one time-out does not open it


@pytest.mark.anyio
async def test_a_long_retry_after_is_not_waited_out_and_keeps_the_provider_skipped(
    fakes: Fakes, tmp_path: Path
) -> None:
    primary, backup, _ = fakes
    primary.add_error(429, "Rate limit reached for requests", retry_after=60)
    settings = settings_for(
        tmp_path,
        {"primary": primary.base_url, "backup": backup.base_url},
        llm__max_retries=2,  # the client would retry a 429: not this one
    )
    async with failover(settings) as provider:
        started = time.monotonic()
        answer = await provider.chat(HELLO)
        took = time.monotonic() - started
        again = await provider.chat(HELLO)
        status = provider.breakers["primary"].status()
    assert answer.provider == again.provider == "backup"
    assert took < 2  # neither the 60 s nor the client's backoff was waited
    assert len(primary.chat_requests) == 1  # not retried, and skipped afterwards
    assert status.state is BreakerState.OPEN and status.opened == 1
    assert status.retry_in is not None and 55 < status.retry_in <= 60


@pytest.mark.anyio
async def test_a_short_retry_after_is_waited_out_on_the_same_provider(
    fakes: Fakes, tmp_path: Path
) -> None:
    primary, backup, _ = fakes
    primary.add_error(429, retry_after=0.2)
    settings = settings_for(
        tmp_path, {"primary": primary.base_url, "backup": backup.base_url}, llm__max_retries=1
    )
    async with failover(settings) as provider:
        started = time.monotonic()
        answer = await provider.chat(HELLO)
        took = time.monotonic() - started
    assert answer.provider == "primary" and took >= 0.2
    assert [r.retry_count for r in primary.chat_requests] == [0, 1]
    assert backup.chat_requests == []


@pytest.mark.anyio
async def test_a_refused_key_moves_on_and_counts_against_its_provider(
    fakes: Fakes, tmp_path: Path
) -> None:
    primary, backup, _ = fakes
    wrong = "sk-wrong-key-0123456789"
    settings = settings_for(
        tmp_path, {"primary": primary.base_url, "backup": backup.base_url}, {"primary": wrong}
    )
    async with failover(settings) as provider:
        answer = await provider.chat(HELLO)
        status = provider.breakers["primary"].status()
    assert answer.provider == "backup"
    assert status.failures == 1 and "HTTP 401" in status.last_failure
    assert wrong not in status.last_failure


@pytest.mark.anyio
async def test_three_providers_one_down_one_rate_limited_the_third_answers(
    fakes: Fakes, tmp_path: Path
) -> None:
    primary, second, third = fakes
    second.fail_model("gpt-4o-mini", 429, "Rate limit reached", retry_after=3600)
    with proxy_to(primary) as proxy:
        proxy.cut()
        settings = settings_for(
            tmp_path,
            {
                "primary": f"http://127.0.0.1:{proxy.port}/v1",
                "second": second.base_url,
                "third": third.base_url,
            },
        )
        async with failover(settings) as provider:
            answers = [await provider.chat(HELLO) for _ in range(4)]
            states = {s.provider: s.state for s in provider.statuses()}
    assert [a.provider for a in answers] == ["third"] * 4
    assert len(second.chat_requests) == 1  # its hour-long Retry-After keeps it skipped
    assert states == {
        "primary": BreakerState.OPEN,
        "second": BreakerState.OPEN,
        "third": BreakerState.CLOSED,
    }


@pytest.mark.anyio
async def test_a_bad_request_is_not_sent_to_another_provider(fakes: Fakes, tmp_path: Path) -> None:
    primary, backup, _ = fakes
    primary.add_error(400, "Invalid value for 'temperature'", code="invalid_value")
    settings = settings_for(tmp_path, {"primary": primary.base_url, "backup": backup.base_url})
    async with failover(settings) as provider:
        with pytest.raises(LLMError) as caught:
            await provider.chat(HELLO)
        status = provider.breakers["primary"].status()
    assert "HTTP 400" in str(caught.value)
    assert backup.chat_requests == []
    assert (status.state, status.failures) == (BreakerState.CLOSED, 0)


@pytest.mark.anyio
async def test_every_provider_failing_says_each_ones_failure(fakes: Fakes, tmp_path: Path) -> None:
    primary, backup, _ = fakes
    primary.fail_model("gpt-4o-mini", 503)
    backup.fail_model("gpt-4o-mini", 401)
    settings = settings_for(tmp_path, {"primary": primary.base_url, "backup": backup.base_url})
    async with failover(settings) as provider:
        with pytest.raises(LLMError) as caught:
            await provider.chat(HELLO)
    detail = str(caught.value)
    assert "primary (gpt-4o-mini)" in detail and "HTTP 503" in detail
    assert "backup (gpt-4o-mini)" in detail and "HTTP 401" in detail
    assert not isinstance(caught.value, LLMConfigError)  # not only a configuration issue
    assert caught.value.user_message == "The model is not answering right now. Please try again."


@pytest.mark.anyio
async def test_one_provider_alone_is_asked_every_time_even_with_its_breaker_open(
    fakes: Fakes, tmp_path: Path
) -> None:
    """The single-provider configuration works as before failover: a failing server is
    asked at every turn (there is no other), and its error is the person's as it was."""
    primary, _, _ = fakes
    primary.fail_model("gpt-4o-mini", 503)
    settings = load_settings(
        None,
        environ={
            "OPENAI_BASE_URL": primary.base_url,
            "OPENAI_API_KEY": DEFAULT_API_KEY,
            "GATEWAY_LLM__MAX_RETRIES": "0",
        },
    )
    async with failover(settings) as provider:
        for _ in range(5):
            with pytest.raises(LLMError) as caught:
                await provider.chat(HELLO)
        status = provider.breakers["default"].status()
    assert len(primary.chat_requests) == 5
    assert status.state is BreakerState.OPEN and status.skipped == 2
    assert "HTTP 503" in str(caught.value) and "every provider" not in str(caught.value)


@pytest.mark.anyio
async def test_a_stream_moves_on_only_before_its_first_token(fakes: Fakes, tmp_path: Path) -> None:
    primary, backup, _ = fakes
    settings = settings_for(tmp_path, {"primary": primary.base_url, "backup": backup.base_url})
    async with failover(settings) as provider:
        primary.fail_model("gpt-4o-mini", 503)
        texts, final = [], None
        async for delta in provider.stream(HELLO):
            texts.append(delta.text)
            final = delta.response or final
        assert final is not None and final.provider == "backup"
        assert "".join(texts) == "echo: hello"

        primary.reset()
        backup.reset()
        primary.add(Reply(text="the first half and then more words", break_after=3))
        shown: list[str] = []
        with pytest.raises(LLMError) as caught:
            async for delta in provider.stream(HELLO):
                shown.append(delta.text)
    assert "".join(shown) and "cut off" in caught.value.user_message
    assert backup.chat_requests == []  # what the person saw is not continued elsewhere


@pytest.mark.anyio
async def test_an_alias_asks_each_provider_for_its_own_model_name(
    fakes: Fakes, tmp_path: Path
) -> None:
    primary, backup, _ = fakes
    primary.fail_model("gpt-4o", 500)
    settings = settings_for(
        tmp_path,
        {"primary": primary.base_url, "backup": backup.base_url},
        llm__aliases__smart='["primary:gpt-4o", "backup:openai/gpt-4o"]',
    )
    async with failover(settings) as provider:
        answer = await provider.chat(HELLO, model="smart")
    assert answer.provider == "backup" and answer.model == "openai/gpt-4o"
    assert [r.model for r in primary.chat_requests] == ["gpt-4o"]
    assert [r.model for r in backup.chat_requests] == ["openai/gpt-4o"]


# -- a whole turn -----------------------------------------------------------------------


def inbound(text: str) -> InboundMessage:
    return InboundMessage(channel="cli", chat_id="t", text=text, session_key_override="cli:t")


def words(n: int, word: str = "word") -> str:
    return " ".join(f"{word}{i}" for i in range(n))


@pytest.mark.anyio
async def test_a_backup_with_a_smaller_window_gets_the_turn_fitted_to_its_own(
    tmp_path: Path,
) -> None:
    """The primary is down; the backup is a llama-cpp-python server with 2,048 tokens
    that says its size only in its overflow error: each turn is fitted to the backup's
    window once it is known, while the primary's stays its own."""
    async with (
        FakeOpenAI() as primary,
        FakeOpenAI(api_key=None, flavor="llama-cpp-python", context_window=2048) as backup,
    ):
        with proxy_to(primary) as proxy:
            proxy.cut()
            settings = settings_for(
                tmp_path,
                {"primary": f"http://127.0.0.1:{proxy.port}/v1", "backup": backup.base_url},
                memory__auto_consolidate="false",
                # The primary stays open through the turns: a trial after the 0.3 s of
                # the others (a slow machine) would fit a turn to the primary's window
                # again, and the backup would refuse it once more before fitting it.
                llm__failover__cooldown_seconds="600",
            )
            gw = Gateway.build(settings)
            try:
                replies = [
                    await gw.agent.handle(inbound(f"turn {i} " + words(300))) for i in range(6)
                ]
                status = await gw.agent.handle(inbound("/status"))
                backup_window = gw.agent.windows.known("gpt-4o-mini", "backup")
                primary_window = gw.agent.windows.known("gpt-4o-mini", "primary")
            finally:
                await gw.aclose()
        sizes = [estimate_prompt_tokens(r.body) for r in backup.chat_requests]
    # Fitted to the primary's window while it still came first, one request was refused,
    # fitted again to the backup's and sent once more; none since was too long.
    assert [size >= 2048 for size in sizes] == [False, True] + [False] * 5
    assert [r.is_error for r in replies] == [False] * 6, [r.text for r in replies]
    assert backup_window.tokens == 2048 and primary_window.tokens == 32768
    assert "Provider primary (" in status.text and "): open" in status.text
    assert "Provider backup (" in status.text and "of 2,048 tokens" in status.text


@pytest.mark.anyio
async def test_model_picks_an_alias_and_refuses_a_name_no_provider_serves(
    fakes: Fakes, tmp_path: Path
) -> None:
    primary, backup, _ = fakes
    settings = settings_for(
        tmp_path,
        {"primary": primary.base_url, "backup": backup.base_url},
        llm__providers__primary__models='["gpt-4o-mini"]',
        llm__providers__backup__models='["gpt-4o-mini", "openai/gpt-4o"]',
        llm__aliases__smart='["backup:openai/gpt-4o"]',
        memory__auto_consolidate="false",
    )
    gw = Gateway.build(settings)
    try:
        shown = await gw.agent.handle(inbound("/model"))
        refused = await gw.agent.handle(inbound("/model gpt-5"))
        picked = await gw.agent.handle(inbound("/model smart"))
        answer = await gw.agent.handle(inbound("hello"))
    finally:
        await gw.aclose()
    assert shown.text == "Model: gpt-4o-mini (aliases: smart)"
    assert refused.is_error and refused.text == (
        "No configured model provider offers gpt-5; the model is unchanged. The aliases are smart."
    )
    assert not picked.is_error and not answer.is_error
    assert [r.model for r in backup.chat_requests] == ["openai/gpt-4o"]
    assert primary.chat_requests == []


# -- what operators see, in both storage modes -------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["files", "postgres"])
async def test_the_ledger_metrics_readiness_and_admin_page_show_each_provider(
    fakes: Fakes, tmp_path: Path, mode: str, request: pytest.FixtureRequest
) -> None:
    import aiohttp

    from gateway.daemon import Daemon

    primary, backup, _ = fakes
    token = "failover-admin-token-0123456789"
    shared = {"storage__url": request.getfixturevalue("migrated_pg_url")}
    with proxy_to(primary) as proxy:
        proxy.cut()
        settings = settings_for(
            tmp_path,
            {"primary": f"http://127.0.0.1:{proxy.port}/v1", "backup": backup.base_url},
            llm__failover__cooldown_seconds=60,
            llm__providers__backup__prices='{ "gpt-4o-mini" = { prompt = 1.0, completion = 2.0 } }',
            http__port=0,
            http__token=token,
            memory__auto_consolidate="false",
            **(shared if mode == "postgres" else {}),
        )
        daemon = Daemon(Gateway.build(settings), interactive=False)
        headers = {"Authorization": f"Bearer {token}"}
        async with anyio.create_task_group() as tg, aiohttp.ClientSession() as http:
            base = f"http://127.0.0.1:{await tg.start(daemon.run)}"
            for n in range(4):
                body = {"session": "ops", "text": f"question {n}"}
                async with http.post(f"{base}/api/chat", json=body, headers=headers) as resp:
                    assert resp.status == 200, await resp.text()
            async with http.get(f"{base}/metrics") as resp:
                metrics = await resp.text()
            async with http.get(f"{base}/admin/live", headers=headers) as resp:
                page = await resp.text()
            async with http.get(f"{base}/readyz") as resp:
                ready = await resp.json()
            usage = daemon.gateway.agent.usage
            assert usage is not None
            rows = await anyio.to_thread.run_sync(usage.ledger.rows)
            daemon.stop()
    [row] = [r for r in rows if r.session_key == "api:ops"]
    assert (row.provider, row.calls) == ("backup", 4)
    assert row.cost == pytest.approx((row.prompt_tokens * 1.0 + row.completion_tokens * 2.0) / 1e6)
    for line in (
        'gateway_llm_provider_requests_total{provider="primary"} 3.0',
        'gateway_llm_provider_failures_total{provider="primary"} 3.0',
        'gateway_llm_provider_skipped_total{provider="primary"} 1.0',
        'gateway_llm_breaker_opens_total{provider="primary"} 1.0',
        'gateway_llm_breaker_state{provider="primary"} 2.0',
        'gateway_llm_provider_requests_total{provider="backup"} 4.0',
        'gateway_llm_breaker_state{provider="backup"} 0.0',
    ):
        assert line in metrics, line
    assert 'id="providers"' in page and ">open (tried again in" in page
    assert "Connect call failed" in page or "cannot reach" in page
    components = ready["components"]
    assert components["model:primary"]["healthy"] is False
    assert "does not answer" in components["model:primary"]["detail"]
    assert components["model:backup"]["healthy"] is True
    assert "model" not in components  # one component per provider, not one for [llm]


@pytest.mark.anyio
async def test_each_providers_server_is_asked_its_own_window(tmp_path: Path) -> None:
    async with (
        FakeOpenAI(api_key=None, flavor="llama.cpp", context_window=4096) as primary,
        FakeOpenAI(api_key=None, flavor="vllm", context_window=8192) as backup,
    ):
        settings = settings_for(
            tmp_path,
            {"primary": primary.base_url, "backup": backup.base_url},
            memory__auto_consolidate="false",
        )
        gw = Gateway.build(settings)
        try:
            first = await gw.agent.windows.ensure("gpt-4o-mini")
            mine = await gw.agent.windows.ensure("gpt-4o-mini", "primary")
            theirs = await gw.agent.windows.ensure("gpt-4o-mini", "backup")
            status = await gw.agent.handle(inbound("/status"))
        finally:
            await gw.aclose()
    assert first == mine
    assert (mine.tokens, mine.source) == (4096, "llama.cpp /props n_ctx")
    assert (theirs.tokens, theirs.source) == (8192, "vLLM /v1/models max_model_len")
    assert "of 4,096 tokens" in status.text


def test_the_documented_configuration_is_valid(tmp_path: Path) -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "failover.md").read_text()
    example = doc.split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "gateway.toml").write_text(example)
    key = tmp_path / "openrouter-key"
    key.write_text("sk-or-0123456789\n")
    settings = load_settings(
        tmp_path / "gateway.toml",
        environ={"OPENAI_API_KEY": "sk-0123456789", "GATEWAY_WORKSPACE": str(tmp_path)},
        overrides={"llm.providers.backup.api_key_file": str(key)},
    )
    assert list(settings.llm.used_providers()) == ["default", "backup"]
    assert settings.llm.alias_routes() == {
        "smart": [("default", "gpt-4o"), ("backup", "openai/gpt-4o")]
    }
