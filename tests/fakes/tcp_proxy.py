"""A TCP proxy on 127.0.0.1 that a test can cut and restore: the network between the
gateway and a service (PostgreSQL) going away and coming back, with the service running."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from tests.fakes._serving import free_port


class TcpProxy:
    """Forwards 127.0.0.1:`port` to `target`; `cut` refuses new connections and drops the
    open ones; `restore` listens again on the same port. `stall` holds every byte where
    it is, in both directions, without closing anything (a network that drops packets
    for a while: TCP keeps the connection and delivers it all once it `flow`s again)."""

    def __init__(self, target_host: str, target_port: int, *, port: int | None = None) -> None:
        self.target = (target_host, target_port)
        self.port = port or free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._flowing: asyncio.Event | None = None
        self._thread.start()

    def _call(self, coro: object) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)  # type: ignore[arg-type]

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        flowing = self._flowing
        assert flowing is not None
        try:
            while True:
                await flowing.wait()
                data = await reader.read(65536)
                if not data:
                    break
                await flowing.wait()
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._writers.update((writer, up_writer))
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        self._writers.difference_update((writer, up_writer))

    async def _start(self) -> None:
        if self._flowing is None:
            self._flowing = asyncio.Event()
            self._flowing.set()
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def _cut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _set_flowing(self, on: bool) -> None:
        if self._flowing is not None:
            if on:
                self._flowing.set()
            else:
                self._flowing.clear()

    def stall(self) -> None:
        self._call(self._set_flowing(False))

    def flow(self) -> None:
        self._call(self._set_flowing(True))

    def restore(self) -> None:
        self._call(self._start())

    def cut(self) -> None:
        self._call(self._cut())

    def close(self) -> None:
        self.cut()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


@contextmanager
def tcp_proxy(host: str, port: int, *, listening: bool = True) -> Iterator[TcpProxy]:
    proxy = TcpProxy(host, port)
    if listening:
        proxy.restore()
    try:
        yield proxy
    finally:
        proxy.close()
