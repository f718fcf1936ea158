"""`[http]`: the HTTP server, its tokens and its limits."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, field_validator

from gateway.config.section import SHORT_NAME, Section, secret, secret_file


class ApiTokenSettings(Section):
    """One named client of the OpenAI-compatible API (`[http.api_tokens.NAME]`)."""

    token: SecretStr | None = secret(
        "this client's bearer token", "GATEWAY_HTTP__API_TOKENS__NAME__TOKEN"
    )
    token_file: Path | None = secret_file("GATEWAY_HTTP__API_TOKENS__NAME__TOKEN", "ide-token")
    sessions: list[str] = Field(
        default_factory=list,
        description="Session names this client may use start with one of these (e.g. "
        '["ide-"]); its sessions are api:NAME:<session>. Empty: any name.',
    )


class HTTPSettings(Section):
    host: str = Field("127.0.0.1", description="Address the HTTP server binds.")
    port: int = Field(8080, ge=0, le=65535, description="Port of the HTTP server.")
    token: SecretStr | None = secret("bearer token of the chat API", "GATEWAY_HTTP__TOKEN")
    token_file: Path | None = secret_file("GATEWAY_HTTP__TOKEN", "gateway-http-token")
    admin_token: SecretStr | None = secret(
        "token of the /admin page (unset: the chat API's token; set: chat API clients "
        "cannot open /admin)",
        "GATEWAY_HTTP__ADMIN_TOKEN",
    )
    admin_token_file: Path | None = secret_file("GATEWAY_HTTP__ADMIN_TOKEN", "gateway-admin-token")
    api_tokens: dict[str, ApiTokenSettings] = Field(
        default_factory=dict,
        description="Named clients of /v1/chat/completions, one [http.api_tokens.NAME] "
        "table each (token_file or GATEWAY_HTTP__API_TOKENS__NAME__TOKEN, sessions); the "
        'token above is the client named "default".',
    )
    header_timeout_seconds: float = Field(
        10.0,
        gt=0,
        le=600,
        description="A connection that has not sent a whole request header this long after "
        "it opened (or after the first byte of a later request) is closed.",
    )
    body_timeout_seconds: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="A request body not all there this long after its header gets 408 and "
        "the connection is closed.",
    )
    keepalive_timeout_seconds: float = Field(
        75.0,
        gt=0,
        le=3600,
        description="An idle kept-alive connection is closed after this long; keep it above "
        "the idle timeout of a proxy's connection pool in front (nginx: 60 s).",
    )
    max_connections: int = Field(
        512,
        ge=1,
        le=1_000_000,
        description="Connections open at once; at the bound a new one replaces the longest "
        "idle one, or gets 503 when none is idle.",
    )
    auth_max_failures: int = Field(
        10,
        ge=1,
        le=10_000,
        description="Wrong tokens (chat API, admin page) one client address may send in "
        "the window below; then 429 with Retry-After until the oldest leaves it.",
    )
    auth_failure_window_seconds: float = Field(
        60.0, gt=0, le=86400, description="The window of auth_max_failures, in seconds."
    )
    trusted_proxies: list[str] = Field(
        default_factory=list,
        description="Addresses or CIDR networks of proxies in front of the gateway, e.g. "
        '["127.0.0.1", "10.0.0.0/8"]: only requests from them have their X-Forwarded-For '
        "read, for the client address that wrong tokens are counted under.",
    )

    @field_validator("api_tokens")
    @classmethod
    def _token_names(cls, value: dict[str, ApiTokenSettings]) -> dict[str, ApiTokenSettings]:
        # A client's sessions are api:<name>:...; two names equal but for case would
        # share session files on a case-insensitive file system.
        taken = {"default"}
        for name in value:
            if not SHORT_NAME.fullmatch(name) or name.casefold() in taken:
                raise ValueError(
                    f"{name!r} cannot name a client; use up to 32 letters, digits, - and _, "
                    "and neither \"default\" (http.token's client) nor another client's "
                    "name, in any case"
                )
            taken.add(name.casefold())
        return value

    @field_validator("trusted_proxies")
    @classmethod
    def _proxy_networks(cls, value: list[str]) -> list[str]:
        if value:  # the import pulls in aiohttp: not for every command's settings
            from gateway.http.throttle import parse_networks

            parse_networks(value)
        return value
