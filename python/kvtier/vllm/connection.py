"""This process's connection to the host service: ``ServiceConnection``."""

from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kvtier.vllm.store_probe as store_probe
from kvtier.threads import start_thread
from kvtier.vllm._registry import registry_lock
from kvtier.vllm.namespace import namespace_digest
from kvtier.vllm.options import KvtierOptions
from kvtier.vllm.store_probe import store_directories

logger = logging.getLogger("kvtier.vllm")


# A lost connection is retried at most this often, in the background: a call never waits for it.
RECONNECT_INTERVAL_S = 1.0
# A reconnect that fails says why at WARNING once per outage and then at most this often: an engine
# that never reattaches (its service fails to start, another process holds the start lock) shows
# the cause in its own log, not only at DEBUG.
RECONNECT_WARN_INTERVAL_S = 60.0
# How often this process looks for connections the service hung up on (``_watch_hangups``).
HANGUP_CHECK_S = 0.5
# The service's counters of bytes read from its tiers below DRAM (``tier_bytes_read``); the remote
# tiers' as they land (a ranged GET's body, a shared-tier read's pieces), so that a read of seconds
# on a slow link or mount shows progress before it ends.
TIER_READ_FIELDS = ("bytes_read_nvme", "shared_bytes_received", "bucket_bytes_received")


# How long naming the service's socket may take. The default socket is named from the store path's
# real path, and on a frozen mount (a FUSE daemon stopped, an NFS server gone) resolving it waits
# for as long as the mount does: past this the engine starts (or goes on) serving misses.
SOCKET_NAMING_WAIT_S = 5.0


ATTACH_POLL_S = 0.05  # how often ``wait_attached`` looks


Placement = list[tuple[int, int, int]]


@dataclass(frozen=True)
class _Attached:
    """A client that said hello; the placement sent to it; the service it reached, by the process
    listening on the socket (its pid and start time: ``running_service``)."""

    client: Any
    placement: Placement | None
    service: tuple[int, int] | None


class _Attempt:
    """One connect on a thread of its own, and its outcome."""

    def __init__(self, in_background: bool = False) -> None:
        self.done = threading.Event()
        self.attached: _Attached | None = None
        self.error: Exception | None = None
        self.in_background = in_background  # its outcome is used by the thread, not waited for


class ServiceUnreachable(ConnectionError):
    """The host service did not answer (dead, frozen, or its socket gone): the engine serves misses."""


class _SocketNaming:
    """``options.socket_path()`` on a thread of its own, started once: a connection that retries
    while the store's mount stays frozen waits on the same thread, not on one more each time."""

    def __init__(self, options: KvtierOptions) -> None:
        self._named: list[Path] = []
        self._done = threading.Event()

        def name() -> None:
            try:
                self._named.append(options.socket_path())
            finally:
                self._done.set()

        start_thread(name, "kvtier-socket")

    def wait(self, wait_s: float) -> Path | None:
        self._done.wait(wait_s)
        return self._named[0] if self._named else None


# Every ServiceConnection this process opened and has not closed (for the benchmarks and tests:
# ``kvtier.vllm._testing.service_connections``; under ``registry_lock``).
_service_connections: weakref.WeakSet[ServiceConnection] = weakref.WeakSet()


class ServiceConnection:
    """This process's connection to the host service, attached to the engine's namespace.

    Every call is bounded by ``timeout_ms`` (per read and write on the socket) and never raises: a
    dead, frozen or unreachable service answers with the call's miss (nothing present, nothing
    pinned, no transfer), counted in ``failed_calls`` and logged once per outage. After a failed
    call the service steps aside: calls answer their miss at once, without waiting, while one
    reconnect at a time probes it in the background (starting the service again when none answers;
    its NVMe tier is recovered), so an outage costs the engine at most one timeout and the engine
    reattaches without a restart. An engine whose service cannot be reached at start starts anyway,
    serving misses; a service that answers and refuses the engine stops it with the reason.
    """

    def __init__(
        self,
        options: KvtierOptions,
        description: Mapping[str, Any],
        tp_size: int,
        rank: int,
        slice_bytes: int,
        label: str = "",
        timeout_ms: int | None = None,
        populate_pool: bool = False,
        starts_service: bool = True,
    ):
        self._options = options
        # False: attaches to a running service only, never starts one (the KV-event feed: an idle
        # engine's polls must not start a service stopped on purpose; a request's lookup does).
        self._starts_service = starts_service
        self._label = label[:128]
        # A worker copies through the pool: it faults it in at each attach. The scheduler side never
        # copies, and faulting in a pool of tens of GiB would cost each of its connections seconds
        # and the page tables of the whole pool.
        self._populate_pool = populate_pool
        self._description = json.dumps(description, sort_keys=True).encode()
        self._tp_size, self._rank, self._slice_bytes = tp_size, rank, slice_bytes
        self.timeout_ms = timeout_ms if timeout_ms is not None else options.job_timeout_ms
        self._placement: list[tuple[int, int, int]] | None = None
        self._lock = threading.Lock()
        self._client: Any = None
        self._service: tuple[int, int] | None = None  # the service ``_client`` reached (``_Attached``)
        self._reconnecting = False
        self._last_attempt = 0.0
        # Which client serves calls now, counted up at each one made this connection's: pins live
        # as long as the client that took them (the service releases them when it goes), so a caller
        # holding pins takes them again when this changes (``KvtierManager``).
        self.client_epoch = 0
        self._outage_logged = False
        self._reconnect_warned_at = float("-inf")
        self.failed_calls = 0  # calls sent that timed out or broke (each waited at most the deadline)
        self.stepped_aside_calls = 0  # calls answered with their miss unsent: the service stepped aside
        self.outages = 0  # times the service stopped answering this connection
        # What this engine counted itself, sent to the service's per-engine counters (``report_counts``).
        self._count_sources: list[Callable[[], Mapping[str, int]]] = []
        self._drop_listeners: list[Callable[[], None]] = []
        self._reported: dict[str, int] = {}
        self._report_lock = threading.Lock()
        self.namespace = namespace_digest(description)
        # Named once (`_socket`), within a limit: the default socket's name comes from the store path's
        # real path, and on a frozen mount resolving it waits for as long as the mount does (a
        # reconnect, the load watchdog's probe and the dead client's drop all ask for it).
        self._socket_path: Path | None = None
        self._naming: _SocketNaming | None = None
        self._attach_at_start()
        with registry_lock:
            _service_connections.add(self)
        _start_hangup_watch()

    @property
    def socket_path(self) -> Path:
        return self._socket()

    def _socket(self) -> Path:
        """The service's socket, named within ``SOCKET_NAMING_WAIT_S`` (``ServiceUnreachable`` past it)."""
        if self._socket_path is not None:
            return self._socket_path
        with self._lock:
            if self._naming is None:
                self._naming = _SocketNaming(self._options)
            naming = self._naming
        named = naming.wait(SOCKET_NAMING_WAIT_S)
        if named is None:
            raise ServiceUnreachable(
                f"the store path {self._options.path} did not answer within {SOCKET_NAMING_WAIT_S:g} s (a frozen "
                "or hung filesystem?): its service's socket is named from it; set service_socket to skip that"
            )
        self._socket_path = named
        return named

    def _connect(self, start_timeout_s: float | None) -> _Attached:
        from kvtier.service import SERVICE_START_TIMEOUT_S, connect, ensure_service, running_service

        socket = self._socket()
        if self._starts_service:
            socket = ensure_service(
                self._options.path,
                self._options.service_options(),
                socket_path=socket,
                pool_dir=self._options.pool_dir,
                start_timeout_s=start_timeout_s or SERVICE_START_TIMEOUT_S,
                idle_timeout_s=self._options.service_idle_timeout_s,
            )
        client: Any = None
        try:
            client = connect(socket, timeout_ms=self.timeout_ms)
            client.hello(self._description, self._tp_size, self._rank, self._slice_bytes)
            if self._populate_pool:
                client.populate_pool()
        except Exception as error:
            if client is not None and client.connected:
                raise  # it answered, and refused this engine: the message says why
            raise ServiceUnreachable(str(error)) from error
        placement = self._placement
        if placement is not None:
            client.set_placement(placement)  # refused: raises, the engine must not store under another layout
        if self._label:
            try:
                client.set_label(self._label)
            except Exception as error:  # a service of an older kvtier: no per-engine counters, still serving
                logger.warning("kvtier: the host service keeps no per-engine counters (%s)", error)
        return _Attached(client, placement, running_service(socket))

    def set_placement(self, runs: Placement) -> None:
        """Places this rank's slice in each block object by ``runs`` (``canonical_placement``), now
        and after every reconnect. A placement the service's object size refuses raises: the engine
        must not start storing under another layout."""
        self._placement = runs
        with self._lock:
            client = self._client
        if client is not None:
            client.set_placement(runs)

    def _attach_at_start(self) -> None:
        """The first attach, waited ``store_probe.ATTACH_AT_START_WAIT_S`` at most (and no longer than
        the connection's timeout): a service that refuses this engine within it stops the engine
        with the reason. Past it the engine starts serving misses
        and the attempt goes on in the background (a store opening on a frozen mount, a long
        recovery): it attaches when the service answers, as a reconnect does."""
        with self._lock:
            self._reconnecting, self._last_attempt = True, time.monotonic()
        attempt = _Attempt()
        start_thread(lambda: self._attempt(attempt), "kvtier-attach")
        why_not = self._wait_at_start(attempt)
        with self._lock:  # the outage is noted before the attempt, now in the background, can end it
            finished = attempt.done.is_set()
            attempt.in_background = not finished
            if not finished:
                self._note_outage(f"{why_not}; the engine attaches once it answers")
        if not finished:
            return
        if isinstance(attempt.error, ServiceUnreachable):
            self._note_outage(f"the host service cannot be reached at start ({attempt.error})")
        elif attempt.error is not None:
            raise attempt.error  # it answered, and refused this engine: the message says why
        elif attempt.attached is not None:
            self._publish(attempt.attached)

    def _wait_at_start(self, attempt: _Attempt) -> str:
        """Waits for the first attach to finish (``store_probe.wait_at_start``), less once the service's
        process is seen stopped; why it stopped waiting, if it did."""
        from kvtier.service import process_stopped

        service_pid: int | None = None

        def stopped() -> str:
            nonlocal service_pid
            service_pid = service_pid or self._service_pid()
            if service_pid is not None and process_stopped(service_pid):
                return f"the host service's process ({service_pid}) is stopped (SIGSTOP?) at start"
            return ""

        # Never longer than one of its calls may take: a scheduler's start is waited its 2-s deadline,
        # as its calls are. Its worker attached first (vLLM makes the workers before the scheduler),
        # so a namespace still opening then is one the worker stopped waiting for, on a frozen mount
        # or past the attach limit: waiting longer there only delays the engine's start.
        limit_s = min(store_probe.ATTACH_AT_START_WAIT_S, self.timeout_ms / 1000)
        timed_out = (
            f"the host service did not answer within {limit_s:g} s at start "
            "(its store opening on a slow filesystem, or a long recovery?)"
        )
        directories = store_directories(self._options.path)
        note = ", and the host service opens the store there"
        return store_probe.wait_at_start(attempt.done, directories, timed_out, stopped, note, limit_s)

    def _service_pid(self) -> int | None:
        """The pid of the service on this connection's socket; None while the socket is not named
        yet (the attempt names it) or nothing listens there."""
        from kvtier.service import running_service

        socket = self._socket_path
        service = running_service(socket) if socket is not None else None
        return service[0] if service is not None else None

    def _reconnect_in_background(self) -> None:
        with self._lock:
            now = time.monotonic()
            if self._reconnecting or now - self._last_attempt < RECONNECT_INTERVAL_S:
                return
            self._reconnecting, self._last_attempt = True, now
        start_thread(lambda: self._attempt(_Attempt(in_background=True)), "kvtier-reconnect")

    def _attempt(self, attempt: _Attempt) -> None:
        """One connect; its result goes to ``_attach_at_start`` while it waits, else is used here."""
        attached, error = None, None
        try:
            attached = self._connect(start_timeout_s=None)
        except Exception as failure:
            error = failure
        with self._lock:
            attempt.attached, attempt.error = attached, error
            attempt.done.set()
            if not attempt.in_background:
                self._reconnecting = False
                return
        try:
            if attached is not None:
                self._publish(attached)
            elif error is not None:
                self._note_failed_reconnect(error)
        finally:
            with self._lock:  # only now: an attempt started before the publish would replace its client
                self._reconnecting = False

    def _publish(self, attached: _Attached) -> None:
        """Makes the client this connection's. A placement set since it was sent is sent too:
        ``set_placement`` reads the client after setting the placement, this the placement after
        setting the client, so one of the two sends it."""
        client, sent = attached.client, attached.placement
        with self._lock:
            if self._last_attempt == float("inf"):
                return  # closed meanwhile
            self._client, self._service = client, attached.service
            self.client_epoch += 1
            reattached = self._outage_logged
            self._outage_logged = False
            self._reconnect_warned_at = float("-inf")
        if self._placement is not sent:
            try:
                client.set_placement(self._placement)
            except Exception as error:
                with self._lock:
                    if self._client is client:
                        self._client = None
                self._note_failed_reconnect(error)
                return
        if reattached:
            logger.warning("kvtier: reattached to the host service; serving its hits again")

    def _note_failed_reconnect(self, error: Exception) -> None:
        now = time.monotonic()
        if now - self._reconnect_warned_at < RECONNECT_WARN_INTERVAL_S:
            logger.debug("kvtier: the host service is still unreachable (%s); serving misses", error)
            return
        self._reconnect_warned_at = now
        logger.warning("kvtier: reconnecting to the host service failed (%s); serving misses, retrying", error)

    def call(self, method: str, *args: Any, default: Any = None, reconnect: bool = True) -> Any:
        """``method`` on the service, ``default`` when it cannot answer; ``reconnect=False``: a call
        only a connected service needs (one started again knows nothing of this one's state)."""
        return self._call(method, args, default, reconnect)[0]

    def call_served(self, method: str, *args: Any, default: Any = None) -> tuple[Any, int | None]:
        """``call``, with the ``client_epoch`` of the client that answered: None when none did, or
        when it was let go before the call returned (what the call left there, pins, went with it).
        Another thread's failed call can let the client go and attach a new one at any time."""
        result, client = self._call(method, args, default, True)
        with self._lock:
            return result, (self.client_epoch if client is not None and self._client is client else None)

    def _call(self, method: str, args: tuple[Any, ...], default: Any, reconnect: bool) -> tuple[Any, Any]:
        """``call``'s result, with the client that answered (None when none did)."""
        client = self.live_client(reconnect=reconnect)
        if client is None:
            return default, None
        try:
            result = getattr(client, method)(*args)
        except Exception as error:
            self.failed_calls += 1
            if not client.connected:
                self._note_outage(f"host service call {method} failed ({error})")
                self._drop_dead(client)
                if reconnect:
                    self._reconnect_in_background()
            else:
                logger.warning("kvtier: host service call %s refused (%s)", method, error)
            return default, None
        self.report_counts()
        return result, client

    def add_count_source(self, source: Callable[[], Mapping[str, int]]) -> None:
        """Counts this engine keeps itself (the worker's jobs given up or skipped, its loads held for
        a reattach, by the names of ``kvtier_core::service::ENGINE_REPORTED``), reported with the
        connection's own."""
        self._count_sources.append(source)

    def report_counts(self) -> None:
        """Sends the service what this engine counted since its last report, if anything: calls that
        failed, calls not sent while it stepped aside, outages, and its sources' counts. An engine's
        fallbacks happen while the service does not answer; they reach its per-engine counters
        (``kvtier top``, the metrics) at the first call that succeeds afterwards. A labelled
        connection only; never waits for another report in progress."""
        if not self._label or not self._report_lock.acquire(blocking=False):
            return
        try:
            counts = {
                "failed_calls": self.failed_calls,
                "stepped_aside_calls": self.stepped_aside_calls,
                "outages": self.outages,
            }
            for source in self._count_sources:
                counts.update(source())
            deltas = [(name, n - self._reported.get(name, 0)) for name, n in counts.items()]
            deltas = [(name, delta) for name, delta in deltas if delta > 0]
            client = self._client
            if not deltas or client is None or not client.connected:
                return
            try:
                client.report_counts(deltas)
            except Exception:
                return  # the next call finds out; the counts go with a later report
            self._reported.update(counts)
        finally:
            self._report_lock.release()

    def _note_outage(self, what: str) -> None:
        """Counted and logged once per outage: every later call answers its miss at once until a
        reconnect ends it."""
        if not self._outage_logged:
            self._outage_logged = True
            self.outages += 1
            logger.error("kvtier: %s; serving misses (recompute) until it answers again", what)

    @property
    def available(self) -> bool:
        """Whether calls go to the service now (False while it is stepped aside after a failure)."""
        client = self._client
        return client is not None and client.connected

    def count_failed_call(self) -> None:
        self.failed_calls += 1

    def live_client(self, reconnect: bool = True) -> Any:
        """The connected client, for a caller that drives the two-phase calls itself (the GPU
        worker); None while the service is unreachable (a reconnect is under way then, unless
        ``reconnect`` is False): the call is answered with its miss without being sent, counted in
        ``stepped_aside_calls``."""
        client = self._connected_client(reconnect)
        if client is None:
            self.stepped_aside_calls += 1
        return client

    def _connected_client(self, reconnect: bool = True) -> Any:
        """The client while it is connected; else None, with a dead one let go and, if
        ``reconnect``, a reconnect started (at most one a second, in the background)."""
        client = self._client
        if client is not None and client.connected:
            return client
        if client is not None and self._drop_dead(client):
            # A call made outside ``call`` broke it (a GPU transfer's, a report's): an outage too.
            self._note_outage("the host service stopped answering this engine's calls")
        if reconnect:
            self._reconnect_in_background()
        return None

    def wait_attached(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` for this connection to be attached, reconnecting meanwhile (one
        try a second, in the background); whether it is. For a caller that must not answer a miss
        (a load under vLLM's plain OffloadingConnector, where a failed load stops the engine). Not
        once its engine shuts down (``stop_reconnecting``): nothing would attach it."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._connected_client() is not None:
                return True
            if time.monotonic() >= deadline or self._last_attempt == float("inf"):
                return False
            time.sleep(ATTACH_POLL_S)

    def drop_if_hung_up(self) -> bool:
        """Lets go of the client if the service hung up on it while idle (killed): whether it did.
        The next call reconnects, as after any failed call."""
        client = self._client
        if client is None or not client.peer_hung_up():
            return False
        self._note_outage("the host service closed the connection (it stopped or died)")
        self._drop_dead(client)
        return True

    def _drop_dead(self, client: Any) -> bool:
        """Lets go of a client whose service stopped answering, and so do this process's other
        connections to that socket (idle ones would notice only at their next call): each unmaps
        its pool once no call holds it. A service started again takes the dead one's pool over (no
        gigabytes to zero beside the engine) only when no process maps it any more. Only clients of
        that service: one another connection attached to a service started since is kept. A client
        already let go (another connection's drop came first) changes nothing more. Whether this
        call let it go."""
        with self._lock:
            if self._client is not client:
                return False
            self._client, dead = None, self._service
        with registry_lock:
            others = [c for c in _service_connections if c is not self and c._socket_path == self._socket_path]
        dropped = [self]
        for other in others:
            with other._lock:
                if other._client is not None and (dead is None or other._service in (dead, None)):
                    other._client = None
                    dropped.append(other)
        for connection in dropped:
            for listener in connection._drop_listeners:
                listener()
        return True

    def add_drop_listener(self, listener: Callable[[], None]) -> None:
        """``listener`` is called (on the thread that noticed) each time this connection lets go of
        a dead service's client: a holder of that client (a GPU rank's pinned pool mapping) lets go
        of it too, or a service started again cannot take the dead one's pool over."""
        self._drop_listeners.append(listener)

    @property
    def current_client(self) -> Any:
        """The client calls go to now, or None; nothing counted, no reconnect started."""
        return self._client

    # The store's calls KvtierManager makes (``backend.BlockIndex``).
    def contains_many(self, keys: list[bytes]) -> list[bool]:
        return [tier is not None for tier in self.locate_many(keys)]

    def locate_many(self, keys: list[bytes]) -> list[str | None]:
        return self.call("locate_many", keys, default=[None] * len(keys))

    def pin_many(self, keys: list[bytes]) -> list[bool]:
        return self.call("pin_many", keys, default=[])

    def pin_many_served(self, keys: list[bytes]) -> tuple[list[bool], int | None]:
        """``pin_many``, with the epoch of the client that holds the pins (``call_served``)."""
        return self.call_served("pin_many", keys, default=[])

    def unpin_many(self, keys: list[bytes]) -> None:
        # Pins live as long as the connection that took them: a dead service's went with it, and a
        # service started again to release them would hold none (an engine shutting down beside a
        # stopped service started it again this way).
        self.call("unpin_many", keys, reconnect=False)

    def unpin_many_at(self, keys: list[bytes], epoch: int) -> None:
        """Releases pins the client of ``epoch`` took, if it is still this connection's: a later
        client holds none of them, and an unpin there would release another request's."""
        with self._lock:
            client = self._client if self.client_epoch == epoch else None
        if client is not None:
            try:
                client.unpin_many(keys)
            except Exception:
                logger.debug("kvtier: unpin failed; the pins go with the client", exc_info=True)

    def assign_tenant(self, keys: list[bytes], tenant: bytes) -> None:
        self.call("assign_tenant", keys, tenant)

    def note_retained(self, keys: list[bytes]) -> None:
        self.call("note_retained", keys)

    def stats(self) -> dict[str, int]:
        stats = dict(self.call("stats", default={}))
        stats["service_failed_calls"] = self.failed_calls
        stats["service_stepped_aside_calls"] = self.stepped_aside_calls
        stats["service_outages"] = self.outages
        return stats

    def tier_bytes_read(self, timeout_ms: int) -> int | None:
        """The bytes the service has read from NVMe, the shared tier and the bucket so far, asked on a
        connection of its own (a transfer may be waiting on this one) within ``timeout_ms``; None
        when it does not answer. A load round waits while the service reads it from its tiers: on a
        slow link that is seconds with nothing copied, and these bytes tell it from a stalled one."""
        from kvtier.service import connect

        if self._socket_path is None:
            return None
        try:
            stats = connect(self._socket_path, timeout_ms=timeout_ms).stats()
        except Exception:
            return None
        return sum(int(stats.get(name, 0)) for name in TIER_READ_FIELDS)

    def flush(self) -> None:
        """Waits until every store the service accepted for this namespace is on NVMe."""
        self.call("flush")

    def stop_reconnecting(self) -> None:
        """Its engine shuts down: calls go on while the service answers, and none starts it again
        (a service stopped on purpose stays stopped; a reconnect under way is let go)."""
        with self._lock:
            self._last_attempt = float("inf")

    def close(self) -> None:
        """Drops the connection: the service releases whatever it still held for this process."""
        self.stop_reconnecting()
        with self._lock:
            self._client = None
        with registry_lock:
            _service_connections.discard(self)


_hangup_watch: threading.Thread | None = None


def _start_hangup_watch() -> None:
    """Starts this process's watch for hung-up connections, once."""
    global _hangup_watch
    with registry_lock:
        if _hangup_watch is not None and _hangup_watch.is_alive():
            return
        _hangup_watch = start_thread(_watch_hangups, "kvtier-hangup-watch")


def _watch_hangups() -> None:
    """Issue 36: an idle engine learned of a killed service only at its next call, and kept the dead
    service's pool mapped until then; the service started again could not take that pool over and
    allocated and zeroed a new one (seconds of kernel time beside a two-core engine). Every
    ``HANGUP_CHECK_S`` each connection whose service hung up drops its client (unmapping the pool);
    no call is made and none waits. It does not start the service: one stopped on purpose stays
    stopped until a request needs it."""
    while True:
        time.sleep(HANGUP_CHECK_S)
        with registry_lock:
            connections = list(_service_connections)
        for connection in connections:
            try:
                connection.drop_if_hung_up()
            except Exception:  # a client of an older build without the check: nothing to watch
                logger.debug("kvtier: hang-up check failed", exc_info=True)
