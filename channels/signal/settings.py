"""`[channels.signal]`: the Signal channel's settings (validated by the gateway's loader)."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from gateway.config.access import AccessSection

#: A phone number as Signal and signal-cli write it: E.164, a "+" and up to 15 digits.
E164 = re.compile(r"\+[1-9][0-9]{6,14}")


class SignalSettings(AccessSection):
    """A Signal number through signal-cli's JSON-RPC daemon (channels/signal, docs/signal.md)."""

    enabled: bool = Field(False, description="Serve a Signal number through signal-cli.")
    account: str | None = Field(
        None,
        description="The bot's Signal number, as signal-cli was registered or linked with it "
        "(E.164, e.g. +15551234567).",
        examples=["+15551234567"],
    )
    url: str = Field(
        "http://127.0.0.1:8080",
        description="signal-cli's HTTP daemon (`signal-cli daemon --http HOST:PORT "
        "--receive-mode manual`); the channel calls /api/v1/rpc.",
    )
    receive_timeout: float = Field(
        5.0,
        ge=1.0,
        le=60.0,
        description="Seconds one `receive` call waits for a message; a stop waits for the "
        "call in flight, so this is also how long a stop may take.",
    )
    read_receipts: bool = Field(
        True,
        description='Send a read receipt ("Read" under the message) once a message is '
        "in the journal, and show typing while it is answered.",
    )
    streaming: bool = Field(
        False,
        description="Must stay false: Signal shows a reply once it is whole (docs/signal.md, "
        "Replies).",
    )
    seen_reaction: str = Field(
        "",
        description="An emoji the bot reacts with once a message is in the journal "
        '(e.g. "👀"); empty: none.',
        examples=["👀"],
    )

    @field_validator("account")
    @classmethod
    def _e164(cls, value: str | None) -> str | None:
        if value is not None and not E164.fullmatch(value):
            raise ValueError(
                f"{value!r}: the number as signal-cli knows it, in E.164 form (a + and the "
                "country code, no spaces), e.g. +15551234567"
            )
        return value

    @field_validator("streaming")
    @classmethod
    def _no_streaming(cls, value: bool) -> bool:
        if value:
            raise ValueError(
                "Signal shows a reply when it is whole: its apps mark edited messages "
                "and take at most 10 edits of one, too few to show a reply while it is "
                "written; leave streaming off (docs/signal.md, Replies)"
            )
        return value
