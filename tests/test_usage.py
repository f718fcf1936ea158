"""Tokens and cost: the ledger in both stores (SQLite file, PostgreSQL), every model call
counted through the real openai client against the fake server (turns, heartbeats,
consolidation apart), budgets, /status, /metrics and `gateway usage`."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import anyio
import pytest

from gateway.config import ConfigError, Settings, load_settings
from gateway.daemon import Gateway
from gateway.messages import InboundMessage
from gateway.sessions.keys import encode_key
from gateway.usage.meter import Price, PriceTable, UsageMeter, usage_table
from gateway.usage.pg_store import PostgresUsageLedger
from gateway.usage.protocol import UsageLedger, UsageRow
from gateway.usage.store import SqliteUsageLedger
from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.telegram_server import FakeTelegram
from tests.test_cli_e2e import base_env, llm_env, run_gateway
from tests.test_memory_e2e import consolidating_responder
from tests.test_telegram_e2e import fake_tg, gateway, wait_sent  # noqa: F401

pytestmark = pytest.mark.anyio

PRICES = '{ "gpt-4o-mini" = { prompt = 0.15, completion = 0.6 } }'


def said(text: str, key: str = "telegram:42") -> InboundMessage:
    channel, chat = key.split(":", 1)
    return InboundMessage(channel=channel, chat_id=chat, text=text)


def reported_usage(settings: Settings, key: str) -> list[dict[str, int]]:
    """The usage the server reported, as the session recorded it on each answer."""
    path = settings.sessions_dir / f"{encode_key(key)}.jsonl"
    entries = [json.loads(line) for line in path.read_text().splitlines()]
    return [
        e["message"]["usage"]
        for e in entries
        if e.get("type") == "message" and "usage" in e["message"]
    ]


def row(day: str, key: str, kind: str, prompt: int, completion: int = 0) -> UsageRow:
    return UsageRow(day, key, key.split(":")[0], "m", kind, 1, prompt, completion, prompt / 1e6)


@pytest.fixture(params=["sqlite", "postgres"])
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[UsageLedger]:
    if request.param == "sqlite":
        store: UsageLedger = SqliteUsageLedger(tmp_path / "usage.sqlite")
        yield store
        store.close()
        return
    from gateway.plumbing.postgres import sync_pool

    with sync_pool(request.getfixturevalue("migrated_pg_url"), max_size=2) as pool:
        pool.wait()
        yield PostgresUsageLedger(pool)


def test_the_ledger_adds_up_per_day_conversation_and_kind(ledger: UsageLedger) -> None:
    ledger.add(row("2026-11-22", "telegram:1", "turn", 100, 10))
    ledger.add(row("2026-11-23", "telegram:1", "turn", 200, 20))
    ledger.add(row("2026-11-23", "telegram:1", "turn", 300, 30))
    ledger.add(row("2026-11-23", "telegram:1", "consolidation", 1000))
    ledger.add(row("2026-11-23", "system:heartbeat:daily", "heartbeat", 50))
    [summed] = [
        r for r in ledger.rows(since="2026-11-23", session_key="telegram:1") if r.kind == "turn"
    ]
    assert (summed.calls, summed.prompt_tokens, summed.completion_tokens) == (2, 500, 50)
    assert summed.cost == pytest.approx(500 / 1e6)
    # Budgets count turns and heartbeats of the day, never consolidation.
    assert ledger.tokens("2026-11-23", "telegram:1") == 550
    assert ledger.tokens("2026-11-23") == 600
    assert ledger.tokens("2026-11-21") == 0
    assert len(ledger.rows()) == 4


def test_each_provider_that_answered_has_its_own_totals(ledger: UsageLedger) -> None:
    """The provider is part of a total's key in both ledgers: the same conversation,
    model and kind answered by two providers are two rows, each adding up on its own."""
    for provider in ("primary", "backup", "backup"):
        ledger.add(
            UsageRow("2026-11-23", "telegram:1", "telegram", "m", "turn", 1, 10, 1, 0.0,
                     provider=provider)
        )  # fmt: skip
    rows = {r.provider: r for r in ledger.rows()}
    assert set(rows) == {"primary", "backup"}
    assert (rows["primary"].calls, rows["backup"].calls, rows["backup"].prompt_tokens) == (1, 2, 20)
    assert ledger.tokens("2026-11-23", "telegram:1") == 33  # budgets count every provider


#: usage.sqlite as the gateway wrote it before providers were counted.
OLD_USAGE_SCHEMA = """
CREATE TABLE usage (
    day TEXT NOT NULL, session_key TEXT NOT NULL, channel TEXT NOT NULL,
    model TEXT NOT NULL, kind TEXT NOT NULL, calls INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL, cost REAL NOT NULL,
    PRIMARY KEY (day, session_key, channel, model, kind)
)
"""


def write_old_ledger(path: Path) -> None:
    import sqlite3

    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path)
    conn.execute(OLD_USAGE_SCHEMA)
    conn.execute(
        "INSERT INTO usage VALUES ('2026-11-20', 'telegram:1', 'telegram', 'm', 'turn', "
        "4, 400, 40, 0.5)"
    )
    conn.commit()
    conn.close()
    path.chmod(0o600)


def test_a_ledger_of_an_older_version_keeps_its_totals_and_gains_the_provider(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ws" / "usage.sqlite"
    write_old_ledger(path)
    ledger = SqliteUsageLedger(path)
    try:
        ledger.add(row("2026-11-20", "telegram:1", "turn", 100))  # not recorded by whom
        ledger.add(
            UsageRow("2026-11-20", "telegram:1", "telegram", "m", "turn", 1, 7, 0, 0.0,
                     provider="backup")
        )  # fmt: skip
        rows = sorted(ledger.rows(), key=lambda r: r.provider)
    finally:
        ledger.close()
    assert [(r.provider, r.calls, r.prompt_tokens) for r in rows] == [
        ("", 5, 500),
        ("backup", 1, 7),
    ]
    again = SqliteUsageLedger(path)  # opened again: nothing to change any more
    try:
        assert len(again.rows()) == 2
    finally:
        again.close()


def test_a_providers_own_price_comes_before_the_general_one() -> None:
    prices = PriceTable(
        {"gpt-4o-mini": Price(0.15, 0.6)}, by_provider={"backup": {"gpt-4o-mini": Price(1, 2)}}
    )
    assert prices.cost("gpt-4o-mini", 1_000_000, 0) == pytest.approx(0.15)
    assert prices.cost("gpt-4o-mini", 1_000_000, 0, provider="primary") == pytest.approx(0.15)
    assert prices.cost("gpt-4o-mini", 1_000_000, 0, provider="backup") == pytest.approx(1.0)
    assert not prices.priced("other") and not prices.priced("other", "backup")


async def test_every_call_is_counted_by_conversation_kind_and_model_with_its_cost(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    fake_openai.responder = consolidating_responder
    settings = make_settings(fake_openai, usage__prices=PRICES, agent__memory_window=1)
    gw = Gateway.build(settings)
    try:
        await gw.agent.handle(said("hello there"))
        await gw.agent.handle(said("and again"))
        await gw.agent.handle(said("check the calendar", key="system:heartbeat:daily"))
        assert gw.consolidator is not None
        outcome = await gw.consolidator.consolidate_now("telegram:42", force=True)
        assert outcome.status == "compacted", outcome.describe()
        status = await gw.agent.handle(said("/status"))
        assert gw.agent.usage is not None
        rows = gw.agent.usage.ledger.rows()
    finally:
        await gw.aclose()
    by_kind = {(r.session_key, r.kind): r for r in rows}
    assert set(by_kind) == {
        ("telegram:42", "turn"),
        ("telegram:42", "consolidation"),
        ("system:heartbeat:daily", "heartbeat"),
    }
    turns = by_kind[("telegram:42", "turn")]
    reported = reported_usage(settings, "telegram:42")
    # The consolidation's call is not among the turns: its request forces a tool.
    assert turns.calls == 2 and turns.channel == "telegram" and turns.model == "gpt-4o-mini"
    assert turns.prompt_tokens == sum(u["prompt_tokens"] for u in reported) > 0
    assert turns.completion_tokens == sum(u["completion_tokens"] for u in reported) > 0
    heartbeat = reported_usage(settings, "system:heartbeat:daily")
    assert by_kind[("system:heartbeat:daily", "heartbeat")].prompt_tokens == sum(
        u["prompt_tokens"] for u in heartbeat
    )
    assert turns.cost == pytest.approx(
        (turns.prompt_tokens * 0.15 + turns.completion_tokens * 0.6) / 1e6
    )
    assert by_kind[("telegram:42", "consolidation")].prompt_tokens > 0
    today = sum(r.tokens for r in rows if r.session_key == "telegram:42")
    assert f"Tokens today: {today:,} ($" in status.text


async def test_at_the_conversation_budget_the_bot_says_so_and_stops_calling_the_model(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai, usage__conversation_tokens_per_day=1)
    gw = Gateway.build(settings)
    try:
        first = await gw.agent.handle(said("one"))
        second = await gw.agent.handle(said("two"))
        other = await gw.agent.handle(said("hi", key="telegram:43"))
        session = gw.agent.sessions.get_or_create("telegram:42")
        kept = [m.content for m in session.messages]
    finally:
        await gw.aclose()
    assert first.text == "echo: one" and other.text == "echo: hi"
    assert second.text.startswith("This conversation has used its token budget for today")
    assert "renews at 00:00 UTC" in second.text
    assert [r.last_user_text for r in fake_openai.chat_requests] == ["one", "hi"]
    assert kept == ["one", "echo: one", "two", second.text]  # the message is kept


async def test_the_daily_budget_of_all_conversations_stops_every_one(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai, usage__tokens_per_day=1)
    gw = Gateway.build(settings)
    try:
        await gw.agent.handle(said("one"))
        other = await gw.agent.handle(said("hi", key="telegram:43"))
    finally:
        await gw.aclose()
    assert other.text.startswith("I have used today's token budget")
    assert len(fake_openai.chat_requests) == 1


def test_a_budget_of_zero_is_refused_with_what_to_do_instead() -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(None, environ={"GATEWAY_USAGE__CONVERSATION_TOKENS_PER_DAY": "0"})
    message = str(caught.value)
    assert "a budget of 0 tokens would stop every conversation" in message
    assert "leave it unset for no budget" in message
    with pytest.raises(ConfigError, match="a budget of 0"):
        load_settings(None, environ={"GATEWAY_USAGE__TOKENS_PER_DAY": "-5"})


async def test_tokens_and_cost_are_in_metrics_per_channel_and_model(
    fake_openai: FakeOpenAI,
    fake_tg: FakeTelegram,  # noqa: F811
    make_settings: Callable[..., Settings],
) -> None:
    async with gateway(make_settings, fake_openai, fake_tg, usage__prices=PRICES) as gw:
        fake_tg.push_update(fake_tg.user_message(4242, "count me"))
        await wait_sent(fake_tg, 4242, 1)
        async with aiohttp.ClientSession() as http, http.get(f"{gw.url}/metrics") as response:
            text = await response.text()
    [usage] = reported_usage(gw.settings, "telegram:4242")
    labels = 'channel="telegram",kind="turn",model="gpt-4o-mini"'
    prompt = f'gateway_llm_tokens_total{{{labels},type="prompt"}} {float(usage["prompt_tokens"])}'
    assert prompt in text, text
    cost = (usage["prompt_tokens"] * 0.15 + usage["completion_tokens"] * 0.6) / 1e6
    [line] = [x for x in text.splitlines() if x.startswith(f"gateway_llm_cost_usd_total{{{labels}")]
    assert float(line.split()[-1]) == pytest.approx(cost)


def test_gateway_usage_prints_per_conversation_and_day(
    tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    env = llm_env(tmp_path, fake_openai_thread) | {"GATEWAY_USAGE__PRICES": PRICES}
    for text in ("first question", "second question"):
        assert run_gateway(["chat", "-m", text], env, tmp_path).returncode == 0
    table = run_gateway(["usage"], env, tmp_path)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == [
        "day", "conversation", "kind", "model", "provider", "calls", "prompt", "completion",
        "cost",
    ]  # fmt: skip
    [cli] = [line for line in lines if "cli:direct" in line]
    assert cli.split()[2:6] == ["turn", "gpt-4o-mini", "default", "2"]
    assert "all conversations" in lines[-1]
    as_json = run_gateway(["usage", "--json", "--session", "direct"], env, tmp_path)
    [record] = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert record["session_key"] == "cli:direct" and record["calls"] == 2
    assert record["provider"] == "default"
    assert record["cost_usd"] > 0
    bad = run_gateway(["usage", "--days", "0"], env, tmp_path)
    assert bad.returncode == 2 and "not a number from 1 up" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_an_empty_ledger_and_unpriced_models_are_said_plainly() -> None:
    assert usage_table([], PriceTable({}), since="2026-11-20") == (
        "No model usage recorded since 2026-11-20."
    )
    table = usage_table([row("2026-11-23", "cli:x", "turn", 10)], PriceTable({}), since="x")
    assert "unpriced" in table


def test_the_ledger_file_is_private_and_a_damaged_one_is_kept(tmp_path: Path) -> None:
    """`usage.sqlite` names conversations: 0600 like every workspace database (so
    `gateway doctor` finds nothing readable by others), and a damaged file is moved aside
    with its bytes, never overwritten."""
    path = tmp_path / "ws" / "usage.sqlite"
    ledger = SqliteUsageLedger(path)
    ledger.add(row("2026-11-23", "telegram:1", "turn", 10))
    ledger.close()
    for name in ("usage.sqlite", "usage.sqlite-wal", "usage.sqlite-shm"):
        file = path.with_name(name)
        if file.exists():
            assert file.stat().st_mode & 0o777 == 0o600, name

    path.with_name("usage.sqlite-wal").unlink(missing_ok=True)
    path.with_name("usage.sqlite-shm").unlink(missing_ok=True)
    path.write_bytes(b"not a database " * 100)
    ledger = SqliteUsageLedger(path)
    try:
        assert ledger.rows() == []
    finally:
        ledger.close()
    [aside] = path.parent.glob("usage.sqlite.broken-*")
    assert aside.read_bytes() == b"not a database " * 100


def test_a_model_call_is_counted_on_the_loop_unless_the_ledger_would_make_it_wait(
    tmp_path: Path,
) -> None:
    """The file mode counts a call on the event loop (no thread hop) when usage.sqlite
    is free; when another writer holds it, nothing is written and the caller falls back
    to the blocking add in a worker thread, which waits and counts it once."""
    import sqlite3
    import threading

    path = tmp_path / "usage.sqlite"
    ledger = SqliteUsageLedger(path)
    meter = UsageMeter(ledger, PriceTable({}))
    seen: list[UsageRow] = []
    meter.on_record(seen.append)
    try:
        assert meter.try_record_nowait(None, "m", 10, 5) is True
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")  # another writer holds the file
        assert meter.try_record_nowait(None, "m", 1, 1) is False
        assert len(seen) == 1
        done = threading.Event()
        worker = threading.Thread(
            target=lambda: (meter.record(None, "m", 1, 1), done.set()), daemon=True
        )
        worker.start()
        assert not done.wait(0.3)  # the blocking add waits for the other writer ...
        other.execute("COMMIT")
        other.close()
        assert done.wait(5)  # ... and counts once it lets go
        [total] = ledger.rows()
        assert (total.calls, total.prompt_tokens, total.completion_tokens) == (2, 11, 6)
        assert len(seen) == 2
    finally:
        ledger.close()


# ----------------------------------------------------------------------- transcriptions

VOICE_PRICES = (
    '{ "gpt-4o-mini" = { prompt = 0.15, completion = 0.6 }, '
    '"whisper-1" = { per_minute = 0.006 }, '
    '"gpt-4o-mini-transcribe" = { prompt = 3.0, completion = 5.0 } }'
)


@pytest.mark.parametrize(
    ("model", "server_usage", "seconds", "tokens", "cost"),
    [
        # billed by the minute: 90 s at $0.006 a minute
        ("whisper-1", True, 90.0, (0, 0), 0.009),
        # billed by tokens: 10 audio tokens a second in the fake, the text at 4 chars a token
        ("gpt-4o-mini-transcribe", True, 0.0, (120, 3), (120 * 3.0 + 3 * 5.0) / 1e6),
        # a local Whisper server that reports nothing: a call, no duration, no cost
        ("whisper-1", False, 0.0, (0, 0), 0.0),
    ],
)
async def test_a_voice_note_is_counted_as_a_transcription_in_the_ledger_and_metrics(
    fake_openai: FakeOpenAI,
    fake_tg: FakeTelegram,  # noqa: F811
    make_settings: Callable[..., Settings],
    tmp_path: Path,
    model: str,
    server_usage: bool,
    seconds: float,
    tokens: tuple[int, int],
    cost: float,
) -> None:
    from tests.media_files import speech

    fake_openai.transcription_usage = server_usage
    fake_openai.add_transcription("buy oat milk", seconds=90.0 if model == "whisper-1" else 12.0)
    async with gateway(
        make_settings,
        fake_openai,
        fake_tg,
        usage__prices=VOICE_PRICES,
        media__transcription_model=model,
    ) as gw:
        fake_tg.push_update(fake_tg.user_message(4242, voice=speech("ignored")))
        await wait_sent(fake_tg, 4242, 1)
        async with aiohttp.ClientSession() as http, http.get(f"{gw.url}/metrics") as response:
            metrics = await response.text()
    assert fake_tg.sent_messages(4242)[0]["text"] == "echo: buy oat milk"

    ledger = SqliteUsageLedger(gw.settings.workspace_path / "usage.sqlite")
    try:
        rows = {r.kind: r for r in ledger.rows()}
    finally:
        ledger.close()
    assert set(rows) == {"turn", "transcription"}
    heard = rows["transcription"]
    assert (heard.session_key, heard.channel, heard.model, heard.calls) == (
        "telegram:4242",
        "telegram",
        model,
        1,
    )
    assert (heard.prompt_tokens, heard.completion_tokens) == tokens
    assert heard.cost == pytest.approx(cost)
    assert rows["turn"].model == "gpt-4o-mini"  # the turn's own call, apart

    labels = f'channel="telegram",kind="transcription",model="{model}"'
    assert f"gateway_llm_calls_total{{{labels}}} 1.0" in metrics
    [line] = [
        x for x in metrics.splitlines() if x.startswith(f"gateway_llm_cost_usd_total{{{labels}")
    ]
    assert float(line.split()[-1]) == pytest.approx(cost)
    audio = f'gateway_transcription_audio_seconds_total{{channel="telegram",model="{model}"}}'
    assert f"{audio} {seconds}" in metrics

    # The duration the server reported stays with the voice message in the session.
    path = gw.settings.sessions_dir / f"{encode_key('telegram:4242')}.jsonl"
    [entry] = [
        e
        for e in map(json.loads, path.read_text().splitlines())
        if e.get("type") == "message" and e["message"]["role"] == "user"
    ]
    [record] = entry["meta"]["attachments"]
    assert record.get("audio_seconds") == (seconds or None)

    # `gateway usage` shows it under its own kind, priced.
    env = base_env(tmp_path) | {
        "GATEWAY_WORKSPACE": str(gw.settings.workspace_path),
        "GATEWAY_USAGE__PRICES": VOICE_PRICES,
    }
    table = await anyio.to_thread.run_sync(lambda: run_gateway(["usage"], env, tmp_path))
    assert table.returncode == 0, table.stderr
    [voice] = [line for line in table.stdout.splitlines() if "transcription" in line]
    assert voice.split()[1:6] == ["telegram:4242", "transcription", model, "-", "1"]
    assert voice.split()[-1] == f"${cost:.6f}"


def test_a_price_is_per_token_per_minute_or_both_and_never_half_given() -> None:
    def prices(value: str) -> Settings:
        return load_settings(None, environ={"GATEWAY_USAGE__PRICES": value})

    whisper = prices('{ "whisper-1" = { per_minute = 0.006 } }').usage.prices["whisper-1"]
    assert (whisper.prompt, whisper.completion, whisper.per_minute) == (0.0, 0.0, 0.006)
    for half in ('{ "m" = { prompt = 0.15 } }', '{ "m" = {} }', '{ "m" = { completion = 1 } }'):
        with pytest.raises(ConfigError, match="give prompt and completion"):
            prices(half)
    table = PriceTable({"whisper-1": Price(0.0, 0.0, per_minute=0.006)})
    assert table.cost("whisper-1", 0, 0, audio_seconds=30) == pytest.approx(0.003)


async def test_status_says_unpriced_for_a_model_without_a_price(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    """A local model has no price: /status says so, as `gateway usage` does, instead of
    a cost of $0.000000 that would pass for a real one."""
    gw = Gateway.build(make_settings(fake_openai))
    try:
        await gw.agent.handle(said("hello there"))
        status = await gw.agent.handle(said("/status"))
    finally:
        await gw.aclose()
    line = next(x for x in status.text.splitlines() if x.startswith("Tokens today:"))
    assert line.endswith("(unpriced)") and "$" not in line, line
