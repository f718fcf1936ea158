"""The example channel package (examples/channel-example): installed through its entry
point like any third party's, listed by `gateway channels`, and its own tests (the
conformance kit in both of its modes, and its unit tests) pass, run as its author runs
them: pytest in its folder. Needs the package installed (tests/example_channel.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from gateway.registry import ENTRY_POINT_GROUP, installed
from tests.example_channel import DISTRIBUTION, EXAMPLE, ROOT, require_example

#: Seconds for one part of the example's run (about a minute and a half on an idle machine).
EXAMPLE_RUN_TIMEOUT = 1500


def test_the_example_is_a_channel_through_its_entry_point() -> None:
    distribution = require_example()
    entries = [e for e in distribution.entry_points if e.group == ENTRY_POINT_GROUP]
    assert [(e.name, e.value) for e in entries] == [
        ("example", "gateway_channel_example.spec:SPEC")
    ]
    assert "example" in {e.name for e in metadata.entry_points(group=ENTRY_POINT_GROUP)}
    registry = installed()
    assert "example" not in registry.broken
    spec = registry.specs["example"]
    assert spec.distribution == DISTRIBUTION
    assert spec.settings().enabled is False


def test_gateway_channels_lists_the_example(tmp_path: Path) -> None:
    require_example()
    listed = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "channels"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=os.environ | {"PYTHONPATH": str(ROOT), "GATEWAY_WORKSPACE": str(tmp_path)},
        timeout=120,
    )
    assert listed.returncode == 0, listed.stderr
    assert "off  example      an Example Chat bot" in listed.stdout, listed.stdout
    assert f"package {DISTRIBUTION}" in listed.stdout


#: The example's run in three parts (its unit tests, then the kit in each of its two
#: modes), so that the suite's workers share them (the whole takes six minutes alone).
PARTS = {
    "unit": ["tests/test_channel.py"],
    "kit-polling": ["tests/test_conformance.py", "-k", "polling"],
    "kit-webhook": ["tests/test_conformance.py", "-k", "webhook"],
}


@pytest.mark.conformance
@pytest.mark.timeout(EXAMPLE_RUN_TIMEOUT + 60)
@pytest.mark.parametrize("part", list(PARTS))
def test_the_example_passes_its_own_tests(part: str, capsys: pytest.CaptureFixture[str]) -> None:
    require_example()
    # This checkout's gateway and example, whatever else the environment has installed.
    path = os.pathsep.join(
        filter(None, [str(ROOT), str(EXAMPLE / "src"), os.environ.get("PYTHONPATH")])
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *PARTS[part]],
        capture_output=True,
        text=True,
        cwd=EXAMPLE,
        env=os.environ | {"PYTHONPATH": path},
        timeout=EXAMPLE_RUN_TIMEOUT,
    )
    lines = done.stdout.splitlines()
    # Each KIT line comes twice: as its scenario ends, and among the summary lines.
    shown = list(dict.fromkeys(line for line in lines if line.startswith("KIT "))) + lines[-1:]
    with capsys.disabled():  # the kit's counts and the run's summary, in CI's log
        print("".join(f"\n{line}" for line in shown))
    assert done.returncode == 0, "\n".join(lines[-80:]) + done.stderr[-3000:]
    assert " passed" in lines[-1] and " failed" not in lines[-1], lines[-1]
    if part.startswith("kit-"):
        mode = part.removeprefix("kit-")
        assert any(
            line.startswith(f"KIT example kill-before-journal-loses-nothing[{mode}]")
            for line in lines
        ), shown
