"""`[channels.email]`: the Email channel's settings (validated by the gateway's loader)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator

from gateway.config.section import Section, reveal, secret, secret_file


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
