"""KV events of an idle engine: kvtier's tiers change while vLLM's engine core waits for requests.

vLLM publishes the events of its KV-cache manager and of the connector (``take_events()``) in
``Scheduler.update_from_output``, after a model step. An engine core with no request steps no more:
it waits on its input queue (``EngineCoreProc._process_input_queue``). kvtier's tiers change without
it (another engine's stores evict this one's blocks, trims, a service restart, this engine's own
stores landing after its last step), so those events would wait for the engine's next request,
and a router would never learn that an idle engine, the best target, can load a prefix.

The idle engine core has two seams, both used by vLLM itself from other threads:

- a ``WAKEUP`` sentinel on its input queue (``EngineCoreRequestType.WAKEUP``: what vLLM's own
  signal handler puts there to wake the loop for shutdown) makes the loop look for work again;
- while it has none, the loop calls the callbacks in ``_idle_state_callbacks`` on its own thread,
  with the engine core (what vLLM's pause uses to finish once the engine is idle).

So when the feed has events waiting, it asks for one callback and wakes the loop; the callback, on
the engine-core thread, does what ``update_from_output`` does with events: the KV-cache manager's
events, then the connector's (through the connector, so that vLLM's offloading tracker translates
kvtier's events as it does after a step, self-describing metadata included), published as one
``KVEventBatch`` on the scheduler's own publisher. Everything stays on the engine-core thread: one
publisher, one order, the tracker used by one thread. No model step runs and no worker is called. A
busy engine drains the events at its steps as before; the callback runs at its next idle moment.

Not chosen: publishing from the feed's thread through vLLM's publisher (its queue is thread-safe,
but the tracker the scheduler mutates would be driven from two threads, and an event taken by a step
not yet published could be overtaken); a publisher of kvtier's own (routers would need a second
endpoint per engine); keeping the scheduler stepping (``has_pending_push_work``: an empty model step
per poll, and only under ``KvtierConnector``).

An engine core run in the front end's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) has no loop of
its own: there events wait for the next step, as before.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import weakref
from types import FrameType
from typing import Any

logger = logging.getLogger("kvtier.vllm")


class IdlePublisher:
    """Publishes the engine core's pending KV events on its own thread once it is idle."""

    def __init__(self, engine_core: Any):
        self._engine_core = weakref.ref(engine_core)
        self._lock = threading.Lock()
        self._asked = False
        self._disabled = False
        self.batches_published = 0

    def ask(self) -> None:
        """From any thread: publish what waits at the engine core's next idle moment (at once if it
        is idle). One request at a time; a busy engine's steps publish meanwhile."""
        engine_core = self._engine_core()
        if engine_core is None or self._disabled:
            return
        callbacks = getattr(engine_core, "_idle_state_callbacks", None)
        input_queue = getattr(engine_core, "input_queue", None)
        if callbacks is None or input_queue is None:
            self._disable("this vLLM's engine core has no idle callbacks or input queue")
            return
        with self._lock:
            if self._asked:
                return
            self._asked = True
        from vllm.v1.engine import EngineCoreRequestType

        callbacks.append(self._publish)
        input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))

    def _publish(self, engine_core: Any) -> None:
        """On the engine-core thread, idle. Never raises: an event is not worth the engine."""
        with self._lock:
            self._asked = False  # events queued from now on ask again
        try:
            if publish_pending_events(engine_core.scheduler):
                self.batches_published += 1
        except Exception as error:
            self._disable(f"publishing failed ({error!r})")

    def _disable(self, why: str) -> None:
        if not self._disabled:
            self._disabled = True
            logger.warning("kvtier: KV events of an idle engine wait for its next step: %s", why)


def publish_pending_events(scheduler: Any) -> bool:
    """What ``Scheduler.update_from_output`` does with events after a step (vLLM 0.32): the
    KV-cache manager's, then the connector's, as one batch. Whether there was any."""
    from vllm.distributed.kv_events import KVEventBatch

    events = list(scheduler.kv_cache_manager.take_events() or ())
    connector = scheduler.get_kv_connector()
    if connector is not None:
        events.extend(connector.take_events() or ())
    if not events:
        return False
    scheduler.kv_event_publisher.publish(KVEventBatch(ts=time.time(), events=events))
    return True


def idle_publisher_of_this_engine() -> IdlePublisher | None:
    """The publisher for the engine core being built on this thread's stack (``get_manager`` runs
    inside the ``Scheduler`` that ``EngineCore.__init__`` builds); None without one, or for an
    engine core with no loop of its own (in the front end's process: no input queue)."""
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError:
        return None
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, EngineCore):
            # EngineCoreProc sets its input queue before EngineCore.__init__ builds the scheduler.
            return IdlePublisher(candidate) if hasattr(candidate, "input_queue") else None
        frame = frame.f_back
    return None
