"""Benchmark of the Matrix channel's crypto store: what saving the device's state costs as
it grows. The state lives in an in-memory SQLite database (matrix-nio's store) and is
saved whole (`MatrixCrypto.persist`: `serialize()` on the event loop, then the write) each
time it changed, before the next /sync; this prints, per number of room keys received
(inbound Megolm sessions, the part that grows with rooms x senders x rotations), the
image's size, the time `serialize()` holds the event loop, and the durable write to a
workspace file (temp file, fsync, rename, in a thread).

    .venv/bin/python bench/matrix_crypto.py                 # 0 to 10,000 room keys
    .venv/bin/python bench/matrix_crypto.py --keys 0 100 1000 --runs 9

Each row is the median of `--runs` saves. No homeserver is needed: the room keys are
made locally with vodozemac and stored as nio stores the ones it receives.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

USER, DEVICE = "@bench:example.org", "BENCHDEVICE"


def add_room_keys(olm: object, count: int) -> None:
    """`count` inbound Megolm sessions, as if `count` (room, sender) keys had come."""
    from nio.crypto import InboundGroupSession, OlmAccount
    from vodozemac import GroupSession

    sender = OlmAccount()
    ed25519 = sender.identity_keys["ed25519"]
    curve = sender.identity_keys["curve25519"]
    for n in range(count):
        outbound = GroupSession()
        key = outbound.session_key.to_base64()
        session = InboundGroupSession(key, ed25519, curve, f"!room{n % 200}:x")
        olm.save_inbound_group_session(session)  # type: ignore[attr-defined]


def measure(keys: int, runs: int, folder: Path) -> tuple[int, float, float]:
    """(image bytes, serialize ms, file save ms), medians."""
    from nio.crypto import Olm
    from nio.store import SqliteMemoryStore

    from gateway.journal.cursors import FileCursorStore

    memory = SqliteMemoryStore(USER, DEVICE)
    olm = Olm(USER, DEVICE, memory)
    add_room_keys(olm, keys)
    store = FileCursorStore(folder / "cursors.json")
    connection = memory.database.connection()
    serialize, write = [], []
    size = 0
    for _ in range(runs):
        began = time.perf_counter()
        image = connection.serialize()
        serialize.append((time.perf_counter() - began) * 1000)
        size = len(image)
        began = time.perf_counter()
        anyio.run(store.save_blob, f"matrix-crypto:{USER}:{DEVICE}", image)
        write.append((time.perf_counter() - began) * 1000)
    return size, statistics.median(serialize), statistics.median(write)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[0, 100, 1000, 10_000])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(f"{'room keys':>10} {'image KB':>10} {'serialize ms':>13} {'file save ms':>13}")
        for keys in args.keys:
            size, serialize, write = measure(keys, args.runs, Path(tmp) / str(keys))
            print(f"{keys:>10,} {size / 1024:>10,.0f} {serialize:>13.2f} {write:>13.2f}")


if __name__ == "__main__":
    main()
