"""Channels as packages (`gateway.registry`): the built-in channels come through the entry
point like a third party's; a third-party package on the path is found, its section
validated by its own model; a broken package, or a channel whose library is missing, is one
line naming the fix, never a traceback, and never stops the other channels.

Third-party packages are real distributions on disk (a `.dist-info` folder with its
`entry_points.txt`, found by importlib.metadata through PYTHONPATH) used by real `gateway`
processes: nothing of the registry is mocked.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

from gateway.config import ConfigError, load_settings
from gateway.registry import ENTRY_POINT_GROUP, ChannelSpec, installed, load_entry_points
from tests.fakes.openai_server import FakeOpenAI
from tests.gateway_process import GatewayProcess, base_env, wait_until

ROOT = Path(__file__).resolve().parents[1]
BUILT_IN = ["discord", "email", "matrix", "mattermost", "qq", "slack", "telegram", "whatsapp"]


def test_the_built_in_channels_come_through_the_entry_point_group() -> None:
    registry = installed()
    ours = sorted(n for n, spec in registry.specs.items() if spec.distribution == "chat-gateway")
    assert ours == BUILT_IN and not registry.broken  # beside them: others' packages, if any
    entries = {e.name: e for e in metadata.entry_points(group=ENTRY_POINT_GROUP)}
    for name in BUILT_IN:
        spec = registry.specs[name]
        assert entries[name].value == f"channels.{name}.spec:SPEC"
        assert spec.distribution == "chat-gateway"
        assert (ROOT / spec.docs).is_file(), spec.docs
        assert spec.settings().enabled is False  # every field has a default, off


SPEC_CHECK = """
import json, sys
for name in sys.argv[1:]:
    sys.modules[name] = None  # as if the library were not installed
from gateway.registry import installed
registry = installed()
from gateway.config import load_settings
env = {"OPENAI_API_KEY": "x", "GATEWAY_CHANNELS__DISCORD__ENABLED": "true",
       "GATEWAY_CHANNELS__MATRIX__ENABLED": "true"}
settings = load_settings(None, environ=env)
heavy = [m for m in ("discord", "nio", "imapclient", "aiosmtplib", "telegram", "slack_bolt")
         if sys.modules.get(m) is not None]
print(json.dumps({"specs": sorted(registry.specs), "unusable": settings.channels.unusable(),
                  "loaded": heavy}))
"""


def test_spec_modules_import_no_platform_library_and_a_missing_one_is_one_line() -> None:
    """Reading the configuration imports no platform's library; a section of a channel
    whose library is missing says which one, and the install command."""
    done = subprocess.run(
        [sys.executable, "-c", SPEC_CHECK, "discord", "nio"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    found = json.loads(done.stdout)
    assert set(BUILT_IN) <= set(found["specs"])
    assert found["loaded"] == []
    assert found["unusable"] == {
        "discord": "channels.discord needs discord, which is not installed; install it with: "
        "pip install 'chat-gateway[discord]'",
        "matrix": "channels.matrix needs nio, which is not installed; install it with: "
        "pip install 'chat-gateway[matrix]'",
    }


def test_a_misspelt_channel_section_names_the_channel_meant(tmp_path: Path) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text("[channels.telegarm]\nenabled = true\n")
    with pytest.raises(ConfigError, match=r"channels\.telegarm: unknown key; did you mean "):
        load_settings(config, environ={"OPENAI_API_KEY": "x"})
    config.write_text("[channels.telegram]\nenabeld = true\n")
    with pytest.raises(ConfigError, match=r"did you mean channels\.telegram\.enabled"):
        load_settings(config, environ={"OPENAI_API_KEY": "x"})


# --------------------------------------------------------------------------- entry points


class Entry(metadata.EntryPoint):
    """An entry point whose `load` gives `value_object` (or raises it), from a named
    distribution, as importlib.metadata hands them out."""

    def __new__(cls, name: str, loaded: object, dist: str = "gateway-channel-x") -> Entry:
        entry = super().__new__(cls)
        return entry

    def __init__(self, name: str, loaded: object, dist: str = "gateway-channel-x") -> None:
        super().__init__(name, f"{dist.replace('-', '_')}.spec:SPEC", ENTRY_POINT_GROUP)
        object.__setattr__(self, "_loaded", loaded)
        object.__setattr__(self, "_dist_name", dist)

    @property
    def dist(self) -> object:  # type: ignore[override]
        return type("Dist", (), {"name": self._dist_name})()

    def load(self) -> object:
        loaded = self._loaded
        if isinstance(loaded, BaseException):
            raise loaded
        return loaded


def spec_named(name: str) -> ChannelSpec:
    from channels.telegram.settings import TelegramSettings

    return ChannelSpec(name, TelegramSettings, lambda s, v: None, "a test", "docs/x.md")


def test_what_cannot_be_loaded_is_recorded_with_its_package_and_the_rest_loads() -> None:
    from pydantic import Field

    from gateway.config.section import Section

    class NoDefault(Section):
        enabled: bool = False
        url: str = Field(description="required")

    without_default = ChannelSpec("nodefault", NoDefault, lambda s, v: None, "x", "docs/x.md")
    registry = load_entry_points(
        [
            Entry("good", spec_named("good")),
            Entry("boom", ImportError("No module named 'foo_sdk'"), dist="gateway-channel-boom"),
            Entry("wrong", object()),
            Entry("alias", spec_named("other")),
            Entry("cli", spec_named("cli")),
            Entry("Bad-Name", spec_named("Bad-Name")),
            Entry("nodefault", without_default),
            Entry("twice", spec_named("twice"), dist="first-package"),
            Entry("twice", spec_named("twice"), dist="second-package"),
        ]
    )
    assert list(registry.specs) == ["good"]
    assert registry.specs["good"].distribution == "gateway-channel-x"
    problems = {name: broken.problem for name, broken in registry.broken.items()}
    assert problems["boom"] == "ImportError: No module named 'foo_sdk'"
    assert problems["wrong"].endswith("is a object, not a ChannelSpec")
    assert problems["alias"] == "its spec is named 'other', its entry point 'alias'"
    assert "not a channel name" in problems["cli"] and "not a channel name" in problems["Bad-Name"]
    assert "a field without a default" in problems["nodefault"]
    assert problems["twice"] == "both first-package and second-package provide it"
    line = registry.broken["boom"].line()
    assert line.startswith("channels.boom: the package gateway-channel-boom could not be loaded")
    assert "\n" not in line


# --------------------------------------------------------------------------- a real package

GOOD_SPEC = """
from pathlib import Path
from pydantic import Field, SecretStr
from gateway.config.access import AccessSection
from gateway.config.section import secret, secret_file
from gateway.registry import ChannelSpec, Finding, Offers


class EchoSettings(AccessSection):
    enabled: bool = Field(False, description="Serve the echo platform.")
    greeting: str = Field("hi", description="What it says first.")
    client_secret: SecretStr | None = secret("its secret", "GATEWAY_CHANNELS__ECHO__CLIENT_SECRET")
    client_secret_file: Path | None = secret_file("GATEWAY_CHANNELS__ECHO__CLIENT_SECRET", "x")


def build(section, services):
    from gateway_channel_echo.channel import EchoChannel
    return EchoChannel(section)


async def checks(section):
    secret = section.client_secret.get_secret_value() if section.client_secret else None
    return [Finding("ok", f"echo says {section.greeting} with secret {secret}")]


SPEC = ChannelSpec(
    name="echo", settings=EchoSettings, build=build, summary="an echo", docs="README",
    offers=Offers(), checks=checks,
)
"""

GOOD_CHANNEL = """
import anyio


class EchoChannel:
    name = "echo"

    def __init__(self, section):
        self.section = section

    async def run(self, submit, *, task_status=anyio.TASK_STATUS_IGNORED):
        task_status.started()
        await anyio.sleep_forever()

    async def send(self, message):
        pass
"""


def fake_distribution(root: Path, dist: str, module: str, files: dict[str, str]) -> None:
    """An installed distribution `dist` with package `module` and an entry point for each
    `<name>.py` holding a SPEC: what `pip install` leaves in site-packages."""
    package = root / module
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for name, text in files.items():
        (package / name).write_text(textwrap.dedent(text))
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    channel = module.removeprefix("gateway_channel_")
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\n{channel} = {module}.spec:SPEC\n"
    )


@pytest.fixture
def site(tmp_path: Path) -> Path:
    root = tmp_path / "site"
    fake_distribution(
        root,
        "gateway-channel-echo",
        "gateway_channel_echo",
        {"spec.py": GOOD_SPEC, "channel.py": GOOD_CHANNEL},
    )
    fake_distribution(
        root,
        "gateway-channel-broken",
        "gateway_channel_broken",
        {"spec.py": "import foo_sdk_that_is_not_installed\n"},
    )
    return root


def gateway_command(
    site: Path, tmp_path: Path, *args: str, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{ROOT}:{site}", **env},
        timeout=120,
    )


def test_a_third_party_channel_is_configured_checked_and_run_like_a_built_in_one(
    site: Path, tmp_path: Path
) -> None:
    env = {
        "GATEWAY_WORKSPACE": str(tmp_path / "ws"),
        "OPENAI_API_KEY": "x",
        "OPENAI_BASE_URL": "http://127.0.0.1:9/v1",
        "GATEWAY_CHANNELS__ECHO__ENABLED": "true",
        "GATEWAY_CHANNELS__ECHO__GREETING": "hello",
    }
    (tmp_path / "echo-secret").write_text("echo-client-secret-1\n")
    env["GATEWAY_CHANNELS__ECHO__CLIENT_SECRET_FILE"] = str(tmp_path / "echo-secret")
    doctor = gateway_command(site, tmp_path, "doctor", env=env)
    # Its secret, under a name only its model knows, was read from its file and redacted.
    assert "echo says hello with secret ***" in doctor.stdout, doctor.stdout + doctor.stderr
    assert "echo-client-secret-1" not in doctor.stdout + doctor.stderr
    # The broken package has no section: a warning naming it, nothing more.
    assert "gateway-channel-broken could not be loaded" in doctor.stdout
    assert "Traceback" not in doctor.stdout + doctor.stderr
    wrong = gateway_command(
        site, tmp_path, "doctor", env=env | {"GATEWAY_CHANNELS__ECHO__GREETNG": "x"}
    )
    assert wrong.returncode == 78  # EX_CONFIG: its own model refused the key
    assert wrong.stderr == (
        "gateway: config error: channels.echo.greetng: unknown key; "
        "did you mean channels.echo.greeting?\n"
    )
    listed = gateway_command(site, tmp_path, "channels", env=env)
    assert listed.returncode == 0  # the broken package has no section here
    assert "on   echo         an echo\n      package gateway-channel-echo; offers DMs; README" in (
        listed.stdout
    )
    assert "off  telegram " in listed.stdout
    assert "warn channels.broken: the package gateway-channel-broken could not be loaded" in (
        listed.stdout
    )
    config = tmp_path / "with-secret.toml"
    config.write_text('[channels.echo]\nclient_secret = "in-the-file"\n')
    refused = gateway_command(site, tmp_path, "--config", str(config), "doctor", env=env)
    assert refused.returncode == 78
    assert "channels.echo.client_secret: secrets do not belong in with-secret.toml" in (
        refused.stderr
    )
    starter = gateway_command(site, tmp_path, "init", str(tmp_path / "new.toml"), env=env)
    assert starter.returncode == 0, starter.stderr
    written = (tmp_path / "new.toml").read_text()
    echo = written[written.index("[channels.echo]\n") :]
    assert "# Serve the echo platform.\nenabled = false\n" in echo
    assert '# What it says first.\ngreeting = "hi"\n' in echo


def test_a_broken_channel_package_is_one_line_and_the_others_run(
    site: Path, tmp_path: Path
) -> None:
    """`[channels.broken]` names a package that cannot be imported: `gateway run` logs
    one line naming the package, shows it failed on /readyz's components without holding
    readiness back, and serves everything else."""
    with FakeOpenAI.in_thread() as llm:
        env = base_env(tmp_path / "ws", llm) | {
            "PYTHONPATH": f"{ROOT}:{site}",
            "GATEWAY_HTTP__PORT": "0",
            "GATEWAY_CHANNELS__BROKEN__ENABLED": "true",
            "GATEWAY_CHANNELS__ECHO__ENABLED": "true",
        }
        gateway = GatewayProcess(env, tmp_path)
        try:
            port = gateway.wait_ready()
            gateway.wait_readyz(port)
            line = gateway.wait_logged("gateway-channel-broken could not be loaded")
            assert "ModuleNotFoundError" in line and "channels.broken" in line
            import urllib.request

            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
                ready = json.loads(r.read())
            assert ready["components"]["echo"]["healthy"] is True
            assert ready["components"]["broken"]["healthy"] is False
            wait_until(lambda: gateway.proc.poll() is None, 1)
        finally:
            gateway.terminate()
    assert not any("Traceback" in line for line in gateway.log), "".join(gateway.log[-30:])
