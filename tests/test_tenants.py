"""Tenants on one DRAM pool (docs/tenants.md): a tenant is a request's ``cache_salt``, and with
``tenant_dram_share`` each keeps its share of the pool however hard another one floods it. Through the
host service, as two engines of different tenants use it (each names its blocks' tenant before it
stores them, as ``KvtierManager`` does)."""

import os
from pathlib import Path

import numpy as np
import pytest

from kvtier._core import Service, ServiceClient, Store, tenant_id

SLICE_BYTES = 64 << 10
POOL_BYTES = 8 << 20  # about 120 slots


def key(tenant: int, i: int) -> bytes:
    return bytes([tenant]) + i.to_bytes(8, "little") * 3 + bytes(7)


def engine(socket: Path) -> ServiceClient:
    client = ServiceClient.connect(os.fspath(socket), 10_000)
    client.hello(b"tenants|service", 1, 0, SLICE_BYTES)
    return client


def store_as(client: ServiceClient, tenant: bytes, keys: list[bytes]) -> None:
    client.assign_tenant(keys, tenant)
    layer = np.zeros((len(keys), SLICE_BYTES), dtype=np.uint8)
    client.store_blocks(keys, [layer], list(range(len(keys))))


def where_after_a_flood(tmp_path: Path, **options: object) -> tuple[list[str | None], dict[str, int]]:
    """Where the quiet tenant's 30 blocks are (``locate_many``) after the other tenant stored 600,
    through a host service with ``options``, and the service's stats."""
    socket = tmp_path / "kvtier.sock"
    service = Service.start(os.fspath(socket), os.fspath(tmp_path / "store"), os.fspath(tmp_path), 30_000, **options)
    try:
        quiet, flood = engine(socket), engine(socket)
        quiet_keys = [key(1, i) for i in range(30)]
        store_as(quiet, tenant_id("quiet"), quiet_keys)
        for batch in range(0, 600, 20):
            store_as(flood, tenant_id("flood"), [key(2, i) for i in range(batch, batch + 20)])
            # The quiet tenant keeps using its prefix, as a chat's system prompt is.
            assert quiet.pin_many(quiet_keys[:1]) in ([True], [])
            quiet.unpin_many(quiet_keys[:1])
        return quiet.locate_many(quiet_keys), quiet.stats()
    finally:
        service.stop()


def resident_after_a_flood(tmp_path: Path, **options: object) -> tuple[int, dict[str, int]]:
    """How many of the quiet tenant's 30 blocks are still in a DRAM pool without NVMe after the flood."""
    found, stats = where_after_a_flood(tmp_path, dram_bytes=POOL_BYTES, nvme_bytes=0, **options)
    return found.count("dram"), stats


def test_a_tenant_keeps_its_share_of_the_pool_while_another_floods_it(tmp_path: Path) -> None:
    resident, stats = resident_after_a_flood(tmp_path, tenant_dram_share=0.4)
    assert resident == 30, f"the flood evicted {30 - resident} of the quiet tenant's blocks"
    quiet_label, flood_label = tenant_id("quiet")[:8].hex(), tenant_id("flood")[:8].hex()
    assert stats[f"tenant_dram_bytes:{quiet_label}"] == 30 * (SLICE_BYTES + 4096)  # a slot: descriptor + value
    assert stats[f"tenant_dram_evictions:{quiet_label}"] == 0
    assert stats[f"tenant_dram_evictions:{flood_label}"] > 400, "the flooder evicted its own blocks"
    assert stats[f"tenant_dram_guaranteed_bytes:{flood_label}"] == stats[f"tenant_dram_guaranteed_bytes:{quiet_label}"]
    assert "tenant_dram_bytes:default" in stats and stats["untracked_tenant_blocks"] == 0
    assert not any(name.startswith("tenant_dram_cap_bytes") for name in stats), "no cap set"


def test_a_cap_keeps_a_flood_to_its_part_of_the_pool_while_slots_are_free(tmp_path: Path) -> None:
    """``tenant_dram_max_share`` alone: the flood evicts its own blocks at the cap, so the quiet tenant,
    which never needs a guarantee here, finds its blocks where it left them and free room after them."""
    resident, stats = resident_after_a_flood(tmp_path, tenant_dram_max_share=0.25)
    assert resident == 30, f"the flood evicted {30 - resident} of the quiet tenant's blocks"
    quiet_label, flood_label = tenant_id("quiet")[:8].hex(), tenant_id("flood")[:8].hex()
    slot = SLICE_BYTES + 4096
    assert stats[f"tenant_dram_bytes:{flood_label}"] <= 0.25 * POOL_BYTES, "the flood is past its cap"
    assert stats[f"tenant_dram_bytes:{flood_label}"] >= 0.25 * POOL_BYTES - slot, "the flood stopped short of its cap"
    assert stats[f"tenant_dram_evictions:{flood_label}"] > 500 and stats[f"tenant_dram_evictions:{quiet_label}"] == 0
    assert stats["dram_used_bytes"] < 0.75 * POOL_BYTES, "the flood's evictions left the rest of the pool free"
    cap = stats[f"tenant_dram_cap_bytes:{flood_label}"]
    assert cap == stats[f"tenant_dram_cap_bytes:{quiet_label}"] == int(0.25 * (POOL_BYTES // slot)) * slot


def test_a_cap_under_a_guaranteed_share_is_refused_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"tenant_dram_max_share.*under a guaranteed share"):
        Store.open(
            os.fspath(tmp_path / "s"),
            object_bytes=SLICE_BYTES,
            namespace="cap",
            dram_bytes=POOL_BYTES,
            nvme_bytes=0,
            tenant_dram_share=0.3,
            tenant_dram_max_share=0.2,
        )


def test_without_shares_the_flood_evicts_the_quiet_tenant(tmp_path: Path) -> None:
    resident, stats = resident_after_a_flood(tmp_path)
    assert resident < 30, "the control: nothing protects a tenant when the pool is not split"
    assert not any(name.startswith("tenant_") for name in stats)


def test_an_in_process_store_splits_its_pool_by_tenant_too(tmp_path: Path) -> None:
    named = "quiet=0.3,flood=0.1"
    store = Store.open(
        os.fspath(tmp_path),
        namespace=b"t",
        object_bytes=SLICE_BYTES,
        dram_bytes=POOL_BYTES,
        nvme_bytes=0,
        tenant_dram_shares=named,
    )
    try:
        value = bytes(SLICE_BYTES)
        quiet_keys = [key(1, i) for i in range(20)]
        store.assign_tenant(quiet_keys, tenant_id("quiet"))
        store.put_many(quiet_keys, [value] * len(quiet_keys))
        for i in range(400):
            store.assign_tenant([key(2, i)], tenant_id("flood"))
            store.put_many([key(2, i)], [value])
        assert store.locate_many(quiet_keys) == ["dram"] * 20
        stats = store.stats()
        assert stats[f"tenant_dram_evictions:{tenant_id('quiet')[:8].hex()}"] == 0
    finally:
        store.close()


@pytest.mark.parametrize("split_nvme", [True, False])
def test_the_nvme_tier_keeps_a_quiet_tenants_blocks_through_a_flood_when_split(
    tmp_path: Path, split_nvme: bool
) -> None:
    """Through the host service, a DRAM pool of 30 slots over 16 regions of NVMe: the quiet tenant's
    share of the pool holds about half of its 30 blocks, its share of the NVMe tier all of them; a flood of
    600 blocks (three passes over the device) rewrites its own regions. In one log (the control) the
    flood pushes the quiet tenant's blocks off the device."""
    found, stats = where_after_a_flood(
        tmp_path,
        dram_bytes=30 * (SLICE_BYTES + 4096),
        nvme_bytes=16 << 20,
        region_bytes=1 << 20,
        tenant_dram_shares="quiet=0.4",
        tenant_shares_nvme=split_nvme,
    )
    quiet_label = tenant_id("quiet")[:8].hex()
    if split_nvme:
        assert None not in found, f"the flood took {found.count(None)} of the quiet tenant's blocks"
        assert found.count("nvme") >= 10, f"past its DRAM share, its blocks are on NVMe: {found}"
        assert stats[f"tenant_nvme_reclaimed_regions:{quiet_label}"] == 0
        assert stats[f"tenant_nvme_bytes:{quiet_label}"] >= 2 << 20, "two regions of 15 blocks"
        assert stats[f"tenant_nvme_reclaimed_regions:{tenant_id('flood')[:8].hex()}"] > 16
    else:
        assert "nvme" not in found and found.count(None) >= 10, found
        assert not any(name.startswith("tenant_nvme") for name in stats)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tenant_dram_share": 1.5}, "tenant_dram_share"),
        ({"tenant_dram_shares": "a=0.7,b=0.7"}, "add up to"),
        ({"tenant_dram_shares": "team-a"}, "salt=share"),
    ],
)
def test_bad_shares_are_refused_with_the_fix(tmp_path: Path, options: dict, message: str) -> None:
    with pytest.raises(Exception, match=message):
        Store.open(
            os.fspath(tmp_path),
            namespace=b"t",
            object_bytes=SLICE_BYTES,
            dram_bytes=POOL_BYTES,
            nvme_bytes=0,
            **options,
        )


def test_a_tenant_id_is_a_hash_of_the_salt_and_no_salt_is_the_default_tenant() -> None:
    assert tenant_id("") == bytes(16) and tenant_id(b"") == bytes(16)
    assert tenant_id("a") == tenant_id(b"a") != tenant_id("b")
    assert b"a" not in tenant_id("a") and len(tenant_id("a")) == 16
