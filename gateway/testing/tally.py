"""Counting a scenario from the outside: what people said, what the bot posted, what the
session files hold and what the model was asked, and the promise checked over them.

Every message the kit has a person write carries a token of its own (``m00042``). The
model echoes the message it answers, so a post that starts with ``echo:`` answers the
last token in it; the session files (the files storage mode, one JSONL file per session
key) hold a user entry per message stored and an assistant entry per answer.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from gateway.sessions.keys import key_from_filename
from gateway.testing.driver import MessageRef, Place, Post

__all__ = ["TOKEN", "Said", "Tally", "answered_token", "session_entries"]

TOKEN = re.compile(r"\bm\d{5}\b")


@dataclass(frozen=True, slots=True)
class Said:
    """A message the kit had a person write: its token, the platform's ref, whether the
    bot owes it an answer (a DM, a mention; False for a busy room's chatter), and
    whether it was written in a group (where an answer names its sender)."""

    token: str
    ref: MessageRef
    addressed: bool = True
    in_group: bool = False


def answered_token(post: Post) -> str | None:
    """The kit message a post answers: the last token after its ``echo:`` (a group
    message reaches the model after a header naming its sender), or None."""
    _, sep, echoed = post.text.partition("echo:")
    if not sep:
        return None
    found = TOKEN.findall(echoed.split("\n\n", 1)[0]) or TOKEN.findall(echoed)
    return found[-1] if found else None


def session_entries(workspace: Path) -> tuple[Counter[str], Counter[str]]:
    """(user, assistant) message entries per token, over the session files of every key
    in the workspace (``sessions/<encoded key>.jsonl``; a torn last line, the mark of a
    kill mid-write, is skipped)."""
    user: Counter[str] = Counter()
    assistant: Counter[str] = Counter()
    folder = workspace / "sessions"
    if not folder.is_dir():
        return user, assistant
    for path in sorted(folder.glob("*.jsonl")):
        if key_from_filename(path.name) is None:
            continue
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if not isinstance(entry, dict) or entry.get("type") != "message":
                continue
            message = entry.get("message") or {}
            content = message.get("content")
            text = content if isinstance(content, str) else json.dumps(content)
            counter = {"user": user, "assistant": assistant}.get(str(message.get("role")))
            if counter is not None:
                # One entry counts once for its message, whatever else it quotes.
                found = TOKEN.findall(text)
                if found:
                    counter[found[-1] if counter is user else found[0]] += 1
    return user, assistant


@dataclass(frozen=True)
class Tally:
    """One scenario, counted from the outside; `problems` is the promise checked."""

    channel: str
    scenario: str
    said: Sequence[Said]
    posts: Sequence[Post]
    user_entries: Counter[str]
    assistant_entries: Counter[str]
    #: The tokens that reached the model in any request.
    model_saw: frozenset[str]
    kills: int = 0
    #: Turns the gateway runs at once (`dispatch.max_concurrent_turns`): a kill catches
    #: at most that many replies on their way.
    turns_at_once: int = 8
    #: Messages the platform may lose to the kills and cuts of this scenario
    #: (`Requirements.lost_when_cut`).
    lost_allowed: int = 0
    seconds: float = 0.0
    exit_code: int | None = 0
    seed: int = 0
    #: Posts that answer no kit message (continuation pieces, pairing codes, notices)
    #: that the scenario expects; any other such post is a problem.
    other_posts_allowed: bool = False
    notes: dict[str, int] = field(default_factory=dict)

    # -- what happened ----------------------------------------------------------------

    @cached_property
    def replies(self) -> dict[str, list[Post]]:
        """Per token, the posts that answer it, in the order the platform got them."""
        found: dict[str, list[Post]] = defaultdict(list)
        for post in self.posts:
            token = answered_token(post)
            if token is not None:
                found[token].append(post)
        return dict(found)

    @property
    def addressed(self) -> list[Said]:
        return [s for s in self.said if s.addressed]

    @property
    def chatter(self) -> list[Said]:
        return [s for s in self.said if not s.addressed]

    @property
    def lost(self) -> list[str]:
        """Owed an answer, yet neither stored nor answered."""
        return [
            s.token
            for s in self.addressed
            if not self.user_entries[s.token] and s.token not in self.replies
        ]

    @property
    def unanswered(self) -> list[str]:
        """Stored, never answered."""
        return [
            s.token
            for s in self.addressed
            if self.user_entries[s.token] and s.token not in self.replies
        ]

    @property
    def stored_twice(self) -> list[str]:
        return [s.token for s in self.said if self.user_entries[s.token] >= 2]

    @property
    def turns_twice(self) -> list[str]:
        """Answered by the model twice (a replay ran the turn again)."""
        return [s.token for s in self.said if self.assistant_entries[s.token] >= 2]

    @property
    def answered_twice(self) -> int:
        """Replies beyond the first, over all messages."""
        return sum(len(posts) - 1 for posts in self.replies.values())

    @property
    def most_repeats_of_one_message(self) -> int:
        return max((len(posts) - 1 for posts in self.replies.values()), default=0)

    @property
    def most_repeats_in_one_place(self) -> int:
        """The most repeated replies any one conversation got."""
        where = {s.token: s.ref.place for s in self.said}
        repeats: Counter[Place] = Counter()
        for token, posts in self.replies.items():
            if token in where:
                repeats[where[token]] += len(posts) - 1
        return max(repeats.values(), default=0)

    @property
    def out_of_order(self) -> dict[Place, tuple[list[str], list[str]]]:
        """Conversations whose messages were first answered in another order than they
        were written: (written, answered)."""
        first: dict[str, int] = {}
        for position, post in enumerate(self.posts):
            token = answered_token(post)
            if token is not None:
                first.setdefault(token, position)
        wrong = {}
        places: dict[Place, list[str]] = defaultdict(list)
        for s in self.addressed:
            if s.token in first:
                places[s.ref.place].append(s.token)
        for place, written in places.items():
            answered = sorted(written, key=first.__getitem__)
            if answered != written:
                wrong[place] = (written, answered)
        return wrong

    @property
    def wrong_place(self) -> list[str]:
        """Replies posted somewhere else than the message they answer (another
        conversation, or outside its thread)."""
        where = {s.token: s.ref.place for s in self.said}
        return [
            f"{token} from {where[token]} answered in {post.place}"
            for token, posts in self.replies.items()
            if token in where
            for post in posts
            if post.place != where[token]
        ]

    @property
    def not_to_sender(self) -> list[str]:
        """Replies in a group that neither answer their message (a reply, a quote) nor
        name its sender."""
        return [
            s.token
            for s in self.said
            if s.in_group
            for post in self.replies.get(s.token, ())
            if post.reply_to != s.ref.id and s.ref.sender not in post.mentions
        ]

    @property
    def bystanders_told(self) -> list[str]:
        """Posts to people who did not address the bot: an answer to anything the bot
        owed no answer, a reply to a group's chatter, or a mention of someone who only
        chattered there. A DM owed no answer (a stranger's) was written to the bot: a
        pairing code in reply to it (threaded under it, as a mail is) tells no
        bystander, and the stranger scenario checks it."""
        chatter = {s.ref.id: s for s in self.chatter if s.in_group}
        chatter_tokens = {s.token for s in self.chatter}
        talkers = {s.ref.sender for s in self.addressed}
        silent = {s.ref.sender for s in chatter.values()} - talkers
        told = []
        for post in self.posts:
            token = answered_token(post)
            if token in chatter_tokens:
                told.append(f"answered {token}")
            elif post.reply_to in chatter:
                told.append(f"replied to {chatter[post.reply_to].token}: {post.text[:60]!r}")
            elif post.mentions & silent:
                told.append(f"mentioned {sorted(post.mentions & silent)}: {post.text[:60]!r}")
        return told

    @property
    def chatter_stored(self) -> list[str]:
        return [s.token for s in self.chatter if self.user_entries[s.token]]

    @property
    def chatter_to_model(self) -> list[str]:
        return [s.token for s in self.chatter if s.token in self.model_saw]

    @property
    def pings(self) -> int:
        return sum(post.pings_everyone for post in self.posts)

    @property
    def other_posts(self) -> list[str]:
        return [post.text[:80] for post in self.posts if answered_token(post) is None]

    # -- the promise ------------------------------------------------------------------

    def problems(self) -> list[str]:
        """Every part of the promise this scenario broke (empty: it held)."""
        found = []

        def add(what: str, items: Sequence[object] | Mapping[Place, object]) -> None:
            if items:
                sample = list(items.items() if isinstance(items, Mapping) else items)[:5]
                found.append(f"{len(items)} {what}, e.g. {sample}")

        if len(self.lost) > self.lost_allowed:
            what = "lost (never stored, never answered)"
            if self.lost_allowed:
                what += f", {self.lost_allowed} allowed by the platform's lost_when_cut"
            add(what, self.lost)
        add("stored twice", self.stored_twice)
        add("never answered", self.unanswered)
        add("answered by the model twice", self.turns_twice)
        add("conversations answered out of order (written, answered)", self.out_of_order)
        add("replies in the wrong place", self.wrong_place)
        add("group replies that answer neither the message nor its sender", self.not_to_sender)
        add("posts to people who never addressed the bot", self.bystanders_told)
        add("unaddressed messages stored", self.chatter_stored)
        add("unaddressed messages that reached the model", self.chatter_to_model)
        if self.pings:
            found.append(f"{self.pings} posts ping everyone")
        if self.kills == 0 and self.answered_twice:
            repeated = [t for t, p in self.replies.items() if len(p) > 1]
            found.append(f"{self.answered_twice} replies sent twice, e.g. {repeated[:5]}")
        if self.kills and self.most_repeats_of_one_message > self.kills:
            found.append(
                f"a message was answered {self.most_repeats_of_one_message} extra times in "
                f"{self.kills} kills (at most one extra reply per message per kill)"
            )
        if self.kills and self.most_repeats_in_one_place > self.kills:
            found.append(
                f"a conversation got {self.most_repeats_in_one_place} repeated replies in "
                f"{self.kills} kills (it has one reply on its way at a time: one per kill)"
            )
        if self.kills and self.answered_twice > self.kills * self.turns_at_once:
            found.append(
                f"{self.answered_twice} repeated replies in {self.kills} kills (at most "
                f"{self.turns_at_once} per kill: the replies of the turns running at once)"
            )
        if not self.other_posts_allowed and self.other_posts:
            add("posts that answer no message", self.other_posts)
        if self.exit_code not in (0, None):
            found.append(f"the gateway exited with {self.exit_code} after SIGTERM")
        return found

    def summary(self) -> str:
        """One line of counts (``KIT <channel> <scenario>: sent=... lost=...``)."""
        counts = {
            "sent": len(self.said),
            "addressed": len(self.addressed),
            "lost": len(self.lost),
            "stored_twice": len(self.stored_twice),
            "answered_twice": self.answered_twice,
            "unanswered": len(self.unanswered),
            "out_of_order": len(self.out_of_order),
            "wrong_place": len(self.wrong_place),
            "bystanders_told": len(self.bystanders_told),
            "chatter_to_model": len(self.chatter_to_model),
            "pings": self.pings,
            "other_posts": len(self.other_posts),
            "kills": self.kills,
            **self.notes,
        }
        text = " ".join(f"{name}={value}" for name, value in counts.items())
        return (
            f"KIT {self.channel} {self.scenario}: {text} exit={self.exit_code} "
            f"seconds={self.seconds:.1f} seed={self.seed}"
        )
