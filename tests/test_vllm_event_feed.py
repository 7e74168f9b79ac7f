"""The KV-event feed (``kvtier.vllm.events.EventFeed``) against a real host service (no engine): a
router that applies the feed's events in order holds exactly what the service holds, whatever the
feed's pages span (several log refreshes, by other followers), when vLLM stops draining it past its
cap, and when another follower refreshed the log just before a store landed.

The feed is polled by hand (``poll_once``) and drained (``take``) as vLLM's scheduler drains it; the
service's state is read the way ``kvtier ls --blocks`` reads it (``Op::Changes`` from cursor 0).
"""

from __future__ import annotations

import time
from collections import defaultdict

import pytest

try:
    from vllm.v1.kv_offload.base import OffloadingEvent, make_offload_key
except Exception as import_error:  # pragma: no cover - depends on the environment
    pytest.skip(f"vllm is not importable ({import_error!r}); run scripts/install_vllm.sh", allow_module_level=True)

from kvtier import service as kvtier_service
from kvtier.vllm import KvtierLoadStoreSpec
from kvtier.vllm import events as events_module
from kvtier.vllm.events import TIER_MEDIA, EventFeed, direct_offload_key
from test_vllm_worker import ENGINE_BLOCKS, connection, engine_blocks, finished, key, layers, options_for, worker

# The service reads the store into its change log when a follower asks and the log is older than this.
REFRESH_S = 0.5
# The 8 MiB pool holds about 60 blocks of 128 KiB: the first blocks fill most of it, and each churn
# round stores more than half of it, so that every round evicts blocks the round before stored.
FIRST_BLOCKS = 56
CHURN_BLOCKS = 48


@pytest.fixture
def service(tmp_path):
    options = options_for(tmp_path)
    yield options
    kvtier_service.stop_service(options.socket_path())


class Router:
    """A router's index of one engine's kvtier tiers, from its events applied in order."""

    def __init__(self) -> None:
        self.blocks: dict[tuple, set] = defaultdict(set)

    def apply(self, events: list[OffloadingEvent]) -> None:
        for event in events:
            if vars(event).get("metadata_only"):
                continue  # vLLM 0.33 frees its snapshot and publishes nothing
            tier = (event.medium, event.locality, event.ownership)
            if event.removed:
                self.blocks[tier].difference_update(event.keys)
            else:
                self.blocks[tier].update(event.keys)

    def held(self) -> dict[tuple, set]:
        return {tier: keys for tier, keys in self.blocks.items() if keys}


def service_blocks(follower) -> dict[tuple, set]:
    """What the service holds, as ``kvtier ls --blocks`` reads it, in the router's terms."""
    reset, _, changes = follower.call("changes", 0, 1 << 16)
    assert reset
    held: dict[tuple, set] = defaultdict(set)
    for store_key, tier, removed in changes:
        assert not removed
        held[TIER_MEDIA[tier]].add(make_offload_key(store_key, 0))
    return dict(held)


def store(w, keys: list[bytes], job_ids: list[int]) -> None:
    """Stores ``keys`` through the service worker, as vLLM's store jobs do, and waits for them."""
    for start in range(0, len(keys), ENGINE_BLOCKS):
        chunk = keys[start : start + ENGINE_BLOCKS]
        job_ids.append(len(job_ids) + 1)
        assert w.submit_store(job_ids[-1], engine_blocks(list(range(len(chunk)))), KvtierLoadStoreSpec(chunk))
        assert finished(w, job_ids[-1])


def refresh(follower) -> None:
    """Another follower (another engine's feed, ``kvtier ls --blocks``) has the log refreshed."""
    time.sleep(REFRESH_S + 0.05)
    follower.call("changes", 0, 1)


def churn(w, job_ids: list[int], other, first_round: int) -> None:
    """Three rounds of stores, each evicting what the one before stored, each seen by a refresh."""
    for round_ in range(first_round, first_round + 3):
        store(w, [key(1000 * round_ + i) for i in range(CHURN_BLOCKS)], job_ids)
        refresh(other)


def test_a_page_spanning_refreshes_leaves_the_router_with_what_the_service_holds(service):
    """Blocks stored in one refresh and evicted in the next come out of one page as a store then a
    removal, in that order: grouped by (tier, removed), the router kept them for good."""
    w = worker(service, layers())
    feed = EventFeed(lambda: connection(service), direct_offload_key(0), poll_interval_s=3600)
    follower, other = connection(service), connection(service)
    router, job_ids = Router(), list[int]()
    try:
        store(w, [key(i) for i in range(FIRST_BLOCKS)], job_ids)
        feed.poll_once(follower)
        router.apply(feed.take())
        assert router.held() == service_blocks(other)
        # Each refresh logs its removals first: the page the feed reads next starts with one.
        churn(w, job_ids, other, first_round=1)
        feed.poll_once(follower)
        router.apply(feed.take())
        held = service_blocks(other)
        extra = {tier: len(keys - held.get(tier, set())) for tier, keys in router.held().items()}
        assert router.held() == held, f"the router holds blocks the service evicted: {extra}"
    finally:
        feed.close()
        follower.close()
        other.close()
        w.shutdown()


def test_past_the_cap_the_queue_folds_and_the_router_still_learns_every_removal(service, monkeypatch):
    """vLLM stopped draining the feed (a stuck scheduler, an engine that never steps) while blocks
    came and went: past the cap, the queue is folded into what routers were told against what the
    service holds, so the router's next batch removes every evicted block it knew and adds the rest;
    the feed then goes on from the same cursor."""
    monkeypatch.setattr(events_module, "MAX_PENDING_EVENTS", 30)
    w = worker(service, layers())
    feed = EventFeed(lambda: connection(service), direct_offload_key(0), poll_interval_s=3600)
    follower, other = connection(service), connection(service)
    router, job_ids = Router(), list[int]()
    try:
        store(w, [key(i) for i in range(FIRST_BLOCKS)], job_ids)
        feed.poll_once(follower)
        router.apply(feed.take())
        assert router.held() == service_blocks(other)
        resets = feed.resets  # 1: the first read
        churn(w, job_ids, other, first_round=1)
        feed.poll_once(follower)  # vLLM takes nothing: hundreds of events wait, past the cap
        assert feed.folds == 1
        router.apply(feed.take())
        assert router.held() == service_blocks(other), "the router missed removals or stores past the cap"
        assert feed.resets == resets, "the feed went on from its cursor"
        churn(w, job_ids, other, first_round=4)
        feed.poll_once(follower)
        router.apply(feed.take())
        assert router.held() == service_blocks(other)
    finally:
        feed.close()
        follower.close()
        other.close()
        w.shutdown()


def test_a_store_that_landed_just_after_another_followers_refresh_is_not_released(service):
    """Another follower (engine) refreshed the log just before this engine's store landed: this
    feed's next poll reads that log, which cannot know the store yet. Settled then, a store that
    did land would be released as never landed (vLLM 0.33 would free its tokens and publish its
    stored event with none)."""
    w = worker(service, layers())
    feed = EventFeed(lambda: connection(service), direct_offload_key(0), poll_interval_s=3600)
    follower, other = connection(service), connection(service)
    job_ids = list[int]()
    try:
        feed.poll_once(follower)
        stored = [key(500 + attempt) for attempt in range(3)]
        for block in stored:
            refresh(other)
            started = time.monotonic()
            store(w, [block], job_ids)
            feed.expect_stored([block])
            feed.poll_once(follower)
            if time.monotonic() - started < REFRESH_S / 2:
                break  # the poll read the log the other follower had refreshed
        time.sleep(REFRESH_S + 0.15)
        feed.poll_once(follower)
        reported = [k for event in feed.take() if not event.removed for k in event.keys]
        assert sorted(reported) == sorted(make_offload_key(k, 0) for k in stored[: len(job_ids)])
        assert feed.unlanded_store_blocks == 0, "a store that landed was released as never landed"
    finally:
        feed.close()
        follower.close()
        other.close()
        w.shutdown()
