"""Media through a real `gateway run` process: Telegram (long polling) and Slack (Socket
Mode) against the fakes, the fake OpenAI server as model and transcription service.
Run with `-s` to see the exchange printed as a transcript."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.slack_server import FakeSlack
from tests.fakes.telegram_server import FakeTelegram
from tests.gateway_process import GatewayProcess, base_env, telegram_env, wait_until
from tests.media_files import docx_bomb, pdf, png, speech

CHAT = 4242
GROUP = -1001234567890
WAIT = 60  # seconds: generous, the machine may be busy


def show(who: str, text: str) -> None:
    for number, line in enumerate(text.splitlines() or [""]):
        print(f"{who if number == 0 else ' ' * len(who)} {line}")


def test_telegram_media_in_and_files_out_through_gateway_run(tmp_path: Path) -> None:
    with FakeOpenAI.in_thread() as llm, FakeTelegram.in_thread() as telegram:
        env = telegram_env(tmp_path / "ws", llm, telegram) | {
            "GATEWAY_CHANNELS__TELEGRAM__GROUP_POLICY": "open",
            "GATEWAY_AGENT__TOOLS": '["send_file"]',
        }
        gateway = GatewayProcess(env, tmp_path)
        try:
            gateway.wait_ready()
            gateway.wait_logged("telegram: @gateway_bot is live")
            steps: list[tuple[str, dict[str, Any]]] = [
                ("photo 640x480 + 'what colour is this?'", {"photo": png(640, 480)}),
                ("voice note", {"voice": speech("what's on my calendar tomorrow")}),
                ("q3.pdf", {"document": ("q3.pdf", "application/pdf", pdf("Revenue up 12%"))}),
                ("broken.pdf", {"document": ("broken.pdf", "application/pdf", b"%PDF-1.4 x")}),
                ("huge.png, 50 MB", {"document": ("huge.png", "image/png", bytes(50 * 2**20))}),
                ("bomb.docx", {"document": ("bomb.docx", "", docx_bomb(200))}),
            ]
            for number, (label, media) in enumerate(steps, start=1):
                text = "what colour is this?" if "photo" in media else ""
                telegram.push_update(telegram.user_message(CHAT, text, **media))
                wait_until(lambda n=number: len(telegram.sent_messages(CHAT)) >= n, WAIT, label)
                show("user>", f"[{label}]")
                show("bot> ", telegram.sent_messages(CHAT)[-1]["text"])
            llm.add_tool_call(
                "send_file", {"name": "todo.csv", "content": "task,due\nmilk,today\n"}
            )
            llm.add_reply("Here is your list.")
            telegram.push_update(telegram.user_message(CHAT, "send my todo list as a file"))
            wait_until(lambda: telegram.sent_files(CHAT), WAIT, "the file")
            show("user>", "send my todo list as a file")
            show("bot> ", telegram.sent_messages(CHAT)[-1]["text"])
            [(document, data)] = telegram.sent_files(CHAT)
            show("bot> ", f"[sendDocument {document['document']['file_name']}: {data!r}]")
            telegram.push_update(
                telegram.user_message(GROUP, "@gateway_bot who am I?", chat_type="supergroup")
            )
            wait_until(lambda: telegram.sent_messages(GROUP), WAIT, "the group reply")
            show("alice@group>", "@gateway_bot who am I?")
            show("bot>        ", telegram.sent_messages(GROUP)[-1]["text"])
        finally:
            assert gateway.terminate() == 0
    for line in gateway.log:  # the operator's side of the bad inputs
        if "not used" in line or "tool call" in line:
            print(line.rstrip())
    replies = [m["text"] for m in telegram.sent_messages(CHAT)]
    assert replies[0] == (
        "echo: what colour is this?\n\n[image: photo.jpg, 640x480] [image 640x480 png]"
    )
    assert replies[1] == "echo: what's on my calendar tomorrow"
    assert replies[2] == "echo: [document: q3.pdf]\nRevenue up 12%\n[end of q3.pdf]"
    assert replies[3].startswith("I could not use broken.pdf: the PDF is damaged")
    assert replies[4] == "I could not use huge.png: it is 50.0 MB; the limit is 20.0 MB."
    assert replies[5] == (
        "I could not use bomb.docx: it expands to more than 50 MB when unpacked, so I did not "
        "read it."
    )
    assert replies[6] == "Here is your list." and data == b"task,due\nmilk,today\n"
    assert telegram.sent_messages(GROUP)[-1]["text"] == 'echo: [from "Alice (@alice)"]\nwho am I?'
    log = "".join(gateway.log)
    assert "Traceback" not in log and telegram.token not in log


def test_slack_files_through_gateway_run(tmp_path: Path) -> None:
    with FakeOpenAI.in_thread() as llm, FakeSlack.in_thread() as slack:
        env = base_env(tmp_path / "ws", llm) | {
            "GATEWAY_HTTP__PORT": "0",
            "GATEWAY_CHANNELS__SLACK__ENABLED": "true",
            "GATEWAY_CHANNELS__SLACK__BOT_TOKEN": slack.bot_token,
            "GATEWAY_CHANNELS__SLACK__APP_TOKEN": slack.app_token,
            "GATEWAY_CHANNELS__SLACK__BASE_URL": slack.api_url,
            "GATEWAY_CHANNELS__SLACK__DM_POLICY": "open",
            "GATEWAY_CHANNELS__SLACK__GROUP_POLICY": "open",
            "GATEWAY_MEDIA__CODE_BLOCK_FILE_CHARS": "200",
        }
        gateway = GatewayProcess(env, tmp_path)
        try:
            gateway.wait_ready()
            gateway.wait_logged("connected over Socket Mode")
            shot = slack.add_file(png(300, 200), "shot.png", "image/png")
            slack.socket_event_soon(slack.dm_message("U0ALICE001", "what is this?", files=[shot]))
            wait_until(lambda: slack.posted_messages(), WAIT, "the answer to the image")
            show("alice> ", "what is this? [shot.png]")
            show("bot>   ", slack.posted_messages()[-1]["text"])
            code = "\n".join(f"echo step {i}" for i in range(40))
            llm.add_reply(f"Run this:\n```bash\n{code}\n```")
            slack.socket_event_soon(slack.app_mention("C0GENERAL01", "U0BOB00001", "a script?"))
            wait_until(lambda: slack.uploaded_files(), WAIT, "the uploaded script")
            show("bob>   ", "@gateway a script?")
            show("bot>   ", slack.posted_messages()[-1]["text"])
            [upload] = slack.uploaded_files()
            show("bot>   ", f"[file upload {upload['filename']}, {len(upload['data'])} bytes]")
        finally:
            assert gateway.terminate() == 0
    assert slack.posted_messages()[0]["text"] == (
        "echo: what is this?\n\n[image: shot.png, 300x200] [image 300x200 png]"
    )
    assert upload["filename"] == "snippet-1.sh" and upload["data"] == (code + "\n").encode()
    assert "Traceback" not in "".join(gateway.log)
