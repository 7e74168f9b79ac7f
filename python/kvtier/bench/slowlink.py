"""A slow link for the benchmarks: a TCP proxy on 127.0.0.1 that forwards to a target with a bandwidth
limit and an added one-way latency, so that a bucket (or any TCP service) on this machine looks like
one behind a slow network (issue 36: load or recompute, measured against slow tiers).

The link has two directions (towards the target, and back); each is a delay line shared by every
connection through the link: a chunk read from one side is written to the other at

    release = max(arrival + latency, previous release of that direction) + size / rate

so the chunks of all connections leave one after the other at ``rate`` bytes per second (the
bandwidth is shared, as on one network link), and none before ``latency`` after it arrived. Chunks
are at most ``CHUNK_BYTES``, so a burst after an idle spell waits for its own transmission time too.
Each connection's direction holds at most its share of the bandwidth-delay product in flight and then
stops reading (TCP's own back-pressure slows the sender): the proxy never buffers a whole transfer.

Two ways to run it:

- ``SlowLink(target, spec)``: in a thread of this process (an asyncio loop of its own); ``start()``
  returns the listening port, ``close()`` closes every connection and the listener.
- ``SlowLinkProcess(target, spec)``: a child process (``python -m kvtier.bench.slowlink``), so that a
  benchmark's proxy has its own interpreter (a GIL of its own). It exits when its standard input
  closes, so it goes with the benchmark that started it, also when that one is killed.

Both are context managers. Only 127.0.0.1: the link listens there and the target must be there too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

CHUNK_BYTES = 64 << 10
LOOPBACK = "127.0.0.1"
READY_PREFIX = "slowlink listening on port "
START_TIMEOUT_S = 30.0
# Per connection and direction, chunks in flight beyond the bandwidth-delay product: enough to keep
# the line busy while the writer waits for the reader, few enough that the proxy holds little.
SPARE_CHUNKS = 4


class SlowLinkError(RuntimeError):
    """The slow link cannot be set up as asked; the message says what to change."""


@dataclass(frozen=True)
class LinkSpec:
    """A link's bandwidth (``rate_mb_per_s``, 10^6 bytes per second, each direction, shared by all
    connections) and the latency it adds to each direction (``latency_ms``)."""

    rate_mb_per_s: float
    latency_ms: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate_mb_per_s) and self.rate_mb_per_s > 0):
            raise SlowLinkError(f"a link's rate must be a positive number of MB/s, not {self.rate_mb_per_s!r}")
        if not (math.isfinite(self.latency_ms) and self.latency_ms >= 0):
            raise SlowLinkError(f"a link's latency must be 0 ms or more, not {self.latency_ms!r}")

    @property
    def rate_bytes_per_s(self) -> float:
        return self.rate_mb_per_s * 1e6

    @property
    def latency_s(self) -> float:
        return self.latency_ms / 1000

    def describe(self) -> str:
        return f"{self.rate_mb_per_s:g} MB/s, +{self.latency_ms:g} ms each way"


def parse_rates(text: str) -> list[float]:
    """``"20,50,200"`` -> ``[20.0, 50.0, 200.0]`` (MB/s, in the order given, each once)."""
    rates: list[float] = []
    for part in text.split(","):
        if not part.strip():
            continue
        try:
            rate = float(part)
        except ValueError:
            raise SlowLinkError(f"link speeds are MB/s separated by commas (e.g. 20,50,200), not {text!r}") from None
        LinkSpec(rate)  # checks it
        if rate not in rates:
            rates.append(rate)
    if not rates:
        raise SlowLinkError("no link speed given: list MB/s separated by commas (e.g. 20,50,200)")
    return rates


def parse_target(text: str) -> tuple[str, int]:
    """``host:port`` or an http(s) URL's ``host:port``; the host must be 127.0.0.1 (or localhost)."""
    rest = text.split("://", 1)[-1].split("/", 1)[0]
    host, _, port = rest.rpartition(":")
    if host == "localhost":
        host = LOOPBACK
    if host != LOOPBACK or not port.isdigit():
        raise SlowLinkError(f"the slow link forwards to 127.0.0.1:PORT only, not {text!r}")
    return host, int(port)


@dataclass
class DelayLine:
    """One direction of the link: when each chunk may leave (shared by every connection)."""

    spec: LinkSpec
    _last_release_s: float = -math.inf
    bytes_forwarded: int = 0
    chunks: int = 0

    def schedule(self, size_bytes: int, now_s: float) -> float:
        release_s = max(now_s + self.spec.latency_s, self._last_release_s) + size_bytes / self.spec.rate_bytes_per_s
        self._last_release_s = release_s
        self.bytes_forwarded += size_bytes
        self.chunks += 1
        return release_s

    def window_chunks(self) -> int:
        """Chunks one connection may have in flight in this direction."""
        in_flight_bytes = self.spec.rate_bytes_per_s * self.spec.latency_s
        return max(1, math.ceil(in_flight_bytes / CHUNK_BYTES)) + SPARE_CHUNKS


@dataclass
class LinkStats:
    connections: int = 0
    open_connections: int = 0
    errors: list[str] = field(default_factory=list)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, line: DelayLine) -> None:
    """One direction of one connection: reads chunks, holds each until its release, writes it; at the
    reader's end of stream, half-closes the writer (the other direction goes on)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(maxsize=line.window_chunks())

    async def read_side() -> None:
        while data := await reader.read(CHUNK_BYTES):
            await queue.put((line.schedule(len(data), loop.time()), data))
        await queue.put(None)

    async def write_side() -> None:
        while (item := await queue.get()) is not None:
            release_s, data = item
            delay_s = release_s - loop.time()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof() and not writer.is_closing():
            writer.write_eof()

    sides = {asyncio.ensure_future(read_side()), asyncio.ensure_future(write_side())}
    try:
        done, _ = await asyncio.wait(sides, return_when=asyncio.FIRST_EXCEPTION)
        for side in done:
            side.result()  # a reset or a closed socket ends the connection
    finally:
        for side in sides:
            side.cancel()
        await asyncio.gather(*sides, return_exceptions=True)


class _Server:
    """The listener and its connections, in one event loop."""

    def __init__(self, target: tuple[str, int], spec: LinkSpec):
        self.target, self.spec = target, spec
        self.up, self.down = DelayLine(spec), DelayLine(spec)  # towards the target, and back
        self.stats = LinkStats()
        self._tasks: set[asyncio.Task] = set()
        self._server: asyncio.Server | None = None

    async def start(self, port: int = 0) -> int:
        self._server = await asyncio.start_server(self._handle, LOOPBACK, port)
        return int(self._server.sockets[0].getsockname()[1])

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.stats.connections += 1
        self.stats.open_connections += 1
        target_writer = None
        try:
            target_reader, target_writer = await asyncio.open_connection(*self.target)
            pumps = [
                asyncio.ensure_future(_pump(client_reader, target_writer, self.up)),
                asyncio.ensure_future(_pump(target_reader, client_writer, self.down)),
            ]
            try:
                await asyncio.gather(*pumps)
            finally:
                for pump in pumps:
                    pump.cancel()
        except (ConnectionError, OSError) as error:  # a reset or a refused target: this connection ends
            if len(self.stats.errors) < 100:
                self.stats.errors.append(f"{type(error).__name__}: {error}")
        finally:
            self.stats.open_connections -= 1
            for writer in (client_writer, target_writer):
                if writer is not None:
                    writer.close()
            self._tasks.discard(task)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()


class SlowLink:
    """The slow link in a thread of this process (its own event loop): ``start()`` -> port."""

    def __init__(self, target: str | tuple[str, int], spec: LinkSpec):
        self._server = _Server(parse_target(target) if isinstance(target, str) else target, spec)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvtier-slowlink", daemon=True)
        self.port = 0  # the listening port once started

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def stats(self) -> LinkStats:
        return self._server.stats

    def forwarded_bytes(self) -> tuple[int, int]:
        """Bytes forwarded (towards the target, back)."""
        return self._server.up.bytes_forwarded, self._server.down.bytes_forwarded

    def start(self, port: int = 0) -> int:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._server.start(port), self._loop)
        self.port = future.result(timeout=START_TIMEOUT_S)
        return self.port

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._server.close(), self._loop).result(timeout=START_TIMEOUT_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=START_TIMEOUT_S)
        self._loop.close()

    def __enter__(self) -> SlowLink:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


class SlowLinkProcess:
    """The slow link in a child process; it exits when this process closes its standard input (or dies)."""

    def __init__(self, target: str, spec: LinkSpec, log_path: str | os.PathLike | None = None):
        parse_target(target)  # refused here, not in the child
        self.spec = spec
        self.target = target
        self._log_path = log_path
        self.process: subprocess.Popen | None = None
        self.port = 0  # the listening port once started

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self) -> int:
        command = [sys.executable, "-m", "kvtier.bench.slowlink", "--target", self.target]
        command += ["--rate-mb-per-s", repr(self.spec.rate_mb_per_s), "--latency-ms", repr(self.spec.latency_ms)]
        with contextlib.ExitStack() as stack:  # the log is the child's: closed here once it has it
            log = stack.enter_context(open(self._log_path, "a")) if self._log_path else subprocess.DEVNULL
            self.process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
            )
        assert self.process.stdout is not None
        line = _read_line_within(self.process.stdout, START_TIMEOUT_S)
        if not line.startswith(READY_PREFIX):
            self.close()
            where = f"; see {self._log_path}" if self._log_path else ""
            raise SlowLinkError(f"the slow link did not start (it said {line.strip()!r}){where}")
        self.port = int(line[len(READY_PREFIX) :])
        return self.port

    def close(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        with contextlib.suppress(OSError):
            assert process.stdin is not None
            process.stdin.close()  # the child's signal to go
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        if process.stdout is not None:
            process.stdout.close()

    def __enter__(self) -> SlowLinkProcess:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def _read_line_within(stream, timeout_s: float) -> str:
    """The stream's next line, or "" when none comes within ``timeout_s`` (the child hung or died)."""
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return lines[0] if lines else ""


async def _serve_until_stdin_closes(target: tuple[str, int], spec: LinkSpec, port: int) -> LinkStats:
    server = _Server(target, spec)
    bound = await server.start(port)
    print(f"{READY_PREFIX}{bound}", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # returns at end of input: the parent is done or gone
    await server.close()
    return server.stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvtier.bench.slowlink",
        description="A TCP proxy on 127.0.0.1 with a bandwidth limit and an added latency; exits when stdin closes.",
    )
    parser.add_argument("--target", required=True, help="127.0.0.1:PORT (or http://127.0.0.1:PORT) to forward to")
    parser.add_argument("--rate-mb-per-s", type=float, required=True, help="bandwidth per direction, MB/s")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="latency added to each direction")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default: a free one)")
    args = parser.parse_args(argv)
    try:
        spec = LinkSpec(args.rate_mb_per_s, args.latency_ms)
        target = parse_target(args.target)
    except SlowLinkError as error:
        print(f"slowlink: {error}", file=sys.stderr)
        return 2
    started = time.monotonic()
    stats = asyncio.run(_serve_until_stdin_closes(target, spec, args.port))
    print(
        f"slowlink: {stats.connections} connections over {time.monotonic() - started:.0f} s, "
        f"{len(stats.errors)} ended by an error",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
