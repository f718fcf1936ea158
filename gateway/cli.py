"""Command line: `gateway run | chat | init | sessions ...`.

Errors a user can cause end in one line on stderr and a distinct exit code, never a
traceback: 2 for bad usage or input, 78 for configuration, 1 for a failed operation.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from gateway import __version__
from gateway.config import EXIT_CONFIG, ConfigError, Settings, load_settings, write_starter_config
from gateway.llm.types import LLMConfigError
from gateway.logs import setup_logging

if TYPE_CHECKING:
    from gateway.sessions import Session, SessionManager

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 69  # sysexits EX_UNAVAILABLE: a service we need does not answer


class CommandError(Exception):
    """A command could not do what was asked; the message says why and what to do."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gateway", description="Chat gateway: talk to an LLM agent from chat apps."
    )
    parser.add_argument("--version", action="version", version=f"gateway {__version__}")
    parser.add_argument("--config", metavar="PATH", help="config file (default ./gateway.toml)")
    parser.add_argument("--workspace", metavar="DIR", help="data folder (also GATEWAY_WORKSPACE)")
    parser.add_argument("--model", metavar="NAME", help="LLM model (also GATEWAY_MODEL)")
    parser.add_argument("--log-level", metavar="LEVEL", help="TRACE, DEBUG, INFO, WARNING, ERROR")
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
    for name, text in (
        ("show", "the conversation on the current branch"),
        ("tree", "every entry of the session as a tree"),
    ):
        ssub.add_parser(name, help=text).add_argument("key")
    fork = ssub.add_parser("fork", help="copy the current branch into a new session")
    fork.add_argument("key")
    fork.add_argument("--at", metavar="ENTRY_ID", help="fork at this entry instead of the leaf")
    fork.add_argument("--as", dest="new_key", metavar="NEW_KEY", help="key of the new session")
    delete = ssub.add_parser("delete", help="delete a session's current file")
    delete.add_argument("key")
    delete.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    export = ssub.add_parser("export", help="print a session (JSONL entries or Markdown)")
    export.add_argument("key")
    export.add_argument("--format", choices=("jsonl", "markdown"), default="jsonl")

    memory = sub.add_parser("memory", help="inspect a conversation's long-term memory")
    msub = memory.add_subparsers(dest="action", metavar="ACTION", required=True)
    msub.add_parser("show", help="MEMORY.md of the session's memory scope").add_argument("key")
    msearch = msub.add_parser("search", help="search the remembered facts")
    msearch.add_argument("key")
    msearch.add_argument("query")
    msearch.add_argument("--category", help="only facts of this category")
    mhist = msub.add_parser("history", help="search the conversation summaries (HISTORY.md)")
    mhist.add_argument("key")
    mhist.add_argument("query")
    msub.add_parser("compact", help="consolidate the session into memory now").add_argument("key")
    mknow = msub.add_parser("knowledge", help="the knowledge base entries")
    mknow.add_argument("key")
    mknow.add_argument("--category", help="only this category")

    sub.add_parser("doctor", help="check the installation and say what to fix")

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
    return parser


def _settings(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {"workspace": args.workspace, "llm.model": args.model}
    if args.log_level:
        overrides["log.level"] = args.log_level
    return load_settings(args.config, overrides=overrides)


# ----------------------------------------------------------------------------- commands


def cmd_init(args: argparse.Namespace) -> int:
    path = Path(args.path)
    write_starter_config(path)
    print(f"wrote {path}; edit it, then set OPENAI_API_KEY (or OPENAI_BASE_URL) and run it")
    return EXIT_OK


def cmd_chat(args: argparse.Namespace, settings: Settings) -> int:
    from channels.cli import CLIChannel, cli_session_key
    from gateway.daemon import Gateway

    key = cli_session_key(args.session)
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
    from gateway.daemon import Gateway, run_daemon

    gateway = Gateway.build(settings)
    return anyio.run(run_daemon, gateway)


def _manager(settings: Settings) -> SessionManager:
    from gateway.daemon import build_session_manager

    return build_session_manager(settings)


def _existing(manager: SessionManager, key: str) -> Session:
    session = manager.get(key)
    if session is None:
        raise CommandError(f"no session {key!r}; `gateway sessions list` shows the keys")
    return session


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _message_line(message: Any) -> str:
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
    data = entry.to_dict()
    kind = data.get("type", "?")
    if kind == "message":
        text = _message_line(entry.message)
        return text if len(text) <= 80 else text[:77] + "..."
    detail = {k: v for k, v in data.items() if k not in ("type", "id", "parent_id", "timestamp")}
    text = json.dumps(detail, ensure_ascii=False)
    return f"<{kind}> {text if len(text) <= 70 else text[:67] + '...'}"


def cmd_sessions(args: argparse.Namespace, settings: Settings) -> int:
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
    if action == "list":
        infos = manager.list_sessions()
        if args.json:
            print(
                json.dumps(
                    [
                        {"key": i.key, "updated_at": i.updated_at, "size_bytes": i.size_bytes}
                        for i in infos
                    ]
                )
            )
        elif not infos:
            print("no sessions yet")
        else:
            width = max(len(i.key) for i in infos)
            for info in infos:
                print(f"{info.key:<{width}}  {_when(info.updated_at)}  {info.size_bytes:>9} B")
        return EXIT_OK
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


def cmd_memory(args: argparse.Namespace, settings: Settings) -> int:
    from gateway.memory import MemoryStore

    if not settings.memory.enabled:
        raise CommandError("memory is disabled ([memory] enabled = false)")
    if args.action == "compact":
        return _memory_compact(args, settings)
    store = MemoryStore(settings.workspace_path, mode=settings.memory.scope)
    try:
        manager = store.for_session(args.key)
        if args.action == "show":
            text = manager.read_memory()
            print(text.rstrip() if text.strip() else f"no remembered facts for {args.key} yet")
        elif args.action == "search":
            hits = manager.search_memory(args.query, category=args.category)
            print("\n".join(hits) if hits else "no matching facts")
        elif args.action == "history":
            hits = manager.search_history(args.query)
            print("\n".join(hits) if hits else "no matching history")
        else:
            kb = manager.knowledge
            entries = kb.by_category(args.category) if args.category else list(kb)
            if not entries:
                print("the knowledge base is empty")
            for entry in entries:
                print(f"[{entry.category}] {entry.content}  (used {entry.access_count}x)")
    finally:
        store.close()
    return EXIT_OK


def _memory_compact(args: argparse.Namespace, settings: Settings) -> int:
    from gateway.daemon import Gateway

    gateway = Gateway.build(settings)
    if gateway.sessions.get(args.key) is None:
        raise CommandError(f"no session {args.key!r}; `gateway sessions list` shows the keys")

    async def main() -> int:
        try:
            assert gateway.consolidator is not None
            outcome = await gateway.consolidator.consolidate_now(args.key, force=True)
        finally:
            await gateway.aclose()
        print(outcome.describe())
        return EXIT_OK if outcome.ok else EXIT_FAILED

    return anyio.run(main)


def cmd_doctor(args: argparse.Namespace, settings: Settings) -> int:
    from gateway.doctor import run_checks

    findings = anyio.run(run_checks, settings)
    for finding in findings:
        print(finding.line())
    failed = sum(f.status == "fail" for f in findings)
    print(f"\n{failed} problem(s) found" if failed else "\nall checks passed")
    return EXIT_FAILED if failed else EXIT_OK


def cmd_pairing(args: argparse.Namespace, settings: Settings) -> int:
    from gateway.access import (
        PairingError,
        PairingStore,
        cli_pairing_approve,
        cli_pairing_list,
        cli_pairing_revoke,
    )
    from gateway.daemon import build_session_manager, pairing_path

    build_session_manager(settings).close()  # creates the private workspace if needed
    store = PairingStore(pairing_path(settings))
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


def cmd_db(args: argparse.Namespace, settings: Settings) -> int:
    from gateway.storage.commands import db_migrate, db_status

    if args.action == "status":
        return db_status(settings, as_json=args.json)
    return db_migrate(settings)


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "init":
        return cmd_init(args)
    settings = _settings(args)
    terminal_chat = settings.channels.cli.enabled and sys.stdin.isatty()
    interactive = (args.command == "run" and terminal_chat) or (
        args.command == "chat" and args.message is None
    )
    level = settings.log.level
    if interactive and not args.log_level and level in ("TRACE", "DEBUG", "INFO"):
        level = "WARNING"  # keep the terminal chat readable
    setup_logging(level, settings.log.format, settings.secrets())
    handlers: dict[str, Callable[[argparse.Namespace, Settings], int]] = {
        "run": cmd_run,
        "chat": cmd_chat,
        "sessions": cmd_sessions,
        "cache": cmd_cache,
        "pairing": cmd_pairing,
        "doctor": cmd_doctor,
        "memory": cmd_memory,
        "db": cmd_db,
    }
    return handlers[args.command](args, settings)


def _user_error_code(exc: BaseException) -> int | None:
    """Print a user-caused error as one line and return its exit code; None if `exc` is
    a bug (then it propagates with its traceback)."""
    from gateway.http import HttpBindError
    from gateway.sessions.errors import SessionError
    from gateway.storage.postgres import StorageError, StorageUnavailable

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
    if isinstance(exc, HttpBindError):
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
