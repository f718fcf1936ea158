"""Kill tests of the delivery promise: "A message a platform handed us is answered
exactly once, or, when the process dies at the worst moment, its reply is sent at most
one extra time; it is never lost" (the architecture notes, "Delivery"), and never stored
twice.

The real `gateway run` runs as a subprocess against the fake Telegram Bot API or the
fake Slack (both keep the platforms' delivery contracts: Telegram keeps an update until
a later getUpdates offset confirms it; Slack retries an event until a 2xx comes within
3 s) and the fake OpenAI, whose answer echoes the user's text. It is SIGKILLed at
chosen or random instants and restarted, then left to finish and stopped with SIGTERM.

Every message has a unique text (``u017 m0042``: user 17, message 42) and everything is
counted from the outside: user and assistant entries in the session files of the
workspace, and the replies the fake platform received. Per message:

- lost: handed over (Telegram: pushed; Slack: acknowledged), yet no user entry and no
  reply;
- stored twice: two or more user entries;
- answered twice: replies beyond the first. The promise allows one extra reply per
  message per kill: a reply on its way at the kill, not yet marked sent, is sent again
  (Telegram cannot be asked whether it arrived). Each conversation has at most one
  turn's reply on its way at a time, so a kill repeats at most one reply per user, and
  at most `CAP` (the gateway's `dispatch.max_concurrent_turns`, default 8) in all;
- unanswered: stored, but never answered;
- turns twice: two or more assistant entries (a replay must not run the turn again);
- order: per user, the order of first replies is the order the gateway got them in.

Each scenario prints one summary line (``KILL-DELIVERY <scenario>: ...``) past pytest's
capture, so CI logs show the counts, with the seed: ``KILL_SEED=<seed>`` repeats a run's
random choices, ``KILL_SCALE=0.3`` runs every scenario at 30 % of its size (default 1).
On failure the message names a folder with every gateway process's log and the fake
platform's record (getUpdates calls, or every delivery attempt of every Slack event).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import random
import re
import signal
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gateway.sessions.keys import key_from_filename
from tests.fakes._serving import free_port
from tests.fakes.openai_server import FakeOpenAI, FakeToolCall, Reply, echo_responder
from tests.fakes.slack_server import EventDelivery, FakeSlack
from tests.fakes.telegram_server import FakeTelegram
from tests.gateway_process import GatewayProcess, base_env, telegram_env, wait_until

pytestmark = pytest.mark.kill

TOKEN = re.compile(r"\bu\d{3} m\d{4}\b")
SEED = int(os.environ.get("KILL_SEED") or random.SystemRandom().randrange(1_000_000))
SCALE = float(os.environ.get("KILL_SCALE") or 1.0)
#: Slack's retry schedule (nearly immediately, 1 min, 5 min) compressed, still long
#: enough for the retries to span a restart of the gateway.
SLACK_RETRIES = (0.5, 2.0, 5.0)
#: The longest a delivery can take: four attempts of 3 s, and the waits between them.
SLACK_DELIVERY_MAX = 4 * 3.0 + sum(SLACK_RETRIES)
CAP = 8  # dispatch.max_concurrent_turns, the gateway's default: turns (and replies) in flight
QUIET = 3.0  # nothing sent for this long, and nothing pending: the gateway is done


def scaled(n: int) -> int:
    return max(1, round(n * SCALE))


# -- the messages ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Message:
    user: int  # 0-based user number
    number: int  # 0-based, in send order over all users

    @property
    def text(self) -> str:
        return f"u{self.user:03d} m{self.number:04d}"


def plan_messages(count: int, users: int, rng: random.Random) -> list[Message]:
    """`count` messages spread evenly over `users` users, in a random interleaving."""
    senders = [i % users for i in range(count)]
    rng.shuffle(senders)
    return [Message(user, n) for n, user in enumerate(senders)]


def slow_echo(rng: random.Random, low: float = 0.02, high: float = 0.1) -> Callable[..., Reply]:
    """The fake model's echo, after a random latency: turns overlap, so a kill finds
    some of them in flight (user entry written, reply not yet sent)."""

    def respond(body: dict[str, Any]) -> Reply:
        answer = echo_responder(body)
        text = answer if isinstance(answer, str) else answer.text
        return Reply(text=text, delay=rng.uniform(low, high))

    return respond


def tool_then_echo(rng: random.Random) -> Callable[..., Reply]:
    """A model that works in two steps, for the steer mode: a turn's first call asks for
    the `current_time` tool (so messages that arrive meanwhile can join the turn), and
    the call after the tool's result answers ``echo: `` and every message token the
    turn's user messages hold, in order (the turn's own and those that joined it)."""

    def respond(body: dict[str, Any]) -> Reply:
        turn: list[dict[str, Any]] = []
        for message in body.get("messages") or ():
            if message.get("role") == "assistant" and not message.get("tool_calls"):
                turn = []  # a final answer: an earlier turn ended here
            elif message.get("role") != "system":
                turn.append(message)
        if not any(m.get("role") == "tool" for m in turn):
            call = FakeToolCall("current_time", {})
            return Reply(tool_calls=(call,), delay=rng.uniform(0.05, 0.2))
        said = [str(m.get("content") or "") for m in turn if m.get("role") == "user"]
        tokens = [t for text in said for t in TOKEN.findall(text)]
        return Reply(text="echo: " + " ".join(tokens), delay=rng.uniform(0.02, 0.1))

    return respond


#: The model of each queue mode a scenario runs in: the steer mode needs turns that
#: take more than one model call, or nothing could join them.
MODELS: dict[str, Callable[[random.Random], Callable[..., Reply]]] = {
    "followup": slow_echo,
    "steer": tool_then_echo,
}


# -- counting from the outside ---------------------------------------------------------


def session_entries(sessions_dir: Path) -> tuple[Counter[str], Counter[str]]:
    """(user, assistant) message entries per message text, over the current session file
    of every key (``<sessions>/<encoded key>.jsonl``; see `gateway.sessions.keys`); the
    user entries of messages that joined a running turn (the steer mode) under the key
    ``STEERED`` too."""
    user: Counter[str] = Counter()
    assistant: Counter[str] = Counter()
    for path in sorted(sessions_dir.glob("*.jsonl")):
        if key_from_filename(path.name) is None:
            continue
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a torn last line: the kill hit mid-write
            if not isinstance(entry, dict) or entry.get("type") != "message":
                continue
            message = entry.get("message") or {}
            content = message.get("content")
            text = content if isinstance(content, str) else json.dumps(content)
            counter = {"user": user, "assistant": assistant}.get(message.get("role"))
            if counter is not None:
                counter.update(TOKEN.findall(text))
            if message.get("role") == "user" and (entry.get("meta") or {}).get("steered"):
                user[STEERED] += 1
    return user, assistant


STEERED = "steered"


def echoed(texts: Iterable[str]) -> tuple[list[tuple[str, ...]], list[str]]:
    """(the messages each reply answers, in reply order with repeats; every other
    reply). A reply answers one message, or in the steer mode several (the turn's own
    and those that joined it)."""
    answered, other = [], []
    for text in texts:
        found = TOKEN.findall(text) if text.startswith("echo: ") else []
        if found and " ".join(found) == text.removeprefix("echo: "):
            answered.append(tuple(found))
        else:
            other.append(text)
    return answered, other


def answered_texts(replies: Iterable[tuple[str, ...]]) -> list[str]:
    """The message texts `echoed` replies answer, in reply order, with repeats."""
    return [text for reply in replies for text in reply]


@dataclass(frozen=True)
class Tally:
    """What one scenario did, counted from the outside."""

    scenario: str
    sent: Sequence[Message]
    user_entries: Counter[str]
    assistant_entries: Counter[str]
    #: The messages each reply answered, in the order the replies went out: one each,
    #: or in the steer mode a turn's own and those that joined it.
    reply_order: Sequence[tuple[str, ...]]
    other_replies: Sequence[str]
    kills: int
    seconds: float
    exit_code: int | None
    #: Slack: the events never acknowledged, Slack's to retry (None: not applicable).
    not_acked: frozenset[str] | None = None
    #: Slack: per message, the earliest time it can have reached the gateway (its first
    #: attempt that connected) and the time it was acknowledged. A kill between the
    #: journal and the 200 makes Slack retry a message the gateway already has, so the
    #: ack order is not the order the gateway took messages in; only "B was acked
    #: before A could have arrived" proves that B came first.
    arrival: Mapping[str, tuple[float, float]] | None = None
    logs: Path | None = None  # where the gateways' logs and the platform's log were put
    replies: Counter[str] = field(init=False)  # replies per message text

    def __post_init__(self) -> None:
        object.__setattr__(self, "replies", Counter(answered_texts(self.reply_order)))

    @property
    def steered(self) -> int:
        """Messages that joined a running turn (user entries marked `steered`)."""
        return self.user_entries[STEERED]

    @property
    def handed_over(self) -> list[Message]:
        return [m for m in self.sent if m.text not in (self.not_acked or ())]

    @property
    def lost(self) -> list[str]:
        return [
            m.text
            for m in self.handed_over
            if not self.user_entries[m.text] and not self.replies[m.text]
        ]

    @property
    def stored_twice(self) -> list[str]:
        return [m.text for m in self.sent if self.user_entries[m.text] >= 2]

    @property
    def turns_twice(self) -> list[str]:
        """Messages whose turn ran again (two or more assistant entries)."""
        return [m.text for m in self.sent if self.assistant_entries[m.text] >= 2]

    @property
    def answered_twice(self) -> int:
        """Replies sent again, over all messages (a reply that answers several messages,
        sent twice, is one repeat)."""
        return sum(n - 1 for n in Counter(self.reply_order).values())

    @property
    def most_repeats_of_one_user(self) -> int:
        """The largest number of repeated replies any one user got."""
        user_of = {m.text: m.user for m in self.sent}
        per_user: Counter[int] = Counter()
        for reply, n in Counter(self.reply_order).items():
            per_user[user_of[reply[0]]] += n - 1
        return max(per_user.values(), default=0)

    @property
    def unanswered(self) -> list[str]:
        return [
            m.text
            for m in self.handed_over
            if self.user_entries[m.text] and not self.replies[m.text]
        ]

    @property
    def out_of_order(self) -> dict[int, tuple[list[str], list[str]]]:
        """Users whose first replies came in another order than they sent: (sent order
        of the answered ones, reply order)."""
        first_replies: dict[str, int] = {}
        for position, text in enumerate(answered_texts(self.reply_order)):
            first_replies.setdefault(text, position)
        wrong = {}
        for user in sorted({m.user for m in self.sent}):
            sent = [m.text for m in self.handed_over if m.user == user and m.text in first_replies]
            replied = sorted(sent, key=first_replies.__getitem__)
            if self.arrival is not None:
                bounds = self.arrival
                # replied[i] answered before replied[j]: wrong only if replied[j] was
                # acknowledged before replied[i] could have reached the gateway.
                if any(
                    bounds[later][1] < bounds[earlier][0]
                    for i, earlier in enumerate(replied)
                    for later in replied[i + 1 :]
                ):
                    wrong[user] = (sent, replied)
            elif sent != replied:
                wrong[user] = (sent, replied)
        return wrong

    def summary(self) -> str:
        fields = {
            "sent": len(self.sent),
            "lost": len(self.lost),
            "stored_twice": len(self.stored_twice),
            "answered_twice": self.answered_twice,
            "most_repeats_one_user": self.most_repeats_of_one_user,
            "kills": self.kills,
            "unanswered": len(self.unanswered),
            "turns_twice": len(self.turns_twice),
            "out_of_order_users": len(self.out_of_order),
            "other_replies": len(self.other_replies),
            "steered": self.steered,
        }
        if self.not_acked is not None:
            fields["not_acked"] = len(self.not_acked)
        counts = " ".join(f"{name}={value}" for name, value in fields.items())
        return (
            f"KILL-DELIVERY {self.scenario}: {counts} exit={self.exit_code} "
            f"seconds={self.seconds:.1f} seed={SEED}"
        )

    def check_promise(self) -> None:
        """The delivery promise, every part at once (so one failure shows them all)."""
        problems = []
        if self.lost:
            problems.append(f"{len(self.lost)} lost, e.g. {self.lost[:5]}")
        if self.stored_twice:
            problems.append(f"{len(self.stored_twice)} stored twice, e.g. {self.stored_twice[:5]}")
        if self.most_repeats_of_one_user > self.kills:
            problems.append(
                f"a user got {self.most_repeats_of_one_user} repeated replies in {self.kills} "
                "kills (at most one per kill: one reply per conversation is on its way)"
            )
        if self.answered_twice > self.kills * CAP:
            problems.append(
                f"{self.answered_twice} repeated replies for {self.kills} kills "
                f"(at most {CAP} per kill: the replies on their way)"
            )
        if self.unanswered:
            problems.append(f"{len(self.unanswered)} never answered, e.g. {self.unanswered[:5]}")
        if self.turns_twice:
            problems.append(f"{len(self.turns_twice)} turns ran twice, e.g. {self.turns_twice[:5]}")
        if self.out_of_order:
            user, (sent, replied) = next(iter(self.out_of_order.items()))
            problems.append(
                f"{len(self.out_of_order)} users answered out of order, e.g. user {user}: "
                f"sent {sent}, answered {replied}"
            )
        if self.exit_code != 0:
            problems.append(f"the last gateway exited with {self.exit_code} after SIGTERM")
        if problems and self.logs is not None:
            problems.append(f"logs of every gateway process and of the platform: {self.logs}")
        assert not problems, f"{self.summary()}\n" + "\n".join(problems)


@pytest.fixture
def report(
    request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> Callable[[Tally], None]:
    """Print a scenario's summary line to the terminal, past pytest's capture, and again
    at the end of the run (also from a pytest-xdist worker)."""
    from gateway.testing.plugin import summary_line

    def show(tally: Tally) -> None:
        summary_line(request.node, tally.summary(), capsys)

    return show


# -- running the gateway ---------------------------------------------------------------


def slack_env(workspace: Path, llm: FakeOpenAI, slack: FakeSlack, port: int) -> dict[str, str]:
    return base_env(workspace, llm) | {
        "GATEWAY_HTTP__PORT": str(port),  # fixed: Slack retries to the same URL
        "GATEWAY_CHANNELS__SLACK__ENABLED": "true",
        "GATEWAY_CHANNELS__SLACK__MODE": "http",
        "GATEWAY_CHANNELS__SLACK__BOT_TOKEN": slack.bot_token,
        "GATEWAY_CHANNELS__SLACK__SIGNING_SECRET": slack.signing_secret,
        "GATEWAY_CHANNELS__SLACK__BASE_URL": slack.api_url,
        "GATEWAY_CHANNELS__SLACK__DM_POLICY": "open",
    }


class Gateways:
    """The gateway process of a scenario: started, killed and restarted, and always
    cleaned up."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        self.env = env
        self.cwd = cwd
        self.current: GatewayProcess | None = None
        self.processes: list[GatewayProcess] = []
        self.kills = 0
        self.exit_code: int | None = None
        self.ready_at = 0.0  # time.monotonic() when the current process became ready

    def launch(self) -> GatewayProcess:
        """Start a gateway process, without waiting for it."""
        self.current = GatewayProcess(self.env, self.cwd)
        self.processes.append(self.current)
        return self.current

    def start(self) -> GatewayProcess:
        """Start a gateway process and wait until /readyz answers 200."""
        process = self.launch()
        process.wait_readyz(process.wait_ready())
        self.ready_at = time.monotonic()
        return process

    def sleep_until_due(self, instant: float, min_up: float) -> None:
        """Wait for a planned kill at `instant` (time.monotonic()), and until the current
        process has served for `min_up` seconds."""
        sleep_until(max(instant, self.ready_at + min_up))

    def kill(self) -> None:
        assert self.current is not None
        self.current.kill()
        self.kills += 1

    def terminate(self) -> None:
        assert self.current is not None
        self.exit_code = self.current.terminate()

    def stop(self) -> None:
        if self.current is not None:
            self.current.stop()

    def save_logs(self, directory: Path, platform: Iterable[str]) -> Path:
        """Write each process's log (``gateway-<n>.log``, in start order) and the fake
        platform's record (`platform`, one line each) into `directory`."""
        directory.mkdir(parents=True, exist_ok=True)
        for n, process in enumerate(self.processes):
            (directory / f"gateway-{n}.log").write_text("".join(process.log))
        (directory / "platform.log").write_text("".join(f"{line}\n" for line in platform))
        return directory


@pytest.fixture
def gateways(tmp_path: Path) -> Iterator[Callable[[dict[str, str]], Gateways]]:
    made: list[Gateways] = []

    def make(env: dict[str, str]) -> Gateways:
        made.append(Gateways(env, tmp_path))
        return made[-1]

    try:
        yield make
    finally:
        for each in made:
            each.stop()


@contextlib.contextmanager
def pushing(
    messages: Sequence[Message], rate: float, send: Callable[[Message], None]
) -> Iterator[float]:
    """Send `messages` at `rate` per second from a thread of its own during the `with`
    block, which gets the seconds that takes; leaving the block waits for the last
    message (or stops the sending when the block raised)."""
    stop = threading.Event()
    failures: list[BaseException] = []

    def run() -> None:
        began = time.monotonic()
        try:
            for i, message in enumerate(messages):
                if stop.wait(max(0.0, began + i / rate - time.monotonic())):
                    return
                send(message)
        except BaseException as exc:
            failures.append(exc)

    seconds = len(messages) / rate
    thread = threading.Thread(target=run, name="pusher", daemon=True)
    thread.start()
    try:
        yield seconds
    except BaseException:
        stop.set()
        raise
    finally:
        thread.join(seconds + 30)
    if failures:
        raise failures[0]


def sleep_until(instant: float) -> None:
    """Wait for a scheduled instant (time.monotonic())."""
    time.sleep(max(0.0, instant - time.monotonic()))


def kill_schedule(kills: int, seconds: float, rng: random.Random) -> list[float]:
    """`kills` random offsets in (0, seconds): one in each of `kills` equal slots, so
    that a restart has time to finish before the next kill."""
    slot = seconds / kills
    return [i * slot + rng.uniform(0.2, 0.9) * slot for i in range(kills)]


def settle(progress: Callable[[], tuple[bool, int, bool]], timeout: float = 120) -> None:
    """Wait until `progress()` says everything is answered, or until nothing was sent for
    `QUIET` seconds while nothing is pending at the platform. `progress()` gives (all
    answered, number of messages sent by the bot, something still pending)."""
    last_sent, last_change = -1, time.monotonic()

    def done() -> bool:
        nonlocal last_sent, last_change
        complete, sent, pending = progress()
        if complete:
            return True
        if sent != last_sent or pending:
            last_sent, last_change = sent, time.monotonic()
            return False
        return time.monotonic() - last_change >= QUIET

    wait_until(done, timeout, "the gateway to finish answering")


# -- Telegram ----------------------------------------------------------------------------

TELEGRAM_TOKEN = "777:KILL-delivery-test"
FIRST_CHAT = 7000  # user n writes in private chat FIRST_CHAT + n


def push_telegram(telegram: FakeTelegram, message: Message) -> None:
    chat = FIRST_CHAT + message.user
    telegram.push_update(telegram.user_message(chat, message.text, user_id=chat))


def journaled_in(workspace: Path) -> Callable[[], bool]:
    """Whether the file mode's journal (`dedupe.sqlite`) holds messages taken in and not
    answered yet: the gateway still owes them, however quiet it is (a restart, a replay
    waiting for its turn), so `settle` must not stop waiting."""

    def check() -> bool:
        path = workspace / "dedupe.sqlite"
        if not path.exists():
            return False
        try:
            with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
                return bool(db.execute("SELECT count(*) FROM inbox").fetchone()[0])
        except sqlite3.Error:
            return True  # being written: ask again

    return check


def telegram_progress(
    telegram: FakeTelegram, sent: Sequence[Message], journaled: Callable[[], bool] | None = None
) -> Callable[[], tuple[bool, int, bool]]:
    """For `settle`: everything answered; replies so far; and whether work is still
    pending at Telegram (updates not confirmed) or, with `journaled`, in the journal."""
    wanted = {m.text for m in sent}

    def progress() -> tuple[bool, int, bool]:
        texts = [m.get("text", "") for m in telegram.sent_messages()]
        answered, _ = echoed(texts)
        if wanted <= set(answered_texts(answered)):
            return True, len(texts), False
        owed = bool(telegram.pending_updates) or (journaled is not None and journaled())
        return False, len(texts), owed

    return progress


def telegram_tally(
    scenario: str,
    telegram: FakeTelegram,
    sent: Sequence[Message],
    workspace: Path,
    gateways: Gateways,
    started: float,
) -> Tally:
    user, assistant = session_entries(workspace / "sessions")
    answered, other = echoed(m.get("text", "") for m in telegram.sent_messages())
    polls = (
        f"getUpdates at {p.received_at:.3f} offset={p.offset} confirmed={len(p.confirmed)} "
        f"returned={list(p.update_ids)} {p.outcome}"
        for p in telegram.polls
    )
    return Tally(
        scenario=scenario,
        logs=gateways.save_logs(workspace.parent / "logs", polls),
        sent=sent,
        user_entries=user,
        assistant_entries=assistant,
        reply_order=answered,
        other_replies=other,
        kills=gateways.kills,
        seconds=time.monotonic() - started,
        exit_code=gateways.exit_code,
    )


def queue_env(mode: str) -> dict[str, str]:
    """The gateway's environment for a queue mode (`[dispatch] mode`)."""
    return {"GATEWAY_DISPATCH__MODE": mode}


def scenario(name: str, mode: str) -> str:
    return name if mode == "followup" else f"{name}-{mode}"


def check_steered(tally: Tally, mode: str) -> None:
    """In the steer mode, messages did join running turns (else the run proved nothing
    about them)."""
    if mode == "steer":
        assert tally.steered > 0, f"{tally.summary()}\nno message joined a running turn"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["followup", "steer"])
def test_telegram_backlog_survives_kills_right_after_start(
    tmp_path: Path,
    gateways: Callable[[dict[str, str]], Gateways],
    report: Callable[[Tally], None],
    mode: str,
) -> None:
    """300 updates from 30 users wait at Telegram; the gateway is SIGKILLed 0-300 ms
    after /readyz answers, three times, while it works through the backlog (its poller
    has fetched batches of up to 100 and is handling them), then left to finish. In the
    steer mode each turn calls a tool first, and a user's messages waiting behind it
    join it."""
    rng = random.Random(SEED)
    workspace = tmp_path / "ws"
    sent = plan_messages(scaled(300), scaled(30), rng)
    with (
        FakeOpenAI.in_thread(responder=MODELS[mode](random.Random(SEED + 1))) as llm,
        FakeTelegram.in_thread(token=TELEGRAM_TOKEN) as telegram,
    ):
        for message in sent:
            push_telegram(telegram, message)
        run = gateways(telegram_env(workspace, llm, telegram) | queue_env(mode))
        started = time.monotonic()
        for _ in range(3):
            run.start()
            time.sleep(rng.uniform(0.0, 0.3))
            run.kill()
        run.start()
        with contextlib.suppress(AssertionError):  # what is missing is counted below
            settle(telegram_progress(telegram, sent, journaled_in(workspace)))
        run.terminate()
        name = scenario("telegram-backlog", mode)
        tally = telegram_tally(name, telegram, sent, workspace, run, started)
    report(tally)
    tally.check_promise()
    check_steered(tally, mode)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("mode", ["followup", "steer"])
def test_telegram_traffic_survives_kills_while_it_flows(
    tmp_path: Path,
    gateways: Callable[[dict[str, str]], Gateways],
    report: Callable[[Tally], None],
    mode: str,
) -> None:
    """1,000 messages from 100 users arrive at about 25 a second while the gateway is
    SIGKILLed five times, each time the instant its poller confirms updates to Telegram
    (the getUpdates whose offset passes them has arrived): from then on the updates are
    the gateway's alone to keep. Kills 1, 3 and 5 come at random times in steady
    traffic; kills 2 and 4 hit the gateway restarted after kills 1 and 3 as it confirms
    the backlog that piled up while it was down (a crash loop). After each kill the
    gateway is restarted at once. In the steer mode each turn calls a tool first, and
    what its user sends meanwhile joins it."""
    rng = random.Random(SEED)
    workspace = tmp_path / "ws"
    count, rate, kills = scaled(1000), 25.0, 5
    sent = plan_messages(count, scaled(100), rng)
    with (
        FakeOpenAI.in_thread(responder=MODELS[mode](random.Random(SEED + 1))) as llm,
        FakeTelegram.in_thread(token=TELEGRAM_TOKEN) as telegram,
    ):
        run = gateways(telegram_env(workspace, llm, telegram) | queue_env(mode))
        run.start()
        started = time.monotonic()
        with pushing(sent, rate, lambda m: push_telegram(telegram, m)) as seconds:
            for offset in kill_schedule((kills + 1) // 2, seconds, rng):
                run.sleep_until_due(started + offset, min_up=1.0)
                kill_at_next_confirmation(telegram, run, timeout=2)
                if run.kills < kills:
                    kill_at_next_confirmation(telegram, run, restart=True)
                run.start()
        with contextlib.suppress(AssertionError):  # what is missing is counted below
            settle(telegram_progress(telegram, sent, journaled_in(workspace)))
        run.terminate()
        name = scenario("telegram-traffic", mode)
        tally = telegram_tally(name, telegram, sent, workspace, run, started)
    report(tally)
    tally.check_promise()
    check_steered(tally, mode)


def kill_at_next_confirmation(
    telegram: FakeTelegram, run: Gateways, *, restart: bool = False, timeout: float = 15
) -> None:
    """SIGKILL the gateway from the fake's serving thread the instant its poller confirms
    updates (the getUpdates call with the higher offset has arrived and is not answered
    yet). `restart`: launch a new gateway first and kill that one at its first
    confirmation. After `timeout` seconds without a confirmation, kill it all the same."""
    fired = threading.Event()

    def kill(ids: tuple[int, ...]) -> None:
        process = run.current
        if process is not None and not fired.is_set():
            fired.set()
            # Not reaped until run.kill() below: the pid is still this process's.
            os.kill(process.proc.pid, signal.SIGKILL)

    telegram.on_confirm = kill
    try:
        if restart:
            run.launch()
        fired.wait(timeout)
    finally:
        telegram.on_confirm = None
    run.kill()


# -- Slack over HTTP ---------------------------------------------------------------------


def slack_user(message: Message) -> str:
    return f"U0K{message.user:03d}"


def kill_after_next_ack(slack: FakeSlack, run: Gateways, timeout: float = 2) -> None:
    """SIGKILL the gateway as soon as it has acknowledged one more event (its turn has
    just begun); after `timeout` seconds without one, kill it all the same."""
    try:
        slack.wait_for_event_acks(len(slack.acked_deliveries()) + 1, timeout)
    except TimeoutError:
        pass
    run.kill()


def event_text(delivery: EventDelivery) -> str:
    """The message text (``u017 m0042``) an event delivered."""
    found = TOKEN.search(str(delivery.payload["event"]["text"]))
    assert found is not None
    return found.group()


@pytest.mark.timeout(300)
def test_slack_http_events_survive_kills(
    tmp_path: Path,
    gateways: Callable[[dict[str, str]], Gateways],
    report: Callable[[Tally], None],
) -> None:
    """750 direct messages from 75 users come over HTTP at about 25 a second, each
    delivered the way Slack does (acked by a 2xx within 3 s, else retried after 0.5, 2
    and 5 s with X-Slack-Retry-Num), while the gateway is SIGKILLed three times, each
    right after it acknowledged an event. Every event Slack considers acknowledged must
    be answered, at most once more per kill, and stored once; events never acknowledged
    are Slack's to retry and are counted apart. Slack does not keep the order of events
    (a retried one overtakes later ones), and a kill between the journal and the 200
    makes Slack retry an event the gateway already holds; so per user, a reply order is
    wrong only when an event was acknowledged before an earlier-answered one could
    have reached the gateway."""
    rng = random.Random(SEED)
    workspace = tmp_path / "ws"
    # Long enough for three kills, each after six seconds up, while events still flow.
    count, rate, kills = scaled(750), 25.0, 3
    sent = plan_messages(count, scaled(75), rng)
    port = free_port()
    url = f"http://127.0.0.1:{port}/slack/events"
    with (
        FakeOpenAI.in_thread(responder=slow_echo(random.Random(SEED + 1))) as llm,
        FakeSlack.in_thread() as slack,
    ):
        run = gateways(slack_env(workspace, llm, slack, port))
        run.start()
        started = time.monotonic()
        deliveries: list[concurrent.futures.Future[Any]] = []

        def deliver(message: Message) -> None:
            payload = slack.dm_message(slack_user(message), message.text)
            deliveries.append(slack.deliver_event_soon(url, payload, retry_delays=SLACK_RETRIES))

        with pushing(sent, rate, deliver) as seconds:
            for offset in kill_schedule(kills, seconds, rng):
                # Kills closer together than this could leave some retries of an event
                # no moment at which the gateway is up (0.5 + 2 + 5 s after it failed).
                run.sleep_until_due(started + offset, min_up=6.0)
                kill_after_next_ack(slack, run)
                run.start()
        concurrent.futures.wait(deliveries, timeout=SLACK_DELIVERY_MAX + 10)

        def progress() -> tuple[bool, int, bool]:
            records = slack.event_deliveries
            acked = {event_text(d) for d in records if d.acked}
            answered, _ = echoed(str(p.get("text", "")) for p in slack.posted_messages())
            in_progress = any(d.in_progress for d in records)
            return acked <= set(answered_texts(answered)), len(answered), in_progress

        settle(progress)
        run.terminate()
        user, assistant = session_entries(workspace / "sessions")
        answered, other = echoed(str(p.get("text", "")) for p in slack.posted_messages())
        records = slack.event_deliveries
        not_acked = frozenset(event_text(d) for d in records if not d.acked)
        acked_at = {event_text(d): d.acked_at for d in records if d.acked_at is not None}
        in_ack_order = sorted(sent, key=lambda m: acked_at.get(m.text, float("inf")))
        arrival = {
            event_text(d): (
                min(a.sent_at for a in d.attempts if a.failure != "connection_failed"),
                d.acked_at,
            )
            for d in records
            if d.acked_at is not None
        }
        attempts = (
            f"{event_text(d)} {d.event_id}: "
            + ", ".join(
                f"#{a.retry_num} {a.sent_at:.3f} {a.status} {a.failure}" for a in d.attempts
            )
            for d in records
        )
        tally = Tally(
            scenario="slack-http",
            logs=run.save_logs(tmp_path / "logs", attempts),
            sent=in_ack_order,
            user_entries=user,
            assistant_entries=assistant,
            reply_order=answered,
            other_replies=other,
            kills=run.kills,
            seconds=time.monotonic() - started,
            exit_code=run.exit_code,
            not_acked=not_acked,
            arrival=arrival,
        )
    report(tally)
    tally.check_promise()
