"""Benchmark of the email channel against a private Dovecot (tests/dovecot_server.py):
how fast mail is read, and how long a new mail waits before the channel takes it.

    .venv/bin/python bench/email_channel.py                  # a table
    .venv/bin/python bench/email_channel.py --mails 500 --json

Rows:
- `translate` of a short plain mail, of an HTML mail with a Gmail quote, and of a mail
  with a 5 MB attachment (parse, new text, files): per mail, in-process.
- `backlog`: `--mails` mails wait in the folder; the channel reads them all (fetch in
  batches, translate, submit to a recorder that stands in for the journal, flag each
  `\\Seen`, move the mark): mails per second, from start to the last one flagged.
- `IDLE latency`: a mail is appended while the channel idles; the time until it is
  submitted (median and 95th percentile of `--idle-rounds`). Dovecot announces new mail
  in IDLE after about half a second of its own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from email.message import EmailMessage
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout, without installing

from channels.email import EmailChannel, Pacing, translate_mail  # noqa: E402
from channels.email.settings import EmailSettings  # noqa: E402
from gateway.journal.cursors import CURSOR_FILE, FileCursorStore, run_with  # noqa: E402
from gateway.messages import InboundMessage, OutboundMessage  # noqa: E402
from tests.dovecot_server import running_dovecot  # noqa: E402

BOT, ALICE = "bot@example.org", "alice@example.org"
USERS = {BOT: "bot-pw", ALICE: "alice-pw"}


def mail(n: int, *, html: bool = False, attachment: int = 0) -> bytes:
    msg = EmailMessage()
    msg["From"] = ALICE
    msg["To"] = BOT
    msg["Subject"] = f"question {n}"
    msg["Message-ID"] = f"<b{n}.{time.time_ns()}@example.org>"
    body = f"Hello, this is question {n}.\n\nOn Mon, Bot wrote:\n> earlier\n"
    msg.set_content(body)
    if html:
        msg.add_alternative(
            f"<div>Hello, this is question {n}.</div><div class='gmail_quote'>"
            "<blockquote>earlier</blockquote></div>",
            subtype="html",
        )
    if attachment:
        msg.add_attachment(
            b"\0" * attachment, maintype="application", subtype="pdf", filename="a.pdf"
        )
    return msg.as_bytes()


def time_translate(raw: bytes, settings: EmailSettings, rounds: int) -> float:
    started = time.perf_counter()
    for _ in range(rounds):
        translate_mail(raw, uidvalidity=1, uid=1, settings=settings)
    return (time.perf_counter() - started) / rounds


class Ticket:
    taken = True

    async def reply(self) -> OutboundMessage | None:
        return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    base = EmailSettings.model_validate(
        {"address": BOT, "imap_host": "x", "smtp_host": "x", "allow_from": ["*"]}
    )
    for name, raw, rounds in (
        ("translate: short plain mail", mail(1), 2000),
        ("translate: HTML mail with a quote", mail(2, html=True), 1000),
        ("translate: 5 MB attachment", mail(3, attachment=5 * 2**20), 10),
    ):
        results[name] = time_translate(raw, base, rounds) * 1000
    with running_dovecot(USERS) as dovecot, tempfile.TemporaryDirectory() as tmp:
        settings = EmailSettings.model_validate(
            {
                "address": BOT,
                "imap_host": dovecot.host,
                "imap_port": dovecot.imaps_port,
                "tls_ca_file": str(dovecot.ca_file),
                "smtp_host": "unused",
                "password": USERS[BOT],
                "allow_from": ["*"],
            }
        )
        for n in range(args.mails):
            dovecot.append(BOT, mail(n))
        submitted: list[tuple[float, InboundMessage]] = []

        async def submit(message: InboundMessage) -> Ticket:
            submitted.append((time.perf_counter(), message))
            return Ticket()

        async def measure() -> None:
            lead = run_with(FileCursorStore(Path(tmp) / CURSOR_FILE))
            channel = EmailChannel(settings, lead=lead, pacing=Pacing(idle_check=0.05))
            async with anyio.create_task_group() as tg:
                started = time.perf_counter()
                await tg.start(channel.run, submit)
                while channel.taken < args.mails:  # noqa: ASYNC110 (a benchmark's poll)
                    await anyio.sleep(0.01)
                results["backlog: mails per second"] = args.mails / (time.perf_counter() - started)
                waits = []
                for n in range(args.idle_rounds):
                    await anyio.sleep(0.3)  # idling
                    before = len(submitted)
                    appended = time.perf_counter()
                    await anyio.to_thread.run_sync(dovecot.append, BOT, mail(10_000 + n))
                    while len(submitted) == before:  # noqa: ASYNC110 (a benchmark's poll)
                        await anyio.sleep(0.005)
                    waits.append(submitted[-1][0] - appended)
                waits.sort()
                results["IDLE latency: median ms"] = statistics.median(waits) * 1000
                results["IDLE latency: p95 ms"] = waits[int(len(waits) * 0.95) - 1] * 1000
                tg.cancel_scope.cancel()

        anyio.run(measure)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mails", type=int, default=300)
    parser.add_argument("--idle-rounds", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = run(args)
    if args.json:
        print(json.dumps(results, indent=1))
        return
    width = max(len(name) for name in results)
    print(f"{'measure'.ljust(width)}  value")
    for name, value in results.items():
        unit = "" if "ms" in name or "second" in name else " ms per mail"
        print(f"{name.ljust(width)}  {value:,.2f}{unit}")


if __name__ == "__main__":
    main()
