"""`gateway chat` on a real pseudo-terminal: the keys a person presses, as in a shell."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.openai_server import FakeOpenAI
from tests.gateway_process import base_env
from tests.terminal import CTRL_C, CTRL_D, Terminal
from tests.test_cli_e2e import run_gateway


@pytest.fixture
def env(tmp_path: Path, fake_openai_thread: FakeOpenAI) -> dict[str, str]:
    return base_env(tmp_path / "ws", fake_openai_thread)


@pytest.fixture
def chat(tmp_path: Path, env: dict[str, str]) -> Iterator[Terminal]:
    terminal = Terminal([sys.executable, "-m", "gateway.cli", "chat"], env, tmp_path)
    try:
        terminal.expect("you> ")
        yield terminal
    finally:
        terminal.close()


def sent_texts(fake: FakeOpenAI) -> list[str]:
    return [str(m.get("content")) for r in fake.chat_requests for m in r.messages]


def test_ctrl_c_at_the_prompt_drops_the_line_and_gives_a_new_prompt(
    chat: Terminal, fake_openai_thread: FakeOpenAI
) -> None:
    chat.type(b"half a thought")
    at = chat.expect("half a thought")
    chat.type(CTRL_C)
    at = chat.expect("you> ", after=at, timeout=5)  # at once, not after Enter
    chat.type(b"second\r")
    chat.expect("bot> echo: second", after=at)
    assert chat.proc.poll() is None
    assert "half a thought" not in "".join(sent_texts(fake_openai_thread))
    assert not any("half a thought" in line for line in chat.screen.splitlines()[-2:])


def test_ctrl_d_on_an_empty_line_leaves_with_0(chat: Terminal) -> None:
    chat.type(CTRL_D)
    assert chat.wait() == 0


def test_ctrl_c_during_a_turn_stops_waiting_and_keeps_the_message(
    tmp_path: Path, chat: Terminal, env: dict[str, str], fake_openai_thread: FakeOpenAI
) -> None:
    fake_openai_thread.add_delay(60, "too late")
    chat.type(b"a slow question\r")
    fake_openai_thread.wait_for_requests(1, timeout=20)
    at = chat.mark()
    chat.type(CTRL_C)
    at = chat.expect("interrupted", after=at, timeout=5)
    at = chat.expect("you> ", after=at, timeout=5)
    assert chat.proc.poll() is None  # the chat goes on
    chat.type(b"and now?\r")
    at = chat.expect("bot> echo: and now?", after=at)
    # What the interrupted turn stored goes to the model with the next question.
    assert fake_openai_thread.last_request.messages[-2:] == [
        {"role": "user", "content": "a slow question"},
        {"role": "user", "content": "and now?"},
    ]
    chat.expect("you> ", after=at)
    chat.type(CTRL_D)
    assert chat.wait() == 0
    shown = run_gateway(["sessions", "show", "cli:direct"], env, tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "[user] a slow question\n[user] and now?\n[assistant] echo: and now?" in shown.stdout


def test_an_unknown_command_is_answered_and_never_sent_to_the_model(
    chat: Terminal, fake_openai_thread: FakeOpenAI
) -> None:
    chat.type(b"/frobnicate now\r")
    at = chat.expect("unknown command /frobnicate")
    chat.expect("/new", after=at)
    assert fake_openai_thread.chat_requests == []


def test_gateway_run_on_a_terminal_chats_and_ctrl_c_stops_it(
    tmp_path: Path, env: dict[str, str]
) -> None:
    run = Terminal(
        [sys.executable, "-m", "gateway.cli", "run"], env | {"GATEWAY_HTTP__PORT": "0"}, tmp_path
    )
    try:
        at = run.expect("you> ")
        run.type(b"hello\r")
        at = run.expect("bot> echo: hello", after=at)
        run.expect("you> ", after=at)
        run.type(CTRL_C)  # as without a chat: the daemon drains and stops
        assert run.wait() == 0
    finally:
        run.close()


@pytest.mark.parametrize("token", [None, "terminal-test-token-0123456789"])
def test_gateway_run_on_a_terminal_says_where_its_http_port_and_admin_page_are(
    tmp_path: Path, env: dict[str, str], token: str | None
) -> None:
    """A person at `gateway run` sees no INFO log: the first line says where to point a
    browser (or that the admin page needs a token), with the port actually bound."""
    extra = {"GATEWAY_HTTP__PORT": "0"} | ({"GATEWAY_HTTP__TOKEN": token} if token else {})
    run = Terminal([sys.executable, "-m", "gateway.cli", "run"], env | extra, tmp_path)
    try:
        at = run.expect("HTTP: http://127.0.0.1:")
        run.expect("you> ", after=at)
        line = next(x for x in run.screen.splitlines() if x.startswith("HTTP: "))
        port = line.split("http://127.0.0.1:", 1)[1].split()[0]
        assert port.isdigit() and port != "0", line
        if token:
            assert line.endswith(f"admin page: http://127.0.0.1:{port}/admin"), line
        else:
            assert line.endswith(
                "admin page: off until GATEWAY_HTTP__TOKEN (or GATEWAY_HTTP__ADMIN_TOKEN) is set"
            ), line
        run.type(CTRL_D)
        assert run.wait() == 0
    finally:
        run.close()


def test_after_ctrl_c_the_terminal_says_the_model_is_still_busy_with_it(
    tmp_path: Path,
) -> None:
    """llama-cpp-python's server finishes an answer whose client went away before the
    next (one at a time): the next question waits, and the terminal says why, once."""
    from gateway.agent.loop import MODEL_BUSY_TEXT
    from tests.fakes.openai_server import Reply

    with FakeOpenAI.in_thread(one_at_a_time=True) as llm:
        llm.add(Reply(text="too late", delay=6.0))
        chat = Terminal(
            [sys.executable, "-m", "gateway.cli", "chat"], base_env(tmp_path / "ws", llm), tmp_path
        )
        try:
            at = chat.expect("you> ")
            chat.type(b"a slow question\r")
            llm.wait_for_requests(1, timeout=20)
            chat.type(CTRL_C)
            at = chat.expect("you> ", after=chat.expect("interrupted", after=at, timeout=5))
            chat.type(b"and now?\r")
            at = chat.expect("... " + MODEL_BUSY_TEXT, after=at, timeout=10)
            at = chat.expect("bot> echo: and now?", after=at, timeout=20)
            assert chat.screen.count(MODEL_BUSY_TEXT) == 1
            chat.expect("you> ", after=at)
            chat.type(CTRL_D)
            assert chat.wait() == 0
        finally:
            chat.close()
