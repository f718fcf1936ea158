"""A model server's context window: asked of the server, or read from the error it gives
a request that is too long; and what a 404 from a base URL without /v1 means.

Where each kind of server says its window, as the probe asks it (first answer wins):

| server | where | what |
|---|---|---|
| vLLM | ``GET <base>/models`` | ``data[].max_model_len`` of the model |
| llama-server | ``GET <root>/props`` | ``default_generation_settings.n_ctx`` (a slot's) |
| Ollama | ``GET <root>/api/ps`` | ``context_length`` of the model, once it is loaded |
| Ollama | ``POST <root>/api/show`` | ``num_ctx`` in ``parameters`` (a Modelfile's) |

`<root>` is the base URL without its ``/v1``. llama-cpp-python's server and OpenAI say it
nowhere: their overflow error names it ("This model's maximum context length is N
tokens"), as vLLM's does and llama-server's (``n_ctx`` in the error body). Ollama says
nothing when a prompt is longer than its ``num_ctx``: it cuts the prompt silently, so
asking matters most there. Without ``num_ctx`` in /api/show and before /api/ps lists the
model, its smallest default (2,048) is assumed, and asked again after the model answered.

Nothing here imports `openai` at module level: one-shot commands start without it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import orjson

from gateway.llm.types import ServerKind, ServerWindow, WindowUnknown

if TYPE_CHECKING:
    import openai

#: What makes each kind of server's context window larger.
WINDOW_SETTINGS: dict[ServerKind | None, str] = {
    "llama.cpp": "start llama-server with a larger --ctx-size (-c)",
    "llama-cpp-python": "start llama_cpp.server with a larger --n_ctx",
    "ollama": "raise Ollama's num_ctx (OLLAMA_CONTEXT_LENGTH, or PARAMETER num_ctx in a Modelfile)",
    "vllm": "start vLLM with a larger --max-model-len",
    "openai": "use a model with a larger context window",
    None: "raise the model server's context size",
}

#: Ollama's smallest default context (older versions; newer ones start at 4,096 or more,
#: and /api/ps tells the real one once the model is loaded).
OLLAMA_ASSUMED_DEFAULT = 2048
#: A window outside these bounds is a misread, not a window.
_SMALLEST, _LARGEST = 16, 100_000_000

_NUM_CTX = re.compile(r"^\s*num_ctx\s+(\d+)\s*$", re.MULTILINE)


def server_root(base_url: str) -> str:
    """`base_url` without a trailing ``/v1`` (and slash): where a server's own routes are,
    e.g. ``http://127.0.0.1:8080`` for ``http://127.0.0.1:8080/v1``."""
    parts = urlsplit(base_url.strip())
    path = parts.path.rstrip("/")
    path = path.removesuffix("/v1")
    return f"{parts.scheme}://{parts.netloc}{path}"


def ends_in_version(base_url: str) -> bool:
    """True when `base_url`'s path ends in an API version (``/v1``, ``/v2``, ...)."""
    return re.search(r"/v\d+$", urlsplit(base_url.strip()).path.rstrip("/")) is not None


def _tokens(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and _SMALLEST <= value <= _LARGEST:
        return value
    return None


def _model_names(model: str) -> set[str]:
    # Ollama lists "llama3.2:latest" for a model asked for as "llama3.2".
    return {model, f"{model}:latest"} if ":" not in model else {model}


async def probe_server_window(
    client: openai.AsyncOpenAI, base_url: str, model: str, *, per_request: float = 3.0
) -> ServerWindow | None:
    """The context window `model`'s server states (see the module docstring), through
    `client` (its auth, transport and base URL). None when the server answered but says
    it nowhere; `WindowUnknown` when it did not answer (down, or slower than
    `per_request` seconds)."""
    import openai

    root = server_root(base_url)
    options: Any = {"timeout": per_request, "max_retries": 0}

    async def ask(path: str, body: dict[str, Any] | None = None) -> Any:
        """The JSON the server answers at `path` (relative: under the base URL), or
        None for an error status or a body that is not JSON."""
        try:
            if body is None:
                raw = await client.get(path, cast_to=bytes, options=options)
            else:
                raw = await client.post(path, cast_to=bytes, body=body, options=options)
        except openai.APIStatusError:
            return None
        except openai.APIConnectionError as exc:  # timeouts included
            raise WindowUnknown(f"{root} did not answer: {exc}") from None
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None

    names = _model_names(model)
    listing = await ask("models")
    if isinstance(listing, dict) and isinstance(listing.get("data"), list):
        entries = [e for e in listing["data"] if isinstance(e, dict)]
        mine = [e for e in entries if e.get("id") in names] or entries[:1]
        for entry in mine:
            if (tokens := _tokens(entry.get("max_model_len"))) is not None:
                return ServerWindow(tokens, "vLLM /v1/models max_model_len", "vllm")
    props = await ask(f"{root}/props")
    if isinstance(props, dict):
        settings = props.get("default_generation_settings")
        n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else props.get("n_ctx")
        if (tokens := _tokens(n_ctx)) is not None:
            return ServerWindow(tokens, "llama.cpp /props n_ctx", "llama.cpp")
    running = await ask(f"{root}/api/ps")
    if isinstance(running, dict) and isinstance(running.get("models"), list):
        for entry in running["models"]:
            listed = isinstance(entry, dict) and {entry.get("name"), entry.get("model")} & names
            if listed and (tokens := _tokens(entry.get("context_length"))) is not None:
                return ServerWindow(tokens, "Ollama /api/ps context_length", "ollama")
    shown = await ask(f"{root}/api/show", {"model": model})
    if isinstance(shown, dict) and ("parameters" in shown or "model_info" in shown):
        parameters = shown.get("parameters")
        found = _NUM_CTX.search(parameters) if isinstance(parameters, str) else None
        if found and (tokens := _tokens(int(found.group(1)))) is not None:
            return ServerWindow(tokens, "Ollama /api/show num_ctx", "ollama")
        info = shown.get("model_info")
        trained = None
        if isinstance(info, dict):
            trained = _tokens(info.get(f"{info.get('general.architecture')}.context_length"))
        tokens = min(OLLAMA_ASSUMED_DEFAULT, trained or OLLAMA_ASSUMED_DEFAULT)
        source = f"Ollama's smallest default, {tokens:,} (/api/show sets no num_ctx)"
        return ServerWindow(tokens, source, "ollama", settled=False)
    return None


# -- the overflow error -------------------------------------------------------------------

_WINDOW_IN_TEXT = (
    re.compile(r"maximum context length is (\d+) tokens"),  # OpenAI, vLLM, llama-cpp-python
    re.compile(r"available context size \((\d+) tokens\)"),  # llama-server
)
_PROMPT_IN_TEXT = (
    re.compile(r"\((\d+) in the messages"),  # llama-cpp-python, vLLM before 0.10
    re.compile(r"your request has (\d+) input tokens"),  # vLLM
    re.compile(r"messages resulted in (\d+) tokens"),  # OpenAI
    re.compile(r"request \((\d+) tokens\) exceeds"),  # llama-server
)
_OVERFLOW_WORDS = ("exceeds the available context size", "maximum context length")


@dataclass(frozen=True, slots=True)
class Overflow:
    """What an overflow error says: the window, the prompt's size, the kind of server."""

    context_tokens: int | None
    prompt_tokens: int | None
    server: ServerKind | None


def _first_number(patterns: tuple[re.Pattern[str], ...], text: str) -> int | None:
    for pattern in patterns:
        if found := pattern.search(text):
            return int(found.group(1))
    return None


def read_overflow(status: int, body: object, message: str) -> Overflow | None:
    """The overflow an HTTP error reports, or None when it is another error. `body` is
    the error's JSON object (the ``error`` member where there is one) or its text."""
    fields = body if isinstance(body, dict) else {}
    text = str(fields.get("message") or "") if fields else str(body or "")
    text = f"{text} {message}"
    kind = fields.get("type")
    code = str(fields.get("code") or "")
    if status not in (400, 413) or not (
        kind == "exceed_context_size_error"
        or code == "context_length_exceeded"
        or any(words in text for words in _OVERFLOW_WORDS)
    ):
        return None
    server: ServerKind | None = None
    if kind == "exceed_context_size_error" or "available context size" in text:
        server = "llama.cpp"
    elif kind == "BadRequestError":
        server = "vllm"
    elif code == "context_length_exceeded":
        server = "llama-cpp-python" if "in the messages" in text else "openai"
    window = _tokens(fields.get("n_ctx")) or _tokens(_first_number(_WINDOW_IN_TEXT, text))
    prompt = _tokens(fields.get("n_prompt_tokens")) or _tokens(_first_number(_PROMPT_IN_TEXT, text))
    return Overflow(window, prompt, server)


# -- a 404 for the chat path --------------------------------------------------------------


def names_a_model(body: object, message: str) -> bool:
    """Whether a 404's body is about the model (it does not exist, as OpenAI, vLLM and
    Ollama answer) rather than the path (no such route: a base URL without /v1)."""
    fields = body if isinstance(body, dict) else {}
    if fields.get("code") == "model_not_found" or fields.get("param") == "model":
        return True
    text = f"{fields.get('message') or ''} {body if not fields else ''} {message}".lower()
    return "model" in text


def wrong_path_detail(base_url: str, path: str) -> str:
    """What a 404 for `path` (e.g. ``/chat/completions``) under `base_url` most likely
    means, with the corrected URL when the base URL lacks its /v1."""
    base = base_url.rstrip("/")
    said = f"the server at {base} answered 404 for {path}"
    if ends_in_version(base_url):
        return f"{said}; is it an OpenAI-compatible server?"
    return f"{said}; OpenAI-compatible base URLs usually end in /v1 (try {base}/v1)"
