"""The example channel package (examples/channel-example) as the tests find it: installed
like a third party's (`pip install -e examples/channel-example`, which .ci/run does), its
entry point registering the `example` channel."""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "channel-example"
DISTRIBUTION = "gateway-channel-example"
INSTALL = "pip install -e examples/channel-example"


def require_example() -> metadata.Distribution:
    """The installed example package; skip without it, or under CI=true fail (CI must
    run the kit against it)."""
    try:
        return metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        reason = f"the example channel package is not installed ({INSTALL})"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}; CI=true requires it (.ci/run installs it)")
        pytest.skip(reason)
