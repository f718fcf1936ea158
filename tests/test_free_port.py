"""`gateway.testing.process.free_port`: a port one test process picked is never handed
to another while the first lives, so a server stopped for a while (a gateway killed and
started again, a network cut and restored) gets its port back."""

from __future__ import annotations

import socket
import subprocess
import sys

from gateway.testing.process import _reserve, free_port

CHILD = """
import sys
from gateway.testing.process import _reserve
print(_reserve(int(sys.argv[1])), _reserve(int(sys.argv[2])))
"""


def _in_child(*ports: int) -> str:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *map(str, ports)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.strip()


def test_a_port_picked_here_is_refused_to_another_process_and_to_this_one_again() -> None:
    held = free_port()
    other = free_port()
    assert held != other
    assert not _reserve(held)  # this process picked it already
    # Another process may not pick either; a port nobody holds it may (once: then it
    # is its own). free_port never picks this high.
    unheld = 64_999
    assert _in_child(held, unheld) == "False True"
    assert _in_child(other, other) == "False False"


def test_a_picked_port_is_free_to_bind() -> None:
    port = free_port()
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))
        server.listen()
        assert server.getsockname()[1] == port
