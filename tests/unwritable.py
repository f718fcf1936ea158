"""Folders this test process's `gateway` children cannot write in, also when run as root.

Root writes through mode bits (CAP_DAC_OVERRIDE), so under root the child runs with
that capability (and its relatives) dropped from its bounding set: it is then held to
the mode bits like any other user, which is what an operator's service user meets.
"""

from __future__ import annotations

import os
import shutil

import pytest

_DROP = "--bounding-set=-dac_override,-dac_read_search,-fowner,-linux_immutable"


def unprivileged() -> list[str]:
    """The command prefix that makes a child respect mode bits (empty unless root);
    skips the test when that cannot be arranged."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: root writes through chmod 0500")
    return [setpriv, _DROP, "--"]
