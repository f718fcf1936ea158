"""Serving plumbing the fakes share: an aiohttp app on 127.0.0.1, in a loop or a thread."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, ClassVar, Generic, Protocol, Self, TypeVar

from aiohttp import web

from gateway.testing.process import free_port as free_port  # the fakes and drivers use it

T = TypeVar("T")


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running in this thread, or None outside one."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def at_least(count: int, items: Callable[[], list[T]]) -> Callable[[], list[T] | None]:
    """A wait condition for `LocalServer._until`/`_wait_blocking`: `items()` once it
    holds at least `count` entries, else None."""

    def enough() -> list[T] | None:
        found = items()
        return found if len(found) >= count else None

    return enough


class LocalServer(abc.ABC):
    """A fake service on 127.0.0.1 at a free port: ``async with`` it in the running event
    loop, or ``with Fake.in_thread(...)`` to serve it from a loop in a thread of its own.

    State changes are announced with `_notify`, which wakes both kinds of waiter: threads
    blocked in `_wait_blocking` (on `_lock`) and coroutines in `_until` (on `_changed`).
    Stopping sets `_closing` and wakes every waiter, so no wait outlives the server.
    """

    _thread_name: ClassVar[str]
    """The name of the serving thread of `in_thread`, e.g. ``fake-openai``."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._runner: web.AppRunner | None = None
        self._port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing: asyncio.Event | None = None
        self._changed: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

    @abc.abstractmethod
    def _build_app(self) -> web.Application:
        """The application to serve, with its routes."""

    # -- running ----------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The server root, e.g. ``http://127.0.0.1:41234``."""
        if self._port is None:
            raise RuntimeError(f"{type(self).__name__} is not running")
        return f"http://127.0.0.1:{self._port}"

    async def start(self) -> None:
        """Start serving in the running event loop."""
        app = self._build_app()
        self._closing = asyncio.Event()
        self._changed = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        runner = web.AppRunner(
            app, access_log=None, handler_cancellation=True, shutdown_timeout=0.5
        )
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self._runner = runner
        self._port = int(runner.addresses[0][1])

    async def stop(self) -> None:
        """Stop serving; every pending wait (a delayed reply, a long poll) is cut short."""
        if self._closing is not None:
            self._closing.set()
        self._notify()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    @classmethod
    @contextlib.contextmanager
    def in_thread(cls, *args: Any, **kwargs: Any) -> Iterator[Self]:
        """Run a fake in its own thread and event loop for the `with` block (its handlers,
        and so any callback it calls, run in that thread)."""
        fake = cls(*args, **kwargs)
        ready = threading.Event()
        failures: list[BaseException] = []
        loop = asyncio.new_event_loop()

        def serve() -> None:
            try:
                loop.run_until_complete(fake.start())
            except BaseException as exc:
                failures.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(fake.stop())
            loop.close()

        fake._thread = threading.Thread(target=serve, name=cls._thread_name, daemon=True)
        fake._thread.start()
        ready.wait(10)
        if failures:
            raise failures[0]
        try:
            yield fake
        finally:
            loop.call_soon_threadsafe(loop.stop)
            fake._thread.join(10)

    async def _on_server_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` in the loop that serves the fake, awaiting it from any loop."""
        loop = self._loop
        if loop is None:
            coro.close()
            raise RuntimeError(f"{type(self).__name__} is not running")
        if asyncio.get_running_loop() is loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))

    # -- waiting for state changes ----------------------------------------------------

    def _notify(self) -> None:
        """Tell every waiter that the state changed; safe from any thread."""
        with self._lock:
            self._lock.notify_all()
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        if running_loop() is loop:
            self._renew_changed()
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._renew_changed)

    def _renew_changed(self) -> None:
        # A fresh event per change lets each waiter re-check its condition.
        if self._changed is not None:
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()

    async def _until(self, condition: Callable[[], T | None]) -> T:
        """In the server loop: wait until `condition()` returns something (not None)."""
        while True:
            changed = self._changed
            if (found := condition()) is not None:
                return found
            assert changed is not None
            await changed.wait()

    def _wait_blocking(
        self,
        condition: Callable[[], T | None],
        timeout: float,
        *,
        async_method: str,
        describe_timeout: Callable[[], str],
    ) -> T:
        """Block this thread until `condition()` returns something (not None), for thread
        mode; a TimeoutError says `describe_timeout()` after `timeout` seconds."""
        if self._loop is not None and running_loop() is self._loop:
            # Blocking here would stop the very loop that serves the requests.
            raise RuntimeError(f"use `await fake.{async_method}(...)` in the event loop")
        with self._lock:
            if not self._lock.wait_for(lambda: condition() is not None, timeout):
                raise TimeoutError(describe_timeout())
            found = condition()
        assert found is not None
        return found


class NamedCall(Protocol):
    """What an API call record needs for the call log: the method it called."""

    @property
    def method(self) -> str: ...


CallT = TypeVar("CallT", bound=NamedCall)


class LocalApiServer(LocalServer, Generic[CallT]):
    """A `LocalServer` for a method-call API (``/api/<method>``, ``/bot<token>/<method>``)
    that logs every call it answers, in the order the answers go out."""

    def __init__(self) -> None:
        super().__init__()
        self._calls: list[CallT] = []

    def _canonical(self, method: str) -> str:
        """The name calls of `method` are logged under (the same, unless the API's method
        names are case-insensitive)."""
        return method

    def _log_call(self, call: CallT) -> None:
        with self._lock:
            self._calls.append(call)
        self._notify()

    @property
    def calls(self) -> list[CallT]:
        """Every answered call so far, oldest answer first (a snapshot; a call still being
        answered, such as a pending long poll, shows up when it is answered)."""
        with self._lock:
            return list(self._calls)

    def calls_to(self, method: str) -> list[CallT]:
        canonical = self._canonical(method)
        return [c for c in self.calls if c.method == canonical]

    def wait_for_calls(self, method: str, count: int = 1, timeout: float = 5.0) -> list[CallT]:
        """Block until at least `count` calls of `method` were answered (thread mode)."""
        return self._wait_blocking(
            at_least(count, lambda: self.calls_to(method)),
            timeout,
            async_method="wait_for_calls_async",
            describe_timeout=lambda: (
                f"{len(self.calls_to(method))} of {count} {self._canonical(method)} calls "
                f"after {timeout}s; calls: {[c.method for c in self.calls]}"
            ),
        )

    async def wait_for_calls_async(self, method: str, count: int = 1) -> list[CallT]:
        """Wait, without blocking the event loop, until at least `count` calls of
        `method` were answered; works from any event loop. Bound it with
        ``asyncio.timeout(...)``."""
        return await self._on_server_loop(
            self._until(at_least(count, lambda: self.calls_to(method)))
        )
