"""A counting PostgreSQL wire proxy: the round trips and statements its clients send.

The benchmarks put it between the gateways and PostgreSQL (`PgWireCounter.in_thread`)
and divide its counts by the turns run. It parses the client's side of the v3 protocol
only as far as message boundaries: a round trip is a ``Sync`` (the extended protocol
psycopg uses) or a ``Query`` (the simple protocol); a statement is an ``Execute`` or a
``Query``. The server's side is relayed untouched.
"""

from __future__ import annotations

import asyncio
import struct
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

_SSL_REQUEST = 80877103
_GSSENC_REQUEST = 80877104


def _text(body: bytes) -> str:
    return " ".join(body.decode(errors="replace").split())[:100]


class PgWireCounter:
    """Listens on 127.0.0.1 (an ephemeral port) and relays to ``host:port``."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.listen_port = 0
        self.messages: Counter[str] = Counter()  # client message type -> count
        self.connections = 0
        #: Statement text -> times sent (``Query``, or ``Parse`` then ``Execute``).
        self.texts: Counter[str] = Counter()

    @property
    def round_trips(self) -> int:
        return self.messages["S"] + self.messages["Q"]

    @property
    def statements(self) -> int:
        return self.messages["E"] + self.messages["Q"]

    def snapshot(self) -> tuple[int, int, int]:
        """Round trips, statements and connections so far."""
        return self.round_trips, self.statements, self.connections

    async def _relay_client(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        # Start-up: untyped messages (SSL/GSS requests, then the startup packet).
        while True:
            head = await reader.readexactly(8)
            length, code = struct.unpack("!ii", head)
            rest = await reader.readexactly(length - 8)
            writer.write(head + rest)
            await writer.drain()
            if code not in (_SSL_REQUEST, _GSSENC_REQUEST):
                break
        prepared: dict[bytes, str] = {}
        bound = "?"
        while True:
            head = await reader.readexactly(5)
            kind, length = head[:1].decode(), struct.unpack("!i", head[1:])[0]
            body = await reader.readexactly(length - 4)
            self.messages[kind] += 1
            if kind == "Q":
                self.texts[_text(body.split(b"\0", 1)[0])] += 1
            elif kind == "P":  # name, query: an unnamed one lasts until the next Parse
                name, query = body.split(b"\0", 2)[:2]
                prepared[name] = _text(query)
            elif kind == "B":  # portal, statement name
                bound = prepared.get(body.split(b"\0", 2)[1], "?")
            elif kind == "E":
                self.texts[bound] += 1
            writer.write(head + body)
            await writer.drain()

    async def _relay_server(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()

    async def _serve_one(
        self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter
    ) -> None:
        self.connections += 1
        server_r, server_w = await asyncio.open_connection(self.host, self.port)
        tasks = [
            asyncio.create_task(self._relay_client(client_r, server_w)),
            asyncio.create_task(self._relay_server(server_r, client_w)),
        ]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            for w in (client_w, server_w):
                w.close()

    @classmethod
    @contextmanager
    def in_thread(cls, host: str = "127.0.0.1", port: int = 5432) -> Iterator[PgWireCounter]:
        """Run the proxy on its own event loop in a daemon thread."""
        counter = cls(host, port)
        started = threading.Event()
        loop = asyncio.new_event_loop()

        async def main() -> None:
            server = await asyncio.start_server(counter._serve_one, "127.0.0.1", 0)
            counter.listen_port = server.sockets[0].getsockname()[1]
            started.set()
            async with server:
                await server.serve_forever()

        def run() -> None:
            task = loop.create_task(main())
            loop.run_forever()
            del task  # cancelled below with every relay still running
            pending = asyncio.all_tasks(loop)
            for each in pending:
                each.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

        threading.Thread(target=run, daemon=True).start()
        started.wait(10)
        try:
            yield counter
        finally:
            loop.call_soon_threadsafe(loop.stop)
