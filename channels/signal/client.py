"""signal-cli's JSON-RPC over HTTP (`POST /api/v1/rpc`), on the gateway's aiohttp: one
request per call, its failures told apart by what they mean for a retry.

signal-cli answers every request with HTTP 200 and a JSON-RPC object, errors included
(signal-cli-jsonrpc(5); `SignalJsonRpcCommandHandler`): -1 a user error ("Failed to send
message", a group not found, "Receive command cannot be used if messages are already
being received."), -3 an I/O error (`receive` could not reach Signal: asked again),
-4 an untrusted identity, -5 a rate limit (its `data.response.results[].retryAfterSeconds`),
-32601 a method the daemon does not have.
A send whose every result is `NETWORK_FAILURE` could not reach Signal's servers.

In multi-account mode (a daemon started without `-a`) every request names its account;
in single-account mode `receive` refuses an `account` parameter, so the client learns
the mode once (`listAccounts` exists only in multi-account mode) and sends it only there.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

RPC_PATH = "/api/v1/rpc"
CHECK_PATH = "/api/v1/check"

USER_ERROR = -1
IO_ERROR = -3
UNTRUSTED_KEY_ERROR = -4
RATELIMIT_ERROR = -5
METHOD_NOT_FOUND = -32601
#: `receive` while the daemon receives for someone else (ManagerImpl, AlreadyReceiving).
RECEIVE_BUSY = "already being received"

#: What a failed request means for repeating it: "not_done" it certainly did not take
#: effect (no connection, Signal's servers unreachable, a rate limit); "maybe_done" it
#: went out and no answer came back; "final" repeating cannot help.
Kind = Literal["not_done", "maybe_done", "final"]


class SignalError(Exception):
    """A request to signal-cli that failed; `kind` says whether it may be repeated,
    `retry_after` how long Signal asked to wait (a rate limit). Never holds a message's
    text."""

    def __init__(
        self,
        message: str,
        *,
        kind: Kind = "final",
        code: int | None = None,
        retry_after: float | None = None,
        http_status: int = 0,
    ) -> None:
        super().__init__(message)
        self.kind: Kind = kind
        self.code = code
        self.retry_after = retry_after
        self.http_status = http_status

    @property
    def busy(self) -> bool:
        """`receive` refused: the daemon already receives (for another client, a call of
        a gateway that is gone, or by itself in on-start mode)."""
        return self.code == USER_ERROR and RECEIVE_BUSY in str(self)


def _results(data: Any) -> list[Mapping[str, Any]]:
    response = data.get("response") if isinstance(data, Mapping) else None
    results = response.get("results") if isinstance(response, Mapping) else None
    return [r for r in results if isinstance(r, Mapping)] if isinstance(results, list) else []


def error_from(error: Mapping[str, Any]) -> SignalError:
    """The `SignalError` of a JSON-RPC error object."""
    code = error.get("code")
    code = int(code) if isinstance(code, int) else None
    message = str(error.get("message") or "signal-cli answered with an error")
    results = _results(error.get("data"))
    types = {str(r.get("type")) for r in results}
    if code == RATELIMIT_ERROR or (types and types <= {"RATE_LIMIT_FAILURE"}):
        waits = [float(r["retryAfterSeconds"]) for r in results if r.get("retryAfterSeconds")]
        return SignalError(
            message, kind="not_done", code=code, retry_after=max(waits, default=None)
        )
    if types and types <= {"NETWORK_FAILURE"}:
        return SignalError(
            f"{message}: signal-cli could not reach Signal's servers", kind="not_done", code=code
        )
    if code == IO_ERROR:  # signal-cli could not talk to Signal's servers or its disk
        return SignalError(message, kind="not_done", code=code)
    if code == UNTRUSTED_KEY_ERROR:
        message += (
            " (the person's safety number changed; trust the new key with `signal-cli -a "
            "ACCOUNT trust RECIPIENT`)"
        )
    return SignalError(message, kind="final", code=code)


@dataclass
class SignalRpc:
    """JSON-RPC calls to one signal-cli daemon for one account (`multi_account` is learnt
    by `learn_mode`)."""

    url: str
    account: str
    timeout: float = 30.0
    multi_account: bool = False

    def __post_init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None
        self._ids = itertools.count(1)

    @property
    def root(self) -> str:
        return self.url.rstrip("/")

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # One connection per request in flight: a long `receive` never holds up a send.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64))
        return self._session

    async def call(
        self, method: str, params: Mapping[str, Any] | None = None, *, within: float | None = None
    ) -> Any:
        """One request; its `result`, or SignalError."""
        body_params = dict(params or {})
        if self.multi_account:
            body_params["account"] = self.account
        body: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "id": next(self._ids)}
        if body_params:
            body["params"] = body_params
        wait = aiohttp.ClientTimeout(total=within or self.timeout)
        try:
            async with self._http().post(
                f"{self.root}{RPC_PATH}", json=body, timeout=wait
            ) as response:
                if response.status != 200:
                    raise SignalError(
                        _status_text(response.status, self.root),
                        kind="final",
                        http_status=response.status,
                    )
                try:
                    answer = await response.json(content_type=None)
                except ValueError:
                    raise SignalError(
                        "signal-cli's answer is not JSON", kind="maybe_done"
                    ) from None
        except aiohttp.ClientConnectorError as exc:  # never connected: nothing was asked
            raise SignalError(
                f"cannot connect to signal-cli at {self.root} ({exc.os_error})", kind="not_done"
            ) from None
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise SignalError(
                f"signal-cli's answer to {method} never came ({type(exc).__name__})",
                kind="maybe_done",
            ) from None
        if not isinstance(answer, Mapping):
            raise SignalError("signal-cli's answer is not a JSON-RPC object", kind="maybe_done")
        error = answer.get("error")
        if isinstance(error, Mapping):
            raise error_from(error)
        return answer.get("result")

    async def learn_mode(self) -> str:
        """Ask whether the daemon serves several accounts (`listAccounts` exists only
        then) and that it serves ours; a line for the log. Raises SignalError."""
        self.multi_account = False
        try:
            accounts = await self.call("listAccounts")
        except SignalError as exc:
            if exc.code == METHOD_NOT_FOUND:
                return "single-account mode"
            raise
        numbers = [str(a.get("number")) for a in accounts or () if isinstance(a, Mapping)]
        if self.account not in numbers:
            raise SignalError(
                f"signal-cli at {self.root} serves {', '.join(numbers) or 'no account'}, not "
                f"{self.account}; register or link {self.account} there (docs/signal.md)",
                kind="final",
            )
        self.multi_account = True
        return f"multi-account mode ({len(numbers)} accounts)"

    async def check(self) -> None:
        """`GET /api/v1/check`: the daemon is up. Raises SignalError."""
        try:
            async with self._http().get(
                f"{self.root}{CHECK_PATH}", timeout=aiohttp.ClientTimeout(total=10)
            ) as response:
                if response.status != 200:
                    raise SignalError(_status_text(response.status, self.root), kind="final")
        except aiohttp.ClientError as exc:
            raise SignalError(
                f"cannot reach signal-cli at {self.root} ({type(exc).__name__}: {exc})",
                kind="not_done",
            ) from None

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _status_text(status: int, root: str) -> str:
    if status == 421:
        return (
            f"signal-cli at {root} refused the Host header (421): it listens on another "
            "address than the gateway uses; start it with --http 0.0.0.0:PORT behind a "
            "firewall, or point channels.signal.url at the address it listens on"
        )
    if status == 404:
        return f"{root} has no {RPC_PATH}: is it signal-cli's daemon with --http?"
    return f"signal-cli at {root} answered HTTP {status}"
