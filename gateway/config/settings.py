"""`Settings`: the whole configuration, every section validated, as `gateway run`,
`gateway doctor` and every command but the one-shot `sessions` ones load it."""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, Any

from pydantic import Field

from gateway.config.agent import AgentSettings
from gateway.config.cache import CacheSettingsSection
from gateway.config.channels import ChannelsSettings
from gateway.config.dispatch import DispatchSettings
from gateway.config.heartbeat import HeartbeatSettings
from gateway.config.http import HTTPSettings
from gateway.config.llm import LLMSettings
from gateway.config.log import LogSettings
from gateway.config.mcp import MCPSettings
from gateway.config.media import MediaSettings
from gateway.config.memory import MemorySettings
from gateway.config.schedules import ScheduleSettings
from gateway.config.section import secret_items
from gateway.config.sessions import SessionSettings
from gateway.config.storage import StorageSettings
from gateway.config.subagents import SubagentSettings
from gateway.config.telemetry import TelemetrySettings
from gateway.config.tools import ToolsSettings
from gateway.config.toplevel import TopLevelSettings
from gateway.config.usage import UsageSettings

if TYPE_CHECKING:
    from gateway.redaction import Redactor


class Settings(TopLevelSettings):
    """Everything the gateway reads from configuration, validated and frozen. Its
    sections are `gateway.config.loader.SECTIONS`, in this order."""

    llm: LLMSettings = Field(default_factory=LLMSettings)
    agent: AgentSettings = Field(default_factory=AgentSettings)
    media: MediaSettings = Field(default_factory=MediaSettings)
    sessions: SessionSettings = Field(default_factory=SessionSettings)
    memory: MemorySettings = Field(default_factory=MemorySettings)
    cache: CacheSettingsSection = Field(default_factory=CacheSettingsSection)
    dispatch: DispatchSettings = Field(default_factory=DispatchSettings)
    usage: UsageSettings = Field(default_factory=UsageSettings)
    heartbeat: HeartbeatSettings = Field(default_factory=HeartbeatSettings)
    subagents: SubagentSettings = Field(default_factory=SubagentSettings)
    schedules: ScheduleSettings = Field(default_factory=ScheduleSettings)
    log: LogSettings = Field(default_factory=LogSettings)
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    http: HTTPSettings = Field(default_factory=HTTPSettings)
    storage: StorageSettings = Field(default_factory=StorageSettings)
    channels: ChannelsSettings = Field(default_factory=ChannelsSettings)
    tools: ToolsSettings = Field(default_factory=ToolsSettings)
    mcp: MCPSettings = Field(default_factory=MCPSettings)

    def undeliverable_heartbeats(self) -> list[tuple[str, str]]:
        """(job, deliver_to) of heartbeat jobs whose target channel is not enabled: their
        replies would only reach the log."""
        enabled = set(self.channels.enabled())
        if self.channels.cli.enabled:
            enabled.add("cli")
        return [
            (name, job.deliver_to)
            for name, job in self.heartbeat.jobs.items()
            if job.deliver_to and job.deliver_to.partition(":")[0] not in enabled
        ]

    def secrets(self) -> list[str]:
        """Every secret value configured (those read from files too)."""
        return [value for _, value in secret_items({"": self})]

    @cached_property
    def redactor(self) -> Redactor:
        """The process's one redactor (`gateway.redaction`), built once from these
        settings' secrets: every surface that shows text takes it from here."""
        from gateway.redaction import Redactor

        return Redactor(self.secrets())

    def model_copy(self, *, update: Any = None, deep: bool = False) -> Settings:
        copied = super().model_copy(update=update, deep=deep)
        # A copy with other values has other secrets: its redactor is built when asked.
        copied.__dict__.pop("redactor", None)
        return copied
