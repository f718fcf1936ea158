"""What a conformance scenario works with (`Kit`): the driver's platform, the kit's model,
gateway processes on one workspace, people who write messages with tokens of their own,
waits that read the platform from the outside, and the tally that checks the promise."""

from __future__ import annotations

import contextlib
import os
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from gateway.testing.driver import ChannelDriver, MessageRef, Place, Post
from gateway.testing.model import KitModel
from gateway.testing.process import GatewayRuns, child_pythonpath
from gateway.testing.tally import TOKEN, Said, Tally, answered_token, session_entries

__all__ = ["LANE", "TURNS_AT_ONCE", "Kit"]

#: `dispatch.max_queue_per_lane` in every scenario: a backlog "longer than a lane" is
#: cheap to write. A platform's message is never refused for it (docs/delivery.md, 7).
LANE = 5
#: After the last answer the kit waits this long for answers that should not come (a
#: reply sent twice) before it stops the gateway.
LINGER = 1.5
#: No post for this long and nothing left in the journal: what is missing is not coming.
STALL = 15.0
#: `dispatch.max_concurrent_turns` in every scenario (the gateway's default): a kill
#: catches at most this many replies on their way.
TURNS_AT_ONCE = 8


class Kit:
    """One scenario's world. Scenarios write through `dm` and `group`, start gateways with
    `gateways`, wait with `settle`, and end with `check` (which stops the gateway with
    SIGTERM, counts, reports and asserts)."""

    def __init__(
        self,
        driver: ChannelDriver,
        model: KitModel,
        folder: Path,
        *,
        scenario: str,
        seed: int,
        report: Callable[[str], None],
        scale: float = 1.0,
    ) -> None:
        self.driver = driver
        self.model = model
        self.folder = folder
        self.workspace = folder / "workspace"
        self.scenario = scenario
        self.seed = seed
        # Each scenario draws from its own stream of the run's seed: one repeats alone.
        self.rng = random.Random(f"{seed}:{scenario}")
        self.report = report
        #: Multiplies the scenarios' sizes (`sized`): 1 keeps each to seconds.
        self.scale = scale
        self.said: list[Said] = []
        self.runs: list[GatewayRuns] = []
        #: Times the network to the platform was cut (`platform_down`).
        self.outages = 0
        self.logs: Path | None = None  # where `save_logs` put them
        self.started = time.monotonic()
        self._numbers = iter(range(1, 100_000))

    # -- gateways ---------------------------------------------------------------------

    def env(self, settings: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of a `gateway run`: this process's without any GATEWAY_* or
        OPENAI_* of the developer's own; the workspace, the model and the dispatch
        settings; the driver's channel; then `settings`."""
        inherited = {
            k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "OPENAI_"))
        }
        kit = {
            "PYTHONPATH": child_pythonpath(),
            "GATEWAY_WORKSPACE": str(self.workspace),
            "OPENAI_BASE_URL": self.model.base_url,
            "OPENAI_API_KEY": self.model.api_key,
            "GATEWAY_LLM__MODEL": self.model.model,
            "GATEWAY_LLM__MAX_RETRIES": "0",
            "GATEWAY_LLM__TIMEOUT": "60",
            "GATEWAY_HTTP__PORT": "0",
            "GATEWAY_DISPATCH__MAX_QUEUE_PER_LANE": str(LANE),
            "GATEWAY_DISPATCH__MAX_CONCURRENT_TURNS": str(TURNS_AT_ONCE),
        }
        return inherited | kit | self.driver.gateway_env() | (settings or {})

    def channel_setting(self, key: str, value: str) -> dict[str, str]:
        """One setting of the driver's channel section (``[channels.<name>] key``)."""
        return {f"GATEWAY_CHANNELS__{self.driver.name.upper()}__{key.upper()}": value}

    def gateways(self, settings: dict[str, str] | None = None) -> GatewayRuns:
        """The gateway processes of this scenario, on its workspace (none started yet)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        runs = GatewayRuns(self.env(settings), self.folder)
        self.runs.append(runs)
        return runs

    def close(self) -> None:
        for runs in self.runs:
            runs.stop_all()

    def save_logs(self) -> Path:
        """Every gateway's log and the platform's record, in the scenario's ``logs``
        folder (its path)."""
        self.logs = self.folder / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        for n, runs in enumerate(self.runs):
            runs.save_logs(self.logs / f"run-{n}" if len(self.runs) > 1 else self.logs)
        (self.logs / "platform.log").write_text(
            "".join(f"{line}\n" for line in self.driver.platform_log()), encoding="utf-8"
        )
        return self.logs

    def platform_down(self) -> None:
        """Cut the network between the gateway and the platform (the driver's)."""
        self.outages += 1
        self.driver.platform_down()

    def platform_up(self) -> None:
        self.driver.platform_up()

    # -- people -------------------------------------------------------------------------

    def _text(self, words: str) -> tuple[str, str]:
        token = f"m{next(self._numbers):05d}"
        return token, f"{token} {words}".strip()

    def dm(self, person: int, words: str = "", *, addressed: bool = True) -> Said:
        """`person` writes a message of their own (a fresh token, then `words`) to the bot
        in their DM; `addressed=False` for a message the bot owes no answer (a
        stranger's)."""
        token, text = self._text(words)
        said = Said(token, self.driver.dm(person, text), addressed=addressed)
        self.said.append(said)
        return said

    def group(
        self, person: int, *, mention: bool, thread: int | None = None, words: str = ""
    ) -> Said:
        """`person` writes in the driver's group (in thread `thread`), mentioning the bot
        or not; only a mention is owed an answer."""
        token, text = self._text(words)
        ref = self.driver.group_message(person, text, mention=mention, thread=thread)
        said = Said(token, ref, addressed=mention, in_group=True)
        self.said.append(said)
        return said

    def edit(self, said: Said, words: str = "") -> Said:
        """The author of `said` edits it into a message with a fresh token (not in the
        tally: what an edit is owed is the scenario's to check)."""
        token, text = self._text(words)
        return Said(token, self.driver.edit(said.ref, text), in_group=said.in_group)

    def forge(self, words: str = "forged") -> bool:
        """Send the gateway a forged message (`ChannelDriver.forge`), owed nothing;
        whether the gateway refused it."""
        token, text = self._text(words)
        refused = self.driver.forge(text)
        ref = MessageRef(f"forged {token}", Place("forged"), "forger")
        self.said.append(Said(token, ref, addressed=False))
        return refused

    def sized(self, count: int) -> int:
        """`count` scaled by `scale` (at least 1)."""
        return max(1, round(count * self.scale))

    # -- kills --------------------------------------------------------------------------

    @contextlib.contextmanager
    def kills_meanwhile(
        self,
        runs: GatewayRuns,
        kills: int,
        *,
        over: float,
        down: tuple[float, float] = (1.0, 3.0),
        up_at_least: float = 1.0,
    ) -> Iterator[None]:
        """SIGKILL the running gateway `kills` times while the `with` block runs (people
        write in it, from the test's thread, for about `over` seconds): once at a random
        moment of each of `kills` equal slots of `over`, when the gateway has served
        for `up_at_least` seconds; each time it is kept down a random `down` seconds
        (people go on writing), then started again. Leaving the block waits for the
        last start."""
        slot = over / kills
        plan = [
            (n * slot + self.rng.uniform(0.2, 0.9) * slot, self.rng.uniform(*down))
            for n in range(kills)
        ]
        failures: list[BaseException] = []
        stop = threading.Event()  # the block failed: no more kills
        began = time.monotonic()

        def kill_and_restart() -> None:
            ready = time.monotonic()
            try:
                for at, rest in plan:
                    due = max(began + at, ready + up_at_least)
                    if stop.wait(max(0.0, due - time.monotonic())):
                        return
                    runs.kill()
                    time.sleep(rest)
                    runs.start()
                    ready = time.monotonic()
            except BaseException as exc:
                failures.append(exc)

        killer = threading.Thread(target=kill_and_restart, name="kit-killer", daemon=True)
        killer.start()
        try:
            yield
        except BaseException:
            stop.set()
            raise
        finally:
            killer.join()
        if failures:
            raise failures[0]

    # -- waiting ------------------------------------------------------------------------

    def answered(self) -> set[str]:
        """The tokens the bot's posts answer so far."""
        return {t for post in self.driver.bot_posts() if (t := answered_token(post))}

    def wait_answers(self, count: int, timeout: float = 60.0) -> None:
        """Wait until at least `count` messages have an answer."""
        deadline = time.monotonic() + timeout
        while len(self.answered()) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"fewer than {count} messages answered after {timeout:g}s")
            time.sleep(0.1)

    def journal_holds_messages(self) -> bool:
        """Whether the workspace's journal (the files mode's `dedupe.sqlite`) holds
        messages taken in and not answered yet: the gateway still owes them."""
        path = self.workspace / "dedupe.sqlite"
        if not path.exists():
            return False
        try:
            with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
                return bool(db.execute("SELECT count(*) FROM inbox").fetchone()[0])
        except sqlite3.Error:
            return True  # being written: ask again

    def settle(self, said: Sequence[Said] | None = None, timeout: float = 120.0) -> None:
        """Wait until every addressed message of `said` (default: all so far) has an
        answer, then `LINGER` seconds for answers that should not come. Stops early
        when nothing was posted for `STALL` seconds while the journal owes nothing and
        the platform is not retrying a delivery (`ChannelDriver.delivering`): what is
        missing then is counted by `check`, not waited for."""
        wanted = {s.token for s in (self.said if said is None else said) if s.addressed}
        deadline = time.monotonic() + timeout
        posts, changed = -1, time.monotonic()
        while time.monotonic() < deadline:
            found = self.driver.bot_posts()
            done = {t for post in found if (t := answered_token(post))}
            if wanted <= done:
                time.sleep(LINGER)
                return
            if len(found) != posts:
                posts, changed = len(found), time.monotonic()
            elif (
                time.monotonic() - changed > STALL
                and not self.journal_holds_messages()
                and not self.driver.delivering()
            ):
                return
            time.sleep(0.2)

    def wait_posts(
        self, predicate: Callable[[list[Post]], bool], timeout: float, what: str
    ) -> None:
        """Wait until `predicate(the bot's posts)`; AssertionError after `timeout`."""
        deadline = time.monotonic() + timeout
        while not predicate(self.driver.bot_posts()):
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout:g}s")
            time.sleep(0.2)

    # -- the end ------------------------------------------------------------------------

    def tally(self, runs: GatewayRuns, *, other_posts_allowed: bool = False) -> Tally:
        user, assistant = session_entries(self.workspace)
        return Tally(
            channel=self.driver.name,
            scenario=self.scenario,
            said=list(self.said),
            posts=self.driver.bot_posts(),
            user_entries=user,
            assistant_entries=assistant,
            model_saw=frozenset(self.model.asked(TOKEN)),
            kills=runs.kills,
            turns_at_once=TURNS_AT_ONCE,
            lost_allowed=self.driver.requirements.lost_when_cut * (runs.kills + self.outages),
            seconds=time.monotonic() - self.started,
            exit_code=runs.exit_code,
            seed=self.seed,
            other_posts_allowed=other_posts_allowed,
        )

    def check(
        self,
        runs: GatewayRuns,
        *,
        other_posts_allowed: bool = False,
        extra: Callable[[Tally], list[str]] | None = None,
    ) -> Tally:
        """Stop the gateway (SIGTERM: it drains, then exits 0), count, print the summary
        line, and assert the promise (and `extra`'s checks); on failure the message
        names a folder with every gateway's log and the platform's record."""
        peak = None
        if runs.current is not None:
            if runs.current.proc.poll() is None:
                peak = runs.current.peak_memory_mb()
                runs.terminate()
            else:  # it ended by itself: that is its exit code
                runs.exit_code = runs.current.proc.returncode
        tally = self.tally(runs, other_posts_allowed=other_posts_allowed)
        if peak is not None:  # the last gateway's peak memory: backlogs must not grow it
            tally.notes["peak_mb"] = round(peak)
        if tally.lost_allowed:
            tally.notes["lost_allowed"] = tally.lost_allowed
        self.report(tally.summary())
        problems = tally.problems() + (extra(tally) if extra is not None else [])
        if problems:
            folder = self.save_logs()
            problems.append(f"every gateway's log and the platform's record: {folder}")
            problems.extend(self._evidence(tally, folder))
            raise AssertionError(tally.summary() + "\n" + "\n".join(problems))
        return tally

    def _evidence(
        self, tally: Tally, folder: Path, *, tokens: int = 3, lines: int = 12
    ) -> list[str]:
        """The log lines that name the first few messages lost or never answered (their
        token, or a platform id long enough to be unique), so that a failure on a
        machine whose files are gone (CI) still says what happened to them."""
        missing = [*tally.lost, *tally.unanswered][:tokens]
        if not missing:
            return []
        said = {s.token: s for s in self.said}
        files = sorted(path for path in folder.rglob("*") if path.is_file())
        texts = [(path, path.read_text(encoding="utf-8", errors="replace")) for path in files]
        found: list[str] = []
        for token in missing:
            needles = [token]
            if token in said and len(said[token].ref.id) >= 6:
                needles.append(said[token].ref.id)
            hits = [
                f"  {path.relative_to(folder)}: {line[:240]}"
                for path, text in texts
                for line in text.splitlines()
                if any(needle in line for needle in needles)
            ]
            found.append(f"what the logs say of {token} ({', '.join(needles)}): {len(hits)} lines")
            found.extend(hits[:lines])
        return found
