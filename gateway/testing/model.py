"""The conformance kit's model: a small OpenAI-compatible server on 127.0.0.1 that echoes.

The gateway's real `openai` client talks to it over HTTP: ``POST /v1/chat/completions``
(a JSON ``chat.completion``, or with ``stream`` server-sent ``chat.completion.chunk``
events and ``data: [DONE]``) and ``GET /v1/models``. Its answer to a conversation is
``echo: <the last user message>``, so a scenario finds in the bot's posts which message
each one answers. The echo is one line (each line break of the message, the one after a
group message's sender header too, is one space): on a platform whose posts are
lines (IRC) each answer is then one post, as elsewhere. Words in that message steer it
(`answer_for`):

| word | what the model does |
|---|---|
| ``kit:slow=<seconds>`` | answers after that many seconds (else after `delay`) |
| ``kit:long=<characters>`` | adds that many characters of numbered lines (``L00001``) |
| ``kit:everyone`` | adds `everyone_text` (the platform's ping of everyone) |

Every request is recorded (`requests`, `asked`), so a scenario checks what the model was
never asked: a stranger's message, the chatter of a busy room.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

__all__ = ["Answer", "KitModel", "ModelRequest", "answer_for", "long_text"]

_LINE_BREAKS = re.compile(r"[ \t]*[\r\n]+[ \t]*")

MODEL = "kit-model"
API_KEY = "kit-model-key"
#: What /v1/models says of the model's window (vLLM's field; the gateway reads it).
CONTEXT_WINDOW = 32768

_SLOW = re.compile(r"\bkit:slow=(\d+(?:\.\d+)?)")
_LONG = re.compile(r"\bkit:long=(\d+)")
_EVERYONE = re.compile(r"\bkit:everyone\b")
LONG_LINE = re.compile(r"\bL(\d{5})\b")


@dataclass(frozen=True, slots=True)
class Answer:
    """What the model says to one request, and how long it thinks first."""

    text: str
    delay: float


@dataclass(frozen=True, slots=True)
class ModelRequest:
    """One chat request as it arrived: when, whether streamed, and its messages' texts."""

    at: float
    stream: bool
    texts: tuple[str, ...]

    @property
    def last_user_text(self) -> str:
        return self.texts[-1] if self.texts else ""


def content_text(content: Any) -> str:
    """The text of a message's `content`: a string, or the text parts of a list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(part.get("text", ""))
            for part in content
            if isinstance(part, dict) and part.get("type") == "text"
        )
    return ""


def last_user_text(messages: Sequence[Any]) -> str:
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            return content_text(message.get("content"))
    return ""


def long_text(characters: int) -> str:
    """Numbered lines (``L00001 ...``), at least `characters` long in all: a reply whose
    every part can be found, in order, once the platform has split it."""
    lines: list[str] = []
    size = 0
    for number in itertools.count(1):
        line = f"L{number:05d} is line {number} of a long answer, in order."
        lines.append(line)
        size += len(line) + 1
        if size >= characters:
            break
    return "\n".join(lines)


def answer_for(messages: Sequence[Any], *, delay: float = 0.0, everyone_text: str = "") -> Answer:
    """The model's answer to a conversation (see the module docstring)."""
    said = last_user_text(messages)
    text = "echo: " + _LINE_BREAKS.sub(" ", said)
    if everyone_text and _EVERYONE.search(said) is not None:
        text += f" {everyone_text}"
    if (found := _LONG.search(said)) is not None:
        text += "\n\n" + long_text(int(found.group(1)))
    if (found := _SLOW.search(said)) is not None:
        delay = float(found.group(1))
    return Answer(text, delay)


class KitModel:
    """The model server, served from a thread of its own (`running`). `delay` and
    `everyone_text` may be changed while it runs; they apply to the next requests."""

    def __init__(self, *, delay: float = 0.0, everyone_text: str = "") -> None:
        self.delay = delay
        self.everyone_text = everyone_text
        self.model = MODEL
        self.api_key = API_KEY
        self._lock = threading.Lock()
        self._requests: list[ModelRequest] = []
        self._ids = itertools.count(1)
        self._port: int | None = None

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (``http://127.0.0.1:<port>/v1``)."""
        if self._port is None:
            raise RuntimeError("the kit's model is not running")
        return f"http://127.0.0.1:{self._port}/v1"

    @property
    def requests(self) -> list[ModelRequest]:
        """Every chat request so far, in arrival order (a copy)."""
        with self._lock:
            return list(self._requests)

    def asked(self, pattern: re.Pattern[str]) -> set[str]:
        """Everything `pattern` finds in any message of any request so far."""
        return {found for r in self.requests for text in r.texts for found in pattern.findall(text)}

    @classmethod
    @contextlib.contextmanager
    def running(cls, **kwargs: Any) -> Iterator[KitModel]:
        """A model serving on a free port for the `with` block."""
        model = cls(**kwargs)
        loop = asyncio.new_event_loop()
        started = threading.Event()
        failures: list[BaseException] = []
        runner: list[web.AppRunner] = []

        async def start() -> None:
            app = web.Application(client_max_size=64 * 2**20)
            app.router.add_post("/v1/chat/completions", model._chat)
            app.router.add_get("/v1/models", model._models)
            app.router.add_get("/v1/models/{name}", model._model)
            served = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
            await served.setup()
            site = web.TCPSite(served, "127.0.0.1", 0)
            await site.start()
            runner.append(served)
            model._port = int(served.addresses[0][1])

        def serve() -> None:
            try:
                loop.run_until_complete(start())
            except BaseException as exc:
                failures.append(exc)
                return
            finally:
                started.set()
            loop.run_forever()
            loop.run_until_complete(runner[0].cleanup())
            loop.close()

        thread = threading.Thread(target=serve, name="kit-model", daemon=True)
        thread.start()
        started.wait(10)
        if failures:
            raise failures[0]
        try:
            yield model
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)

    # -- HTTP -------------------------------------------------------------------------

    def _refused(self, request: web.Request) -> web.Response | None:
        if request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return _error(401, "Incorrect API key provided.", "invalid_api_key")
        return None

    async def _models(self, request: web.Request) -> web.Response:
        if (refused := self._refused(request)) is not None:
            return refused
        return web.json_response({"object": "list", "data": [self._model_object()]})

    async def _model(self, request: web.Request) -> web.Response:
        if (refused := self._refused(request)) is not None:
            return refused
        if request.match_info["name"] != self.model:
            return _error(404, f"The model `{request.match_info['name']}` does not exist.")
        return web.json_response(self._model_object())

    def _model_object(self) -> dict[str, Any]:
        return {
            "id": self.model,
            "object": "model",
            "created": 1_700_000_000,
            "owned_by": "gateway-testing",
            "max_model_len": CONTEXT_WINDOW,
        }

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        if (refused := self._refused(request)) is not None:
            return refused
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "We could not parse the JSON body of your request.")
        messages = body.get("messages") if isinstance(body, dict) else None
        if not isinstance(messages, list) or not messages:
            return _error(400, "'messages' must be a non-empty array.")
        recorded = ModelRequest(
            at=time.time(),
            stream=bool(body.get("stream")),
            texts=tuple(content_text(m.get("content")) for m in messages if isinstance(m, dict)),
        )
        with self._lock:
            self._requests.append(recorded)
        answer = answer_for(messages, delay=self.delay, everyone_text=self.everyone_text)
        if answer.delay > 0:
            await asyncio.sleep(answer.delay)
        usage = _usage(messages, answer.text)
        ident = f"chatcmpl-kit{next(self._ids):06d}"
        model = str(body.get("model") or self.model)
        if not recorded.stream:
            return web.json_response(
                {
                    "id": ident,
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": answer.text},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": usage,
                }
            )
        options = body.get("stream_options")
        with_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        base = {"id": ident, "object": "chat.completion.chunk", "created": int(time.time())}
        base["model"] = model

        async def event(choices: list[dict[str, Any]], **extra: Any) -> None:
            chunk = {**base, "choices": choices, **extra}
            await response.write(f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode())

        def choice(delta: Mapping[str, Any], finish: str | None = None) -> list[dict[str, Any]]:
            return [{"index": 0, "delta": dict(delta), "finish_reason": finish}]

        await event(choice({"role": "assistant", "content": ""}))
        for start in range(0, len(answer.text), 64):
            await event(choice({"content": answer.text[start : start + 64]}))
        await event(choice({}, "stop"))
        if with_usage:
            await event([], usage=usage)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _usage(messages: Sequence[Any], answer: str) -> dict[str, int]:
    """Tokens as ceil(characters / 4), the usual estimate."""
    prompt = sum(
        -(-len(content_text(m.get("content"))) // 4) + 3 for m in messages if isinstance(m, dict)
    )
    completion = -(-len(answer) // 4)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _error(status: int, message: str, code: str | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return web.json_response(body, status=status)
