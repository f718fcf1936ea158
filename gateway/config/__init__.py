"""Configuration: gateway.toml, GATEWAY_* environment overrides and command-line flags,
validated into frozen settings with errors a person can act on.

One package by section: each section's model in its own module (`llm`, `sessions`,
`channels`, ... one per key of `SECTIONS`; a chat platform's section is its channel
package's, `access` what they share), the keys outside any section in `toplevel`,
the whole (`Settings`) in `settings`, and one loader (`loader`: `load_settings` for all
of it, `load_sections` for the sections one command reads). The starter file of `gateway
init` is `starter`'s.

The names are imported on first use: `from gateway.config import ConfigError` loads no
pydantic, and a command that loads some sections builds no model of the others.
"""

from typing import TYPE_CHECKING

from gateway.lazy import lazy_exports

if TYPE_CHECKING:
    from gateway.config.access import AccessSection
    from gateway.config.agent import AgentSettings
    from gateway.config.cache import CacheSettingsSection
    from gateway.config.channels import ChannelsSettings, CLIChannelSettings
    from gateway.config.dispatch import DispatchSettings
    from gateway.config.heartbeat import HeartbeatJobSettings, HeartbeatSettings
    from gateway.config.http import ApiTokenSettings, HTTPSettings
    from gateway.config.llm import (
        DEFAULT_PROVIDER,
        FailoverSettings,
        LLMProviderSettings,
        LLMSettings,
    )
    from gateway.config.loader import (
        DEFAULT_CONFIG_NAME,
        ENV_PREFIX,
        EXIT_CONFIG,
        SECRET_KEYS,
        SECTIONS,
        ConfigError,
        PartialSettings,
        all_keys,
        env_warnings,
        find_config_path,
        load_sections,
        load_settings,
    )
    from gateway.config.log import LogSettings
    from gateway.config.mcp import MCPServerSettings, MCPSettings
    from gateway.config.media import MediaSettings
    from gateway.config.memory import MemorySettings
    from gateway.config.schedules import ScheduleSettings
    from gateway.config.section import Section, reveal
    from gateway.config.sessions import SessionSettings
    from gateway.config.settings import Settings
    from gateway.config.starter import starter_toml, write_starter_config
    from gateway.config.storage import StorageSettings
    from gateway.config.subagents import SubagentSettings
    from gateway.config.telemetry import TelemetrySettings
    from gateway.config.tools import ToolsSettings, WebFetchSettings
    from gateway.config.toplevel import TopLevelSettings
    from gateway.config.usage import ModelPriceSettings, UsageSettings

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "agent": ("AgentSettings",),
        "cache": ("CacheSettingsSection",),
        "access": ("AccessSection",),
        "channels": ("CLIChannelSettings", "ChannelsSettings"),
        "dispatch": ("DispatchSettings",),
        "heartbeat": ("HeartbeatJobSettings", "HeartbeatSettings"),
        "http": ("ApiTokenSettings", "HTTPSettings"),
        "llm": ("DEFAULT_PROVIDER", "FailoverSettings", "LLMProviderSettings", "LLMSettings"),
        "loader": (
            "ConfigError",
            "DEFAULT_CONFIG_NAME",
            "ENV_PREFIX",
            "EXIT_CONFIG",
            "PartialSettings",
            "SECRET_KEYS",
            "SECTIONS",
            "all_keys",
            "env_warnings",
            "find_config_path",
            "load_sections",
            "load_settings",
        ),
        "log": ("LogSettings",),
        "mcp": ("MCPServerSettings", "MCPSettings"),
        "media": ("MediaSettings",),
        "memory": ("MemorySettings",),
        "schedules": ("ScheduleSettings",),
        "section": ("Section", "reveal"),
        "sessions": ("SessionSettings",),
        "settings": ("Settings",),
        "starter": ("starter_toml", "write_starter_config"),
        "storage": ("StorageSettings",),
        "subagents": ("SubagentSettings",),
        "telemetry": ("TelemetrySettings",),
        "tools": ("ToolsSettings", "WebFetchSettings"),
        "toplevel": ("TopLevelSettings",),
        "usage": ("ModelPriceSettings", "UsageSettings"),
    },
)

__all__ = [
    "DEFAULT_CONFIG_NAME",
    "DEFAULT_PROVIDER",
    "ENV_PREFIX",
    "EXIT_CONFIG",
    "SECRET_KEYS",
    "SECTIONS",
    "AccessSection",
    "AgentSettings",
    "ApiTokenSettings",
    "CLIChannelSettings",
    "CacheSettingsSection",
    "ChannelsSettings",
    "ConfigError",
    "DispatchSettings",
    "FailoverSettings",
    "HTTPSettings",
    "HeartbeatJobSettings",
    "HeartbeatSettings",
    "LLMProviderSettings",
    "LLMSettings",
    "LogSettings",
    "MCPServerSettings",
    "MCPSettings",
    "MediaSettings",
    "MemorySettings",
    "ModelPriceSettings",
    "PartialSettings",
    "ScheduleSettings",
    "Section",
    "SessionSettings",
    "Settings",
    "StorageSettings",
    "SubagentSettings",
    "TelemetrySettings",
    "ToolsSettings",
    "TopLevelSettings",
    "UsageSettings",
    "WebFetchSettings",
    "all_keys",
    "env_warnings",
    "find_config_path",
    "load_sections",
    "load_settings",
    "reveal",
    "starter_toml",
    "write_starter_config",
]
