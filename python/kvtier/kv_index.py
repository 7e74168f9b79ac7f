"""A router's view of vLLM's KV events: subscribe to engines' ZMQ publishers and index which engine
holds which block in which tier (``python -m kvtier.kv_index`` prints it live).

This is what a prefix-aware router (llm-d's KV-cache indexer, Dynamo's KV router) keeps, built on
vLLM's own message classes (``KVEventBatch``: ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``, msgpack over ZMQ). Tiers are ``(medium, locality, ownership)``: vLLM's GPU
cache is ``("GPU", None, None)``; kvtier reports its DRAM pool as ``("CPU", "LOCAL", None)``, its
NVMe tier as ``("STORAGE", "LOCAL", "kvtier-nvme")`` and the shared tier as
``("STORAGE", "REMOTE", "kvtier-shared")`` (``kvtier.vllm.events``).

``AllBlocksCleared`` carries no medium; vLLM emits it only from its GPU block pool (a prefix-cache
reset), so it clears the GPU tier here, not the blocks kvtier still holds.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

Tier = tuple[str, str | None, str | None]
GPU: Tier = ("GPU", None, None)


class KvEventIndex:
    """Blocks per (engine, tier), from the events of each engine's publisher, on a thread."""

    def __init__(self, endpoints: dict[str, str]):
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._context = zmq.Context()
        self._sockets: dict[Any, str] = {}
        self._poller = zmq.Poller()
        for engine, endpoint in endpoints.items():
            socket = self._context.socket(zmq.SUB)
            socket.setsockopt(zmq.SUBSCRIBE, b"")
            # vLLM's publisher binds wildcard and ipc endpoints (tcp://*:PORT, ipc://PATH): the
            # index connects to them. (It connects to any other endpoint itself, and what it sent
            # to an index bound there did not arrive in our tests; use a binding endpoint.)
            socket.connect(endpoint)
            self._sockets[socket] = engine
            self._poller.register(socket, zmq.POLLIN)
        self._lock = threading.Lock()
        self.blocks: dict[str, dict[Tier, set[Any]]] = defaultdict(lambda: defaultdict(set))
        self.events_seen = 0
        self.bytes_seen = 0
        # Events per medium ("GPU", "CPU", "STORAGE"; AllBlocksCleared counts as GPU).
        self.events_by_medium: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-index", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for socket, _ in self._poller.poll(timeout=200):
                _topic, _seq, payload = socket.recv_multipart()
                batch = self._decoder.decode(payload)
                with self._lock:
                    self.bytes_seen += len(payload)
                    for event in batch.events:
                        self.apply(self._sockets[socket], event)

    def apply(self, engine: str, event: Any) -> None:
        """Holds the lock. One event of ``engine``'s stream."""
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        self.events_seen += 1
        medium = getattr(event, "medium", None) or "GPU"
        self.events_by_medium[medium] = self.events_by_medium.get(medium, 0) + 1
        if isinstance(event, AllBlocksCleared):
            self.blocks[engine][GPU].clear()
            return
        tier: Tier = (event.medium or "GPU", event.locality, event.ownership)
        if tier[0] == "GPU":
            tier = GPU
        held = self.blocks[engine][tier]
        if isinstance(event, BlockStored):
            held.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            held.difference_update(event.block_hashes)

    def held(self, engine: str, tier: Tier) -> set[Any]:
        with self._lock:
            return set(self.blocks[engine][tier])

    def counts(self) -> dict[str, Any]:
        """Events and bytes received so far, and events per medium."""
        with self._lock:
            return {"events": self.events_seen, "bytes": self.bytes_seen, "by_medium": dict(self.events_by_medium)}

    def snapshot(self) -> dict[str, dict[Tier, int]]:
        with self._lock:
            return {engine: {tier: len(keys) for tier, keys in tiers.items()} for engine, tiers in self.blocks.items()}

    def wait_for(self, condition: Any, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if condition():
                return True
            time.sleep(0.1)
        return bool(condition())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for socket in self._sockets:
            socket.close(linger=0)
        self._context.term()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.kv_index", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "endpoints",
        nargs="+",
        help="NAME=ENDPOINT per engine: tcp://HOST:PORT of an engine publishing on tcp://*:PORT, or its ipc://PATH",
    )
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between prints")
    parser.add_argument("--once", action="store_true", help="print once after --interval and exit")
    args = parser.parse_args(list(argv) if argv is not None else None)
    endpoints = dict(item.split("=", 1) for item in args.endpoints)
    index = KvEventIndex(endpoints)
    try:
        while True:
            time.sleep(args.interval)
            for engine, tiers in sorted(index.snapshot().items()):
                row = ", ".join(
                    f"{'/'.join(str(p) for p in tier if p)}: {count}" for tier, count in sorted(tiers.items(), key=str)
                )
                print(f"{engine}: {row}", flush=True)
            if args.once:
                return 0
    except KeyboardInterrupt:
        return 0
    finally:
        index.close()


if __name__ == "__main__":
    raise SystemExit(main())
