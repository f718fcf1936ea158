"""No configured secret is shown anywhere, tested from outside (issue 37, item 5).

Every kind of secret the settings hold is planted in a real `gateway run` (model keys,
bot and app tokens, app secrets, passwords, the HTTP tokens, a Redis and a PostgreSQL
password in their URLs, an MCP server's env and passed variables). A fake model server
then quotes all of them, as they are and in the forms text carries them in (a bearer
header, URL-encoded, inside a URL's `user:password@`): in a 401 (its error reaches the
admin page's provider table), and in an answer whose text and model name are theirs.
Every surface is read as its reader reads it, and none may show a secret in any of the
forms a page, a JSON body or a label would carry it in: the admin pages and the live
view, /readyz, /metrics, the log, the Telegram replies (and /status), the trace spans
a collector receives, and `gateway doctor`."""

from __future__ import annotations

import html
import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, quote_plus

import markupsafe
import pytest

from tests.fakes.openai_server import FakeOpenAI, Reply
from tests.fakes.otlp_receiver import otlp_receiver
from tests.fakes.telegram_server import FakeTelegram
from tests.gateway_process import ROOT, GatewayProcess, base_env, wait_until

LLM_KEY = "planted-llm-api-key-4f9a1c"
TELEGRAM_TOKEN = "7351946280:AAPlantedTelegramBotToken_x9Kq2Lm5Np8R"
HTTP_TOKEN = "planted-http-token-6d5c4b3a"
ADMIN_TOKEN = "planted-admin-token-1f2e3d4c"
REDIS_PASSWORD = "planted/redis@pw:77"
PG_PASSWORD = "planted-pg:pass#91"
MCP_PASSED = "planted-mcp-passed-secret-4d4d"

#: Every other secret setting, by its variable; the values are what must never show.
PLANTED = {
    "GATEWAY_LLM__PROVIDERS__BACKUP__API_KEY": "planted-backup-key-88d1e2",
    "GATEWAY_MEDIA__TRANSCRIPTION_API_KEY": "planted-whisper-key-3b7c0d",
    "GATEWAY_CHANNELS__TELEGRAM__WEBHOOK_SECRET": "planted_webhook_secret_51ac",
    "GATEWAY_CHANNELS__SLACK__BOT_TOKEN": "xoxb-planted-slack-bot-7788",
    "GATEWAY_CHANNELS__SLACK__APP_TOKEN": "xapp-1-planted-slack-app-9911",
    "GATEWAY_CHANNELS__SLACK__SIGNING_SECRET": "planted-slack-signing-2c4e6a",
    "GATEWAY_CHANNELS__EMAIL__PASSWORD": 'pl@nted:mail&pass"<word>',
    "GATEWAY_CHANNELS__EMAIL__SMTP_PASSWORD": "planted smtp pass/+?#%",
    "GATEWAY_CHANNELS__MATRIX__ACCESS_TOKEN": "syt_planted_matrix_token_ab12",
    "GATEWAY_CHANNELS__WHATSAPP__ACCESS_TOKEN": "EAAPlantedWhatsAppToken77zz",
    "GATEWAY_CHANNELS__WHATSAPP__APP_SECRET": "planted-meta-app-secret-e5f6",
    "GATEWAY_CHANNELS__WHATSAPP__VERIFY_TOKEN": "planted-verify-token-0a0b",
    "GATEWAY_CHANNELS__DISCORD__TOKEN": "planted.discord.bot.token.Zq93",
    "GATEWAY_HTTP__API_TOKENS__IDE__TOKEN": "planted-ide-client-token-77aa",
}
MCP_ENV_TOKEN = "planted-mcp-env-token-5e5e"
CHAT = 4242


def shown_forms(secret: str) -> set[str]:
    """The forms in which a reader would see `secret`: as it is, URL-encoded, escaped in
    HTML (Jinja2's and the standard library's entities), in a JSON string or a label."""
    return {
        secret,
        quote(secret, safe=""),
        quote_plus(secret),
        html.escape(secret),
        str(markupsafe.escape(secret)),
        json.dumps(secret)[1:-1],
        json.dumps(secret, ensure_ascii=False)[1:-1],
    }


def every_secret(shared: bool) -> list[str]:
    secrets = [
        LLM_KEY,
        TELEGRAM_TOKEN,
        HTTP_TOKEN,
        ADMIN_TOKEN,
        REDIS_PASSWORD,
        MCP_PASSED,
        MCP_ENV_TOKEN,
        *PLANTED.values(),
    ]
    return [*secrets, PG_PASSWORD] if shared else secrets


def quoting(secrets: list[str]) -> str:
    """A text that quotes each secret, as it is and in the usual encodings."""
    return " ".join(
        f"[{s} | Authorization: Bearer {s} | {quote(s, safe='')} | "
        f"https://user:{quote(s, safe='')}@example.org/x]"
        for s in secrets
    )


def leaks(text: str, secrets: list[str]) -> list[str]:
    """The secrets `text` shows in any of their forms."""
    return [s for s in secrets if any(form in text for form in shown_forms(s))]


def said(leaked: dict[str, list[str]], secrets: list[str]) -> str:
    """Which surface shows which secrets, one line each."""
    lines = [f"{name}: {len(found)} of {len(secrets)}: {found}" for name, found in leaked.items()]
    return "secrets shown:\n" + "\n".join(lines)


def planted_env(workspace: Path, llm: FakeOpenAI, pg_url: str | None) -> dict[str, str]:
    env = base_env(workspace, llm) | PLANTED
    env |= {
        "GATEWAY_HTTP__PORT": "0",
        "GATEWAY_HTTP__TOKEN": HTTP_TOKEN,
        "GATEWAY_HTTP__ADMIN_TOKEN": ADMIN_TOKEN,
        "GATEWAY_LLM__PROVIDERS__BACKUP__BASE_URL": llm.base_url,
        # Nothing listens on port 9: the cache is down, its URL still holds a password.
        "GATEWAY_CACHE__URL": f"redis://:{quote(REDIS_PASSWORD, safe='')}@127.0.0.1:9/0",
        "GATEWAY_MCP__SERVERS__GH__COMMAND": "true",
        "GATEWAY_MCP__SERVERS__GH__ENABLED": "false",
        "GATEWAY_MCP__SERVERS__GH__ENV": f'{{ GITHUB_TOKEN = "{MCP_ENV_TOKEN}" }}',
        "GATEWAY_MCP__SERVERS__GH__PASS_ENV": '["PLANTED_MCP_PASS"]',
        "PLANTED_MCP_PASS": MCP_PASSED,
    }
    if pg_url is not None:  # shared mode, the password in the URL (the test server trusts)
        user, rest = pg_url.split("://", 1)[1].split("@", 1)
        password = quote(PG_PASSWORD, safe="")
        env["GATEWAY_STORAGE__URL"] = f"postgresql://{user}:{password}@{rest}"
    return env


def telegram_env(telegram: FakeTelegram) -> dict[str, str]:
    return {
        "GATEWAY_CHANNELS__TELEGRAM__ENABLED": "true",
        "GATEWAY_CHANNELS__TELEGRAM__TOKEN": TELEGRAM_TOKEN,
        "GATEWAY_CHANNELS__TELEGRAM__BASE_URL": telegram.api_url,
        "GATEWAY_CHANNELS__TELEGRAM__BASE_FILE_URL": telegram.file_url,
        "GATEWAY_CHANNELS__TELEGRAM__POLL_TIMEOUT": "1",
        "GATEWAY_CHANNELS__TELEGRAM__DM_POLICY": "open",
        "GATEWAY_AGENT__OWNERS": f'["telegram:{CHAT}"]',
    }


def answer_quoting(text: str) -> Reply:
    """A chat completion whose text, and whose model name, quote `text`."""
    body = {
        "id": "chatcmpl-planted",
        "object": "chat.completion",
        "created": 0,
        "model": text,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20},
    }
    return Reply(raw=json.dumps(body).encode())


def api_chat(port: int, text: str) -> str:
    """The reply /api/chat gives, as the client reads its JSON."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/api/chat",
        data=json.dumps({"session": "api-user", "text": text}).encode(),
        headers={"Authorization": f"Bearer {HTTP_TOKEN}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return str(response.read().decode("utf-8"))


def get(port: int, path: str, token: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return str(response.read().decode("utf-8"))
    except urllib.error.HTTPError as refused:  # /readyz answers 503 while the cache is down
        return str(refused.read().decode("utf-8"))


def span_texts(span: Any) -> Iterator[str]:
    """Every text an exported span carries: name, status, attributes, events."""
    yield span.name
    yield span.status.message
    for attribute in span.attributes:
        yield attribute.value.string_value
    for event in span.events:
        yield event.name
        for attribute in event.attributes:
            yield attribute.value.string_value


@pytest.fixture(params=["files", "shared"])
def shared_url(request: pytest.FixtureRequest) -> str | None:
    """None in the files mode; the PostgreSQL URL of a schema of its own in the shared."""
    return str(request.getfixturevalue("pg_url")) if request.param == "shared" else None


def test_no_surface_shows_a_configured_secret(tmp_path: Path, shared_url: str | None) -> None:
    secrets = every_secret(shared=shared_url is not None)
    quoted = quoting(secrets)
    with (
        FakeOpenAI.in_thread(api_key=LLM_KEY) as llm,
        FakeTelegram.in_thread(token=TELEGRAM_TOKEN) as telegram,
        otlp_receiver() as (otlp_url, spans),
    ):
        env = planted_env(tmp_path / "ws", llm, shared_url) | telegram_env(telegram)
        env |= {
            "GATEWAY_LOG__LEVEL": "DEBUG",
            "GATEWAY_TELEMETRY__OTLP_ENDPOINT": otlp_url,
            "OTEL_BSP_SCHEDULE_DELAY": "50",
        }
        gateway = GatewayProcess(env, tmp_path)
        try:
            port = gateway.wait_ready()
            surfaces: dict[str, str] = {"/api/chat replies": "", "provider table": ""}
            # The provider table shows the start of the last failure (300 characters):
            # one 401 per secret, each quoting it, and the table read after each.
            for secret in secrets:
                llm.add_error(401, f"Incorrect API key provided: {quoting([secret])}")
                surfaces["/api/chat replies"] += api_chat(port, "hello")
                surfaces["provider table"] += get(port, "/admin/live", ADMIN_TOKEN)
            # The model server refuses the key and quotes every secret in its 401.
            llm.add_error(401, f"Incorrect API key provided: {quoted}", code="invalid_api_key")
            telegram.push_update(telegram.user_message(CHAT, "hello"))
            wait_until(lambda: len(telegram.sent_messages(CHAT)) >= 1, 30, "the error reply")
            # Then it answers, its text and its model name quoting them all again.
            llm.add(answer_quoting(quoted))
            telegram.push_update(telegram.user_message(CHAT, "again"))
            wait_until(lambda: len(telegram.sent_messages(CHAT)) >= 2, 30, "the answer")
            telegram.push_update(telegram.user_message(CHAT, "/status"))
            wait_until(lambda: len(telegram.sent_messages(CHAT)) >= 3, 30, "the /status reply")

            for path in (
                "/admin",
                "/admin/live",
                "/admin/sessions",
                f"/admin/session?key=telegram:{CHAT}",
                f"/admin/memory?key=telegram:{CHAT}&q=planted",
                "/admin/pairing",
                "/admin/cache",
            ):
                surfaces[path] = get(port, path, ADMIN_TOKEN)
            assert "Model providers" in surfaces["/admin"]  # the provider table is there
            assert "HTTP 401" in surfaces["/admin/live"]  # with its last failure
            surfaces["/readyz"] = get(port, "/readyz")
            surfaces["/metrics"] = get(port, "/metrics")
            assert "gateway_llm_tokens_total" in surfaces["/metrics"]
            sent = telegram.sent_messages(CHAT)
            surfaces["telegram replies"] = json.dumps(sent, ensure_ascii=False)
            assert "Provider default" in sent[2]["text"]  # /status answered
            assert gateway.terminate() == 0
            wait_until(lambda: spans, 10, "spans exported")
        finally:
            gateway.stop()
        surfaces["log"] = "".join(gateway.log)
        assert "HTTP 401" in surfaces["log"]
        surfaces["traces"] = "\n".join(text for span in list(spans) for text in span_texts(span))
        assert "Error" in surfaces["traces"]  # the failed model call's span says why
    leaked = {name: found for name, text in surfaces.items() if (found := leaks(text, secrets))}
    assert not leaked, said(leaked, secrets)
    # Shown, with the secrets replaced: the provider's last failure, the answer (whose
    # masks Telegram's markdown may have made bold).
    assert "Incorrect API key provided: [***" in surfaces["/admin/live"]
    assert surfaces["provider table"].count("Incorrect API key provided: [***") == len(secrets)
    assert sent[1]["text"].count("Authorization: Bearer *") == len(secrets)


def test_the_doctor_shows_no_configured_secret(tmp_path: Path) -> None:
    secrets = every_secret(shared=False)
    with (
        FakeOpenAI.in_thread(api_key=LLM_KEY) as llm,
        FakeTelegram.in_thread(token=TELEGRAM_TOKEN) as telegram,
    ):
        # Telegram's Bot API refuses the token check, quoting every secret.
        telegram.fail_next("getMe", 400, description=f"Bad Request: {quoting(secrets)}")
        env = planted_env(tmp_path / "ws", llm, None) | telegram_env(telegram)
        done = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "doctor"],
            env=env | {"PYTHONPATH": str(ROOT)},
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
    output = done.stdout + done.stderr
    assert "telegram credentials were not accepted" in output, output
    assert "Traceback" not in output
    leaked = leaks(output, secrets)
    assert not leaked, said({"gateway doctor": leaked}, secrets)
