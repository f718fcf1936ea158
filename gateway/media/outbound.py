"""Files that go out with a reply: long code blocks as files, and the `send_file` tool."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any

from gateway.messages import OutboundFile

_FENCE = re.compile(r"^```([\w+#.-]*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_EXTENSIONS = {
    "python": "py",
    "py": "py",
    "javascript": "js",
    "js": "js",
    "typescript": "ts",
    "ts": "ts",
    "json": "json",
    "yaml": "yaml",
    "yml": "yaml",
    "toml": "toml",
    "bash": "sh",
    "sh": "sh",
    "shell": "sh",
    "sql": "sql",
    "html": "html",
    "css": "css",
    "go": "go",
    "rust": "rs",
    "java": "java",
    "c": "c",
    "cpp": "cpp",
    "c++": "cpp",
    "csharp": "cs",
    "ruby": "rb",
    "markdown": "md",
    "md": "md",
    "csv": "csv",
    "xml": "xml",
}
_MIME = {"json": "application/json", "csv": "text/csv", "html": "text/html", "xml": "text/xml"}
#: The largest file the `send_file` tool makes.
MAX_TOOL_FILE_BYTES = 5 * 1024 * 1024
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._ -]+")


def mime_for(name: str) -> str:
    suffix = PurePosixPath(name).suffix.lstrip(".").lower()
    return _MIME.get(suffix, "text/plain")


def code_blocks_as_files(text: str, min_chars: int) -> tuple[str, tuple[OutboundFile, ...]]:
    """`text` with each fenced code block longer than `min_chars` replaced by a line
    naming the file it goes out as (`snippet-1.py`, from the block's language), and
    those files. `min_chars` 0 leaves the text as it is."""
    if min_chars <= 0:
        return text, ()
    files: list[OutboundFile] = []

    def cut(match: re.Match[str]) -> str:
        code = match.group(2)
        if len(code) <= min_chars:
            return match.group(0)
        extension = _EXTENSIONS.get(match.group(1).lower(), "txt")
        name = f"snippet-{len(files) + 1}.{extension}"
        files.append(OutboundFile(name, code.encode("utf-8"), mime_type=mime_for(name)))
        lines = code.count("\n") + (not code.endswith("\n"))
        return f"(The code, {lines} lines, is attached as {name}.)"

    return _FENCE.sub(cut, text), tuple(files)


def safe_file_name(name: str) -> str:
    """A file name without folders or odd characters (the platform shows it)."""
    base = PurePosixPath(name.replace("\\", "/")).name
    cleaned = _SAFE_NAME.sub("_", base).strip(" .")
    return cleaned[:100] or "file.txt"


def send_file_handler(attach: Callable[[OutboundFile], None], args: dict[str, Any]) -> str:
    """The `send_file` tool: a text file from the model's arguments goes out with the
    reply. Returns what the model is told."""
    name = safe_file_name(str(args.get("name") or "file.txt"))
    content = args.get("content")
    if not isinstance(content, str):
        return "error: give the file's text as `content`"
    data = content.encode("utf-8")
    if len(data) > MAX_TOOL_FILE_BYTES:
        return f"error: the file is {len(data):,} bytes; the limit is {MAX_TOOL_FILE_BYTES:,}"
    caption = str(args.get("caption") or "")[:1000]
    attach(OutboundFile(name, data, mime_type=mime_for(name), caption=caption))
    return f"{name} ({len(data):,} bytes) will be sent with your reply."
