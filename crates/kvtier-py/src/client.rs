//! `kvtier._core.ServiceClient` and `CopyGate`.
//!
//! A connection to the host service (`kvtier serve`), with the namespace's pool mapped: the
//! engine side of the multi-process layout. Calls release the GIL; a failed call drops the
//! connection (`connected` turns false) and the caller reconnects.

use crate::convert::{hex, parse_digest, parse_keys, parse_layer_blocks, parse_tenant, to_py, verify_dict};
use kvtier_core::service::{Client, CopyGate, PlacementRun, ReserveReply};
use parking_lot::Mutex;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[pyclass(name = "ServiceClient", module = "kvtier._core", frozen)]
pub(crate) struct PyServiceClient {
    inner: Mutex<Client>,
}

fn tier_name(code: u8) -> Option<&'static str> {
    kvtier_core::Tier::from_wire_code(code).map(kvtier_core::Tier::name)
}

#[pymethods]
impl PyServiceClient {
    /// Connects to the service's socket; every call then waits at most `timeout_ms` per read/write.
    #[staticmethod]
    fn connect(py: Python<'_>, socket_path: PathBuf, timeout_ms: u64) -> PyResult<PyServiceClient> {
        let client =
            py.detach(move || Client::connect(&socket_path, Duration::from_millis(timeout_ms))).map_err(to_py)?;
        Ok(PyServiceClient { inner: Mutex::new(client) })
    }

    /// Attaches to a namespace as `rank` of `tp_size` moving `slice_bytes` per block; maps its pool.
    /// Returns the pool's layout.
    fn hello<'py>(
        &self,
        py: Python<'py>,
        description: &[u8],
        tp_size: u32,
        rank: u32,
        slice_bytes: usize,
    ) -> PyResult<Bound<'py, PyDict>> {
        let description = description.to_vec();
        let attached =
            py.detach(|| self.inner.lock().hello(&description, tp_size, rank, slice_bytes).cloned()).map_err(to_py)?;
        let d = PyDict::new(py);
        d.set_item("pool_path", attached.pool_path)?;
        d.set_item("pool_bytes", attached.pool_bytes)?;
        d.set_item("slot_bytes", attached.slot_bytes)?;
        d.set_item("slot_count", attached.slot_count)?;
        d.set_item("object_bytes", attached.object_bytes)?;
        Ok(d)
    }

    /// Faults the mapped pool in now, so that this connection's copies take no page fault per
    /// 4 KiB: a worker that copies calls it at attach; a connection that never copies leaves it.
    fn populate_pool(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.lock().populate_pool()).map_err(to_py)
    }

    /// Whether no call has failed on the connection. True while a call is in progress on another
    /// thread: asking must never wait behind it (the caller may hold the engine's step).
    #[getter]
    fn connected(&self) -> bool {
        self.inner.try_lock().is_none_or(|client| client.is_connected())
    }

    /// Whether the service hung up on this connection while no call was on it (it died); False while
    /// a call is in progress on another thread (that call finds out itself), without waiting for it.
    fn peer_hung_up(&self) -> bool {
        self.inner.try_lock().is_some_and(|client| client.peer_hung_up())
    }

    /// Makes blocks resident in the service's DRAM pool (read from NVMe or the shared tier, verified)
    /// without copying them out: `True` per block resident afterwards.
    fn prefetch(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        let keys = parse_keys(keys)?;
        py.detach(|| self.inner.lock().prefetch(&keys)).map_err(to_py)
    }

    /// Threads a large `load_blocks` copies with (clamped to 1..=8). Call it from the thread that
    /// loads: it waits for a call in progress on this connection.
    fn set_copy_threads(&self, py: Python<'_>, threads: usize) {
        py.detach(|| self.inner.lock().set_copy_threads(threads));
    }

    /// Places this rank's slice in each block object by `runs`, `(slice_offset, object_offset, len)`
    /// tiling the slice in order, instead of one range at `rank * slice_bytes` (a rank-independent
    /// object layout, shared by engines of every TP size; after `hello`).
    fn set_placement(&self, py: Python<'_>, runs: Vec<(usize, usize, usize)>) -> PyResult<()> {
        let runs = runs
            .into_iter()
            .map(|(slice_offset, object_offset, len)| PlacementRun { slice_offset, object_offset, len })
            .collect();
        py.detach(|| self.inner.lock().set_placement(runs)).map_err(to_py)
    }

    /// Per key: "dram", "nvme", "shared" or None.
    fn locate_many(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<Option<&'static str>>> {
        let keys = parse_keys(keys)?;
        let codes = py.detach(|| self.inner.lock().locate(&keys)).map_err(to_py)?;
        Ok(codes.into_iter().map(tier_name).collect())
    }

    /// Pins the leading present keys for this connection: one flag per present key (False: shared
    /// tier only, no pin). Pins end with `unpin_many` or when the connection closes.
    fn pin_many(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        let keys = parse_keys(keys)?;
        py.detach(|| self.inner.lock().pin(&keys)).map_err(to_py)
    }

    fn unpin_many(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        let keys = parse_keys(keys)?;
        py.detach(|| self.inner.lock().unpin(&keys)).map_err(to_py)
    }

    /// The blocks are the tenant's (`tenant_id(cache_salt)`): charged to its share of the DRAM pool.
    fn assign_tenant(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, tenant: &[u8]) -> PyResult<()> {
        let (keys, tenant) = (parse_keys(keys)?, parse_tenant(tenant)?);
        py.detach(|| self.inner.lock().assign_tenant(&keys, &tenant)).map_err(to_py)
    }

    /// The blocks will be read again (a request's retention hint): evidence of reuse for writes below DRAM.
    fn note_retained(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        let keys = parse_keys(keys)?;
        py.detach(|| self.inner.lock().note_retained(&keys)).map_err(to_py)
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let fields = py.detach(|| self.inner.lock().stats()).map_err(to_py)?;
        let d = PyDict::new(py);
        for (name, value) in fields {
            d.set_item(name, value)?;
        }
        Ok(d)
    }

    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.lock().flush()).map_err(to_py)
    }

    /// Names the engine this connection works for in the service's per-engine counters (after
    /// `hello`; 1 to 128 bytes of UTF-8).
    fn set_label(&self, py: Python<'_>, label: &str) -> PyResult<()> {
        let label = label.to_string();
        py.detach(|| self.inner.lock().set_label(&label)).map_err(to_py)
    }

    /// Adds `(name, count)` pairs the engine counted itself since its last report to its per-engine
    /// counters (after `set_label`; names: `kvtier_core::service::ENGINE_REPORTED`).
    fn report_counts(&self, py: Python<'_>, counts: Vec<(String, u64)>) -> PyResult<bool> {
        py.detach(|| self.inner.lock().report(&counts)).map_err(to_py).map(|()| true)
    }

    /// What became or stopped being loadable in this connection's namespace since `cursor` (after
    /// `hello`): `(reset, next_cursor, [(key, tier, removed)])`, tier "dram", "nvme" or "shared";
    /// `reset`: the cursor was not a position in the service's log, the changes are its state.
    fn changes<'py>(&self, py: Python<'py>, cursor: u64, max: u32) -> PyResult<(bool, u64, Vec<PyChange<'py>>)> {
        use kvtier_core::service::{TIER_DRAM, TIER_NVME};
        let reply = py.detach(|| self.inner.lock().changes(cursor, max)).map_err(to_py)?;
        let tier_name = |tier: u8| match tier {
            TIER_DRAM => "dram",
            TIER_NVME => "nvme",
            _ => "shared",
        };
        let changes =
            reply.changes.iter().map(|c| (PyBytes::new(py, &c.key.0), tier_name(c.tier), c.removed)).collect();
        Ok((reply.reset, reply.next, changes))
    }

    /// The per-engine counters of namespace `digest` (64 hex digits): `[(label, {name: int})]`,
    /// sorted by label (no hello needed).
    fn engines<'py>(&self, py: Python<'py>, digest: &str) -> PyResult<Vec<(String, Bound<'py, PyDict>)>> {
        let digest = parse_digest(digest)?;
        let engines = py.detach(|| self.inner.lock().engines(&digest)).map_err(to_py)?;
        engines
            .into_iter()
            .map(|(label, pairs)| {
                let d = PyDict::new(py);
                for (name, value) in pairs {
                    d.set_item(name, value)?;
                }
                Ok((label, d))
            })
            .collect()
    }

    /// Every namespace the service has open (protocol version 2, no hello needed):
    /// `{"protocol_version": int, "namespaces": [{"digest", "description", "tp_size", "slice_bytes",
    /// "object_bytes", "values": {name: int}}]}`.
    fn namespaces<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (version, list) = py.detach(|| self.inner.lock().namespaces()).map_err(to_py)?;
        let out = PyDict::new(py);
        out.set_item("protocol_version", version)?;
        let items = PyList::empty(py);
        for ns in list {
            let d = PyDict::new(py);
            d.set_item("digest", hex(&ns.digest))?;
            d.set_item("description", PyBytes::new(py, &ns.description))?;
            d.set_item("tp_size", ns.tp_size)?;
            d.set_item("slice_bytes", ns.slice_bytes)?;
            d.set_item("object_bytes", ns.object_bytes)?;
            let values = PyDict::new(py);
            for (name, value) in ns.values {
                values.set_item(name, value)?;
            }
            d.set_item("values", values)?;
            items.append(d)?;
        }
        out.set_item("namespaces", items)?;
        Ok(out)
    }

    /// One step of a scrub of the namespace `digest` (64 hex digits) in the service; `shared_tier`:
    /// of its shared tier.
    #[pyo3(signature = (digest, after, max_blocks, max_bytes_per_s, shared_tier=false))]
    fn verify_batch<'py>(
        &self,
        py: Python<'py>,
        digest: &str,
        after: u64,
        max_blocks: u32,
        max_bytes_per_s: u64,
        shared_tier: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let digest = parse_digest(digest)?;
        let b = py
            .detach(|| self.inner.lock().verify_batch(&digest, after, max_blocks, max_bytes_per_s, shared_tier))
            .map_err(to_py)?;
        let bad = b
            .bad
            .iter()
            .map(|x| (x.key.0, tier_name(x.tier).unwrap_or("?"), x.quarantined, x.reason.clone()))
            .collect();
        verify_dict(py, b.next_after, b.done, b.values, bad)
    }

    /// Trims the namespace `digest` in the service: `mode` "all", "older_than" (ms) or "nvme_to" (bytes).
    fn trim<'py>(&self, py: Python<'py>, digest: &str, mode: &str, value: u64) -> PyResult<Bound<'py, PyDict>> {
        let digest = parse_digest(digest)?;
        let code = match mode {
            "all" => 0,
            "older_than" => 1,
            "nvme_to" => 2,
            other => {
                return Err(PyValueError::new_err(format!(
                    "trim mode {other:?} is unknown; choose \"all\", \"older_than\" or \"nvme_to\""
                )))
            }
        };
        let pairs = py.detach(|| self.inner.lock().trim(&digest, code, value)).map_err(to_py)?;
        let d = PyDict::new(py);
        for (name, value) in pairs {
            d.set_item(name, value)?;
        }
        Ok(d)
    }

    /// The namespace's pool as mapped in this process, for a caller that copies itself (the GPU
    /// path): `{"address", "bytes", "slot_bytes", "slot_count", "object_bytes", "slice_bytes",
    /// "placement_runs": [(slice_offset, object_offset, len)]}` (runs merged where they continue).
    fn pool<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let span = py.detach(|| {
            let client = self.inner.lock();
            client.attached().cloned().zip(client.pool_span())
        });
        let (attached, (address, bytes)) = span.ok_or_else(|| PyValueError::new_err("call hello() first"))?;
        let d = PyDict::new(py);
        d.set_item("address", address)?;
        d.set_item("bytes", bytes)?;
        d.set_item("slot_bytes", attached.slot_bytes)?;
        d.set_item("slot_count", attached.slot_count)?;
        d.set_item("object_bytes", attached.object_bytes)?;
        d.set_item("slice_bytes", attached.slice_bytes)?;
        let runs: Vec<(usize, usize, usize)> =
            attached.placement.runs().iter().map(|r| (r.slice_offset, r.object_offset, r.len)).collect();
        d.set_item("placement_runs", runs)?;
        Ok(d)
    }

    /// Reserves a slot per block for this rank's slice: per key `("fill", object_offset)` (copy the
    /// slice to pool address + offset by the placement, then `commit_many` or `abort_many`),
    /// `("present", None)`, `("dropped", None)` or `("retry", None)` (no room now: commit, then
    /// reserve again).
    fn reserve_many(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<(&'static str, Option<usize>)>> {
        let keys = parse_keys(keys)?;
        let replies = py.detach(|| self.inner.lock().reserve(&keys)).map_err(to_py)?;
        Ok(replies
            .into_iter()
            .map(|reply| match reply {
                ReserveReply::Fill { object_offset } => ("fill", Some(object_offset)),
                ReserveReply::Present => ("present", None),
                ReserveReply::Dropped => ("dropped", None),
                ReserveReply::Retry => ("retry", None),
            })
            .collect())
    }

    /// Commits this rank's copies of reserved blocks: `True` per slice accepted.
    fn commit_many(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        let keys = parse_keys(keys)?;
        py.detach(|| self.inner.lock().commit(&keys)).map_err(to_py)
    }

    /// Gives reserved slots back unfilled (the copy failed).
    fn abort_many(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        let keys = parse_keys(keys)?;
        py.detach(|| self.inner.lock().abort(&keys)).map_err(to_py)
    }

    /// Makes blocks resident and verified and pins them for this connection: per key the offset of
    /// its object in the pool, or None for a miss. Copy out, then `release_many`.
    fn acquire_many(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<Option<usize>>> {
        let keys = parse_keys(keys)?;
        py.detach(|| self.inner.lock().acquire(&keys)).map_err(to_py)
    }

    fn release_many(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        let keys = parse_keys(keys)?;
        py.detach(|| self.inner.lock().release(&keys)).map_err(to_py)
    }

    /// Stores this rank's slice of blocks straight from the engine's layer buffers into the pool:
    /// `True` per block accepted or already stored. `gate`: another thread may give the store up
    /// (`CopyGate.cancel`); no copy from the buffers starts after that.
    #[pyo3(signature = (keys, layers, block_ids, gate = None))]
    fn store_blocks(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        layers: &Bound<'_, PyAny>,
        block_ids: &Bound<'_, PyAny>,
        gate: Option<&PyCopyGate>,
    ) -> PyResult<Vec<bool>> {
        self.move_blocks(py, (keys, layers, block_ids), false, gate)
    }

    /// Loads this rank's slice of blocks from the pool into the engine's layer buffers: `True` per
    /// block loaded (verified by the service when it came from storage). `gate`: another thread may
    /// give the load up (`CopyGate.cancel`); no copy into the buffers starts after that.
    #[pyo3(signature = (keys, layers, block_ids, gate = None))]
    fn load_blocks(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        layers: &Bound<'_, PyAny>,
        block_ids: &Bound<'_, PyAny>,
        gate: Option<&PyCopyGate>,
    ) -> PyResult<Vec<bool>> {
        self.move_blocks(py, (keys, layers, block_ids), true, gate)
    }
}

/// One transfer's gate (`kvtier_core::service::CopyGate`): the job thread passes it to
/// `load_blocks`/`store_blocks`; another thread gives the transfer up with `cancel`.
#[pyclass(name = "CopyGate", module = "kvtier._core", frozen)]
pub(crate) struct PyCopyGate {
    inner: Arc<CopyGate>,
}

#[pymethods]
impl PyCopyGate {
    #[new]
    fn new() -> Self {
        PyCopyGate { inner: Arc::new(CopyGate::new()) }
    }

    /// Gives the transfer up unless a copy runs now: True once no copy of it will run from now on;
    /// False while one runs (it is short: ask again).
    fn cancel(&self) -> bool {
        self.inner.cancel()
    }

    #[getter]
    fn cancelled(&self) -> bool {
        self.inner.is_cancelled()
    }

    /// Rounds copied so far (a transfer that makes none is stalled, not long).
    #[getter]
    fn rounds(&self) -> u64 {
        self.inner.rounds()
    }
}

impl PyServiceClient {
    /// `what`: the keys, the layer buffers and the engine block ids.
    fn move_blocks(
        &self,
        py: Python<'_>,
        what: (&Bound<'_, PyAny>, &Bound<'_, PyAny>, &Bound<'_, PyAny>),
        load: bool,
        gate: Option<&PyCopyGate>,
    ) -> PyResult<Vec<bool>> {
        let (keys, layers, block_ids) = what;
        let keys = parse_keys(keys)?;
        let slice_bytes = py
            .detach(|| self.inner.lock().attached().map(|a| a.slice_bytes))
            .ok_or_else(|| PyValueError::new_err("call hello() first"))?;
        let mut held = Vec::new();
        let bufs = parse_layer_blocks(slice_bytes, layers, block_ids, load, &mut held)?;
        let gate = gate.map_or_else(|| Arc::new(CopyGate::new()), |g| Arc::clone(&g.inner));
        // SAFETY: `held` keeps every buffer alive across the call; load buffers were requested
        // writable. A caller that cancels the gate stops relying on them only once cancel said so.
        let r = py.detach(|| unsafe {
            let mut client = self.inner.lock();
            if load {
                client.load_blocks_gated(&keys, &bufs, &gate)
            } else {
                client.store_blocks_gated(&keys, &bufs, &gate)
            }
        });
        drop(held);
        r.map_err(to_py)
    }
}

/// One change of `ServiceClient.changes`: `(key, tier name, removed)`.
type PyChange<'py> = (Bound<'py, PyBytes>, &'static str, bool);
