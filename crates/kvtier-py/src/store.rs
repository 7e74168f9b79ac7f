//! `kvtier._core.Store`: a store opened in this process. Every data call parses its keys and
//! buffers, holds the buffers, runs without the GIL and releases them (`transfer`, `submit`).

use crate::convert::{
    parse_buffers, parse_config, parse_keys, parse_layer_blocks, parse_tenant, to_py, verify_dict, Held,
};
use kvtier_core::{BlockBuffer, BlockKey, Job, JobKind, Store};
use parking_lot::Mutex;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

#[pyclass(name = "Store", module = "kvtier._core", frozen)]
pub(crate) struct PyStore {
    inner: Arc<Store>,
    /// Buffers of asynchronous jobs in flight, released when the job is reported.
    held: Mutex<HashMap<u64, Vec<Held>>>,
}

/// Where a data call's blocks are in memory: one buffer (or list of segments) per key, or the
/// engine's layer buffers and block ids.
enum Buffers<'a, 'py> {
    Objects(&'a Bound<'py, PyAny>),
    Layers(&'a Bound<'py, PyAny>, &'a Bound<'py, PyAny>),
}

impl PyStore {
    /// The keys and the blocks' memory of a data call, borrowed writable for a get; `Held` keeps
    /// the memory alive until it is dropped.
    fn parse_call(
        &self,
        kind: JobKind,
        keys: &Bound<'_, PyAny>,
        buffers: Buffers<'_, '_>,
    ) -> PyResult<(Vec<BlockKey>, Vec<BlockBuffer>, Vec<Held>)> {
        let keys = parse_keys(keys)?;
        let writable = kind == JobKind::Get;
        let mut held = Vec::new();
        let bufs = match buffers {
            Buffers::Objects(buffers) => parse_buffers(buffers, writable, &mut held)?,
            Buffers::Layers(layers, block_ids) => {
                parse_layer_blocks(self.inner.object_bytes(), layers, block_ids, writable, &mut held)?
            }
        };
        Ok((keys, bufs, held))
    }

    /// A put or get that returns when it is done, without the GIL meanwhile.
    fn transfer(
        &self,
        py: Python<'_>,
        kind: JobKind,
        keys: &Bound<'_, PyAny>,
        buffers: Buffers<'_, '_>,
    ) -> PyResult<Vec<bool>> {
        let (keys, bufs, held) = self.parse_call(kind, keys, buffers)?;
        let inner = Arc::clone(&self.inner);
        // SAFETY: `held` keeps every buffer alive across the call; a get's were requested writable.
        let r = py.detach(move || unsafe {
            match kind {
                JobKind::Put => inner.put_raw(&keys, &bufs),
                JobKind::Get => inner.get_raw(&keys, &bufs),
            }
        });
        drop(held);
        r.map_err(to_py)
    }

    /// A put or get queued as job `job_id`, reported by `poll` or `wait`.
    fn submit(
        &self,
        py: Python<'_>,
        job_id: u64,
        kind: JobKind,
        keys: &Bound<'_, PyAny>,
        buffers: Buffers<'_, '_>,
    ) -> PyResult<()> {
        let (keys, bufs, held) = self.parse_call(kind, keys, buffers)?;
        self.submit_job(py, job_id, kind, keys, bufs, held)
    }

    fn submit_job(
        &self,
        py: Python<'_>,
        job_id: u64,
        kind: JobKind,
        keys: Vec<BlockKey>,
        buffers: Vec<BlockBuffer>,
        held: Vec<Held>,
    ) -> PyResult<()> {
        {
            let mut map = self.held.lock();
            if map.contains_key(&job_id) {
                return Err(PyValueError::new_err(format!(
                    "job_id {job_id} is already in flight; use a new id per job"
                )));
            }
            map.insert(job_id, held);
        }
        let job = Job { id: job_id, kind, keys, buffers };
        let inner = Arc::clone(&self.inner);
        // SAFETY: the buffers are held in `self.held` until the job is reported by poll/wait.
        let r = py.detach(move || unsafe { inner.submit(job) });
        if let Err(e) = r {
            self.held.lock().remove(&job_id);
            return Err(to_py(e));
        }
        Ok(())
    }
}

#[pymethods]
impl PyStore {
    /// Opens (or creates) a store. See docs/configuration.md for the options.
    #[staticmethod]
    #[pyo3(signature = (path, **options))]
    fn open(py: Python<'_>, path: &Bound<'_, PyAny>, options: Option<&Bound<'_, PyDict>>) -> PyResult<PyStore> {
        let config = parse_config(path, options)?;
        let store = py.detach(move || Store::open(config)).map_err(to_py)?;
        Ok(PyStore { inner: Arc::new(store), held: Mutex::new(HashMap::new()) })
    }

    #[getter]
    fn object_bytes(&self) -> usize {
        self.inner.object_bytes()
    }

    #[getter]
    fn namespace_hex(&self) -> String {
        self.inner.namespace().hex()
    }

    fn put_many(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, buffers: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        self.transfer(py, JobKind::Put, keys, Buffers::Objects(buffers))
    }

    fn get_many(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, buffers: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        self.transfer(py, JobKind::Get, keys, Buffers::Objects(buffers))
    }

    fn put_blocks(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        layers: &Bound<'_, PyAny>,
        block_ids: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<bool>> {
        self.transfer(py, JobKind::Put, keys, Buffers::Layers(layers, block_ids))
    }

    fn get_blocks(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        layers: &Bound<'_, PyAny>,
        block_ids: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<bool>> {
        self.transfer(py, JobKind::Get, keys, Buffers::Layers(layers, block_ids))
    }

    fn submit_put(
        &self,
        py: Python<'_>,
        job_id: u64,
        keys: &Bound<'_, PyAny>,
        buffers: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.submit(py, job_id, JobKind::Put, keys, Buffers::Objects(buffers))
    }

    fn submit_get(
        &self,
        py: Python<'_>,
        job_id: u64,
        keys: &Bound<'_, PyAny>,
        buffers: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.submit(py, job_id, JobKind::Get, keys, Buffers::Objects(buffers))
    }

    fn submit_put_blocks(
        &self,
        py: Python<'_>,
        job_id: u64,
        keys: &Bound<'_, PyAny>,
        layers: &Bound<'_, PyAny>,
        block_ids: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.submit(py, job_id, JobKind::Put, keys, Buffers::Layers(layers, block_ids))
    }

    fn submit_get_blocks(
        &self,
        py: Python<'_>,
        job_id: u64,
        keys: &Bound<'_, PyAny>,
        layers: &Bound<'_, PyAny>,
        block_ids: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.submit(py, job_id, JobKind::Get, keys, Buffers::Layers(layers, block_ids))
    }

    /// Jobs finished since the last poll: list of (job_id, list[bool]).
    fn poll(&self) -> Vec<(u64, Vec<bool>)> {
        let done = self.inner.poll();
        let mut held = self.held.lock();
        for (id, _) in &done {
            held.remove(id);
        }
        done
    }

    #[pyo3(signature = (job_id, timeout_ms=None))]
    fn wait(&self, py: Python<'_>, job_id: u64, timeout_ms: Option<u64>) -> PyResult<Vec<bool>> {
        if !self.held.lock().contains_key(&job_id) {
            return Err(PyValueError::new_err(format!(
                "job_id {job_id} is not in flight (already reported, or never submitted)"
            )));
        }
        let inner = Arc::clone(&self.inner);
        let r = py.detach(move || inner.wait(job_id, timeout_ms.map(Duration::from_millis)));
        if r.is_ok() {
            self.held.lock().remove(&job_id);
        }
        r.map_err(to_py)
    }

    fn lookup_prefix(&self, keys: &Bound<'_, PyAny>) -> PyResult<usize> {
        Ok(self.inner.lookup_prefix(&parse_keys(keys)?))
    }

    fn contains_many(&self, keys: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        Ok(self.inner.contains_many(&parse_keys(keys)?))
    }

    /// Per key: "dram", "nvme", "shared" (the tier it would be served from) or None.
    fn locate_many(&self, keys: &Bound<'_, PyAny>) -> PyResult<Vec<Option<&'static str>>> {
        Ok(self.inner.locate_many(&parse_keys(keys)?).into_iter().map(|t| t.map(|t| t.name())).collect())
    }

    fn pin_many(&self, keys: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        Ok(self.inner.pin_prefix(&parse_keys(keys)?))
    }

    fn unpin_many(&self, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        self.inner.unpin(&parse_keys(keys)?);
        Ok(())
    }

    /// The blocks are the tenant's (`tenant_id(cache_salt)`): charged to its share of the DRAM pool.
    fn assign_tenant(&self, keys: &Bound<'_, PyAny>, tenant: &[u8]) -> PyResult<()> {
        self.inner.assign_tenant(&parse_keys(keys)?, &parse_tenant(tenant)?);
        Ok(())
    }

    /// The blocks will be read again (a request's retention hint): evidence of reuse for writes below DRAM.
    fn note_retained(&self, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        self.inner.note_retained(&parse_keys(keys)?);
        Ok(())
    }

    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let inner = Arc::clone(&self.inner);
        py.detach(move || inner.flush()).map_err(to_py)
    }

    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let inner = Arc::clone(&self.inner);
        let r = py.detach(move || inner.close());
        self.held.lock().clear();
        r.map_err(to_py)
    }

    /// One step of a scrub (`kvtier verify`): re-reads and checks up to `max_blocks` blocks above
    /// sequence `after`, paced to `max_bytes_per_s` (0: unpaced), and quarantines bad copies.
    /// `shared_tier`: the shared tier's blocks instead, `after` a position in its key order.
    #[pyo3(signature = (after=0, max_blocks=256, max_bytes_per_s=0, shared_tier=false))]
    fn verify_batch<'py>(
        &self,
        py: Python<'py>,
        after: u64,
        max_blocks: usize,
        max_bytes_per_s: u64,
        shared_tier: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let inner = Arc::clone(&self.inner);
        let b = py
            .detach(move || {
                if shared_tier {
                    inner.verify_shared_batch(after, max_blocks, max_bytes_per_s)
                } else {
                    inner.verify_batch(after, max_blocks, max_bytes_per_s)
                }
            })
            .map_err(to_py)?;
        let pairs = [
            ("checked_dram", b.checked_dram),
            ("checked_nvme", b.checked_nvme),
            ("bad_dram", b.bad_dram),
            ("bad_nvme", b.bad_nvme),
            ("bytes_read", b.bytes_read),
            ("skipped_busy", b.skipped_busy),
            ("remaining_blocks", b.remaining_blocks),
            ("newest_sequence", b.newest_sequence),
            ("pace_wait_ms", b.pace_wait_ms),
        ];
        let bad = b.bad.iter().map(|x| (x.key.0, x.tier.name(), x.quarantined, x.reason.clone())).collect();
        verify_dict(py, b.next_after, b.done, pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect(), bad)
    }

    /// Removes blocks nobody uses (`kvtier trim`): `mode` "all", "older_than" (`value` ms) or
    /// "nvme_to" (`value` bytes: oldest whole regions until the NVMe tier uses at most that).
    fn trim<'py>(&self, py: Python<'py>, mode: &str, value: u64) -> PyResult<Bound<'py, PyDict>> {
        let request = match mode {
            "all" => kvtier_core::TrimRequest::All,
            "older_than" => kvtier_core::TrimRequest::OlderThan(Duration::from_millis(value)),
            "nvme_to" => kvtier_core::TrimRequest::NvmeTo(value),
            other => {
                return Err(PyValueError::new_err(format!(
                    "trim mode {other:?} is unknown; choose \"all\", \"older_than\" or \"nvme_to\""
                )))
            }
        };
        let inner = Arc::clone(&self.inner);
        let c = py.detach(move || inner.trim(request)).map_err(to_py)?;
        let d = PyDict::new(py);
        d.set_item("dram_blocks", c.dram_blocks)?;
        d.set_item("dram_bytes", c.dram_bytes)?;
        d.set_item("nvme_blocks", c.nvme_blocks)?;
        d.set_item("nvme_bytes", c.nvme_bytes)?;
        d.set_item("regions_freed", c.regions_freed)?;
        d.set_item("skipped_in_use", c.skipped_in_use)?;
        Ok(d)
    }

    /// Block count and dates of the namespace (`kvtier inspect`).
    fn namespace_facts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let f = self.inner.namespace_facts();
        let d = PyDict::new(py);
        d.set_item("blocks", f.visible_blocks)?;
        d.set_item("oldest_block_unix_ms", f.oldest_unix_ms)?;
        d.set_item("newest_block_unix_ms", f.newest_unix_ms)?;
        d.set_item("oldest_block_before_open", u64::from(f.oldest_before_open))?;
        d.set_item("newest_block_before_open", u64::from(f.newest_before_open))?;
        d.set_item("opened_unix_ms", f.opened_unix_ms)?;
        d.set_item("nvme_write_backlog_bytes", f.write_backlog_bytes)?;
        Ok(d)
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        for (name, value) in s.counters.fields() {
            d.set_item(name, value)?;
        }
        for (name, value) in s.gauges.fields() {
            d.set_item(name, value)?;
        }
        d.set_item("io_engine", s.io_engine)?;
        d.set_item("direct_io", s.direct_io)?;
        d.set_item("buffers_registered", s.buffers_registered)?;
        d.set_item("huge_pages", s.huge_pages)?;
        d.set_item("namespace", s.namespace_hex)?;
        for (name, value) in s.tenant_fields {
            d.set_item(name, value)?;
        }
        Ok(d)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _t: &Bound<'_, PyAny>,
        _v: &Bound<'_, PyAny>,
        _tb: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }
}
