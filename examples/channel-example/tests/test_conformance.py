"""The conformance kit's scenarios (`gateway.testing.suite`) against the example channel:
each runs the real `gateway run` with it, over Example Chat (conftest.py's driver)."""

from gateway.testing.suite import *  # noqa: F403
