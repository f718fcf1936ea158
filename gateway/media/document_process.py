"""PDF and DOCX files read in a child process that a memory limit and a deadline bound.

The promise: reading one document takes at most `max_memory_bytes` of memory, none of
it the gateway's, and at most `max_seconds` + 5 s once it starts, whatever the file
holds.

Why a process, not a worker thread: the reader's budgets (gateway.media.documents) are
checked between steps, and one step can be a call into C (zlib inflating a stream,
libxml2 parsing) or a long loop inside pypdf (it skips whitespace a byte at a time: 8 s
for 40 MB of it) that nothing outside can interrupt in a thread, and whose allocations
Python cannot refuse. A child process can be held by the kernel to an address-space limit
(RLIMIT_AS: an allocation past it fails, and the child answers that the document needs
more memory than it may have) and killed at a deadline; when it dies, the gateway does
not. A fresh interpreter costs about 0.2 s per document (pypdf and lxml load in the
child only), small next to the model's answer. At most `concurrent` children run at
once, so the worst case is that many times the memory limit. The child gets only the
environment it needs to start: no API key or token reaches a parser of strangers' files.

The child reads one JSON line (name, type, limits) and the file's bytes from stdin, and
writes one JSON object to stdout: the DocumentText's fields, or `error` (the reason in
one line), with `peak_rss_kb`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import anyio
from loguru import logger

from gateway.media.documents import (
    MB,
    DocumentLimits,
    DocumentText,
    document_kind,
    document_text,
    unsupported,
)
from gateway.media.errors import MediaError

#: How long past `max_seconds` a child may run before it is killed (its own clock
#: stops reading at `max_seconds`; this is for a child stuck inside one step).
KILL_GRACE_SECONDS = 5.0
_MAX_ANSWER = 16 * 1024 * 1024  # the text is at most max_chars, JSON-escaped
_SEND_CHUNK = 64 * 1024


@dataclass(frozen=True, slots=True)
class ReaderOutcome:
    """What one child made of a document: its text, or the one line saying why it was
    refused; the child's peak resident memory (None where it cannot be known) and the
    time it took, start to exit."""

    document: DocumentText | None
    error: str | None
    peak_rss_bytes: int | None
    seconds: float


class DocumentReaders:
    """Reads documents: text files in a worker thread, PDF and DOCX files in child
    processes, at most `concurrent` of those at once."""

    def __init__(self, limits: DocumentLimits, concurrent: int = 2) -> None:
        self.limits = limits
        self._slots = anyio.CapacityLimiter(concurrent)

    async def read(self, data: bytes, *, name: str, mime_type: str) -> DocumentText:
        """The document's text. Raises MediaError with the reason it was refused."""
        kind = document_kind(name, mime_type)
        if kind is None:
            raise unsupported(mime_type)
        if kind == "text":  # nothing to unpack or parse: a decode, bounded by the download
            return await anyio.to_thread.run_sync(
                lambda: document_text(data, name=name, mime_type=mime_type, limits=self.limits)
            )
        async with self._slots:
            outcome = await run_reader(data, name=name, mime_type=mime_type, limits=self.limits)
        peak = "?" if outcome.peak_rss_bytes is None else f"{outcome.peak_rss_bytes / MB:.0f}"
        stopped = outcome.document.stopped if outcome.document else None
        logger.info(
            "document {} ({:.1f} MB) read in {:.1f} s, reader peak {} MB: {}",
            name,
            len(data) / MB,
            outcome.seconds,
            peak,
            outcome.error or (f"stopped at the {stopped} budget" if stopped else "ok"),
        )
        if outcome.document is None:
            raise MediaError(outcome.error or "the document could not be read")
        return outcome.document


async def run_reader(
    data: bytes,
    *,
    name: str,
    mime_type: str,
    limits: DocumentLimits,
    kill_after: float | None = None,
) -> ReaderOutcome:
    """Read `data` in a child process (see the module docstring), killed after
    `kill_after` seconds (by default `max_seconds` + KILL_GRACE_SECONDS)."""
    header = {"name": name, "mime_type": mime_type, "limits": dataclasses.asdict(limits)}
    deadline = limits.max_seconds + KILL_GRACE_SECONDS if kill_after is None else kill_after
    started = time.monotonic()
    # -P: the working directory (where people's files may be) is not on its import path.
    command = [sys.executable, "-P", "-m", "gateway.media.document_process"]
    answer, errors = b"", b""
    async with await anyio.open_process(command, env=_child_env()) as process:
        stdin, stdout, stderr = process.stdin, process.stdout, process.stderr
        assert stdin is not None and stdout is not None and stderr is not None

        async def send() -> None:
            try:
                await stdin.send(json.dumps(header).encode() + b"\n")
                for start in range(0, len(data), _SEND_CHUNK):  # no copy of the whole file
                    await stdin.send(data[start : start + _SEND_CHUNK])
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass  # the child stopped reading (or died): its answer says why
            finally:
                await stdin.aclose()

        async def drain() -> None:
            nonlocal errors
            async for chunk in stderr:
                errors = (errors + chunk)[-4096:]  # the end of a traceback is enough

        with anyio.move_on_after(deadline) as scope:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(send)
                tasks.start_soon(drain)
                async for chunk in stdout:
                    answer += chunk
                    if len(answer) > _MAX_ANSWER:
                        break
            await process.wait()
        if scope.cancelled_caught:
            peak = _peak_rss(process.pid)
            process.kill()  # the context's exit waits for it
            reason = f"reading it took longer than {deadline:.0f} s, so I stopped"
            return ReaderOutcome(None, reason, peak, time.monotonic() - started)
    seconds = time.monotonic() - started
    try:
        result: dict[str, Any] = json.loads(answer)
    except ValueError:
        logger.error(
            "the document reader for {} ended with code {} and no answer: {}",
            name,
            process.returncode,
            errors.decode(errors="replace").strip()[-2000:],
        )
        return ReaderOutcome(None, "the document reader failed on it", None, seconds)
    peak_kb = result.pop("peak_rss_kb", None)
    peak_bytes = peak_kb * 1024 if isinstance(peak_kb, int) else None
    if "error" in result:
        return ReaderOutcome(None, str(result["error"]), peak_bytes, seconds)
    return ReaderOutcome(DocumentText(**result), None, peak_bytes, seconds)


#: What the child needs of the gateway's environment: to find Python and this package.
#: Nothing else goes to a process that parses files strangers sent: no API key, no token.
_CHILD_ENV = ("PATH", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "LANG", "LC_ALL", "TMPDIR")


def _child_env() -> dict[str, str]:
    return {key: os.environ[key] for key in _CHILD_ENV if key in os.environ}


def _peak_rss(pid: int) -> int | None:
    """A process's peak resident memory in bytes, from /proc (Linux); None elsewhere.
    Not getrusage's ru_maxrss: Linux carries that over an exec, so a child would report
    the gateway's own size from before it was spawned."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _limit_memory(max_bytes: int) -> None:
    """Hold this process to `max_bytes` of address space (where the OS enforces it)."""
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (max_bytes, max_bytes))
    except (ImportError, ValueError, OSError):
        pass  # not enforced here (macOS, Windows): the deadline still holds


def main() -> None:
    """The child: read the request from stdin, answer on stdout (see the docstring)."""
    started = time.monotonic()
    request = json.loads(sys.stdin.buffer.readline())
    limits = DocumentLimits(**request["limits"])
    _limit_memory(limits.max_memory_bytes)
    answer: dict[str, Any]
    try:
        # pypdf reports what it repairs through logging; the answer is what counts here.
        import logging

        logging.getLogger("pypdf").setLevel(logging.ERROR)
        data = sys.stdin.buffer.read()
        document = document_text(
            data,
            name=request["name"],
            mime_type=request["mime_type"],
            limits=limits,
            started=started,
        )
        answer = dataclasses.asdict(document)
    except MediaError as exc:
        answer = {"error": str(exc)}
    except MemoryError:
        data = b""
        answer = {
            "error": f"reading it needs more than {limits.max_memory_bytes >> 20} MB of memory, "
            "so I stopped"
        }
    peak = _peak_rss(os.getpid())
    if peak is not None:
        answer["peak_rss_kb"] = peak // 1024
    sys.stdout.write(json.dumps(answer))
    sys.stdout.flush()
    os._exit(0)  # nothing to clean up, and a large heap is not worth tearing down


if __name__ == "__main__":
    main()
