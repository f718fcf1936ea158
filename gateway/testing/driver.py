"""What a channel's author writes for the conformance kit: a `ChannelDriver` for their
platform's fake (or real) server, and the `Requirements` that say what the platform can do.

The kit runs the real `gateway run` with the channel the driver configures, plays people
through the driver (a DM, a group message with or without a mention, an edit, a message
handed over twice) and reads back what the bot posted. It never learns the platform's
wire format: ids, places and mentions reach it as the plain values below.

A driver is used by one scenario at a time, from the test's thread. A scenario starts the
platform (`running`), then one or more gateways against it, so what the driver's platform
holds (messages written while no gateway runs, what the bot posted) lives as long as the
`running` block, across gateway restarts.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, fields

__all__ = ["ChannelDriver", "MessageRef", "Place", "Post", "Requirements"]


@dataclass(frozen=True, slots=True)
class Place:
    """Where something was said: a conversation (a DM, a group, a room, a mailbox
    correspondent), and a thread in it (None: the conversation itself). Ids are the
    driver's own strings; the kit only compares them."""

    conversation: str
    thread: str | None = None

    def __str__(self) -> str:
        return self.conversation if self.thread is None else f"{self.conversation}/{self.thread}"


@dataclass(frozen=True, slots=True)
class MessageRef:
    """A message a person wrote, as the driver put it on the platform: its platform id
    (what a `Post.reply_to` names when the bot answers it), where it was written, who
    wrote it (the person's platform id, as a `Post.mentions` names them), and the
    driver's own handle of the event that carried it (an update id, a webhook delivery:
    an edit is the same message in another event), for `ChannelDriver.redeliver`."""

    id: str
    place: Place
    sender: str
    event: str = ""


@dataclass(frozen=True, slots=True)
class Post:
    """A message the bot posted, as the platform holds it (plain text: the platform's
    markup already rendered, as a reader sees it).

    `reply_to` is the id of the message the post answers when the platform shows that (a
    quote, a reply reference, the thread it was posted in; None in a DM); `mentions` the
    ids of the people it notifies; `pings_everyone` whether it notifies everyone in the
    place (an `@everyone` that the platform would act on)."""

    place: Place
    text: str
    reply_to: str | None = None
    mentions: frozenset[str] = frozenset()
    pings_everyone: bool = False


@dataclass(frozen=True, slots=True)
class Requirements:
    """What the platform can do; each scenario names what it needs and is skipped, with
    the reason, on a driver whose platform lacks it (SQLAlchemy's `requirements.py`).

    The defaults are those of a platform with DMs only, that keeps what the gateway did
    not take (the least every channel must manage for the delivery promise)."""

    #: Conversations of several people (`ChannelDriver.group_message`).
    groups: bool = False
    #: In a group a message can address the bot (a mention, a reply to the bot), and with
    #: `require_mention` on (the default) the bot answers only those.
    mentions: bool = False
    #: A group has threads, each a conversation of its own, answered in the thread
    #: (`group_message(..., thread=...)`).
    threads: bool = False
    #: A person can edit a message and the platform tells the bot (`edit`).
    edits: bool = False
    #: The platform may hand the same message over twice (`redeliver`): a retried
    #: webhook, the same message in two updates.
    duplicate_delivery: bool = False
    #: What the gateway did not take before it stopped (killed before it confirmed,
    #: written while it was down) reaches it after the next start: Telegram's pending
    #: updates, Matrix's sync token, Discord's read-back, unread mail, webhook retries.
    catch_up: bool = True
    #: DM access applies: with `dm_policy = "pairing"` a stranger gets a pairing code.
    strangers: bool = True
    #: Inbound is signed or carries a secret, and forged input can be sent (`forge`).
    signed_inbound: bool = False
    #: A reply longer than `ChannelDriver.max_message_length` is split into several posts.
    split_long_replies: bool = False
    #: The platform has pings that notify everyone in a place (`ping_everyone_text`).
    mass_pings: bool = False
    #: The network between the gateway and the platform can be cut and restored
    #: (`platform_down`, `platform_up`) while people go on writing.
    platform_outage: bool = False
    #: How many messages the platform may lose each time the gateway is killed or cut off
    #: from it (`platform_down`): those it hands to a request whose answer the gateway is
    #: no longer there to read, and cannot hand over again (signal-cli's `receive`: the
    #: message it takes for a call whose client is gone). 0: the platform keeps whatever
    #: the gateway did not confirm. The kit allows that many lost messages per kill or
    #: cut, and no more; the channel's page must say so.
    lost_when_cut: int = 0

    def lacking(self, needs: tuple[str, ...]) -> list[str]:
        """The names in `needs` this platform lacks (a name that is no field is a
        mistake in the scenario, and raises)."""
        known = {f.name for f in fields(self) if f.type in (bool, "bool")}
        unknown = [n for n in needs if n not in known]
        if unknown:
            raise ValueError(f"no such requirement: {', '.join(unknown)}; known: {sorted(known)}")
        return [n for n in needs if not getattr(self, n)]


class ChannelDriver(abc.ABC):
    """One platform for the conformance kit: start it, point a gateway at it, play people
    on it, read what the bot posted. Subclass it and override what `requirements` says
    the platform can do; the methods of a capability it lacks are never called.

    People are numbered (0, 1, 2, ...); the driver gives each a platform identity of its
    own, the same for the whole `running` block. Texts are plain words and digits (the
    kit finds its messages in posts and in the session files by them), which the driver
    puts on the platform as they are, adding only what `mention` asks for.
    """

    #: The channel's name: its session keys' prefix and its `[channels.<name>]` section
    #: (the kit turns pairing on with `GATEWAY_CHANNELS__<NAME>__DM_POLICY=pairing`).
    name: str = ""
    requirements: Requirements = Requirements()
    #: The longest text one post holds on this platform, in characters.
    max_message_length: int = 4096

    # -- the platform ---------------------------------------------------------------

    @abc.abstractmethod
    def running(self) -> AbstractContextManager[None]:
        """Start the platform (the fake server, or a fresh space on a real one) for the
        `with` block, and stop it after."""

    @abc.abstractmethod
    def gateway_env(self) -> dict[str, str]:
        """The GATEWAY_* environment that enables the channel and points it at the
        running platform, open to everyone: `dm_policy = "open"` and `group_policy =
        "open"`. The kit adds the workspace, the model, the dispatch settings and
        `GATEWAY_HTTP__PORT=0` (set it here when the platform must reach the gateway at
        a fixed address, for webhooks)."""

    def platform_down(self) -> None:
        """Cut the network between the gateway and the platform: the gateway's requests
        fail, people can still write (`platform_outage`)."""
        raise NotImplementedError(f"{type(self).__name__} cannot take the platform away")

    def platform_up(self) -> None:
        """Restore what `platform_down` cut."""
        raise NotImplementedError(f"{type(self).__name__} cannot take the platform away")

    # -- people -----------------------------------------------------------------------

    @abc.abstractmethod
    def dm(self, person: int, text: str) -> MessageRef:
        """`person` writes `text` to the bot in their direct conversation with it."""

    def group_message(
        self, person: int, text: str, *, mention: bool, thread: int | None = None
    ) -> MessageRef:
        """`person` writes `text` in the driver's group (one group for the whole
        `running` block), mentioning the bot the platform's way when `mention` (the
        mention is the platform's business: the kit's text carries none). `thread`: in
        the group's thread number `thread` (0, 1, ...; `threads`), each a conversation of
        its own; None: in the group itself (`groups`)."""
        raise NotImplementedError(f"{type(self).__name__} has no groups")

    def edit(self, ref: MessageRef, text: str) -> MessageRef:
        """The author of `ref` changes its text to `text` (`edits`); the edit's ref."""
        raise NotImplementedError(f"{type(self).__name__} has no edits")

    def redeliver(self, ref: MessageRef) -> None:
        """Hand the message of `ref` (a message or an edit) to the gateway once more, as
        the platform does when it delivers a message twice (`duplicate_delivery`)."""
        raise NotImplementedError(f"{type(self).__name__} never delivers twice")

    def forge(self, text: str) -> bool:
        """Send the gateway a message in `text` that does not come from the platform: a
        bad signature, a wrong secret (`signed_inbound`). True when the gateway refused
        it (an HTTP 401/403), False when it took it."""
        raise NotImplementedError(f"{type(self).__name__} has no signed inbound")

    def ping_everyone_text(self) -> str:
        """What, in a text the bot posts, would notify everyone in a place if the
        platform acted on it (`@everyone`; `mass_pings`)."""
        raise NotImplementedError(f"{type(self).__name__} has no mass pings")

    def delivering(self) -> bool:
        """Whether the platform is still trying to hand the gateway a message it holds
        (a retry of an unacknowledged event is due): the kit's `settle` waits for it
        rather than count the message lost. A platform that only redelivers on the
        gateway's asking (a poll, a sync, a backfill) holds nothing here: False."""
        return False

    # -- what the bot posted ----------------------------------------------------------

    @abc.abstractmethod
    def bot_posts(self) -> list[Post]:
        """Every message the bot posted since `running` began, in the order the platform
        received them (an edit of a post counts as a post of its own only when the
        platform shows it as one). Called a few times a second while a scenario waits."""

    def platform_log(self) -> Iterator[str]:
        """Lines about the platform's own record (calls, deliveries) for a failure's
        logs folder; nothing by default."""
        return iter(())
