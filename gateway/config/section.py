"""The base of every section's model: strict, frozen, unknown keys refused; and what the
sections' fields share (secrets only from the environment or a file, short names)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


def secret(what: str, env: str) -> Any:
    """A secret setting: never in gateway.toml, from `env` or the file of its `_file`."""
    return Field(None, description=f"Secret: {what}, from {env}, or from the file below.")


def secret_file(env: str, example: str) -> Any:
    """The `<secret>_file` setting next to a secret: a file holding it."""
    return Field(
        None,
        description=f"File holding the secret above, read at start-up (a trailing newline "
        f"is dropped); also {env}_FILE.",
        examples=[f"/run/secrets/{example}"],
    )


def reveal(secret: SecretStr | None) -> str | None:
    """A secret's value; None when it is unset or empty."""
    return (secret.get_secret_value() or None) if secret is not None else None


#: What a provider's name may be (it appears in `model@provider` and `provider:model`),
#: and an API client's.
SHORT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,31}")


def secret_values(sections: Iterable[BaseModel], storage_url: str | None) -> list[str]:
    """Every secret value set in `sections` (those read from files too) and the password
    of `storage_url`, for log redaction."""
    found: list[str] = []

    def collect(section: BaseModel) -> None:
        for name in type(section).model_fields:
            value = getattr(section, name)
            if isinstance(value, BaseModel):
                collect(value)
            elif isinstance(value, dict):  # [llm.providers.NAME] and the like
                for item in value.values():
                    if isinstance(item, BaseModel):
                        collect(item)
            elif isinstance(value, SecretStr) and value.get_secret_value():
                found.append(value.get_secret_value())

    for section in sections:
        collect(section)
    if storage_url:
        from gateway.storage.postgres import url_password

        password = url_password(storage_url)
        if password:
            found.append(password)
    return found
