"""A TCP proxy in front of a real Redis that can hang: the way a paused or wedged Redis
looks to a client (connections are taken, commands are read, nothing is answered).

    async with StallingProxy(6379) as proxy:      # in the running event loop
        url = proxy.url                            # redis://127.0.0.1:<port>/0
        proxy.stalled = True                       # from now on nothing is answered

Unlike `CLIENT PAUSE` on the real server, stalling the proxy touches no one else who
shares that Redis.
"""

from __future__ import annotations

from types import TracebackType
from typing import Self

import anyio
import anyio.abc
from anyio.streams.stapled import MultiListener


class StallingProxy:
    """Forwards bytes to and from `upstream_host:upstream_port` until `stalled` is set;
    then it keeps reading what clients send and forwards none of it. `connections`
    counts the connections clients opened (a skipped call opens none)."""

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.stalled = False
        self.connections = 0
        self.port = 0
        self._tg: anyio.abc.TaskGroup | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def __aenter__(self) -> Self:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        assert isinstance(listener, MultiListener)
        self.port = listener.listeners[0].extra(anyio.abc.SocketAttribute.local_port)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(listener.serve, self._handle)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        await self._tg.__aexit__(exc_type, exc, tb)

    async def _handle(self, client: anyio.abc.SocketStream) -> None:
        self.connections += 1
        async with client:
            try:
                upstream = await anyio.connect_tcp(*self.upstream)
            except OSError:
                return
            async with upstream, anyio.create_task_group() as tg:
                tg.start_soon(self._pump, client, upstream, True)
                tg.start_soon(self._pump, upstream, client, False)

    async def _pump(
        self, source: anyio.abc.SocketStream, sink: anyio.abc.SocketStream, requests: bool
    ) -> None:
        try:
            async for chunk in source:
                if requests and self.stalled:
                    continue  # read and dropped: the command is never answered
                await sink.send(chunk)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
        finally:
            await sink.aclose()
