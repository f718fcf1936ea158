"""`[channels]`: the terminal and each chat platform, with who may talk to the bot."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from gateway.config.section import Section, reveal, secret, secret_file
from gateway.messages import session_key_from_name


class CLIChannelSettings(Section):
    enabled: bool = Field(True, description="Chat in the terminal when stdin is a TTY.")
    session: str = Field(
        "cli:direct",
        description="Session of the terminal chat: a name (work = cli:work) or a full key.",
    )

    @field_validator("session")
    @classmethod
    def _session_key(cls, value: str) -> str:
        return session_key_from_name(value)


class AccessSection(Section):
    """Who may talk to the bot on a chat platform."""

    dm_policy: Literal["open", "allowlist", "pairing"] = Field(
        "pairing",
        description="Direct messages: open = anyone, allowlist = allow_from only, pairing = "
        "strangers get a code for `gateway pairing approve`.",
    )
    allow_from: list[str] = Field(
        default_factory=list, description='Sender or chat ids always allowed; "*" = anyone.'
    )
    group_policy: Literal["open", "allowlist", "disabled"] = Field(
        "allowlist", description="Groups and channels: open, allowlist or disabled."
    )
    require_mention: bool = Field(
        True, description="In groups, answer only when mentioned or replied to."
    )
    pairing_ttl_seconds: float = Field(3600.0, gt=0, description="How long a code is valid.")
    streaming: bool = Field(
        False, description="Show the reply while it is written (needs llm.stream = true)."
    )


class TelegramSettings(AccessSection):
    enabled: bool = Field(False, description="Serve a Telegram bot.")
    token: SecretStr | None = secret("the BotFather token", "GATEWAY_CHANNELS__TELEGRAM__TOKEN")
    token_file: Path | None = secret_file("GATEWAY_CHANNELS__TELEGRAM__TOKEN", "telegram-token")
    mode: Literal["polling", "webhook"] = Field(
        "polling", description="polling (no public URL needed) or webhook."
    )
    base_url: str | None = Field(
        None,
        description="Bot API server for self-hosted servers, e.g. http://127.0.0.1:8081/bot "
        "(the token is appended).",
        examples=["http://127.0.0.1:8081/bot"],
    )
    base_file_url: str | None = Field(
        None,
        description="File download URL prefix, likewise.",
        examples=["http://127.0.0.1:8081/file/bot"],
    )
    webhook_url: str | None = Field(
        None,
        description="Public HTTPS URL that reaches this gateway's /telegram/webhook "
        "(webhook mode).",
        examples=["https://bot.example.com/telegram/webhook"],
    )
    webhook_secret: SecretStr | None = secret(
        "webhook secret token ([A-Za-z0-9_-])", "GATEWAY_CHANNELS__TELEGRAM__WEBHOOK_SECRET"
    )
    webhook_secret_file: Path | None = secret_file(
        "GATEWAY_CHANNELS__TELEGRAM__WEBHOOK_SECRET", "telegram-webhook-secret"
    )
    poll_timeout: int = Field(30, ge=0, le=50, description="Long-poll seconds per request.")

    def resolved_token(self) -> str | None:
        """The bot token (from the environment or `token_file`), if any."""
        return reveal(self.token)


class SlackSettings(AccessSection):
    enabled: bool = Field(False, description="Serve a Slack app.")
    bot_token: SecretStr | None = secret("xoxb- token", "GATEWAY_CHANNELS__SLACK__BOT_TOKEN")
    bot_token_file: Path | None = secret_file(
        "GATEWAY_CHANNELS__SLACK__BOT_TOKEN", "slack-bot-token"
    )
    app_token: SecretStr | None = secret(
        "xapp- token for Socket Mode", "GATEWAY_CHANNELS__SLACK__APP_TOKEN"
    )
    app_token_file: Path | None = secret_file(
        "GATEWAY_CHANNELS__SLACK__APP_TOKEN", "slack-app-token"
    )
    signing_secret: SecretStr | None = secret(
        "signing secret for HTTP mode", "GATEWAY_CHANNELS__SLACK__SIGNING_SECRET"
    )
    signing_secret_file: Path | None = secret_file(
        "GATEWAY_CHANNELS__SLACK__SIGNING_SECRET", "slack-signing-secret"
    )
    mode: Literal["socket", "http"] = Field(
        "socket", description="socket (no public URL needed) or http (/slack/events)."
    )
    base_url: str | None = Field(
        None,
        description="Web API URL, e.g. https://slack-gov.com/api/ for GovSlack.",
        examples=["https://slack-gov.com/api/"],
    )
    reply_mode: Literal["thread", "channel"] = Field(
        "thread",
        description="Where to answer: thread = always in a thread, channel = in the channel.",
    )


class EmailSettings(Section):
    """One mailbox: mail in over IMAP, replies out over SMTP (docs/email.md). Mail has no
    groups: who may write is `dm_policy` and `allow_from` alone."""

    enabled: bool = Field(False, description="Answer the mail of one mailbox.")
    address: str | None = Field(
        None,
        description="The mailbox's address: replies come from it, mail from it is never answered.",
        examples=["assistant@example.com"],
    )
    from_name: str = Field("", description="Display name on replies, e.g. Assistant.")
    imap_host: str | None = Field(None, description="IMAP server.", examples=["imap.example.com"])
    imap_port: int | None = Field(
        None, ge=1, le=65535, description="Default: 993 with tls, 143 with starttls."
    )
    imap_security: Literal["tls", "starttls"] = Field(
        "tls", description="tls (IMAPS) or starttls; never without TLS."
    )
    username: str | None = Field(None, description="IMAP (and SMTP) login; default: address.")
    password: SecretStr | None = secret("the mailbox password", "GATEWAY_CHANNELS__EMAIL__PASSWORD")
    password_file: Path | None = secret_file("GATEWAY_CHANNELS__EMAIL__PASSWORD", "email-password")
    folder: str = Field("INBOX", description="The folder watched for new mail.")
    processed_folder: str | None = Field(
        None,
        description="Move mail here once it is in the journal, instead of flagging it \\Seen.",
        examples=["Processed"],
    )
    idle: bool = Field(True, description="Wait for mail with IMAP IDLE where the server has it.")
    poll_interval_seconds: float = Field(
        60.0, gt=0, le=3600, description="Without IDLE: seconds between two looks at the folder."
    )
    catch_up_days: int = Field(
        7,
        ge=0,
        description="At the first start (and after the server renumbered the folder): unseen "
        "mail of the last N days is answered; 0 = all unseen mail.",
    )
    smtp_host: str | None = Field(None, description="SMTP server.", examples=["smtp.example.com"])
    smtp_port: int | None = Field(
        None, ge=1, le=65535, description="Default: 587 with starttls, 465 with tls."
    )
    smtp_security: Literal["starttls", "tls"] = Field(
        "starttls", description="starttls (submission) or tls (SMTPS); never without TLS."
    )
    smtp_username: str | None = Field(None, description="SMTP login; default: username.")
    smtp_password: SecretStr | None = secret(
        "the SMTP password when it differs", "GATEWAY_CHANNELS__EMAIL__SMTP_PASSWORD"
    )
    smtp_password_file: Path | None = secret_file(
        "GATEWAY_CHANNELS__EMAIL__SMTP_PASSWORD", "email-smtp-password"
    )
    tls_ca_file: Path | None = Field(
        None,
        description="CA certificates for servers with a private CA (PEM).",
        examples=["/etc/ssl/private-ca.pem"],
    )
    threads: bool = Field(
        True,
        description="A conversation per email thread (email:ADDRESS:thread:ROOT); false: one "
        "per correspondent (email:ADDRESS).",
    )
    own_addresses: list[str] = Field(
        default_factory=list,
        description="Other addresses of the gateway (aliases): mail from them is never answered.",
    )
    require_auth: list[Literal["spf", "dkim", "dmarc"]] = Field(
        default_factory=list,
        description="Answer only mail whose Authentication-Results (from authserv_id) show "
        'these passed for the sender\'s domain, e.g. ["dmarc"].',
    )
    authserv_id: str | None = Field(
        None,
        description="Your receiving server's id in Authentication-Results (with require_auth).",
        examples=["mx.example.com"],
    )
    refusal_replies: bool = Field(
        False,
        description="Answer mail the allowlist refuses with a one-line refusal (off: such "
        "mail, mostly spam with a forged sender, is ignored).",
    )
    max_message_mb: float = Field(
        25.0, gt=0, description="Larger mail is answered without its body being read."
    )
    dm_policy: Literal["open", "allowlist", "pairing"] = Field(
        "allowlist",
        description="Who is answered: allowlist (allow_from only), pairing (strangers get a "
        "code by reply, for `gateway pairing approve email CODE`) or open (anyone; spam too).",
    )
    allow_from: list[str] = Field(
        default_factory=list,
        description="Addresses (alice@example.com) and domains (example.com) always "
        'answered; "*" = anyone.',
    )
    pairing_ttl_seconds: float = Field(3600.0, gt=0, description="How long a code is valid.")

    @model_validator(mode="after")
    def _complete(self) -> EmailSettings:
        if self.require_auth and not self.authserv_id:
            raise ValueError(
                "require_auth needs authserv_id: the id your receiving server writes in "
                "Authentication-Results (others can be forged by the sender)"
            )
        return self

    def resolved_password(self) -> str | None:
        """The IMAP password (from the environment or `password_file`), if any."""
        return reveal(self.password)

    def resolved_smtp_password(self) -> str | None:
        """The SMTP password: its own, else the IMAP one."""
        return reveal(self.smtp_password) or self.resolved_password()


class MatrixSettings(AccessSection):
    """A Matrix account the gateway answers as (channels/matrix, docs/matrix.md)."""

    enabled: bool = Field(False, description="Serve a Matrix account.")
    homeserver: str | None = Field(
        None,
        description="The homeserver's client-server API URL.",
        examples=["https://matrix.example.org"],
    )
    user_id: str | None = Field(
        None, description="The bot account's full Matrix id.", examples=["@gateway:example.org"]
    )
    access_token: SecretStr | None = secret(
        "the account's access token", "GATEWAY_CHANNELS__MATRIX__ACCESS_TOKEN"
    )
    access_token_file: Path | None = secret_file(
        "GATEWAY_CHANNELS__MATRIX__ACCESS_TOKEN", "matrix-access-token"
    )
    sync_timeout: int = Field(30, ge=0, le=120, description="Long-poll seconds per /sync.")
    encryption: bool = Field(
        True,
        description="Take part in end-to-end encrypted rooms (docs/matrix.md, section 7); "
        "false declines them with a reason.",
    )
    room_key_wait: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="Seconds an encrypted message waits for its room key before its sender "
        "is told it could not be read (later messages of its room wait behind it).",
    )

    @field_validator("user_id")
    @classmethod
    def _matrix_id(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"@[^:\s]+:\S+", value):
            raise ValueError("a Matrix user id looks like @gateway:example.org")
        return value

    def resolved_token(self) -> str | None:
        """The access token (from the environment or `access_token_file`), if any."""
        return reveal(self.access_token)


class WhatsAppSettings(AccessSection):
    """A WhatsApp Business number through the Cloud API (channels/whatsapp, docs/whatsapp.md)."""

    enabled: bool = Field(False, description="Serve WhatsApp Business numbers (Cloud API).")
    phone_number_ids: list[str] = Field(
        default_factory=list,
        description="The business numbers' phone number ids (WhatsApp Manager > API Setup); "
        "messages to other numbers are acknowledged and ignored.",
    )
    access_token: SecretStr | None = secret(
        "a system user's token with whatsapp_business_messaging",
        "GATEWAY_CHANNELS__WHATSAPP__ACCESS_TOKEN",
    )
    access_token_file: Path | None = secret_file(
        "GATEWAY_CHANNELS__WHATSAPP__ACCESS_TOKEN", "whatsapp-access-token"
    )
    app_secret: SecretStr | None = secret(
        "the Meta app's secret, which signs every webhook (X-Hub-Signature-256)",
        "GATEWAY_CHANNELS__WHATSAPP__APP_SECRET",
    )
    app_secret_file: Path | None = secret_file(
        "GATEWAY_CHANNELS__WHATSAPP__APP_SECRET", "whatsapp-app-secret"
    )
    verify_token: SecretStr | None = secret(
        "the webhook's verify token, as typed in the App Dashboard",
        "GATEWAY_CHANNELS__WHATSAPP__VERIFY_TOKEN",
    )
    verify_token_file: Path | None = secret_file(
        "GATEWAY_CHANNELS__WHATSAPP__VERIFY_TOKEN", "whatsapp-verify-token"
    )
    api_url: str = Field(
        "https://graph.facebook.com", description="The Graph API's root (no version)."
    )
    api_version: str = Field("v26.0", description="The Graph API version the requests name.")
    template: str | None = Field(
        None,
        description="An approved template sent instead of a reply that falls outside the "
        "24-hour customer-service window; unset: such a reply is kept as undeliverable.",
        examples=["pending_reply"],
    )
    template_language: str = Field("en", description="The template's language code.")
    template_parameter: bool = Field(
        True,
        description="Pass the start of the reply as the template body's {{1}} parameter.",
    )
    quote_replies: Literal["auto", "always", "never"] = Field(
        "auto",
        description="Quote the person's message in the reply: auto = only when they wrote "
        "again meanwhile.",
    )
    read_receipts: bool = Field(
        True, description="Mark messages read and show the typing indicator while answering."
    )

    @field_validator("phone_number_ids")
    @classmethod
    def _digits(cls, value: list[str]) -> list[str]:
        for item in value:
            if not item.isdigit():
                raise ValueError(f"{item!r}: a phone number id is digits only (not the number)")
        return value

    def resolved_token(self) -> str | None:
        """The Graph API token (from the environment or `access_token_file`), if any."""
        return reveal(self.access_token)


class DiscordSettings(AccessSection):
    enabled: bool = Field(False, description="Serve a Discord bot.")
    token: SecretStr | None = secret(
        "the bot token (Developer Portal > Bot > Reset Token)", "GATEWAY_CHANNELS__DISCORD__TOKEN"
    )
    token_file: Path | None = secret_file("GATEWAY_CHANNELS__DISCORD__TOKEN", "discord-token")
    api_url: str | None = Field(
        None,
        description="HTTP API base URL, for an egress proxy or tests (default "
        "https://discord.com/api/v10).",
        examples=["https://discord-proxy.internal/api/v10"],
    )
    gateway_url: str | None = Field(
        None,
        description="Gateway WebSocket URL; when set, resumes go there too (default "
        "wss://gateway.discord.gg/).",
        examples=["wss://discord-proxy.internal/gateway/"],
    )
    message_content: bool = Field(
        True,
        description="Ask for the privileged Message Content intent (enable it on the "
        "Developer Portal's Bot page); without it the bot reads only DMs and messages "
        "that mention it.",
    )
    backfill_max_age_seconds: float = Field(
        86400.0,
        gt=0,
        description="After a (re)connect, read back what was written while away up to "
        "this old; older messages are not answered.",
    )
    backfill_max_messages: int = Field(
        500, ge=1, le=10_000, description="At most this many messages read back per conversation."
    )
    backfill_max_conversations: int = Field(
        1000,
        ge=1,
        description="At most this many conversations read back (the most recently active; "
        "each costs one request, DMs always, server channels only when they have news).",
    )

    def resolved_token(self) -> str | None:
        """The bot token (from the environment or `token_file`), if any."""
        return reveal(self.token)


class ChannelsSettings(Section):
    cli: CLIChannelSettings = Field(default_factory=CLIChannelSettings)
    telegram: TelegramSettings = Field(default_factory=TelegramSettings)
    slack: SlackSettings = Field(default_factory=SlackSettings)
    email: EmailSettings = Field(default_factory=EmailSettings)
    matrix: MatrixSettings = Field(default_factory=MatrixSettings)
    whatsapp: WhatsAppSettings = Field(default_factory=WhatsAppSettings)
    discord: DiscordSettings = Field(default_factory=DiscordSettings)
