"""Traces: the span tree of a turn (SDK in-memory exporter), its continuation after a
kill (the journal's traceparent), the OTLP/HTTP wire format (a local receiver decoding
the protobuf), and tracing off costing no SDK import."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
from loguru import logger

from gateway.config import Settings, TelemetrySettings
from gateway.daemon import Daemon, Gateway
from gateway.telemetry import OFF, Telemetry, endpoint_from, from_settings, tracer_provider
from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.otlp_receiver import otlp_receiver

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "telemetry-test-token-0123456789"
SECRET_TEXT = "my secret plan for tuesday"


def in_memory() -> tuple[Telemetry, Any]:
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = tracer_provider("gateway-test")
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Telemetry(provider), exporter


def test_tracing_off_imports_no_sdk_and_hands_back_one_object() -> None:
    assert from_settings(TelemetrySettings(), environ={}) is OFF
    assert OFF.span("a") is OFF.span("b", {"k": 1})
    code = (
        "import sys, gateway.daemon, gateway.dispatch, gateway.agent.loop\n"
        "from gateway.telemetry import OFF\n"
        "with OFF.span('x') as s: s.set_attribute('k', 1)\n"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry.sdk')], 'sdk'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_endpoint_comes_from_the_setting_or_the_standard_variables() -> None:
    plain = TelemetrySettings()
    assert endpoint_from(plain, {}) is None
    assert endpoint_from(plain, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}) == (
        "http://c:4318/v1/traces"
    )
    direct = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/custom"}
    assert endpoint_from(plain, direct) == "http://c:4318/custom"
    mine = TelemetrySettings(otlp_endpoint="http://mine:4318")
    assert endpoint_from(mine, direct) == "http://mine:4318/v1/traces"


@pytest.mark.anyio
async def test_the_span_tree_of_a_turn_with_a_tool_call(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai, http__port=0, http__token=TOKEN)
    tracing, exporter = in_memory()
    daemon = Daemon(Gateway.build(settings), interactive=False)
    daemon.telemetry = tracing
    fake_openai.add_tool_call("current_time", {}, call_id="call_1")
    fake_openai.add_reply("it is noon")
    logged: list[dict[str, Any]] = []
    sink = logger.add(lambda message: logged.append(dict(message.record["extra"])))
    async with anyio.create_task_group() as tg, aiohttp.ClientSession() as http:
        port = await tg.start(daemon.run)
        body = {"session": "traced", "text": SECRET_TEXT, "id": "m-1"}
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with http.post(
            f"http://127.0.0.1:{port}/api/chat", json=body, headers=headers
        ) as resp:
            assert (await resp.json())["reply"] == "it is noon"
        daemon.stop()
    logger.remove(sink)
    spans = exporter.get_finished_spans()
    by_name = {span.name: span for span in spans}
    assert {
        "gateway.intake",
        "gateway.journal",
        "gateway.queue_wait",
        "gateway.turn",
        "gateway.context.build",
        "gateway.cache.lookup",
        "chat gpt-4o-mini",
        "execute_tool current_time",
        "gateway.delivery",
    } <= set(by_name)
    assert len({span.context.trace_id for span in spans}) == 1  # one trace per message
    root = by_name["gateway.intake"]
    assert root.parent is None
    assert root.attributes["messaging.system"] == "api"
    turn = by_name["gateway.turn"]
    for child in ("gateway.journal", "gateway.queue_wait", "gateway.turn", "gateway.delivery"):
        assert by_name[child].parent.span_id == root.context.span_id, child
    calls = [span for span in spans if span.name == "chat gpt-4o-mini"]
    assert len(calls) == 2
    for call in calls:
        assert call.parent.span_id == turn.context.span_id
        assert call.attributes["gen_ai.request.model"] == "gpt-4o-mini"
        assert call.attributes["gen_ai.usage.input_tokens"] > 0
        assert call.attributes["gen_ai.usage.output_tokens"] > 0
    delivery = by_name["gateway.delivery"]
    assert delivery.attributes["gateway.delivery.sent"] is True
    assert "error.type" not in delivery.attributes  # the platform took it
    tool = by_name["execute_tool current_time"]
    assert tool.parent.span_id == turn.context.span_id
    assert tool.attributes["gen_ai.tool.call.id"] == "call_1"
    # The turn's log lines carry the trace id.
    trace_hex = format(root.context.trace_id, "032x")
    assert any(extra.get("trace_id") == trace_hex for extra in logged)
    # No message text anywhere without capture_content.
    values = [str(v) for span in spans for v in (span.attributes or {}).values()]
    assert not [v for v in values if "secret plan" in v or "noon" in v]


@pytest.mark.anyio
async def test_a_failover_shows_each_provider_asked(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    """The default provider answers 500, the backup answers: the model call's span has
    one attempt span per provider, the failed one marked as an error, and names the
    provider that answered."""
    settings = make_settings(
        fake_openai,
        http__port=0,
        http__token=TOKEN,
        llm__chain='["default", "backup"]',
        llm__providers__backup__base_url=fake_openai.base_url,
        llm__providers__backup__api_key=fake_openai.api_key,
    )
    tracing, exporter = in_memory()
    daemon = Daemon(Gateway.build(settings), interactive=False)
    daemon.telemetry = tracing
    fake_openai.add_error(500)
    async with anyio.create_task_group() as tg, aiohttp.ClientSession() as http:
        port = await tg.start(daemon.run)
        body = {"session": "failing", "text": "are you there"}
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with http.post(
            f"http://127.0.0.1:{port}/api/chat", json=body, headers=headers
        ) as resp:
            assert (await resp.json())["reply"] == "echo: are you there"
        daemon.stop()
    spans = exporter.get_finished_spans()
    call = next(span for span in spans if span.name == "chat gpt-4o-mini")
    attempts = sorted(
        (span for span in spans if span.name == "gateway.llm.attempt"),
        key=lambda span: span.attributes["gateway.llm.attempt"],
    )
    assert [a.attributes["gen_ai.provider.name"] for a in attempts] == ["default", "backup"]
    assert all(a.parent.span_id == call.context.span_id for a in attempts)
    assert [a.status.is_ok for a in attempts] == [False, True]
    assert call.attributes["gen_ai.provider.name"] == "backup"


@pytest.mark.anyio
async def test_a_message_taken_in_by_one_replica_and_run_by_another_is_one_trace(
    migrated_pg_url: str,
) -> None:
    """Two replicas over PostgreSQL: a holds the session's lease, b takes the next
    message in (intake, journal) and a runs its turn; both halves are one trace, read
    back from the journal row's traceparent."""
    from gateway.telemetry import install
    from tests.test_replica_router import message, replicas, wait_for

    tracing, exporter = in_memory()
    previous = install(tracing)
    ran: list[tuple[str, str, float]] = []
    try:
        async with replicas(migrated_pg_url, ran) as (a, b):
            await a.dispatcher.submit(message(1))
            await wait_for(lambda: len(ran) == 1, 5)
            await b.dispatcher.submit(message(2))
            await wait_for(lambda: len(ran) == 2 and len(a.sent) == 2, 5)
            ids = {"a": a.router.replica_id, "b": b.router.replica_id}
    finally:
        install(previous)
    assert [who for who, _, _ in ran] == ["a", "a"]
    spans = exporter.get_finished_spans()
    intake = [s for s in spans if s.name == "gateway.intake"][1]  # m2's
    assert intake.attributes["gateway.replica"] == ids["b"]
    same = [s for s in spans if s.context.trace_id == intake.context.trace_id]
    turn = next(s for s in same if s.name == "gateway.turn")
    assert turn.attributes["gateway.replica"] == ids["a"]
    assert {"gateway.journal", "gateway.queue_wait", "gateway.delivery"} <= {s.name for s in same}


@pytest.mark.anyio
async def test_capture_content_puts_the_texts_on_the_model_call(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = tracer_provider("gateway-test")
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    settings = make_settings(fake_openai, http__port=0, http__token=TOKEN)
    daemon = Daemon(Gateway.build(settings), interactive=False)
    daemon.telemetry = Telemetry(provider, capture_content=True)
    async with anyio.create_task_group() as tg, aiohttp.ClientSession() as http:
        port = await tg.start(daemon.run)
        body = {"session": "open", "text": SECRET_TEXT}
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with http.post(
            f"http://127.0.0.1:{port}/api/chat", json=body, headers=headers
        ) as resp:
            assert resp.status == 200
        daemon.stop()
    call = next(s for s in exporter.get_finished_spans() if s.name == "chat gpt-4o-mini")
    assert call.attributes["gen_ai.prompt"] == SECRET_TEXT
    assert call.attributes["gen_ai.completion"] == f"echo: {SECRET_TEXT}"
    assert call.attributes["gen_ai.prompt.length"] == len(SECRET_TEXT)


# ---------------------------------------------------------------- the OTLP wire


@pytest.mark.kill
@pytest.mark.timeout(180)
def test_spans_reach_an_otlp_receiver_and_a_replay_after_a_kill_continues_the_trace(
    tmp_path: Path,
) -> None:
    """`gateway run` exports over OTLP/HTTP to a local receiver (the protobuf decoded);
    killed while the model answers, the restarted gateway replays the message from the
    journal and its turn's spans join the trace the first process began."""
    import urllib.request

    from tests.gateway_process import GatewayProcess, base_env, wait_until

    with FakeOpenAI.in_thread() as llm, otlp_receiver() as (url, received):
        env = base_env(tmp_path / "ws", llm) | {
            "GATEWAY_HTTP__PORT": "0",
            "GATEWAY_HTTP__TOKEN": TOKEN,
            "GATEWAY_TELEMETRY__OTLP_ENDPOINT": url,
            "OTEL_BSP_SCHEDULE_DELAY": "50",
        }

        def names() -> list[str]:
            return [span.name for span in list(received)]

        llm.hold(lambda body: True, count=1)
        first = GatewayProcess(env, tmp_path)
        try:
            port = first.wait_ready()
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/api/chat",
                data=b'{"session": "otlp", "text": "hello traces", "id": "t-1"}',
                headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
            )
            threading.Thread(
                target=lambda: _ignore(lambda: urllib.request.urlopen(request, timeout=60)),
                daemon=True,
            ).start()
            llm.wait_held(1, timeout=30)
            wait_until(lambda: "gateway.journal" in names(), 20, "the journal span exported")
            first.kill()
        finally:
            first.stop()
        llm.release()
        before = list(received)
        second = GatewayProcess(env, tmp_path)
        try:
            second.wait_ready()
            wait_until(lambda: "gateway.delivery" in names(), 30, "the replayed turn's spans")
            assert second.terminate() == 0
        finally:
            second.stop()
    intake = next(span for span in before if span.name == "gateway.intake")
    trace_id = intake.trace_id
    assert len(trace_id) == 16
    later = received[len(before) :]
    replayed = {span.name for span in later if span.trace_id == trace_id}
    assert {"gateway.turn", "chat gpt-4o-mini", "gateway.delivery"} <= replayed
    chat = next(span for span in later if span.name == "chat gpt-4o-mini")
    attributes = {a.key: a.value for a in chat.attributes}
    assert attributes["gen_ai.request.model"].string_value == "gpt-4o-mini"
    assert attributes["gen_ai.usage.input_tokens"].int_value > 0


def _ignore(call: Callable[[], object]) -> None:
    try:
        call()
    except Exception:
        pass


def test_a_traced_turns_text_log_lines_show_the_trace_id() -> None:
    from gateway.logs import text_format

    traced: Any = {"extra": {"session": "api:x", "trace_id": "0af7"}}
    plain: Any = {"extra": {"session": "api:x"}}
    assert "{extra[session]} trace={extra[trace_id]} " in text_format(traced)
    assert "trace=" not in text_format(plain)
