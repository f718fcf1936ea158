"""Whether a model server could be called at all: the LLM settings' policy, without the
`openai` client, so a command refuses in one line before loading it."""

from __future__ import annotations

from urllib.parse import urlsplit

from gateway.llm.types import LLMConfigError

MISSING_KEY_MESSAGE = (
    "No LLM API key: set OPENAI_API_KEY (or GATEWAY_LLM__API_KEY_FILE), or point "
    "OPENAI_BASE_URL at a local OpenAI-compatible server "
    "(Ollama: http://127.0.0.1:11434/v1, vLLM, llama.cpp)"
)

# Hosts of the hosted OpenAI APIs, which always need a key.
_KEYED_HOST_SUFFIXES = ("openai.com", "openai.azure.com")


def api_key_required(base_url: str | None) -> bool:
    """Whether calls to `base_url` need an API key: only the hosted OpenAI APIs do.

    A local server (localhost, 127.x, ::1, *.local) or any other explicitly configured
    OpenAI-compatible server is assumed to work without one.
    """
    if not base_url:
        return True
    host = (urlsplit(base_url.strip()).hostname or "").lower()
    return any(host == suffix or host.endswith("." + suffix) for suffix in _KEYED_HOST_SUFFIXES)


def check_credentials(base_url: str | None, api_key: str | None) -> None:
    """Raise `LLMConfigError` saying what to set when no call could possibly succeed."""
    if base_url is not None:
        parts = urlsplit(base_url.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise LLMConfigError(
                "OPENAI_BASE_URL must be an http(s) URL such as https://api.openai.com/v1 "
                "or http://127.0.0.1:11434/v1 (Ollama)",
                user_message="The gateway's model server address is misconfigured.",
            )
    if (api_key is None or not api_key.strip()) and api_key_required(base_url):
        raise LLMConfigError(
            MISSING_KEY_MESSAGE,
            user_message="The gateway has no API key for its language model yet.",
        )


def check_provider_credentials(name: str, base_url: str | None, api_key: str | None) -> None:
    """`check_credentials` for the provider `name` of the failover chain: "default" is
    `[llm]`'s own server; another's error names its `[llm.providers.NAME]` section."""
    if name == "default":
        check_credentials(base_url, api_key)
        return
    try:
        check_credentials(base_url, api_key)
    except LLMConfigError as exc:
        if str(exc) == MISSING_KEY_MESSAGE:
            env = f"GATEWAY_LLM__PROVIDERS__{name.upper()}__API_KEY"
            detail = f"llm.providers.{name}: no API key; set {env}, or api_key_file"
        else:
            detail = f"llm.providers.{name}.base_url must be an http(s) URL ending in /v1"
        raise LLMConfigError(detail, user_message=exc.user_message) from None
