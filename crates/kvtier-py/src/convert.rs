//! Python objects to the core's types and back: errors as `kvtier.errors` classes, keys, buffers
//! borrowed without copies (`Held` until the core is done with them), and `Store.open`'s options.

use kvtier_core::{
    find_option, unknown_option_message, BlockBuffer, BlockKey, ConfigOption, Error, OptionKind, OptionValue,
    StoreConfig,
};
use pyo3::exceptions::PyValueError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};
use std::path::PathBuf;

/// Raises the exception class of `kvtier.errors` that mirrors the core error kind.
pub(crate) fn to_py(err: Error) -> PyErr {
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

pub(crate) fn config_error(option: &str, message: impl Into<String>) -> PyErr {
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
pub(crate) enum Held {
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

/// A tenant id (`kvtier._core.tenant_id`): 16 bytes.
pub(crate) fn parse_tenant(tenant: &[u8]) -> PyResult<kvtier_core::TenantId> {
    tenant.try_into().map_err(|_| {
        PyValueError::new_err(format!(
            "tenant: {} bytes; pass kvtier._core.tenant_id(cache_salt) (16 bytes)",
            tenant.len()
        ))
    })
}

pub(crate) fn parse_keys(keys: &Bound<'_, PyAny>) -> PyResult<Vec<BlockKey>> {
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
pub(crate) fn parse_buffers(
    buffers: &Bound<'_, PyAny>,
    writable: bool,
    held: &mut Vec<Held>,
) -> PyResult<Vec<BlockBuffer>> {
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
pub(crate) fn parse_layer_blocks(
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
pub(crate) fn parse_config(path: &Bound<'_, PyAny>, options: Option<&Bound<'_, PyDict>>) -> PyResult<StoreConfig> {
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

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub(crate) fn parse_digest(text: &str) -> PyResult<[u8; 32]> {
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
pub(crate) fn verify_dict<'py>(
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
