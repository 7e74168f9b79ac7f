"""The benchmarks' slow link (``kvtier.bench.slowlink``) against a real TCP server on 127.0.0.1:

- the rate holds in each direction (never faster; within a tolerance of it on a busy machine),
- the added latency holds (a ping-pong's round trip is twice the one-way latency),
- the bandwidth is shared by the link's connections (two downloads at once take as long as one
  download of both),
- bytes arrive intact and in order through a half-close (a request, then its answer),
- the proxy does not buffer a whole transfer when the far side stops reading,
- the child-process form forwards the same way, exits when its stdin closes, and leaves no process,
- closing the link ends its open connections and frees its port; bad options are refused with the fix.

No engine; about 5 s.
"""

from __future__ import annotations

import contextlib
import os
import socket
import socketserver
import threading
import time

import pytest

from kvtier.bench.slowlink import LinkSpec, SlowLink, SlowLinkError, SlowLinkProcess, parse_rates, parse_target

MB = 1_000_000


class _Handler(socketserver.BaseRequestHandler):
    """One command line per connection: ``get N`` (send N bytes), ``put N`` (read N bytes, answer
    ``ok``), ``echo`` (echo until end of stream), ``hold`` (read nothing until the client goes)."""

    def handle(self) -> None:
        sock: socket.socket = self.request
        command = _read_line(sock)
        if command.startswith("get "):
            sock.sendall(os.urandom(64) * (int(command[4:]) // 64))
        elif command.startswith("put "):
            left = int(command[4:])
            while left > 0:
                data = sock.recv(1 << 20)
                if not data:
                    return
                left -= len(data)
            sock.sendall(b"ok\n")
        elif command == "echo":
            while data := sock.recv(1 << 16):
                sock.sendall(data)
        elif command == "hold":
            self.server.held.append(sock)  # type: ignore[attr-defined]
            self.server.release.wait(30)  # type: ignore[attr-defined]


def _read_line(sock: socket.socket) -> str:
    line = b""
    while not line.endswith(b"\n"):
        byte = sock.recv(1)
        if not byte:
            break
        line += byte
    return line.decode().strip()


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


@pytest.fixture
def target():
    server = _Server(("127.0.0.1", 0), _Handler)
    server.held = []  # type: ignore[attr-defined]
    server.release = threading.Event()  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.release.set()  # type: ignore[attr-defined]
    server.shutdown()
    server.server_close()


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _download_s(port: int, size: int) -> float:
    started = time.perf_counter()
    with _connect(port) as sock:
        sock.sendall(f"get {size}\n".encode())
        got = 0
        while data := sock.recv(1 << 20):
            got += len(data)
    assert got == size
    return time.perf_counter() - started


def _upload_s(port: int, size: int) -> float:
    started = time.perf_counter()
    with _connect(port) as sock:
        sock.sendall(f"put {size}\n".encode())
        sock.sendall(b"x" * size)
        assert _read_line(sock) == "ok"
    return time.perf_counter() - started


def _within(measured_s: float, expected_s: float) -> bool:
    """Never faster than the link allows; on this busy 2-core machine, up to 1.6x slower (+50 ms)."""
    return 0.95 * expected_s <= measured_s <= 1.6 * expected_s + 0.05


def test_rate_holds_in_each_direction(target):
    with SlowLink(target, LinkSpec(rate_mb_per_s=20)) as link:
        down_s = _download_s(link.port, 4 * MB)
        up_s = _upload_s(link.port, 4 * MB)
        assert link.forwarded_bytes()[1] >= 4 * MB and link.forwarded_bytes()[0] >= 4 * MB
    assert _within(down_s, 4 * MB / (20 * MB)), down_s
    assert _within(up_s, 4 * MB / (20 * MB)), up_s


def test_latency_is_added_each_way(target):
    with SlowLink(target, LinkSpec(rate_mb_per_s=100, latency_ms=30)) as link, _connect(link.port) as sock:
        sock.sendall(b"echo\n")
        rounds = []
        for _ in range(5):
            started = time.perf_counter()
            sock.sendall(b"p")
            assert sock.recv(1) == b"p"
            rounds.append(time.perf_counter() - started)
    # One byte each way: 30 ms of latency each way, microseconds of transmission.
    assert min(rounds) >= 0.060, rounds
    assert sorted(rounds)[2] <= 0.060 * 1.6 + 0.02, rounds


def test_bandwidth_is_shared_by_the_connections(target):
    with SlowLink(target, LinkSpec(rate_mb_per_s=20)) as link:
        times: list[float] = []
        threads = [threading.Thread(target=lambda: times.append(_download_s(link.port, 2 * MB))) for _ in range(2)]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        both_s = time.perf_counter() - started
    assert len(times) == 2
    assert _within(both_s, 4 * MB / (20 * MB)), both_s  # 4 MB through one 20 MB/s link, not two
    assert min(times) >= 0.75 * 0.2, times  # interleaved: neither got the link to itself


def test_bytes_arrive_intact_through_a_half_close(target):
    payload = os.urandom(3 * MB + 17)
    with SlowLink(target, LinkSpec(rate_mb_per_s=200, latency_ms=5)) as link, _connect(link.port) as sock:
        sock.sendall(b"echo\n")

        def send() -> None:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)  # the end of the request: the answer still comes back

        sender = threading.Thread(target=send)
        sender.start()
        received = bytearray()
        while data := sock.recv(1 << 20):
            received += data
        sender.join(30)
    assert bytes(received) == payload


def test_a_stalled_reader_holds_the_sender_back(target):
    """The far side reads nothing: the proxy stops reading too, after a bounded amount in flight."""
    with SlowLink(target, LinkSpec(rate_mb_per_s=1000)) as link, _connect(link.port) as sock:
        sock.sendall(b"hold\n")
        sock.settimeout(2)
        sent = 0
        with pytest.raises(TimeoutError):
            while sent < 256 * MB:
                sent += sock.send(b"y" * (1 << 20))
        forwarded, _ = link.forwarded_bytes()
    # What the proxy took is bounded by the two loopback sockets' buffers and its window, far from
    # everything the sender offered.
    assert forwarded < 64 * MB, forwarded
    assert sent < 256 * MB


def test_the_child_process_forwards_and_goes_when_its_stdin_closes(target, tmp_path):
    link = SlowLinkProcess(target, LinkSpec(rate_mb_per_s=20, latency_ms=10), log_path=tmp_path / "link.log")
    with link:
        assert link.process is not None
        process = link.process
        assert _within(_download_s(link.port, 2 * MB), 2 * MB / (20 * MB) + 0.02)
        port = link.port
    assert process.poll() is not None and process.returncode == 0
    assert "1 connections" in (tmp_path / "link.log").read_text()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5)


def test_closing_the_link_ends_its_connections(target):
    link = SlowLink(target, LinkSpec(rate_mb_per_s=50))
    port = link.start()
    sock = _connect(port)
    sock.sendall(b"echo\n")
    time.sleep(0.1)
    assert link.stats.open_connections == 1
    link.close()
    sock.settimeout(5)
    with contextlib.suppress(ConnectionResetError):  # an end of stream or a reset: either ends it
        assert sock.recv(1) == b""
    sock.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5)


def test_options_are_checked():
    assert parse_rates("20, 50,200,50") == [20.0, 50.0, 200.0]
    assert parse_target("http://localhost:7481/") == ("127.0.0.1", 7481)
    assert parse_target("127.0.0.1:9") == ("127.0.0.1", 9)
    for bad in ("", "fast", "0", "-5", "nan"):
        with pytest.raises(SlowLinkError, match="MB/s"):
            parse_rates(bad)
    with pytest.raises(SlowLinkError, match=r"127\.0\.0\.1:PORT only"):
        parse_target("10.0.0.1:80")
    with pytest.raises(SlowLinkError, match="latency"):
        LinkSpec(10, -1)
    assert LinkSpec(20, 30).describe() == "20 MB/s, +30 ms each way"
