"""Benchmark of failover across providers: how long a request takes to be answered by the
backup while the primary is down in each way (its breaker still closed, so it is tried;
then open, so it is skipped), and how long after the breaker opened a recovered primary
answers again.

    .venv/bin/python bench/failover.py             # the tables
    .venv/bin/python bench/failover.py --runs 5 --timeout 2 --connect-timeout 0.5

The configuration's own `build_provider` and the real openai client against fake OpenAI
servers on 127.0.0.1 (tests/fakes). "Down" is: nothing listening (connection refused), a
port whose accept queue is full (the connect is never answered: a blackholed host), a
server that accepts and never answers (slow), a 429 with Retry-After 3600, and a 401.
The cool-down is shortened so that coming back can be measured; it takes the cool-down
plus one request, whatever the cool-down is (30 s by default).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout, without installing

from loguru import logger  # noqa: E402

from gateway.config import load_settings  # noqa: E402
from gateway.daemon import build_provider  # noqa: E402
from gateway.llm.breaker import BreakerState  # noqa: E402
from gateway.llm.failover import FailoverProvider  # noqa: E402
from gateway.llm.types import LLMMessage  # noqa: E402
from tests.fakes.openai_server import DEFAULT_API_KEY, FakeOpenAI, Reply  # noqa: E402
from tests.fakes.tcp_proxy import TcpProxy  # noqa: E402

HELLO = [LLMMessage(role="user", content="hello")]
#: Turns while the breaker is closed (the primary is tried): failures_to_open.
TRIED = 3
#: Turns measured once it is open (the primary is skipped).
SKIPPED = 5


def provider_for(urls: dict[str, str], keys: dict[str, str], **options: Any) -> FailoverProvider:
    env = {
        "GATEWAY_LLM__CHAIN": json.dumps(list(urls)),
        "GATEWAY_LLM__MAX_RETRIES": str(options.get("retries", 0)),
        "GATEWAY_LLM__TIMEOUT": str(options.get("timeout", 2.0)),
        "GATEWAY_LLM__FAILOVER__FAILURES_TO_OPEN": str(TRIED),
        "GATEWAY_LLM__FAILOVER__COOLDOWN_SECONDS": str(options.get("cooldown", 30.0)),
    }
    if options.get("connect_timeout"):
        env["GATEWAY_LLM__CONNECT_TIMEOUT"] = str(options["connect_timeout"])
    for name, url in urls.items():
        env[f"GATEWAY_LLM__PROVIDERS__{name.upper()}__BASE_URL"] = url
        env[f"GATEWAY_LLM__PROVIDERS__{name.upper()}__API_KEY"] = keys.get(name, DEFAULT_API_KEY)
    return build_provider(load_settings(None, environ=env))


@contextmanager
def refused() -> Iterator[str]:
    """A base URL nothing listens at."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    yield f"http://127.0.0.1:{port}/v1"


@contextmanager
def blackholed() -> Iterator[str]:
    """A base URL whose connect is never answered: a listening socket that never accepts,
    its accept queue filled, so the kernel drops further SYNs (as a host behind a
    firewall that drops packets does)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        try:
            filler.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        fillers.append(filler)
    time.sleep(0.2)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        for filler in fillers:
            filler.close()
        server.close()


async def turn_times(provider: FailoverProvider, turns: int) -> list[float]:
    """Seconds each of `turns` requests took; every one must come from the backup."""
    times = []
    for _ in range(turns):
        started = time.perf_counter()
        answer = await provider.chat(HELLO)
        times.append(time.perf_counter() - started)
        assert answer.provider == "backup", answer.provider
    return times


async def skip_times(
    setup: Callable[[FakeOpenAI], Any], runs: int, **options: Any
) -> tuple[float, float]:
    """Median seconds of a request while the primary is tried (breaker closed) and
    once it is skipped (open)."""
    tried: list[float] = []
    skipped: list[float] = []
    for _ in range(runs):
        async with FakeOpenAI() as primary, FakeOpenAI() as backup:
            with setup(primary) as (url, keys):
                urls = {"primary": url, "backup": backup.base_url}
                provider = provider_for(urls, keys, **options)
                try:
                    await provider.chat(HELLO)  # connections up, as in a running gateway
                    tried += await turn_times(provider, TRIED)
                    assert provider.breakers["primary"].state is BreakerState.OPEN
                    skipped += await turn_times(provider, SKIPPED)
                finally:
                    await provider.aclose()
    return statistics.median(tried), statistics.median(skipped)


async def baseline(runs: int) -> float:
    times: list[float] = []
    for _ in range(runs):
        async with FakeOpenAI() as backup:
            provider = provider_for({"backup": backup.base_url}, {})
            try:
                await provider.chat(HELLO)
                times += await turn_times(provider, TRIED + SKIPPED)
            finally:
                await provider.aclose()
    return statistics.median(times)


def down(kind: str) -> Callable[[FakeOpenAI], Any]:
    """How the primary is down in scenario `kind`."""

    @contextmanager
    def setup(primary: FakeOpenAI) -> Iterator[tuple[str, dict[str, str]]]:
        if kind == "refused":
            with refused() as url:
                yield url, {}
        elif kind == "blackholed":
            with blackholed() as url:
                yield url, {}
        elif kind == "slow":
            primary.responder = lambda body: Reply(text="late", delay=3600)
            yield primary.base_url, {}
        elif kind == "429":
            primary.fail_model("gpt-4o-mini", 429, "Rate limit reached", retry_after=3600)
            yield primary.base_url, {}
        elif kind == "401":
            yield primary.base_url, {"primary": "sk-refused-key-000000"}
        else:
            raise ValueError(kind)

    return setup


async def comeback(cooldown: float, runs: int) -> float:
    """Median seconds from the primary's breaker opening (the primary recovered at that
    moment) until a request is answered by the primary again, asking every 20 ms."""
    times: list[float] = []
    for _ in range(runs):
        async with FakeOpenAI() as primary, FakeOpenAI() as backup:
            proxy = TcpProxy("127.0.0.1", int(primary.url.rsplit(":", 1)[1]))
            proxy.restore()
            url = f"http://127.0.0.1:{proxy.port}/v1"
            provider = provider_for(
                {"primary": url, "backup": backup.base_url}, {}, cooldown=cooldown
            )
            try:
                proxy.cut()
                await turn_times(provider, TRIED)
                opened = time.perf_counter()
                proxy.restore()
                # Asking is the point: a request every 20 ms, as a busy gateway would.
                while (await provider.chat(HELLO)).provider != "primary":  # noqa: ASYNC110
                    await anyio.sleep(0.02)
                times.append(time.perf_counter() - opened)
            finally:
                await provider.aclose()
                proxy.close()
    return statistics.median(times)


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.1f}"


async def run(args: argparse.Namespace) -> None:
    logger.remove()  # the failures are the point; their log lines are not
    timeout, connect = args.timeout, args.connect_timeout
    print(
        f"Failover from a down primary to a backup: median ms per request over {args.runs} "
        f"runs ({TRIED} requests tried while the breaker is closed, {SKIPPED} once it is open;"
        " max_retries 0 unless said)"
    )
    print(f"backup alone (no failover): {ms(await baseline(args.runs))} ms per request\n")
    rows: list[tuple[str, str, dict[str, Any]]] = [
        ("refused", "max_retries 0", {"retries": 0}),
        ("refused", "max_retries 2 (the default)", {"retries": 2}),
        ("blackholed", f"connect_timeout {connect:g} s", {"connect_timeout": connect}),
        ("blackholed", f"no connect_timeout (timeout {timeout:g} s)", {}),
        ("slow", f"timeout {timeout:g} s", {}),
        ("429", "Retry-After 3600, max_retries 2", {"retries": 2}),
        ("401", "key refused", {}),
    ]
    header = f"{'primary':<11} {'setting':<34} {'tried (closed)':>15} {'skipped (open)':>15}"
    print(header)
    print("-" * len(header))
    for kind, setting, options in rows:
        tried, skipped = await skip_times(
            down(kind), args.runs, timeout=timeout, **{"retries": 0, **options}
        )
        print(f"{kind:<11} {setting:<34} {ms(tried):>15} {ms(skipped):>15}")
    print()
    print("Coming back: the primary recovers as its breaker opens; seconds until it answers")
    print(f"{'cool-down':<11} {'back after':>12}")
    for cooldown in args.cooldowns:
        print(f"{cooldown:<11g} {await comeback(cooldown, args.runs):>12.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=2.0, help="the providers' timeout")
    parser.add_argument("--connect-timeout", type=float, default=0.5)
    parser.add_argument("--cooldowns", type=float, nargs="+", default=[1.0, 3.0])
    anyio.run(run, parser.parse_args())


if __name__ == "__main__":
    main()
