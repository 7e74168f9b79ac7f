//! Python binding of the kvtier core (`kvtier._core`). Owns the translation between Python objects
//! and the core's types: option parsing with the option's name in every error, buffer-protocol
//! access without copies (held until a job finishes), typed exceptions, and releasing the GIL
//! during I/O.

use kvtier_core::service::{Client, CopyGate, PlacementRun, ReserveReply, Service, ServiceConfig};
use kvtier_core::{
    find_option, unknown_option_message, BlockBuffer, BlockKey, ConfigOption, Error, Job, JobKind, OptionKind,
    OptionValue, Store, StoreConfig, OPTIONS,
};
use parking_lot::Mutex;
use pyo3::exceptions::PyValueError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Raises the exception class of `kvtier.errors` that mirrors the core error kind.
fn to_py(err: Error) -> PyErr {
    let class = match &err {
        Error::Config { .. } => "ConfigError",
        Error::Io { .. } => "IoError",
        Error::Format { .. } => "FormatError",
        Error::Namespace { .. } => "NamespaceError",
        Error::Capacity { .. } => "CapacityError",
        Error::Locked { .. } => "LockedError",
        Error::Closed => "ClosedError",
        Error::Timeout { .. } => "TimeoutError",
        Error::Service { .. } => "ServiceError",
    };
    let message = err.to_string();
    Python::attach(|py| match py.import("kvtier.errors").and_then(|m| m.getattr(class)) {
        Ok(cls) => match cls.call1((message.clone(),)) {
            Ok(instance) => PyErr::from_value(instance),
            Err(e) => e,
        },
        Err(_) => PyValueError::new_err(message),
    })
}

fn config_error(option: &str, message: impl Into<String>) -> PyErr {
    let message = format!("invalid option `{option}`: {}", message.into());
    Python::attach(|py| match py.import("kvtier.errors").and_then(|m| m.getattr("ConfigError")) {
        Ok(cls) => match cls.call1((message.clone(),)) {
            Ok(instance) => PyErr::from_value(instance),
            Err(e) => e,
        },
        Err(_) => PyValueError::new_err(message),
    })
}

/// A Python buffer (or CPU tensor) kept alive while the core uses its memory.
enum Held {
    View(Box<ffi::Py_buffer>),
    Object(#[allow(dead_code)] Py<PyAny>),
}

// SAFETY: the Py_buffer is only released with the GIL held (Drop attaches).
unsafe impl Send for Held {}
unsafe impl Sync for Held {}

impl Drop for Held {
    fn drop(&mut self) {
        if let Held::View(view) = self {
            Python::attach(|_| unsafe { ffi::PyBuffer_Release(&mut **view) });
        }
    }
}

/// Borrows contiguous memory from `obj`: the buffer protocol first, then torch-style CPU tensors.
fn borrow_memory(obj: &Bound<'_, PyAny>, writable: bool, what: &str) -> PyResult<(*mut u8, usize, Held)> {
    let mut view: Box<ffi::Py_buffer> = Box::new(unsafe { std::mem::zeroed() });
    let flags = ffi::PyBUF_ND | if writable { ffi::PyBUF_WRITABLE } else { 0 };
    // SAFETY: view is a valid, zeroed Py_buffer; released in Held's Drop on success.
    let rc = unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), &mut *view, flags) };
    if rc == 0 {
        let ptr = view.buf as *mut u8;
        let len = view.len as usize;
        return Ok((ptr, len, Held::View(view)));
    }
    let buffer_err = PyErr::fetch(obj.py());
    if obj.hasattr("data_ptr")? && obj.hasattr("is_contiguous")? {
        let device = obj.getattr("device")?.getattr("type")?.extract::<String>()?;
        if device != "cpu" {
            return Err(PyValueError::new_err(format!(
                "{what}: tensor on device {device}; kvtier reads and writes host memory, pass CPU tensors"
            )));
        }
        if !obj.call_method0("is_contiguous")?.extract::<bool>()? {
            return Err(PyValueError::new_err(format!("{what}: tensor is not contiguous; call .contiguous() first")));
        }
        let ptr = obj.call_method0("data_ptr")?.extract::<usize>()? as *mut u8;
        let len = obj.getattr("nbytes")?.extract::<usize>()?;
        return Ok((ptr, len, Held::Object(obj.clone().unbind())));
    }
    Err(PyValueError::new_err(format!(
        "{what}: expected a C-contiguous {}buffer (numpy array, memoryview, bytearray, CPU tensor): {buffer_err}",
        if writable { "writable " } else { "" }
    )))
}

fn parse_keys(keys: &Bound<'_, PyAny>) -> PyResult<Vec<BlockKey>> {
    let mut out = Vec::new();
    for item in keys.try_iter()? {
        let item = item?;
        let bytes: &[u8] =
            item.cast::<PyBytes>().map_err(|_| PyValueError::new_err("keys: each key must be bytes"))?.as_bytes();
        out.push(BlockKey::from_slice(bytes).ok_or_else(|| {
            PyValueError::new_err(format!("keys: a key has {} bytes; keys are 32-byte block hashes", bytes.len()))
        })?);
    }
    Ok(out)
}

/// One buffer per key: a buffer, or a list/tuple of buffers (segments in order).
fn parse_buffers(buffers: &Bound<'_, PyAny>, writable: bool, held: &mut Vec<Held>) -> PyResult<Vec<BlockBuffer>> {
    let mut out = Vec::new();
    for (i, item) in buffers.try_iter()?.enumerate() {
        let item = item?;
        let what = format!("buffers[{i}]");
        let mut segments = Vec::new();
        if item.is_instance_of::<PyList>() || item.is_instance_of::<PyTuple>() {
            for seg in item.try_iter()? {
                let (ptr, len, h) = borrow_memory(&seg?, writable, &what)?;
                segments.push((ptr, len));
                held.push(h);
            }
        } else {
            let (ptr, len, h) = borrow_memory(&item, writable, &what)?;
            segments.push((ptr, len));
            held.push(h);
        }
        out.push(BlockBuffer { segments });
    }
    Ok(out)
}

/// Engine layout: each block object is that block's page in every layer, in layer order.
fn parse_layer_blocks(
    object_bytes: usize,
    layers: &Bound<'_, PyAny>,
    block_ids: &Bound<'_, PyAny>,
    writable: bool,
    held: &mut Vec<Held>,
) -> PyResult<Vec<BlockBuffer>> {
    let mut bases = Vec::new();
    for (i, layer) in layers.try_iter()?.enumerate() {
        let (ptr, len, h) = borrow_memory(&layer?, writable, &format!("layers[{i}]"))?;
        bases.push((ptr, len));
        held.push(h);
    }
    if bases.is_empty() || !object_bytes.is_multiple_of(bases.len()) {
        return Err(PyValueError::new_err(format!(
            "layers: {} layers do not divide object_bytes={object_bytes}; object_bytes must be layers * page_bytes",
            bases.len()
        )));
    }
    let page_bytes = object_bytes / bases.len();
    let mut out = Vec::new();
    for id in block_ids.try_iter()? {
        out.push(layer_pages(&bases, page_bytes, &id?)?);
    }
    Ok(out)
}

/// Block `id`'s page in every layer, or a ValueError naming the id and the valid range. Every block id
/// from Python goes through here: its page must lie wholly inside each layer buffer, checked without
/// overflow (`BlockBuffer::layer_page_offset`), since the copies that follow trust the pointers.
fn layer_pages(bases: &[(*mut u8, usize)], page_bytes: usize, id: &Bound<'_, PyAny>) -> PyResult<BlockBuffer> {
    let bad = |what: String| {
        let blocks = bases.iter().map(|&(_, len)| len.checked_div(page_bytes).unwrap_or(0)).min().unwrap_or(0);
        PyValueError::new_err(format!(
            "block_ids: {what}; valid ids are the integers in range({blocks}) ({page_bytes} bytes per block in each \
             layer buffer): pass the engine's block ids for these buffers"
        ))
    };
    // A negative or huge Python int (or no integer at all) is no block id: the same ValueError, not the
    // OverflowError or TypeError of the conversion.
    let block: usize = id.extract().map_err(|_| {
        let shown = id.repr().map_or_else(|_| "?".to_string(), |r| r.to_string());
        bad(format!("{shown} is not a block id"))
    })?;
    let mut segments = Vec::with_capacity(bases.len());
    for (layer, &(base, len)) in bases.iter().enumerate() {
        let start = BlockBuffer::layer_page_offset(block, page_bytes, len)
            .ok_or_else(|| bad(format!("block {block} is outside layers[{layer}] ({len} bytes)")))?;
        // SAFETY: `start + page_bytes <= len`, checked without overflow: the page is inside the buffer.
        segments.push((unsafe { base.add(start) }, page_bytes));
    }
    Ok(BlockBuffer { segments })
}

fn parse_paths(path: &Bound<'_, PyAny>) -> PyResult<Vec<PathBuf>> {
    if path.is_instance_of::<PyList>() || path.is_instance_of::<PyTuple>() {
        path.try_iter()?.map(|p| p?.extract::<PathBuf>()).collect()
    } else {
        Ok(vec![path
            .extract::<PathBuf>()
            .map_err(|_| config_error("path", "must be a str or os.PathLike, or a list of them"))?])
    }
}

/// Converts a Python value to the option's kind; the error names the option and the expected type.
fn option_value(option: &ConfigOption, value: &Bound<'_, PyAny>) -> PyResult<OptionValue> {
    let wrong = || config_error(option.name, format!("expected {}, got {value}", option.kind.expected()));
    Ok(match option.kind {
        OptionKind::Int | OptionKind::Size => OptionValue::Int(value.extract::<u64>().map_err(|_| wrong())?),
        OptionKind::Float => OptionValue::Float(value.extract::<f64>().map_err(|_| wrong())?),
        OptionKind::Bool => OptionValue::Bool(value.extract::<bool>().map_err(|_| wrong())?),
        OptionKind::Path => OptionValue::Path(value.extract::<PathBuf>().map_err(|_| wrong())?),
        OptionKind::BytesOrStr => OptionValue::Bytes(if let Ok(b) = value.cast::<PyBytes>() {
            b.as_bytes().to_vec()
        } else {
            value.extract::<String>().map_err(|_| wrong())?.into_bytes()
        }),
        OptionKind::Choice(choices) => match value.extract::<String>() {
            Ok(s) if choices.contains(&s.as_str()) => OptionValue::Str(s),
            _ => return Err(wrong()),
        },
    })
}

/// `Store.open`'s keyword options, each looked up in the core's option table (`kvtier_core::OPTIONS`)
/// and applied by its setter; ranges are checked later by `StoreConfig::validate`.
fn parse_config(path: &Bound<'_, PyAny>, options: Option<&Bound<'_, PyDict>>) -> PyResult<StoreConfig> {
    let paths = parse_paths(path)?;
    let mut config = StoreConfig::new(paths[0].clone(), 0);
    config.paths = paths;
    let Some(options) = options else {
        return Err(config_error("object_bytes", "required: the bytes of one block object"));
    };
    for (name, value) in options.iter() {
        let name: String = name.extract()?;
        let option = match find_option(&name) {
            Some(option) if option.python => option,
            Some(option) => {
                return Err(config_error(
                    &name,
                    format!(
                        "settable from Rust only (`StoreConfig::{}`); from Python it keeps its default",
                        option.field
                    ),
                ))
            }
            None => return Err(config_error(&name, unknown_option_message(&name))),
        };
        let value = option_value(option, &value)?;
        option.apply(&mut config, value).map_err(to_py)?;
    }
    if config.object_bytes == 0 && !options.contains("object_bytes")? {
        return Err(config_error("object_bytes", "required: the bytes of one block object"));
    }
    Ok(config)
}

/// The option table as a list of dicts: name, kind, default (typed; None when required or automatic),
/// default_text (as the docs show it), choices, constraint, description, field (Rust), python
/// (settable from Python). Only Python-settable options unless `include_rust_only`.
#[pyfunction]
#[pyo3(signature = (include_rust_only=false))]
fn options(py: Python<'_>, include_rust_only: bool) -> PyResult<Vec<Bound<'_, PyDict>>> {
    let mut out = Vec::new();
    for option in OPTIONS.iter().filter(|o| o.python || include_rust_only) {
        let d = PyDict::new(py);
        d.set_item("name", option.name)?;
        d.set_item("kind", option.kind.name())?;
        let default: Option<Bound<'_, PyAny>> = match option.default_value() {
            None => None,
            Some(OptionValue::Int(v)) => Some(v.into_pyobject(py)?.into_any()),
            Some(OptionValue::Float(v)) => Some(v.into_pyobject(py)?.into_any()),
            Some(OptionValue::Bool(v)) => Some(v.into_pyobject(py)?.to_owned().into_any()),
            Some(OptionValue::Path(v)) => Some(v.to_string_lossy().into_owned().into_pyobject(py)?.into_any()),
            Some(OptionValue::Bytes(v)) => Some(PyBytes::new(py, &v).into_any()),
            Some(OptionValue::Str(v)) => Some(v.into_pyobject(py)?.into_any()),
        };
        d.set_item("default", default)?;
        d.set_item("default_text", option.default_text())?;
        d.set_item("choices", option.kind.choices().to_vec())?;
        d.set_item("constraint", option.constraint)?;
        d.set_item("description", option.description)?;
        d.set_item("field", option.field)?;
        d.set_item("python", option.python)?;
        out.push(d);
    }
    Ok(out)
}

#[pyclass(name = "Store", module = "kvtier._core", frozen)]
struct PyStore {
    inner: Arc<Store>,
    /// Buffers of asynchronous jobs in flight, released when the job is reported.
    held: Mutex<HashMap<u64, Vec<Held>>>,
}

impl PyStore {
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
        let keys = parse_keys(keys)?;
        let mut held = Vec::new();
        let bufs = parse_buffers(buffers, false, &mut held)?;
        let inner = Arc::clone(&self.inner);
        // SAFETY: `held` keeps every buffer alive across the call.
        let r = py.detach(move || unsafe { inner.put_raw(&keys, &bufs) });
        drop(held);
        r.map_err(to_py)
    }

    fn get_many(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, buffers: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        let keys = parse_keys(keys)?;
        let mut held = Vec::new();
        let bufs = parse_buffers(buffers, true, &mut held)?;
        let inner = Arc::clone(&self.inner);
        // SAFETY: as above; the buffers were requested writable.
        let r = py.detach(move || unsafe { inner.get_raw(&keys, &bufs) });
        drop(held);
        r.map_err(to_py)
    }

    fn put_blocks(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        layers: &Bound<'_, PyAny>,
        block_ids: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<bool>> {
        let keys = parse_keys(keys)?;
        let mut held = Vec::new();
        let bufs = parse_layer_blocks(self.inner.object_bytes(), layers, block_ids, false, &mut held)?;
        let inner = Arc::clone(&self.inner);
        let r = py.detach(move || unsafe { inner.put_raw(&keys, &bufs) });
        drop(held);
        r.map_err(to_py)
    }

    fn get_blocks(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        layers: &Bound<'_, PyAny>,
        block_ids: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<bool>> {
        let keys = parse_keys(keys)?;
        let mut held = Vec::new();
        let bufs = parse_layer_blocks(self.inner.object_bytes(), layers, block_ids, true, &mut held)?;
        let inner = Arc::clone(&self.inner);
        let r = py.detach(move || unsafe { inner.get_raw(&keys, &bufs) });
        drop(held);
        r.map_err(to_py)
    }

    fn submit_put(
        &self,
        py: Python<'_>,
        job_id: u64,
        keys: &Bound<'_, PyAny>,
        buffers: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let keys = parse_keys(keys)?;
        let mut held = Vec::new();
        let bufs = parse_buffers(buffers, false, &mut held)?;
        self.submit_job(py, job_id, JobKind::Put, keys, bufs, held)
    }

    fn submit_get(
        &self,
        py: Python<'_>,
        job_id: u64,
        keys: &Bound<'_, PyAny>,
        buffers: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let keys = parse_keys(keys)?;
        let mut held = Vec::new();
        let bufs = parse_buffers(buffers, true, &mut held)?;
        self.submit_job(py, job_id, JobKind::Get, keys, bufs, held)
    }

    fn submit_put_blocks(
        &self,
        py: Python<'_>,
        job_id: u64,
        keys: &Bound<'_, PyAny>,
        layers: &Bound<'_, PyAny>,
        block_ids: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let keys = parse_keys(keys)?;
        let mut held = Vec::new();
        let bufs = parse_layer_blocks(self.inner.object_bytes(), layers, block_ids, false, &mut held)?;
        self.submit_job(py, job_id, JobKind::Put, keys, bufs, held)
    }

    fn submit_get_blocks(
        &self,
        py: Python<'_>,
        job_id: u64,
        keys: &Bound<'_, PyAny>,
        layers: &Bound<'_, PyAny>,
        block_ids: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let keys = parse_keys(keys)?;
        let mut held = Vec::new();
        let bufs = parse_layer_blocks(self.inner.object_bytes(), layers, block_ids, true, &mut held)?;
        self.submit_job(py, job_id, JobKind::Get, keys, bufs, held)
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

/// A connection to the host service (`kvtier serve`), with the namespace's pool mapped: the
/// engine side of the multi-process layout. Calls release the GIL; a failed call drops the
/// connection (`connected` turns false) and the caller reconnects.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn parse_digest(text: &str) -> PyResult<[u8; 32]> {
    let bad = || {
        PyValueError::new_err(format!(
            "namespace digest {text:?}: give its 64 hex digits (`kvtier ls PATH` lists them)"
        ))
    };
    if text.len() != 64 {
        return Err(bad());
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
    }
    Ok(out)
}

/// The dict of one scrub step, the same from a store and from the service.
fn verify_dict<'py>(
    py: Python<'py>,
    next_after: u64,
    done: bool,
    values: Vec<(String, u64)>,
    bad: Vec<([u8; 32], &str, bool, String)>,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("next_after", next_after)?;
    d.set_item("done", done)?;
    for (name, value) in values {
        d.set_item(name, value)?;
    }
    let list = PyList::empty(py);
    for (key, tier, quarantined, reason) in bad {
        let b = PyDict::new(py);
        b.set_item("key", hex(&key))?;
        b.set_item("tier", tier)?;
        b.set_item("quarantined", quarantined)?;
        b.set_item("reason", reason)?;
        list.append(b)?;
    }
    d.set_item("bad", list)?;
    Ok(d)
}

#[pyclass(name = "ServiceClient", module = "kvtier._core", frozen)]
struct PyServiceClient {
    inner: Mutex<Client>,
}

fn tier_name(code: u8) -> Option<&'static str> {
    match code {
        1 => Some("dram"),
        2 => Some("nvme"),
        3 => Some("shared"),
        _ => None,
    }
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
struct PyCopyGate {
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

/// The host service running in this process (`kvtier serve` runs one until it is signalled).
#[pyclass(name = "Service", module = "kvtier._core", frozen)]
struct PyService {
    inner: Mutex<Option<Service>>,
}

#[pymethods]
impl PyService {
    /// Starts serving `socket_path` for stores under `path`; `options` are `Store.open` options
    /// (without `namespace` and `object_bytes`, which come from each engine).
    #[staticmethod]
    /// `host_dram_bytes`: the most DRAM all namespaces' pools take together (0: no host cap).
    /// `idle_timeout_ms`: a namespace no engine has been attached to for this long is closed and its
    /// pool freed (0: never).
    #[pyo3(signature = (socket_path, path, pool_dir = None, fill_timeout_ms = 10000, host_dram_bytes = 0, idle_timeout_ms = 0, **options))]
    #[allow(clippy::too_many_arguments)]
    fn start(
        py: Python<'_>,
        socket_path: PathBuf,
        path: &Bound<'_, PyAny>,
        pool_dir: Option<PathBuf>,
        fill_timeout_ms: u64,
        host_dram_bytes: u64,
        idle_timeout_ms: u64,
        options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<PyService> {
        let template = PyDict::new(py);
        if let Some(options) = options {
            for reserved in ["namespace", "object_bytes"] {
                if options.contains(reserved)? {
                    return Err(config_error(reserved, "set per engine by the service; remove it"));
                }
            }
            template.update(options.as_mapping())?;
        }
        // Placeholders: each namespace's store gets the engines' own.
        template.set_item("object_bytes", 1)?;
        template.set_item("namespace", "service-template")?;
        let store = parse_config(path, Some(&template))?;
        let mut config = ServiceConfig::new(socket_path, store);
        if let Some(dir) = pool_dir {
            config.pool_dir = dir;
        }
        config.fill_timeout_ms = fill_timeout_ms;
        config.host_dram_bytes = host_dram_bytes;
        config.idle_timeout_ms = idle_timeout_ms;
        let service = py.detach(move || Service::start(config)).map_err(to_py)?;
        Ok(PyService { inner: Mutex::new(Some(service)) })
    }

    /// Namespaces (models) served now.
    fn namespace_count(&self) -> usize {
        self.inner.lock().as_ref().map_or(0, Service::namespace_count)
    }

    /// Milliseconds the service has held no connection and no namespace (0 while it holds either).
    fn idle_ms(&self) -> u64 {
        self.inner.lock().as_ref().map_or(0, Service::idle_ms)
    }

    /// Stops accepting and removes the socket if the service has held nothing for `limit_ms`, in
    /// one step with accepting (`Service::stop_if_idle`): `True` if it did; call `stop` next.
    fn stop_if_idle(&self, limit_ms: u64) -> bool {
        self.inner.lock().as_ref().is_some_and(|service| service.stop_if_idle(limit_ms))
    }

    /// Closes every connection, then flushes and closes the stores. Idempotent.
    fn stop(&self, py: Python<'_>) -> PyResult<()> {
        let service = self.inner.lock().take();
        match service {
            Some(mut service) => py.detach(move || service.stop()).map_err(to_py),
            None => Ok(()),
        }
    }
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let _ = pyo3_log::try_init();
    m.add_class::<PyStore>()?;
    m.add_class::<PyServiceClient>()?;
    m.add_class::<PyService>()?;
    m.add_class::<PyCopyGate>()?;
    m.add_function(wrap_pyfunction!(options, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
