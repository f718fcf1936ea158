"""The conformance scenarios: the delivery promise (docs/delivery.md), checked on a channel.

Import them into a test module (``from gateway.testing.suite import *``) beside a
`channel_driver` fixture and the plugin (`gateway.testing.plugin`). Each scenario runs
the real `gateway run` against the driver's platform, has people write messages with
tokens of their own, counts from the outside (`gateway.testing.tally`) and prints one
line (``KIT <channel> <scenario>: sent=... lost=...``). Every scenario checks the whole
promise over what it did: nothing lost, nothing stored twice, each message answered once,
in order per conversation, in its place and, in a group, to its sender; nobody who did
not address the bot told anything; no post that pings everyone. A kill allows one extra
reply per message, and per conversation, per kill. What a scenario needs of the platform
is on its `needs`; a driver that lacks it skips it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gateway.testing.driver import Place, Post
from gateway.testing.kit import LANE, Kit
from gateway.testing.model import LONG_LINE, long_text
from gateway.testing.plugin import needs
from gateway.testing.tally import Said, Tally, answered_token

__all__ = [
    "test_a_full_gateway_loses_nothing",
    "test_backlog_while_down_is_answered_once_each_in_order",
    "test_busy_room_backlog_while_down_answers_only_the_mentions",
    "test_busy_room_live_answers_only_the_mentions",
    "test_duplicate_delivery_is_answered_once",
    "test_edit_is_handled_once",
    "test_forged_inbound_is_refused",
    "test_group_mentions_are_answered_once_each_to_their_sender",
    "test_kill_before_journal_loses_nothing",
    "test_kill_mid_batch_loses_nothing_and_stores_nothing_twice",
    "test_kills_right_after_start_lose_nothing_of_a_backlog",
    "test_kills_while_people_write_lose_nothing",
    "test_long_reply_arrives_whole_and_in_order",
    "test_messages_written_while_the_gateway_drains_are_answered",
    "test_no_reply_pings_everyone",
    "test_one_reply_per_direct_message",
    "test_platform_outage_loses_nothing",
    "test_replies_stay_in_their_thread",
    "test_stranger_never_reaches_the_model",
]


def introduce(kit: Kit, said: list[Said]) -> None:
    """Wait until the bot answered these first messages (a platform that can only read
    back a conversation it has seen, as Discord's DMs, needs one before a downtime)."""
    kit.settle(said, timeout=90)
    missing = {s.token for s in said} - kit.answered()
    assert not missing, f"first messages never answered: {sorted(missing)}"


# -- one reply per message ---------------------------------------------------------------


def test_one_reply_per_direct_message(kit: Kit) -> None:
    """Three people write three DMs each, interleaved: each is answered once, in its
    DM, in the order written, and stored once."""
    run = kit.gateways()
    run.start()
    writers = [p for p in range(3) for _ in range(kit.sized(3))]
    kit.rng.shuffle(writers)
    for person in writers:
        kit.dm(person)
    kit.settle()
    kit.check(run)


@needs("groups", "mentions")
def test_group_mentions_are_answered_once_each_to_their_sender(kit: Kit) -> None:
    """Three people mention the bot in a group, a fourth chats without mentioning it:
    each mention is answered once, in the group, as a reply to it (or naming its
    sender); the chatter gets nothing, is not stored and never reaches the model."""
    run = kit.gateways()
    run.start()
    for _ in range(kit.sized(2)):
        for person in range(3):
            kit.group(person, mention=True)
            kit.group(3, mention=False)
    kit.settle()
    kit.check(run)


@needs("groups", "mentions", "threads")
def test_replies_stay_in_their_thread(kit: Kit) -> None:
    """Mentions in two threads of the group and in the group itself, interleaved: each
    is answered in its own place (a thread is a conversation of its own), in order."""
    run = kit.gateways()
    run.start()
    places = [None, 0, 1] * kit.sized(2)
    kit.rng.shuffle(places)
    for n, thread in enumerate(places):
        kit.group(n % 2, mention=True, thread=thread)
    kit.settle()
    kit.check(run)


@needs("duplicate_delivery")
def test_duplicate_delivery_is_answered_once(kit: Kit) -> None:
    """A DM handed over again while its turn runs, again after it was answered, and
    again after a restart, with other messages between: each is answered once and
    stored once."""
    run = kit.gateways()
    run.start()
    first = kit.dm(0, words="kit:slow=1")
    kit.driver.redeliver(first.ref)
    second = kit.dm(0)
    kit.settle()
    kit.driver.redeliver(first.ref)
    kit.driver.redeliver(second.ref)
    kit.dm(0)
    kit.settle()
    run.terminate()
    run.start()
    kit.driver.redeliver(first.ref)
    kit.dm(0)
    kit.settle()
    kit.check(run)


# -- backlogs ------------------------------------------------------------------------------


@needs("catch_up")
def test_backlog_while_down_is_answered_once_each_in_order(kit: Kit) -> None:
    """While the gateway is stopped one person writes three lanes' worth and one more
    (`dispatch.max_queue_per_lane` is 5) and another a few: after the start each
    message is answered once, in the order written."""
    run = kit.gateways()
    run.start()
    introduce(kit, [kit.dm(0), kit.dm(1)])
    run.terminate()
    writers = [0] * kit.sized(3 * LANE + 1) + [1] * kit.sized(4)
    kit.rng.shuffle(writers)
    for person in writers:
        kit.dm(person)
    run.start()
    kit.settle()
    kit.check(run)


@needs("catch_up", "groups", "mentions")
def test_busy_room_backlog_while_down_answers_only_the_mentions(kit: Kit) -> None:
    """While the gateway is stopped, 40 messages in a group from five people, 15 of them
    mentioning the bot (two people never do): after the start each mention is answered
    once, in order, to its sender; the rest get nothing and never reach the model."""
    run = kit.gateways()
    run.start()
    introduce(kit, [kit.group(0, mention=True)])
    run.terminate()
    total, mentions = kit.sized(40), kit.sized(15)
    addressed = set(kit.rng.sample(range(total), mentions))
    for n in range(total):
        mention = n in addressed
        kit.group(kit.rng.randrange(3) if mention else kit.rng.randrange(5), mention=mention)
    run.start()
    kit.settle()
    kit.check(run)


@needs("groups", "mentions")
def test_busy_room_live_answers_only_the_mentions(kit: Kit) -> None:
    """A mention the model takes 3 s to answer, then 60 messages not addressed to the
    bot, then a second mention: only the two mentions are answered, each to its sender;
    the chatter costs nothing (never stored, never sent to the model) and gets nothing."""
    run = kit.gateways()
    run.start()
    kit.group(0, mention=True, words="kit:slow=3")
    for _ in range(kit.sized(60)):
        kit.group(2 + kit.rng.randrange(4), mention=False)
    kit.group(1, mention=True)
    kit.settle()
    kit.check(run)


@needs("catch_up")
def test_kill_mid_batch_loses_nothing_and_stores_nothing_twice(kit: Kit) -> None:
    """Four people write 24 DMs; the gateway is SIGKILLed once a third are answered, the
    people write 8 more while it is down, and it is killed again at two thirds: after
    the last start every message is answered, none is stored twice, and no message or
    conversation got more than one extra reply per kill."""
    kit.model.delay = 0.15  # turns overlap: a kill finds some in flight
    run = kit.gateways()
    run.start()
    first = [p for p in range(4) for _ in range(kit.sized(6))]
    kit.rng.shuffle(first)
    for person in first:
        kit.dm(person)
    kit.wait_answers(len(first) // 3)
    run.kill()
    for person in kit.rng.choices(range(4), k=kit.sized(8)):
        kit.dm(person)
    run.start()
    kit.wait_answers(2 * len(kit.said) // 3)
    run.kill()
    run.start()
    kit.settle()
    kit.check(run)


@needs("catch_up")
def test_kill_before_journal_loses_nothing(kit: Kit) -> None:
    """While the gateway is stopped three people write four DMs each; the next gateway
    stops itself as it is about to journal the first of them (failpoint
    `dispatch.before_journal`) and is SIGKILLed there, before the journal holds any of
    them. The platform must still hold them all: after the next start each is answered
    once, in order. A channel that confirms a message before the journal holds it (a
    batch fetched ahead of the journal, a webhook answered before `submit` returned, a
    read position stored first) loses what it confirmed."""
    run = kit.gateways()
    run.start()
    introduce(kit, [kit.dm(person) for person in range(3)])
    run.terminate()
    writers = [p for p in range(3) for _ in range(kit.sized(4))]
    kit.rng.shuffle(writers)
    for person in writers:
        kit.dm(person)
    run.kill_at("dispatch.before_journal")
    run.start()
    kit.settle()
    kit.check(run)


def write_somewhere(kit: Kit, people: int) -> Said:
    """One of `people` writes once: in their DM or, where the platform has groups with
    mentions, a quarter of the time in the group (a mention of the bot, or one time in
    three chatter it owes nothing)."""
    person = kit.rng.randrange(people)
    requirements = kit.driver.requirements
    if requirements.groups and requirements.mentions and kit.rng.random() < 0.25:
        return kit.group(person, mention=kit.rng.random() < 2 / 3)
    return kit.dm(person)


def introduce_everyone(kit: Kit, people: int) -> None:
    """Each of `people` writes once in their DM, and one of them mentions the bot in the
    group where there is one: every conversation the kill scenarios write in is known."""
    said = [kit.dm(person) for person in range(people)]
    if kit.driver.requirements.groups and kit.driver.requirements.mentions:
        said.append(kit.group(0, mention=True))
    introduce(kit, said)


@needs("catch_up")
def test_kills_right_after_start_lose_nothing_of_a_backlog(kit: Kit) -> None:
    """Six people who have talked to the bot write 40 messages while the gateway is
    down, in their DMs and in the group (mentions and chatter); it is started and
    SIGKILLed 0-300 ms after it is ready, three times, while it takes that backlog in,
    then left to finish: every message is answered once, in order, stored once, and no
    message or conversation got more than one extra reply per kill."""
    kit.model.delay = 0.05  # turns overlap: a kill finds some in flight
    people = kit.sized(6)
    run = kit.gateways()
    run.start()
    introduce_everyone(kit, people)
    run.kill()
    for _ in range(kit.sized(40)):
        write_somewhere(kit, people)
    for _ in range(3):
        run.start()
        time.sleep(kit.rng.uniform(0.0, 0.3))
        run.kill()
    run.start()
    kit.settle()
    kit.check(run)


@needs("catch_up")
def test_kills_while_people_write_lose_nothing(kit: Kit) -> None:
    """Six people write 60 messages, twelve a second, in their DMs and in the group,
    while the gateway is SIGKILLed four times at random moments (turns in flight,
    messages on their way in) and kept down 1-3 s each time while they go on writing:
    after the last start every message is answered once, in order, stored once, and no
    message or conversation got more than one extra reply per kill."""
    kit.model.delay = 0.05
    people, count, rate = kit.sized(6), kit.sized(60), 12.0
    run = kit.gateways()
    run.start()
    introduce_everyone(kit, people)
    began = time.monotonic()
    with kit.kills_meanwhile(run, 4, over=count / rate):
        for n in range(count):
            time.sleep(max(0.0, began + n / rate - time.monotonic()))
            write_somewhere(kit, people)
    kit.settle()
    kit.check(run)


def test_messages_written_while_the_gateway_drains_are_answered(kit: Kit) -> None:
    """Three people write while the gateway drains (SIGTERM with a 3-second turn in
    flight): each message is answered once, in order, after the next start. A platform
    that hands messages over again keeps them meanwhile (the channel does not confirm
    them); one that never does (a push, a webhook nobody retries) gets them journaled
    for the next start (`redelivers = False`). Nobody is asked to write again."""
    run = kit.gateways()
    run.start()
    introduce(kit, [kit.dm(person) for person in range(3)])
    kit.dm(0, words="kit:slow=3")  # the drain waits for this turn
    time.sleep(0.5)
    process = run.current
    assert process is not None
    process.begin_stop()
    for n in range(kit.sized(6)):
        time.sleep(0.25)
        kit.dm(n % 3)
    run.exit_code = process.wait_exit()
    assert run.exit_code == 0, f"the drain ended with exit code {run.exit_code}"
    run.start()
    kit.settle()
    kit.check(run)


def test_a_full_gateway_loses_nothing(kit: Kit) -> None:
    """With room for two waiting messages in the whole gateway (`max_queued_total`),
    four people write 16 DMs at once to a slow model: every message is answered once,
    in order, and nobody is told the gateway is busy. A platform that hands messages
    over again keeps what does not fit (not confirmed, sent again); one that never does
    has its messages taken past the bound."""
    kit.model.delay = 0.2
    run = kit.gateways({"GATEWAY_DISPATCH__MAX_QUEUED_TOTAL": "2"})
    run.start()
    writers = [p for p in range(4) for _ in range(kit.sized(4))]
    kit.rng.shuffle(writers)
    for person in writers:
        kit.dm(person)
    kit.settle()
    kit.check(run)


# -- who is answered -----------------------------------------------------------------------


@needs("strangers")
def test_stranger_never_reaches_the_model(kit: Kit) -> None:
    """With DM pairing on, someone unknown writes twice: they get a pairing code and
    nothing else; what they wrote is never stored and never reaches the model."""
    run = kit.gateways(kit.channel_setting("dm_policy", "pairing"))
    run.start()
    first = kit.dm(7, addressed=False)
    kit.wait_posts(
        lambda posts: any(p.place == first.ref.place for p in posts), 60, "a pairing code"
    )
    kit.dm(7, addressed=False)
    time.sleep(3)  # the second message is handled (a code is re-sent at most once a while)

    def got_a_code(tally: Tally) -> list[str]:
        theirs = [p for p in tally.posts if p.place == first.ref.place]
        return [] if theirs else ["the stranger got no pairing code"]

    kit.check(run, other_posts_allowed=True, extra=got_a_code)


@needs("signed_inbound")
def test_forged_inbound_is_refused(kit: Kit) -> None:
    """A message that does not come from the platform (a wrong signature or secret) is
    refused, never stored, never answered and never sent to the model; a real message
    after it is answered."""
    run = kit.gateways()
    run.start()
    refused = kit.forge()
    kit.dm(0)
    kit.settle()

    def was_refused(tally: Tally) -> list[str]:
        return [] if refused else ["the gateway took the forged message (no 401/403)"]

    kit.check(run, extra=was_refused)


@needs("mass_pings")
def test_no_reply_pings_everyone(kit: Kit) -> None:
    """The model's answer holds the platform's ping of everyone (`@everyone`), in a DM
    and, where there are groups, in a group: the answers arrive and none pings anyone."""
    run = kit.gateways()
    run.start()
    kit.dm(0, words="kit:everyone")
    if kit.driver.requirements.groups:
        kit.group(1, mention=True, words="kit:everyone")
    kit.settle()
    ping = kit.driver.ping_everyone_text()

    def answered_with_the_ping(tally: Tally) -> list[str]:
        # The text may be defused (a zero-width space), but the answer must be there.
        echoed = [p for p in tally.posts if answered_token(p) is not None]
        return [] if echoed else [f"no answer holding {ping!r} arrived"]

    kit.check(run, extra=answered_with_the_ping)


# -- what a reply looks like -----------------------------------------------------------------


@needs("split_long_replies")
def test_long_reply_arrives_whole_and_in_order(kit: Kit) -> None:
    """A reply three times as long as a post can be arrives as several posts in the
    DM, each within the limit, which together hold every line once, in order."""
    length = 3 * kit.driver.max_message_length
    run = kit.gateways()
    run.start()
    asked = kit.dm(0, words=f"kit:long={length}")
    kit.settle()
    wanted = LONG_LINE.findall(long_text(length))

    def whole_and_in_order(tally: Tally) -> list[str]:
        posts = [p for p in tally.posts if p.place == asked.ref.place]
        problems = []
        too_long = [len(p.text) for p in posts if len(p.text) > kit.driver.max_message_length]
        if too_long:
            problems.append(f"posts over {kit.driver.max_message_length} characters: {too_long}")
        if len(posts) < 2:
            problems.append(f"{len(posts)} post(s) for a reply of {length}+ characters")
        got = [line for p in posts for line in LONG_LINE.findall(p.text)]
        if got != wanted:
            missing = sorted(set(wanted) - set(got))[:5]
            problems.append(
                f"the lines arrived as {len(got)} of {len(wanted)}, missing e.g. {missing}, "
                f"in order: {got == sorted(got)}"
            )
        return problems

    kit.check(run, other_posts_allowed=True, extra=whole_and_in_order)


@needs("edits")
def test_edit_is_handled_once(kit: Kit) -> None:
    """Someone edits the message the bot just answered, in a DM and, where there are
    groups, a mention in a group (where the platform may deliver twice, the edit comes
    twice): each edit gets one post (an answer to the edited text, or a word on why
    not), is stored at most once, and the original is not answered again."""
    run = kit.gateways()
    run.start()
    writes: list[Callable[[], Said]] = [lambda: kit.dm(0)]
    if kit.driver.requirements.groups and kit.driver.requirements.mentions:
        writes.append(lambda: kit.group(1, mention=True))
    edits = []
    for write in writes:
        original = write()
        kit.settle()
        edited = kit.edit(original)
        if kit.driver.requirements.duplicate_delivery:
            kit.driver.redeliver(edited.ref)

        def answered_again(posts: list[Post], place: Place = original.ref.place) -> bool:
            return len([p for p in posts if p.place == place]) >= 2

        kit.wait_posts(answered_again, 60, "a post after the edit")
        # The next message: whatever the edit gets comes before its answer (which may be
        # posted in a place of its own: a mention that opens a thread, as on Slack).
        following = write()
        kit.settle()
        edits.append((original, edited, following))

    def handled_once(tally: Tally) -> list[str]:
        problems = []
        for original, edited, following in edits:
            mine = [answered_token(p) for p in tally.posts if p.place == original.ref.place]
            start = mine.index(original.token) + 1 if original.token in mine else len(mine)
            rest = mine[start:]
            after = rest[: rest.index(following.token)] if following.token in rest else rest
            if len(after) != 1:
                problems.append(f"the edit in {original.ref.place} got {len(after)} posts: {after}")
            elif after[0] not in (edited.token, None):
                problems.append(f"the edit was answered with an answer to {after[0]}")
            if tally.user_entries[edited.token] > 1:
                problems.append(f"the edit in {original.ref.place} was stored twice")
        return problems

    kit.check(run, other_posts_allowed=True, extra=handled_once)


# -- the platform away ------------------------------------------------------------------------


@needs("platform_outage")
def test_platform_outage_loses_nothing(kit: Kit) -> None:
    """The network to the platform is cut for 6 s while the gateway runs, as an answer
    is being written, and people write meanwhile: once it is back, without a restart,
    each message is answered once, in order, the answer that met the cut too."""
    run = kit.gateways()
    run.start()
    introduce(kit, [kit.dm(0)])
    kit.dm(1, words="kit:slow=1")  # its answer is sent while the network is cut
    time.sleep(0.5)
    kit.platform_down()
    try:
        for person in (0, 2, 0, 2, 0):
            kit.dm(person)
        time.sleep(6)
    finally:
        kit.platform_up()
    kit.settle()
    kit.check(run)
