"""`kvtier bench io`'s systems (fio, kvtier and its encrypted and shared-filesystem variants, the
shared-filesystem tier encrypted, the object tier, LMCache): each one's entry in the results document's
``systems`` (run, with what is timed, or skipped and why), and one trial of a case on each
(``measure_trial``), with what every measurement of a run shares (``Rig``). ``kvtier.bench.io`` owns
the command line and the run loop."""

from __future__ import annotations

import dataclasses
import os
import sys
import traceback
from typing import TYPE_CHECKING

from . import fio, kvtier_store, lmcache_client, workload

if TYPE_CHECKING:
    import numpy as np


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclasses.dataclass
class Rig:
    """What every measurement of one run shares: its options, results document, block data, fio's file
    and LMCache's runner."""

    options: dict
    document: dict
    pool_bytes: int
    pool: np.ndarray | None
    fio_file: str
    lmcache_session: lmcache_client.LMCacheSession | None
    # The systems measured, in order before each trial's rotation; LMCache leaves when its runner stops.
    enabled: list[str]


@dataclasses.dataclass
class Trial:
    """One case at one repeat: its objects, the sample its figures go to and the label of its lines."""

    case: dict
    layout: workload.PromptLayout
    sample: dict
    label: str


def kvtier_system(options: dict) -> dict:
    """kvtier's entry in ``systems`` (its local tiers): run, with what is timed, or skipped."""
    if not options["use_kvtier"]:
        return {"enabled": False, "skipped_reason": "--no-kvtier"}
    kvtier_store.load_store_class()  # raises KvtierUnavailable with the fix
    return {
        "enabled": True,
        "dram_bytes": options["dram_bytes"],
        "reopen": options["reopen"],
        "timed": "store: put_many from the caller's buffers + flush (synced); retrieve: get_many into "
        "prefaulted caller buffers, after close/reopen (unless --keep-open) and a page-cache drop; "
        "CPU: getrusage of this process (the store's I/O threads are in it)",
    }


def kvtier_encrypted_system(options: dict) -> dict:
    """kvtier with encryption at rest (``--encrypted``): the same store, its NVMe values encrypted."""
    if not options["use_encrypted"]:
        return {"enabled": False, "skipped_reason": "--no-kvtier" if not options["use_kvtier"] else "no --encrypted"}
    return {
        "enabled": True,
        "timed": "as kvtier's, with encryption_key_file set (AES-256-GCM of every value written; loads "
        "decrypt where the value lands, then copy out)",
    }


def kvtier_shared_encrypted_system(options: dict) -> dict:
    """The shared-filesystem tier with encryption at rest (``--encrypted --shared``): kvtier_shared's
    measurement, both stores with the key."""
    if not (options["use_encrypted"] and options["use_shared"]):
        why = "--no-kvtier" if not options["use_kvtier"] else "not requested (--encrypted --shared)"
        return {"enabled": False, "skipped_reason": why}
    return {
        "enabled": True,
        "timed": "as kvtier_shared's (on a shared root of its own), with encryption_key_file set on stores A "
        "and B (A seals every value before its tag; B checks the tag, decrypts in its DRAM slot, then "
        "the checksum, then copies out)",
    }


def kvtier_shared_system(options: dict) -> dict:
    """The shared-filesystem tier's entry in ``systems``: run, with what is timed, or skipped."""
    if not options["use_shared"]:
        return {
            "enabled": False,
            "skipped_reason": "--no-kvtier" if options["use_kvtier"] is False else "not requested (--shared)",
        }
    return {
        "enabled": True,
        "shared_root": os.path.join(options["scratch_dir"], "kvtier-shared", "shared"),
        "timed": "store: store A (nvme_bytes=0, 8 DRAM slots) put_many + flush, which publishes every "
        "shared file (tmp create, fdatasync, rename, manifest record); retrieve: A closed, page cache "
        "dropped, store B (other local directory, nvme_bytes=0, same shared_root and namespace) "
        "opened and polled until lookup_prefix covers the prompt (visibility, not in the GB/s), "
        "then get_many from the shared files; CPU: getrusage of this process",
    }


def kvtier_object_system(options: dict) -> dict:
    """The object tier's entry in ``systems``: run, with what is timed, or skipped."""
    if not options["object"]:
        return {"enabled": False, "skipped_reason": "not requested (--object)"}
    return {
        "enabled": True,
        "timed": "publish: store A (nvme_bytes=0, DRAM for the prompt) put_many + flush, which PUTs every "
        "segment and its index object; retrieve: A closed, store B (another empty local directory, same "
        "bucket prefix and namespace, listing period 600 s) opened (one listing + index GETs, not timed), "
        "then one get_many of the prompt: a ranged GET per block, verified byte for byte; requests from "
        "the tier's counters",
    }


def fio_system(options: dict) -> dict:
    """fio's entry in ``systems``: run (with its version) or skipped, with the reason."""
    if not options["use_fio"]:
        return {"enabled": False, "skipped_reason": "--no-fio"}
    if not fio.fio_path():
        log(f"note: {fio.missing_fio_message()}; running without the physical limit")
        return {"enabled": False, "skipped_reason": fio.missing_fio_message()}
    return {
        "enabled": True,
        "version": fio.fio_version(),
        "timed": "sequential write then read, O_DIRECT, io_uring, on a file beside the store, "
        "min(prompt, 4 GiB), a few bs/iodepth/jobs combinations; best of each direction per "
        "repeat; CPU: fio's usr+sys",
    }


def start_lmcache(options: dict, systems: dict) -> lmcache_client.LMCacheSession | None:
    """LMCache's runner in its own interpreter, described in ``systems``; None when it is skipped."""
    if not options["use_lmcache"]:
        systems["lmcache"] = {"enabled": False, "skipped_reason": "--no-lmcache"}
        return None
    python_path = options["lmcache_python"] or lmcache_client.default_lmcache_python()
    if not python_path:
        reason = (
            "lmcache is not installed: run scripts/install_lmcache.sh (makes .venv-lmcache) "
            "or pass --lmcache-python PATH; skipped"
        )
        systems["lmcache"] = {"enabled": False, "skipped_reason": reason}
        log(f"note: {reason}")
        return None
    log(f"starting the LMCache runner under {python_path} ...")
    try:
        session = lmcache_client.LMCacheSession(python_path)
    except lmcache_client.LMCacheUnavailable as error:
        systems["lmcache"] = {"enabled": False, "skipped_reason": str(error)}
        log(f"note: LMCache skipped: {error}")
        return None
    systems["lmcache"] = {
        "enabled": True,
        "python": python_path,
        "lmcache_version": session.lmcache_version,
        "torch_version": session.torch_version,
        "backend": "LocalDiskBackend, O_DIRECT, page-aligned staging pool, local_cpu=False",
        "timed": "store: batched_submit_put_task of filled memory objects until every write "
        "completed (no fsync; the copy into its memory objects is not timed); retrieve: "
        "batched_get_blocking into its staging pool after a page-cache drop; CPU: "
        "getrusage of the runner process",
    }
    return session


def measure_trial(rig: Rig, repeat: int, case_index: int, case: dict) -> None:
    """One case at one repeat: every enabled system in turn, the first one rotating so that no system
    always runs first; a failure is recorded and the next system goes on."""
    options = rig.options
    sample: dict = {"repeat": repeat}
    case["repeats"].append(sample)
    layout = workload.prompt_layout(
        workload.MODEL_SHAPES[case["model"]],
        case["prompt_tokens"],
        case["tokens_per_object"],
        key_salt=f"{options['seed']}/{repeat}/{case_index}",
        pool_bytes=rig.pool_bytes,
        start_slot=repeat * 7919 + case_index,
    )
    enabled = rig.enabled
    rotation = (repeat + case_index) % len(enabled) if enabled else 0
    order = enabled[rotation:] + enabled[:rotation]
    label = (
        f"[{repeat + 1}/{options['repeats']}] {case['model']} "
        f"{workload.format_token_count(case['prompt_tokens'])} {case['object_kind']}"
    )
    trial = Trial(case, layout, sample, label)
    errors = rig.document["errors"]
    for system in order:
        try:
            MEASURE_SYSTEM[system](rig, trial)
        except lmcache_client.LMCacheUnavailable as error:
            errors.append({"system": system, "case": label, "error": str(error)})
            log(f"{label} LMCache stopped: {error}")
            rig.document["systems"]["lmcache"]["stopped_reason"] = str(error)
            enabled.remove("lmcache")
        except Exception as error:  # record and go on: one failure should not lose the run
            errors.append({"system": system, "case": label, "error": f"{type(error).__name__}: {error}"})
            log(f"{label} {system} FAILED: {type(error).__name__}: {error}")
            if options["small"]:
                traceback.print_exc()


def measure_fio(rig: Rig, trial: Trial) -> None:
    case = trial.case
    trial.sample["fio"] = fio.measure_limits(
        rig.fio_file, case["prompt_bytes"], case["object_bytes"], rig.options["fio_inflight_bytes"]
    )
    best_read, best_write = trial.sample["fio"]["best_read"], trial.sample["fio"]["best_write"]
    log(
        f"{trial.label} fio: read {best_read['gbps']:.2f} GB/s ({_combo_label(best_read)}), "
        f"write {best_write['gbps']:.2f} GB/s ({_combo_label(best_write)})"
    )


def measure_kvtier(rig: Rig, trial: Trial, system: str = "kvtier", store_options: dict | None = None) -> None:
    case = trial.case
    namespace = f"kvtier-bench-io/{case['model']}/{case['tokens_per_object']}".encode()
    trial.sample[system] = kvtier_store.measure(
        trial.layout,
        rig.pool,
        os.path.join(rig.options["scratch_dir"], "kvtier-store"),
        namespace,
        dram_bytes=rig.options["dram_bytes"],
        reopen=rig.options["reopen"],
        store_options=store_options,
    )
    measured = trial.sample[system]
    log(
        f"{trial.label} {system}: store {measured['store']['gbps']:.2f} GB/s, retrieve "
        f"{measured['retrieve']['gbps']:.2f} GB/s, wrong {measured['wrong_objects']}, "
        f"missing {measured['missing_objects']}"
    )


def measure_kvtier_shared(
    rig: Rig, trial: Trial, system: str = "kvtier_shared", store_options: dict | None = None
) -> None:
    case = trial.case
    namespace = f"kvtier-bench-io/{case['model']}/{case['tokens_per_object']}".encode()
    trial.sample[system] = kvtier_store.measure_shared(
        trial.layout,
        rig.pool,
        os.path.join(rig.options["scratch_dir"], system.replace("_", "-")),
        namespace,
        store_options=store_options,
    )
    measured = trial.sample[system]
    log(
        f"{trial.label} {system.replace('_', ' ')}: store {measured['store']['gbps']:.2f} GB/s "
        f"({measured['files']['data_files']} files, "
        f"{measured['store']['shared_dropped_publishes']} dropped publishes), visible after "
        f"{measured['visibility_seconds'] * 1e3:.1f} ms, retrieve "
        f"{measured['retrieve']['gbps']:.2f} GB/s, wrong {measured['wrong_objects']}, "
        f"missing {measured['missing_objects']}"
    )


def measure_lmcache(rig: Rig, trial: Trial) -> None:
    case, layout, options = trial.case, trial.layout, rig.options
    request = {
        "shape": {
            field: getattr(workload.MODEL_SHAPES[case["model"]], field)
            for field in ("name", "num_layers", "num_kv_heads", "head_dim", "dtype_bytes")
        },
        "prompt_tokens": case["prompt_tokens"],
        "tokens_per_object": case["tokens_per_object"],
        "seed": options["seed"],
        "key_salt": layout.key_salt,
        "pool_bytes": rig.pool_bytes,
        "start_slot": layout.start_slot,
        "dir": os.path.join(options["scratch_dir"], "lmcache-disk"),
        "use_odirect": True,
    }
    timeout_s = max(180.0, case["prompt_bytes"] / 50e6)
    assert rig.lmcache_session is not None  # "lmcache" is in the order only with a session
    trial.sample["lmcache"] = rig.lmcache_session.measure(request, timeout_s)
    measured = trial.sample["lmcache"]
    log(
        f"{trial.label} LMCache: store {measured['store']['gbps']:.2f} GB/s, retrieve "
        f"{measured['retrieve']['gbps']:.2f} GB/s, wrong {measured['wrong_objects']}, "
        f"missing {measured['missing_objects']}"
    )


def encryption_key_file(rig: Rig) -> str:
    """The run's throwaway key, in the scratch folder (beside the stores), made on first use."""
    return workload.throwaway_key_file(rig.options["scratch_dir"])


def measure_kvtier_encrypted(rig: Rig, trial: Trial) -> None:
    """kvtier's measurement with the run's key."""
    measure_kvtier(rig, trial, "kvtier_encrypted", {"encryption_key_file": encryption_key_file(rig)})


def measure_kvtier_shared_encrypted(rig: Rig, trial: Trial) -> None:
    """The shared tier's measurement with the run's key on both stores (on a shared root of its own)."""
    store_options = {"encryption_key_file": encryption_key_file(rig)}
    measure_kvtier_shared(rig, trial, "kvtier_shared_encrypted", store_options)


# What measure_trial runs for each system of the order.
MEASURE_SYSTEM = {
    "fio": measure_fio,
    "kvtier": measure_kvtier,
    "kvtier_encrypted": measure_kvtier_encrypted,
    "kvtier_shared": measure_kvtier_shared,
    "kvtier_shared_encrypted": measure_kvtier_shared_encrypted,
    "lmcache": measure_lmcache,
}


def measure_lookup(rig: Rig) -> None:
    """Once per run: the shared index's lookup latency, in ``systems["kvtier_shared"]["lookup"]``."""
    options = rig.options
    try:
        lookup = kvtier_store.measure_shared_lookup(
            os.path.join(options["scratch_dir"], "kvtier-shared-lookup"),
            b"kvtier-bench-io/lookup",
            calls=kvtier_store.LOOKUP_CALLS if not options["small"] else 5,
        )
        rig.document["systems"]["kvtier_shared"]["lookup"] = lookup
        log(
            f"kvtier shared index, {lookup['key_count']} keys: lookup_prefix "
            f"{lookup['lookup_prefix']['us_per_call']['median']:.0f} us/call, contains_many "
            f"{lookup['contains_many']['us_per_call']['median']:.0f} us/call (median)"
        )
    except Exception as error:
        rig.document["errors"].append(
            {"system": "kvtier_shared", "case": "lookup", "error": f"{type(error).__name__}: {error}"}
        )
        log(f"kvtier shared lookup FAILED: {type(error).__name__}: {error}")


def _combo_label(run: dict) -> str:
    return fio.FioCombo(run["block_bytes"], run["iodepth"], run.get("jobs", 1)).label()
