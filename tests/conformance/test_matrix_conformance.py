"""The conformance kit (`gateway.testing`) run against the Matrix channel over a real
Synapse (tests/synapse_server.py, one for the test session): every scenario Matrix
supports, each on a bot account and rooms of its own."""

from __future__ import annotations

import pytest

from gateway.testing import ChannelDriver
from gateway.testing.suite import *  # noqa: F403
from tests.conformance.matrix_driver import MatrixDriver
from tests.synapse_server import Synapse

pytestmark = pytest.mark.conformance


@pytest.fixture
def channel_driver(synapse: Synapse) -> ChannelDriver:
    return MatrixDriver(synapse)
