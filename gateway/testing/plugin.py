"""The conformance kit's pytest plugin: the `kit` fixture the scenarios take, the skip of
what a platform cannot do, the seed, the summary lines.

Load it explicitly where the kit runs (it is no `pytest11` entry point, so it never
loads into other pytest sessions), and give it your driver::

    # conftest.py
    pytest_plugins = ["gateway.testing.plugin"]

    @pytest.fixture
    def channel_driver() -> ChannelDriver:
        return MyPlatformDriver()

    # test_conformance.py
    from gateway.testing.suite import *  # noqa: F403

Seeds: every random choice of a scenario comes from the run's seed, printed on its
summary line; ``--kit-seed=N`` (or ``GATEWAY_KIT_SEED=N``) repeats a run.
``--kit-scale=4`` (or ``GATEWAY_KIT_SCALE``) writes four times as many messages.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from gateway.testing.driver import ChannelDriver, Requirements
from gateway.testing.kit import Kit
from gateway.testing.model import KitModel

__all__ = ["needs", "summary_line"]

MARKER = "kit_needs"
SEED_VARIABLE = "GATEWAY_KIT_SEED"
SCALE_VARIABLE = "GATEWAY_KIT_SCALE"
#: Seconds a scenario may take at scale 1 (with pytest-timeout).
SCENARIO_TIMEOUT = 300
FAILED = pytest.StashKey[bool]()

_F = TypeVar("_F", bound=Callable[..., object])


def needs(*requirements: str) -> Callable[[_F], _F]:
    """Mark a scenario as needing these `Requirements` fields; on a driver that lacks
    one it is skipped, naming what is missing."""
    Requirements().lacking(requirements)  # a misspelt name fails at import
    marker: Callable[[_F], _F] = getattr(pytest.mark, MARKER)(*requirements)
    return marker


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gateway-kit", "the gateway's channel conformance kit")
    group.addoption(
        "--kit-seed",
        type=int,
        default=None,
        help=f"seed of the kit's random choices (default: ${SEED_VARIABLE}, else random)",
    )
    group.addoption(
        "--kit-scale",
        type=float,
        default=None,
        help=f"multiply the scenarios' sizes (default: ${SCALE_VARIABLE}, else 1)",
    )


def _scale(config: pytest.Config) -> float:
    given = config.getoption("--kit-scale")
    return float(given if given is not None else os.environ.get(SCALE_VARIABLE) or 1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With pytest-timeout: a scenario may take longer than a unit test (gateway starts,
    kills, a slow machine), and longer again at a larger `--kit-scale`."""
    if not config.pluginmanager.hasplugin("timeout"):
        return
    seconds = int(SCENARIO_TIMEOUT * max(1.0, _scale(config)))
    for item in items:
        if "kit" in getattr(item, "fixturenames", ()) and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(seconds))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Remember a failed scenario, so that its `kit` saves the gateways' logs."""
    report = yield
    if report.when == "call" and report.failed:
        item.stash[FAILED] = True
    return report


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(*requirements): a conformance scenario that needs these Requirements "
        "of the channel driver (skipped when the driver lacks one)",
    )


#: The name of a test's user property that holds one of its summary lines.
SUMMARY = "summary line"


def summary_line(node: pytest.Item, line: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Show `line` past pytest's capture now, and again among the summary lines at the end
    of the run (`pytest_terminal_summary`): with pytest-xdist a worker's output is not
    shown, but its reports' user properties reach the controller."""
    node.user_properties.append((SUMMARY, line))
    with capsys.disabled():
        print(f"\n{line}")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Every summary line of the run (the kit's KIT lines and the like), together, in the
    order the tests ended."""
    # A test's reports (call, teardown) each carry its properties so far: the last, longest.
    per_test: dict[str, list[str]] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            found = [
                str(value)
                for name, value in getattr(report, "user_properties", ())
                if name == SUMMARY
            ]
            nodeid = str(getattr(report, "nodeid", ""))
            if len(found) > len(per_test.get(nodeid, [])):
                per_test[nodeid] = found
    lines = [line for found in per_test.values() for line in found]
    if lines:
        terminalreporter.section("summary lines")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def kit_seed(request: pytest.FixtureRequest) -> int:
    """The run's seed: --kit-seed, $GATEWAY_KIT_SEED, or a fresh one (printed on each
    scenario's summary line)."""
    given = request.config.getoption("--kit-seed")
    if given is None and os.environ.get(SEED_VARIABLE):
        given = int(os.environ[SEED_VARIABLE])
    return int(given) if given is not None else random.SystemRandom().randrange(1_000_000)


@pytest.fixture
def channel_driver() -> ChannelDriver:
    """Override this fixture (in your conftest.py) with your platform's driver."""
    pytest.fail(
        "the conformance kit needs a `channel_driver` fixture: define one in your "
        "conftest.py that returns your ChannelDriver (see docs/channel-sdk.md)"
    )


@pytest.fixture
def kit_model() -> Iterator[KitModel]:
    """The kit's OpenAI-compatible model (echoes), running for one scenario."""
    with KitModel.running() as model:
        yield model


@pytest.fixture
def kit(
    request: pytest.FixtureRequest,
    channel_driver: ChannelDriver,
    kit_model: KitModel,
    kit_seed: int,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> Iterator[Kit]:
    """One scenario's world on the driver's running platform; skipped, with the reason,
    when the driver lacks what the scenario needs."""
    marker = request.node.get_closest_marker(MARKER)
    lacking = channel_driver.requirements.lacking(tuple(marker.args) if marker else ())
    if lacking:
        pytest.skip(f"{channel_driver.name or 'the'} driver lacks: {', '.join(lacking)}")
    if channel_driver.requirements.mass_pings:
        kit_model.everyone_text = channel_driver.ping_everyone_text()

    def report(line: str) -> None:
        summary_line(request.node, line, capsys)

    scale = _scale(request.config)
    scenario = request.node.name.removeprefix("test_").replace("_", "-")
    kit = Kit(
        channel_driver,
        kit_model,
        tmp_path,
        scenario=scenario,
        seed=kit_seed,
        report=report,
        scale=scale,
    )
    with channel_driver.running():
        try:
            yield kit
        finally:
            kit.close()
            if request.node.stash.get(FAILED, False) and kit.logs is None:
                report(f"KIT {channel_driver.name} {scenario}: logs in {kit.save_logs()}")
