"""The base of every section's model: strict, frozen, unknown keys refused; and what the
sections' fields share (secrets only from the environment or a file, short names)."""

from __future__ import annotations

import re
from collections.abc import Mapping
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


#: Names that look like they hold a secret. An entry so named of a table of strings (an
#: MCP server's `env`) is a secret; a field so named must be a `SecretStr`
#: (tests/test_redaction.py holds every model to it).
SECRET_NAME = re.compile(r"(?i)token|key|secret|passw|passphrase|credential|auth")


def secret_items(sections: Mapping[str, BaseModel]) -> list[tuple[str, str]]:
    """Every secret set in `sections` (by name), as (setting, value), found by type:
    each `SecretStr` (those read from files too), the password of every URL, each entry
    of a table of strings whose name looks secret (`SECRET_NAME`), and what a model
    declares itself (`extra_secrets()`: the variables an MCP server is passed)."""
    from gateway.redaction import url_password

    found: list[tuple[str, str]] = []

    def take(name: str, value: object) -> None:
        if isinstance(value, BaseModel):
            collect(name, value)
        elif isinstance(value, SecretStr):
            if value.get_secret_value():
                found.append((name, value.get_secret_value()))
        elif isinstance(value, str):
            password = url_password(value) if "://" in value else None
            if password:
                found.append((f"{name} (its password)", password))
        elif isinstance(value, dict):  # [llm.providers.NAME], an MCP server's env, ...
            for key, item in value.items():
                if isinstance(item, str) and SECRET_NAME.search(str(key)) and item:
                    found.append((f"{name}.{key}", item))
                else:
                    take(f"{name}.{key}", item)

    def collect(prefix: str, model: BaseModel) -> None:
        for field in type(model).model_fields:
            take(f"{prefix}.{field}" if prefix else field, getattr(model, field))
        extra = getattr(model, "extra_secrets", None)
        if extra is not None:
            found.extend((f"{prefix}: {what}", value) for what, value in extra() if value)

    for name, section in sections.items():
        collect(name, section)
    return found
