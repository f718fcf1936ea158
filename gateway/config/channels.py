"""`[channels]`: the terminal, and one section per installed chat platform.

The platforms are not named here: each installed channel package declares its section's
model (`gateway.registry.ChannelSpec.settings`), and `ChannelsSettings` is made from the
registry once, when this module is imported. So `[channels.foo]` is validated by the foo
package's own model, with the same strict types and "did you mean" as every section; a
section of a package that cannot be loaded is kept unread (its problem is the package's,
said once by the daemon and `gateway doctor`: `ChannelsSettings.unusable`); a section no
installed package declares is an unknown key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import Field, create_model, field_validator

from gateway.config.section import Section
from gateway.messages import session_key_from_name
from gateway.registry import Registry, installed


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


class ChannelsBase(Section):
    """What every `ChannelsSettings` offers over its fields (one per installed channel)."""

    cli: CLIChannelSettings = Field(default_factory=CLIChannelSettings)

    def platforms(self) -> dict[str, Section]:
        """Each installed platform's section, by channel name (enabled or not)."""
        specs = installed().specs
        return {name: getattr(self, name) for name in type(self).model_fields if name in specs}

    def enabled(self) -> list[str]:
        """The names of the enabled platforms whose package loaded (not the terminal)."""
        specs = installed().specs
        return [name for name, section in self.platforms().items() if specs[name].enabled(section)]

    def unusable(self) -> dict[str, str]:
        """Sections that name a channel the gateway cannot run, with one line each: an
        enabled one whose library is missing, or one whose package is broken."""
        registry = installed()
        found: dict[str, str] = {}
        for name, section in self.platforms().items():
            spec = registry.specs[name]
            line = spec.missing_line() if spec.enabled(section) else None
            if line is not None:
                found[name] = line
        for name, broken in registry.broken.items():
            if getattr(self, name, None) is not None:
                found[name] = broken.line()
        return found


def channels_model(registry: Registry) -> type[ChannelsBase]:
    """The `[channels]` model for the channels of `registry`."""
    fields: dict[str, Any] = {}
    for name, spec in registry.specs.items():
        fields[name] = (spec.settings, Field(default_factory=spec.settings))
    for name, broken in registry.broken.items():
        fields[name] = (dict[str, Any] | None, Field(None, description=broken.line()))
    model: type[ChannelsBase] = create_model(  # type: ignore[call-overload]
        "ChannelsSettings", __base__=ChannelsBase, __module__=__name__, **fields
    )
    return model


if TYPE_CHECKING:
    ChannelsSettings = ChannelsBase
else:
    ChannelsSettings = channels_model(installed())
