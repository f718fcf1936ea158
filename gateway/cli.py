"""Command line: `gateway run | chat | init | sessions ...`.

Errors a user can cause end in one line on stderr and a distinct exit code, never a
traceback: 2 for bad usage or input, 78 for configuration (an unwritable workspace
included), 73 when `gateway init` cannot create its file, 75 when another gateway runs on
the workspace (`gateway run`, `chat` and the commands that change the workspace hold its
lock), 1 for a failed operation.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway import __version__

# Only what parsing the arguments needs is imported here; each command imports what it
# uses, so `gateway --help` does not load pydantic and `gateway sessions list` does not
# load the LLM client, numpy or the platforms' libraries (tests/test_startup_imports.py).
if TYPE_CHECKING:
    from gateway.config import PartialSettings, Settings
    from gateway.memory.protocol import MemoryScope
    from gateway.sessions import ArchivedSessionInfo, Session, SessionManager
    from gateway.sessions.listing import SessionListing
    from gateway.storage.workspace import WorkspaceLock

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_CANTCREAT = 73  # sysexits: an output file cannot be created (`gateway init`)
EXIT_UNAVAILABLE = 69  # sysexits EX_UNAVAILABLE: a service we need does not answer


class CommandError(Exception):
    """A command could not do what was asked; the message says why and what to do."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


# The global options: (flags, dest, metavar, help). They are accepted before the
# subcommand and after it (`gateway --model x chat` = `gateway chat --model x`).
_GLOBAL_OPTIONS: tuple[tuple[str, str, str, str], ...] = (
    ("--config", "config", "PATH", "config file (default ./gateway.toml)"),
    ("--workspace", "workspace", "DIR", "data folder (also GATEWAY_WORKSPACE)"),
    ("--model", "model", "NAME", "LLM model (also GATEWAY_MODEL)"),
    ("--log-level", "log_level", "LEVEL", "TRACE, DEBUG, INFO, WARNING, ERROR"),
)


def _add_global_options(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """The global options on `parser`. Below the top they default to SUPPRESS, so a
    subcommand that is not given one leaves the value given before it in place; one
    given in both places takes the later. An option string the subcommand already
    uses for its own meaning (`cache invalidate --model`) keeps that meaning."""
    taken = {s for action in parser._actions for s in action.option_strings}
    for flag, dest, metavar, text in _GLOBAL_OPTIONS:
        if flag in taken:
            continue
        parser.add_argument(
            flag,
            dest=dest,
            metavar=metavar,
            help=text,
            default=None if top else argparse.SUPPRESS,
        )
    if "-v" not in taken:
        parser.add_argument(
            "-v",
            "--verbose",
            action="store_true",
            help="log progress (INFO) in one-shot commands",
            default=False if top else argparse.SUPPRESS,
        )


def _with_global_options(
    parser: argparse.ArgumentParser, shared: Sequence[argparse.Action] = ()
) -> None:
    """Add the global options to every subcommand below `parser`, at every depth. The
    subcommands share one set of option objects, as argparse's `parents=` does: making
    them anew for each of the 42 took half the time of building the parser."""
    if not shared:
        template = argparse.ArgumentParser(add_help=False)
        _add_global_options(template, top=False)
        shared = template._actions
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                taken = {s for known in child._actions for s in known.option_strings}
                for option in shared:
                    if not taken.intersection(option.option_strings):
                        child._add_action(option)
                _with_global_options(child, shared)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number from 1 up")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gateway", description="Chat gateway: talk to an LLM agent from chat apps."
    )
    parser.add_argument("--version", action="version", version=f"gateway {__version__}")
    _add_global_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    sub.add_parser("run", help="run the gateway daemon (terminal chat on a TTY)")

    chat = sub.add_parser("chat", help="chat with the agent in this terminal")
    chat.add_argument("-m", "--message", help="send one message, print the reply, exit")
    chat.add_argument("--session", metavar="KEY", help="session name or key (default cli:direct)")

    init = sub.add_parser("init", help="write a commented starter gateway.toml")
    init.add_argument("path", nargs="?", default="gateway.toml")

    sessions = sub.add_parser("sessions", help="inspect and manage stored sessions")
    ssub = sessions.add_subparsers(dest="action", metavar="ACTION", required=True)
    lst = ssub.add_parser("list", help="sessions, most recently active first")
    lst.add_argument("--json", action="store_true", help="machine-readable output")
    lst.add_argument("--all", action="store_true", help="also the sessions /new archived")
    archived_help = "an archived session of KEY: 1 = the one /new replaced last"
    for name, text in (
        ("show", "the conversation on the current branch"),
        ("tree", "every entry of the session as a tree"),
    ):
        viewer = ssub.add_parser(name, help=text)
        viewer.add_argument("key")
        viewer.add_argument("--archived", metavar="N", type=_positive, help=archived_help)
    fork = ssub.add_parser("fork", help="copy the current branch into a new session")
    fork.add_argument("key")
    fork.add_argument("--at", metavar="ENTRY_ID", help="fork at this entry instead of the leaf")
    fork.add_argument("--as", dest="new_key", metavar="NEW_KEY", help="key of the new session")
    delete = ssub.add_parser(
        "delete", help="delete a session's current file and its stored tool outputs"
    )
    delete.add_argument("key")
    delete.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    export = ssub.add_parser("export", help="print a session (JSONL entries or Markdown)")
    export.add_argument("key")
    export.add_argument("--format", choices=("jsonl", "markdown"), default="jsonl")
    export.add_argument("--archived", metavar="N", type=_positive, help=archived_help)

    memory = sub.add_parser("memory", help="inspect a conversation's long-term memory")
    msub = memory.add_subparsers(dest="action", metavar="ACTION", required=True)
    msub.add_parser("show", help="MEMORY.md of the session's memory scope").add_argument("key")
    msearch = msub.add_parser("search", help="search the remembered facts")
    msearch.add_argument("key")
    msearch.add_argument("query")
    msearch.add_argument("--category", help="only facts of this category")
    msearch.add_argument(
        "--messages",
        action="store_true",
        help="search the past messages of every session of the scope instead of the facts",
    )
    mhist = msub.add_parser("history", help="search the conversation summaries (HISTORY.md)")
    mhist.add_argument("key")
    mhist.add_argument("query")
    msub.add_parser("compact", help="consolidate the session into memory now").add_argument("key")
    mknow = msub.add_parser("knowledge", help="the knowledge base entries")
    mknow.add_argument("key")
    mknow.add_argument("--category", help="only this category")
    mfacts = msub.add_parser("facts", help="the facts with their ids and where each came from")
    mfacts.add_argument("key")
    mcorrect = msub.add_parser("correct", help="give a fact a new text (it keeps its id)")
    mcorrect.add_argument("key")
    mcorrect.add_argument("id", help="the fact's id (`gateway memory facts KEY`)")
    mcorrect.add_argument("text", nargs="+", help="the corrected fact")
    mforget = msub.add_parser("forget", help="remove a fact for good (and its knowledge entry)")
    mforget.add_argument("key")
    mforget.add_argument("id", help="the fact's id (`gateway memory facts KEY`)")

    sub.add_parser("doctor", help="check the installation and say what to fix")
    sub.add_parser(
        "channels", help="the chat platforms installed, what each offers, and what is missing"
    )

    pairing = sub.add_parser("pairing", help="approve who may talk to the bot")
    psub = pairing.add_subparsers(dest="action", metavar="ACTION", required=True)
    approve = psub.add_parser("approve", help="let the sender holding CODE talk to the bot")
    approve.add_argument("channel")
    approve.add_argument("code")
    plist = psub.add_parser("list", help="approved senders and pending codes")
    plist.add_argument("channel", nargs="?")
    revoke = psub.add_parser("revoke", help="withdraw a sender's approval")
    revoke.add_argument("channel")
    revoke.add_argument("sender")

    schedules = sub.add_parser("schedules", help="reminders and tasks people set from chat")
    schsub = schedules.add_subparsers(dest="action", metavar="ACTION", required=True)
    slist = schsub.add_parser("list", help="every job, soonest first")
    slist.add_argument("--session", help="only the jobs of this conversation (session key)")
    slist.add_argument("--json", action="store_true", help="machine-readable output")
    scancel = schsub.add_parser("cancel", help="cancel a job by its id")
    scancel.add_argument("id")

    cache = sub.add_parser("cache", help="inspect and manage the response cache")
    csub = cache.add_subparsers(dest="action", metavar="ACTION", required=True)
    stats = csub.add_parser("stats", help="entries, hits, misses, hit rate, bytes")
    stats.add_argument("--json", action="store_true", help="machine-readable output")
    csub.add_parser("clear", help="remove every entry")
    inval = csub.add_parser("invalidate", help="remove some entries (exactly one selector)")
    which = inval.add_mutually_exclusive_group(required=True)
    which.add_argument("--key", help="one entry by its key")
    which.add_argument("--model", dest="by_model", help="every entry of a model")
    which.add_argument("--session", help="every entry scoped to a session key")
    which.add_argument("--shared", action="store_true", help="every shared entry")

    db = sub.add_parser("db", help="the PostgreSQL schema of the shared mode (storage.url)")
    dsub = db.add_subparsers(dest="action", metavar="ACTION", required=True)
    dstatus = dsub.add_parser("status", help="applied and pending migrations (exit 3: pending)")
    dstatus.add_argument("--json", action="store_true", help="machine-readable output")
    dsub.add_parser("migrate", help="apply pending migrations (safe with several replicas)")

    storage = sub.add_parser("storage", help="move a file workspace into PostgreSQL and back")
    stsub = storage.add_subparsers(dest="action", metavar="ACTION", required=True)
    simport = stsub.add_parser(
        "import",
        help="copy a workspace (sessions, memory, pairing, heartbeat runs) into storage.url",
    )
    simport.add_argument("dir", type=Path, help="the workspace folder (the one holding sessions/)")
    sexport = stsub.add_parser("export", help="write storage.url out as a file workspace")
    sexport.add_argument("dir", type=Path, help="the folder to write the workspace into")
    people = sub.add_parser("people", help="link one person's ids across channels")
    pesub = people.add_subparsers(dest="action", metavar="ACTION", required=True)
    plink = pesub.add_parser("link", help="make these sender ids one person (shared memory)")
    plink.add_argument("ids", nargs="+", metavar="ID", help="channel:user, e.g. telegram:42")
    pesub.add_parser("list", help="the linked people and their ids")
    punlink = pesub.add_parser("unlink", help="take an id out of its person")
    punlink.add_argument("id", metavar="ID")
    usage = sub.add_parser("usage", help="tokens and cost per conversation and per day")
    usage.add_argument("--days", type=_positive, default=7, help="the last N UTC days (default 7)")
    usage.add_argument("--session", metavar="KEY", help="one conversation only")
    usage.add_argument("--json", action="store_true", help="one JSON object per line")
    _with_global_options(parser)
    return parser


#: The sections of the configuration the `sessions` commands read: the storage mode, the
#: sessions' own, the log's, and memory's (whether the workspace has a memory folder).
#: They load only these (`load_sections`): a mistake in another section is reported by
#: `gateway run`, `gateway doctor` and the other commands, not by these.
SESSIONS_SECTIONS = ("sessions", "memory", "storage", "log")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The configuration's keys the global options set."""
    overrides: dict[str, Any] = {"workspace": args.workspace, "llm.model": args.model}
    if args.log_level:
        overrides["log.level"] = args.log_level
    return overrides


def _settings(args: argparse.Namespace) -> Settings:
    from gateway.config import load_settings

    return load_settings(args.config, overrides=_overrides(args))


# ----------------------------------------------------------------------------- commands


def cmd_init(args: argparse.Namespace) -> int:
    from gateway.config import write_starter_config

    path = Path(args.path)
    try:
        write_starter_config(path)
    except FileExistsError:
        raise CommandError(
            f"{path} already exists; not overwriting it (move it away, or give another path)",
            EXIT_CANTCREAT,
        ) from None
    except OSError as exc:
        where = exc.filename or path
        raise CommandError(
            f"cannot write {where} ({exc.strerror or exc}); give a path you can write to",
            EXIT_CANTCREAT,
        ) from None
    print(f"wrote {path}; edit it, then set OPENAI_API_KEY (or OPENAI_BASE_URL) and run it")
    return EXIT_OK


def cmd_chat(args: argparse.Namespace, settings: Settings) -> int:
    key = args.session or settings.channels.cli.session
    _lock_workspace(
        settings,
        "gateway chat",
        fix="chat in its terminal, through its chat API (/api/chat), or stop it first",
    )
    _check_llm(settings)  # before loading the gateway's parts: it would refuse to start
    import anyio

    from channels.cli import CLIChannel, render_file
    from gateway.daemon import Gateway

    gateway = Gateway.build(settings)

    async def main() -> int:
        channel = CLIChannel(gateway.agent, session_key=key)
        code = EXIT_OK
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(gateway.run_services)
                if args.message is not None:
                    reply = await channel.send_once(args.message)
                    if reply.is_error:
                        print(f"gateway: {reply.text}", file=sys.stderr)
                        code = EXIT_FAILED
                    else:
                        print(reply.text, flush=True)
                        for file in reply.files:
                            print(render_file(file), flush=True)
                else:
                    await channel.run_interactive()
                # Background consolidation gets its grace period before we leave.
                await gateway.aclose()
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await gateway.aclose()
        return code

    return anyio.run(main)


def cmd_run(args: argparse.Namespace, settings: Settings) -> int:
    # One gateway per workspace: a second one would interleave the same session files.
    lock = _lock_workspace(
        settings,
        "gateway run",
        fix="stop it first, or give this one its own workspace (--workspace or GATEWAY_WORKSPACE)",
        always=True,
    )
    _check_llm(settings)  # before waiting for PostgreSQL for a gateway that would not start
    import anyio
    from loguru import logger

    from gateway.daemon import Gateway, run_daemon, wait_for_storage
    from gateway.storage.seam import open_storage

    # Both runs on the same kind of loop: the wait's PostgreSQL connection outlives it.
    options = {"use_uvloop": settings.use_uvloop}
    storage = open_storage(settings)
    if not storage.connected() and not anyio.run(
        wait_for_storage, storage, backend_options=options
    ):
        return EXIT_OK  # stopped by a signal while waiting
    gateway = Gateway.build(settings)
    logger.info("event loop: {}", "uvloop" if settings.use_uvloop else "asyncio")
    return anyio.run(run_daemon, gateway, lock, backend_options=options)


def _check_llm(settings: Settings) -> None:
    """Raise `LLMConfigError` (one line: what to set) when no model call could succeed,
    as building the gateway would, but without loading the LLM client first."""
    from gateway.llm.credentials import check_provider_credentials

    for name, provider in settings.llm.used_providers().items():
        check_provider_credentials(name, provider.base_url, provider.resolved_api_key())


#: The workspace lock a command holds until the process ends (the kernel lets go).
_held: list[WorkspaceLock] = []


def _lock_workspace(
    settings: Settings | PartialSettings,
    command: str,
    *,
    fix: str = "it writes this workspace; stop it first, then run this again",
    always: bool = False,
    folder: Path | None = None,
) -> WorkspaceLock | None:
    """Hold the workspace's one-writer lock for `command` until this process ends, or
    raise `WorkspaceBusy` (one line: who holds it, and `fix`). Only in the file mode
    unless `always`: in the shared mode the state is the database's to guard."""
    from gateway.storage.seam import open_storage
    from gateway.storage.workspace import WorkspaceLock

    if not always and not open_storage(settings).one_writer:
        return None
    lock = WorkspaceLock(folder or settings.workspace_path)
    lock.acquire(command, doing=f"{command} refused", fix=fix)
    _held.append(lock)
    return lock


def _manager(settings: Settings | PartialSettings) -> SessionManager:
    from gateway.storage.seam import open_storage

    return open_storage(settings).sessions()


def _existing(manager: SessionManager, key: str) -> Session:
    session = manager.get(key)
    if session is None:
        raise CommandError(f"no session {key!r}; `gateway sessions list` shows the keys")
    return session


def _when(ts: float) -> str:
    from datetime import datetime

    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _message_line(message: Any) -> str:
    import json

    if message.role == "assistant" and message.tool_calls:
        calls = ", ".join(
            f"{c.function_name}({json.dumps(c.arguments)})" for c in message.tool_calls
        )
        head = f"[assistant -> {calls}]"
        return f"{head} {message.content}" if message.content else head
    if message.role == "tool":
        return f"[tool {message.name or ''}] {message.content or ''}"
    return f"[{message.role}] {message.content or ''}"


def _entry_summary(entry: Any) -> str:
    """One line for `sessions tree`: a message's line breaks and runs of spaces become
    one space each, so the tree's indentation holds."""
    import json

    data = entry.to_dict()
    kind = data.get("type", "?")
    if kind == "message":
        text = " ".join(_message_line(entry.message).split())
        return text if len(text) <= 80 else text[:77] + "..."
    detail = {k: v for k, v in data.items() if k not in ("type", "id", "parent_id", "timestamp")}
    text = json.dumps(detail, ensure_ascii=False)
    return f"<{kind}> {text if len(text) <= 70 else text[:67] + '...'}"


def cmd_sessions(args: argparse.Namespace, settings: Settings | PartialSettings) -> int:
    if args.action == "list":
        from gateway.storage.seam import open_storage

        listing = open_storage(settings).session_listing()
        try:
            _list_sessions(listing, include_archived=args.all, as_json=args.json)
        finally:
            listing.close()
        return EXIT_OK
    if args.action in ("delete", "fork"):
        _lock_workspace(settings, f"gateway sessions {args.action}")
    manager = _manager(settings)
    try:
        return _sessions_action(args, manager)
    finally:
        manager.close()


def _sessions_action(args: argparse.Namespace, manager: SessionManager) -> int:
    action = args.action
    if action == "delete":
        return _delete(args, manager)
    if action == "fork":
        forked = manager.fork(args.key, new_key=args.new_key, entry_id=args.at)
        if forked is None:
            raise CommandError("fork cancelled by a hook")
        print(forked.key)
        return EXIT_OK
    if args.archived is not None:
        session = manager.open_archived(args.key, args.archived)
    else:
        session = _existing(manager, args.key)
    if action == "show":
        ctx = session.build_context()
        if ctx.summary:
            print(f"[summary] {ctx.summary}\n")
        for message in ctx.messages:
            print(_message_line(message))
        return EXIT_OK
    if action == "tree":
        _print_tree(session)
        return EXIT_OK
    if action == "export":
        if args.format == "jsonl":
            sys.stdout.write(session.export_jsonl())
        else:
            ctx = session.build_context()
            print(f"# Session {session.key}\n")
            if ctx.summary:
                print(f"> Summary: {ctx.summary}\n")
            for message in ctx.messages:
                print(f"**{message.role}**: {message.content or ''}\n")
        return EXIT_OK
    raise CommandError(f"unknown action {action}", EXIT_USAGE)


def _list_sessions(listing: SessionListing, *, include_archived: bool, as_json: bool) -> None:
    """Current sessions, most recently active first; with `include_archived`, each
    key's archived sessions follow it (most recent first)."""
    import json

    current = listing.list_sessions()
    archived: dict[str, list[ArchivedSessionInfo]] = {}
    for info in listing.list_archived() if include_archived else []:
        archived.setdefault(info.key, []).append(info)
    # A key whose current session is gone still lists its archive, after the others.
    keys = [i.key for i in current] + sorted(set(archived) - {i.key for i in current})
    by_key = {i.key: i for i in current}
    rows: list[dict[str, Any]] = []
    for key in keys:
        if key in by_key:
            i = by_key[key]
            rows.append(
                {
                    "key": key,
                    "archived": None,
                    "updated_at": i.updated_at,
                    "size_bytes": i.size_bytes,
                }
            )
        for a in archived.get(key, []):
            rows.append(
                {
                    "key": key,
                    "archived": a.number,
                    "session_id": a.session_id,
                    "updated_at": a.archived_at,
                    "size_bytes": a.size_bytes,
                }
            )
    if as_json:
        print(json.dumps(rows))
        return
    if not rows:
        print("no sessions yet")
        return
    width = max(len(r["key"]) for r in rows)
    for r in rows:
        where = "" if r["archived"] is None else f"  --archived {r['archived']}"
        print(f"{r['key']:<{width}}  {_when(r['updated_at'])}  {r['size_bytes']:>9} B{where}")


def _delete(args: argparse.Namespace, manager: SessionManager) -> int:
    if not args.yes:
        if not sys.stdin.isatty():
            raise CommandError("refusing to delete without --yes", EXIT_USAGE)
        answer = input(f"delete session {args.key!r}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("not deleted")
            return EXIT_OK
    if not manager.delete(args.key):
        raise CommandError(f"no session {args.key!r}")
    print(f"deleted {args.key}")
    return EXIT_OK


def _print_tree(session: Session) -> None:
    leaf = session.leaf_id
    labels = session.labels

    def walk(node: Any, prefix: str, last: bool, top: bool) -> None:
        entry = node.entry
        marker = " <- leaf" if entry.id == leaf else ""
        label = f" [{labels[entry.id]}]" if entry.id in labels else ""
        connector = "" if top else ("`-- " if last else "|-- ")
        print(f"{prefix}{connector}{entry.id} {_entry_summary(entry)}{label}{marker}")
        child_prefix = prefix if top else prefix + ("    " if last else "|   ")
        for i, child in enumerate(node.children):
            walk(child, child_prefix, i == len(node.children) - 1, False)

    roots = session.get_tree()
    for i, root in enumerate(roots):
        walk(root, "", i == len(roots) - 1, True)


_NOTHING_REMEMBERED = {
    "show": "no remembered facts for {key} yet",
    "facts": "no remembered facts for {key} yet",
    "search": "no matching facts",
    "history": "no matching history",
    "messages": "no matching message",
    "knowledge": "the knowledge base is empty",
}


def cmd_memory(args: argparse.Namespace, settings: Settings) -> int:
    from gateway.storage.seam import open_storage

    if not settings.memory.enabled:
        raise CommandError("memory is disabled ([memory] enabled = false)")
    if args.action in ("compact", "correct", "forget"):
        _lock_workspace(settings, f"gateway memory {args.action}")
    if args.action == "compact":
        return _memory_compact(args, settings)
    store = open_storage(settings).memory()
    messages = args.action == "search" and args.messages  # the sessions hold them, not memory
    if not messages and not store.exists(args.key):
        if args.action in ("correct", "forget"):
            raise CommandError(f"no fact {args.id} in the memory of {args.key} (it has none)")
        # Nothing remembered yet: say so without making the scope's folder.
        print(_NOTHING_REMEMBERED[args.action].format(key=args.key))
        return EXIT_OK
    try:
        manager = store.for_session(args.key)
        if args.action in ("facts", "correct", "forget"):
            print(_memory_facts(manager, args))
        elif args.action == "show":
            text = manager.read_memory()
            print(
                text.rstrip() if text.strip() else _NOTHING_REMEMBERED["show"].format(key=args.key)
            )
        elif args.action in ("search", "history"):
            # A search answers from all the memory: it waits for an index being built
            # (after an import, or without a saved index), showing how it goes.
            if sys.stderr.isatty():
                _load_indexes_showing_progress(manager)
            kind = "messages" if messages else args.action
            if kind == "messages":
                hits = [hit.describe() for hit in manager.search_messages(args.query, 10)]
            elif kind == "search":
                hits = manager.search_memory(args.query, category=args.category)
            else:
                hits = manager.search_history(args.query)
            print("\n".join(hits) if hits else _NOTHING_REMEMBERED[kind])
        else:
            kb = manager.knowledge
            entries = kb.by_category(args.category) if args.category else list(kb)
            if not entries:
                print(_NOTHING_REMEMBERED["knowledge"])
            for entry in entries:
                print(f"[{entry.category}] {entry.content}  (used {entry.access_count}x)")
    finally:
        store.close()
    return EXIT_OK


def _load_indexes_showing_progress(memory: MemoryScope) -> None:
    """`memory.load_indexes()`, with a line on the terminal while a build is waited for."""
    shown = False

    def show(name: str, done: int, total: int) -> None:
        nonlocal shown
        shown = True
        percent = 100 * done // max(total, 1)
        sys.stderr.write(
            f"\rbuilding the search index of {name}: {percent}% of {total / 1e6:.1f} MB\x1b[K"
        )
        sys.stderr.flush()

    try:
        memory.load_indexes(progress=show)
    finally:
        if shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()


def _memory_facts(memory: MemoryScope, args: argparse.Namespace) -> str:
    """`gateway memory facts|correct|forget`: the answer, or CommandError for a fact id
    the key's memory does not have (nothing is changed then)."""
    from gateway.memory.facts import normalize_id

    if args.action == "facts":
        facts = memory.list_facts()
        if not facts:
            return _NOTHING_REMEMBERED["facts"].format(key=args.key)
        return "\n".join(fact.describe() for fact in facts)
    ident = normalize_id(args.id)
    missing = f"no fact {args.id} in the memory of {args.key}; `gateway memory facts` lists them"
    if ident is None:
        raise CommandError(missing, EXIT_USAGE)
    if args.action == "forget":
        gone = memory.forget_fact(ident)
        if gone is None:
            raise CommandError(missing)
        return f"forgotten: {gone.describe()}"
    text = " ".join(args.text).strip()
    if not text:
        raise CommandError("give the corrected text after the id", EXIT_USAGE)
    fixed = memory.correct_fact(ident, text, by="operator")
    if fixed is None:
        raise CommandError(missing)
    return f"corrected: {fixed.describe()}"


def _memory_compact(args: argparse.Namespace, settings: Settings) -> int:
    import anyio

    from gateway.daemon import Gateway

    gateway = Gateway.build(settings)
    if gateway.sessions.get(args.key) is None:
        raise CommandError(f"no session {args.key!r}; `gateway sessions list` shows the keys")

    async def main() -> int:
        try:
            assert gateway.consolidator is not None
            # This process will not be there for a retry: no "retrying in 30s".
            outcome = await gateway.consolidator.consolidate_now(args.key, force=True, retry=False)
        finally:
            await gateway.aclose()
        if not outcome.ok:
            raise CommandError(
                f"compacting {args.key} failed, nothing was lost ({outcome.error}); "
                "`gateway doctor` checks the LLM, then run it again"
            )
        print(outcome.describe())
        return EXIT_OK

    return anyio.run(main)


def cmd_doctor(args: argparse.Namespace, settings: Settings) -> int:
    from functools import partial

    import anyio

    from gateway.config import find_config_path
    from gateway.doctor import run_checks

    config_path = find_config_path(args.config, os.environ)
    findings = anyio.run(partial(run_checks, settings, config_path=config_path))
    for finding in findings:
        print(finding.line())
    failed = sum(f.status == "fail" for f in findings)
    print(f"\n{failed} problem(s) found" if failed else "\nall checks passed")
    return EXIT_FAILED if failed else EXIT_OK


def cmd_channels(args: argparse.Namespace, settings: Settings) -> int:
    """One line per installed chat platform: on or off, its package, what it offers, its
    documentation; and what keeps one from running (its library, a broken package)."""
    from dataclasses import fields

    from gateway.registry import installed

    registry = installed()
    unusable = settings.channels.unusable()
    enabled = set(settings.channels.enabled())
    for name, spec in registry.specs.items():
        offers = [
            f.name.replace("_", "-") for f in fields(spec.offers) if getattr(spec.offers, f.name)
        ]
        state = "on " if name in enabled else "off"
        print(f"{state}  {name:<12} {spec.summary}")
        print(
            f"      package {spec.distribution}; offers {', '.join(offers) or 'DMs'}; {spec.docs}"
        )
        missing = spec.missing_line()
        if missing is not None:
            print(f"      {'FAIL' if name in unusable else 'note'}: {missing}")
    for name, broken in registry.broken.items():
        print(f"{'FAIL' if name in unusable else 'warn'} {broken.line()}")
    if not registry.specs and not registry.broken:
        print("no chat platform installed (pip install 'chat-gateway[channels]')")
    return EXIT_FAILED if unusable else EXIT_OK


def cmd_people(args: argparse.Namespace, settings: Settings) -> int:
    from gateway.people.commands import cli_link, cli_list, cli_unlink
    from gateway.people.protocol import PeopleError
    from gateway.storage.seam import open_storage

    storage = open_storage(settings)
    storage.sessions().close()  # creates the private workspace if needed
    store = storage.people()
    try:
        if args.action == "link":
            print(cli_link(store, args.ids))
        elif args.action == "unlink":
            print(cli_unlink(store, args.id))
        else:
            print(cli_list(store))
    except PeopleError as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
    if settings.memory.scope != "person":
        print('note: memory.scope is not "person"; links take effect once it is', file=sys.stderr)
    return EXIT_OK


def cmd_usage(args: argparse.Namespace, settings: Settings) -> int:
    import json
    import time

    from gateway.daemon import build_usage_meter
    from gateway.messages import session_key_from_name
    from gateway.storage.seam import open_storage
    from gateway.usage.meter import usage_table
    from gateway.usage.protocol import day_of

    key = session_key_from_name(args.session) if args.session else None
    since = day_of(time.time() - (args.days - 1) * 86400)
    meter = build_usage_meter(open_storage(settings))
    try:
        rows = meter.ledger.rows(since=since, session_key=key)
    finally:
        meter.ledger.close()
    if args.json:
        for row in rows:
            print(json.dumps(row.to_dict()))
    else:
        print(usage_table(rows, meter.prices, since=since))
    return EXIT_OK


def cmd_pairing(args: argparse.Namespace, settings: Settings) -> int:
    from gateway.access.commands import cli_pairing_approve, cli_pairing_list, cli_pairing_revoke
    from gateway.access.protocol import PairingError
    from gateway.daemon import access_policies
    from gateway.storage.seam import open_storage

    channels = sorted(access_policies(settings))  # the platforms that pair senders
    if args.channel is not None and args.channel not in channels:
        raise CommandError(
            f"unknown channel {args.channel!r}; pairing is for "
            f"{', '.join(channels[:-1])} or {channels[-1]}",
            EXIT_USAGE,
        )
    storage = open_storage(settings)
    storage.sessions().close()  # creates the private workspace if needed
    store = storage.pairing()
    try:
        if args.action == "approve":
            print(cli_pairing_approve(store, args.channel, args.code))
        elif args.action == "list":
            print(cli_pairing_list(store, args.channel))
        else:
            print(cli_pairing_revoke(store, args.channel, args.sender))
    except PairingError as exc:
        raise CommandError(str(exc)) from None
    return EXIT_OK


def cmd_cache(args: argparse.Namespace, settings: Settings) -> int:
    import dataclasses
    import json

    import anyio

    from gateway.cache import CacheUnavailable
    from gateway.daemon import build_cache

    cache = build_cache(settings)
    if cache is None:
        raise CommandError("the cache is disabled ([cache] enabled = false)")

    async def main() -> int:
        try:
            if args.action == "stats":
                st = await cache.stats()
                if args.json:
                    print(json.dumps(dataclasses.asdict(st)))
                else:
                    print(f"backend:  {st.backend}")
                    print(f"entries:  {st.entries}")
                    print(f"hits:     {st.hits}")
                    print(f"misses:   {st.misses}")
                    print(f"hit rate: {st.hit_rate:.1%}")
                    print(f"bytes:    {st.bytes}")
            elif args.action == "clear":
                print(f"removed {await cache.clear()} entries")
            else:
                removed = await cache.invalidate(
                    args.key,
                    model=args.by_model,
                    session_key=args.session,
                    shared=args.shared,
                )
                print(f"removed {removed} entries")
            return EXIT_OK
        except CacheUnavailable as exc:
            raise CommandError(f"cache {args.action} failed: {exc}") from None
        finally:
            await cache.aclose()

    return anyio.run(main)


def _resolve_session_names(args: argparse.Namespace) -> None:
    """Every session a command names, as a key: `work` is `cli:work` here as in `chat
    --session work`, and a full key (`telegram:123`) stays as it is."""
    from gateway.messages import session_key_from_name

    if args.command in ("sessions", "memory") and getattr(args, "key", None) is not None:
        args.key = session_key_from_name(args.key)
    if getattr(args, "new_key", None) is not None:
        args.new_key = session_key_from_name(args.new_key)
    if (
        args.command in ("chat", "cache", "schedules")
        and getattr(args, "session", None) is not None
    ):
        args.session = session_key_from_name(args.session)


def cmd_db(args: argparse.Namespace, settings: Settings) -> int:
    from gateway.storage.commands import db_migrate, db_status

    if args.action == "status":
        return db_status(settings, as_json=args.json)
    return db_migrate(settings)


def cmd_storage(args: argparse.Namespace, settings: Settings) -> int:
    from gateway.storage.commands import storage_transfer
    from gateway.storage.workspace import WorkspaceBusy, holder

    # A workspace a gateway writes to is neither copied (its newest appends would be
    # missed) nor written into: checked without leaving a lock file in a folder that
    # may be nobody's workspace yet.
    folder = Path(args.dir).expanduser()
    running = holder(folder)
    if running is not None:
        raise WorkspaceBusy(
            folder,
            running,
            f"gateway storage {args.action} refused",
            "stop it first, then run this again",
        )
    return storage_transfer(settings, args.action, args.dir)


def cmd_schedules(args: argparse.Namespace, settings: Settings) -> int:
    import json

    from gateway.storage.seam import open_storage

    store = open_storage(settings).jobs()
    if args.action == "cancel":
        job = store.remove(args.id)
        if job is None:
            raise CommandError(f"no scheduled job {args.id!r}; `gateway schedules list` shows them")
        print(f"cancelled {job.describe()} (owner {job.owner})")
        return EXIT_OK
    jobs = store.jobs(args.session)
    if args.json:
        print(json.dumps([job.to_dict() for job in jobs], indent=2))
    elif not jobs:
        print("no scheduled jobs")
    else:
        for job in jobs:
            print(f"{job.describe()}  [owner {job.owner}, runs {job.runs}]")
    return EXIT_OK


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "init":
        return cmd_init(args)
    _resolve_session_names(args)
    if args.command == "sessions":
        from gateway.config import load_sections

        partial = load_sections(args.config, SESSIONS_SECTIONS, overrides=_overrides(args))
        # The modules a sessions command runs, in either storage mode, log through
        # gateway.logs' logger: loguru is imported, and set up, only if something is logged.
        _start(args, partial, sections=SESSIONS_SECTIONS, defer=True)
        return cmd_sessions(args, partial)
    settings = _settings(args)
    _start(args, settings)
    handlers: dict[str, Callable[[argparse.Namespace, Settings], int]] = {
        "run": cmd_run,
        "chat": cmd_chat,
        "cache": cmd_cache,
        "pairing": cmd_pairing,
        "schedules": cmd_schedules,
        "doctor": cmd_doctor,
        "channels": cmd_channels,
        "memory": cmd_memory,
        "db": cmd_db,
        "storage": cmd_storage,
        "usage": cmd_usage,
        "people": cmd_people,
    }
    return handlers[args.command](args, settings)


def _start(
    args: argparse.Namespace,
    settings: Settings | PartialSettings,
    *,
    sections: Sequence[str] | None = None,
    defer: bool = False,
) -> None:
    """Set up logging (`defer`: at its first use), then warn of misspelt GATEWAY_*
    variables (of `sections` only, when given) and check the workspace; the doctor
    reports those two among its findings instead."""
    from gateway.config import env_warnings
    from gateway.logs import logger, setup_logging
    from gateway.storage.workspace import check_workspace

    level = _log_level(args, settings)
    setup_logging(level, settings.log.format, settings.redactor, defer=defer)
    if args.command != "doctor":
        for warning in env_warnings(os.environ, sections):
            logger.warning(warning)
        check_workspace(settings)


def _log_level(args: argparse.Namespace, settings: Settings | PartialSettings) -> str:
    """The daemon logs at `log.level`. Everything else a person runs in a terminal (the
    terminal chat, a one-shot `chat -m`, `sessions`, `memory`...) shows only warnings
    and errors, unless `-v` or `--log-level` asks for more: its output is the answer."""
    level = settings.log.level
    if args.log_level:
        return level
    run = args.command == "run"
    terminal_chat = run and settings.channels.cli.enabled and sys.stdin.isatty()
    daemon = run and not terminal_chat
    if args.verbose:
        return "INFO" if level in ("WARNING", "ERROR", "CRITICAL") else level
    if args.command == "memory" and level not in ("TRACE", "DEBUG"):
        return "ERROR"  # a memory command says in one line how it went; logs would repeat it
    if not daemon and level in ("TRACE", "DEBUG", "INFO"):
        return "WARNING"
    return level


def _user_error_code(exc: BaseException) -> int | None:
    """Print a user-caused error as one line and return its exit code; None if `exc` is
    a bug (then it propagates with its traceback)."""
    from gateway.config import EXIT_CONFIG, ConfigError
    from gateway.llm.types import LLMConfigError
    from gateway.plumbing.postgres import StorageError, StorageUnavailable
    from gateway.sessions.errors import SessionError
    from gateway.storage.workspace import (
        EXIT_BUSY,
        WorkspaceBusy,
        WorkspaceError,
        cannot_write,
        write_denied,
    )

    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(exc, ConfigError):
        for line in str(exc).splitlines():
            print(f"gateway: config error: {line}", file=sys.stderr)
        return EXIT_CONFIG
    if isinstance(exc, LLMConfigError):
        print(f"gateway: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if isinstance(exc, CommandError):
        print(f"gateway: {exc}", file=sys.stderr)
        return exc.code
    if isinstance(exc, WorkspaceBusy):
        print(f"gateway: {exc}", file=sys.stderr)
        return EXIT_BUSY
    if isinstance(exc, WorkspaceError):
        print(f"gateway: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if write_denied(exc) and isinstance(exc, OSError) and exc.filename:
        # Any file the gateway may not write (one owned by another user, say): the
        # operator's to fix, like an unwritable workspace.
        print(f"gateway: {cannot_write(exc.filename, exc)}", file=sys.stderr)
        return EXIT_CONFIG
    if _is_bind_error(exc):
        print(f"gateway: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if isinstance(exc, ValueError):  # e.g. a session key that cannot be stored
        print(f"gateway: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(exc, SessionError):  # no such entry, key taken, file unwritable
        print(f"gateway: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if isinstance(exc, StorageUnavailable):
        print(f"gateway: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    if isinstance(exc, StorageError):
        print(f"gateway: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if isinstance(exc, KeyboardInterrupt):
        return 130
    return None


def _is_bind_error(exc: BaseException) -> bool:
    """Could the HTTP server not listen? Asked without importing the server (aiohttp):
    when its module was never loaded, none of its errors was raised."""
    if "gateway.http.server" not in sys.modules:
        return False
    from gateway.http.server import HttpBindError

    return isinstance(exc, HttpBindError)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        return _dispatch(args)
    except (Exception, KeyboardInterrupt) as exc:
        code = _user_error_code(exc)
        if code is None:
            raise
        return code


if __name__ == "__main__":
    sys.exit(main())
