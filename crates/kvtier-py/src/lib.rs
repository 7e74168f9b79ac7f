//! Python binding of the kvtier core (`kvtier._core`). Owns the translation between Python objects
//! and the core's types: option parsing with the option's name in every error, buffer-protocol
//! access without copies (held until a job finishes), typed exceptions, and releasing the GIL
//! during I/O.

mod client;
mod convert;
mod service;
mod store;

use client::{PyCopyGate, PyServiceClient};
use kvtier_core::{OptionValue, OPTIONS};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use service::PyService;
use store::PyStore;

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

/// The 16-byte id of the tenant whose requests carry `cache_salt` (b"" or "" for no salt: the
/// default tenant, all zero); what `assign_tenant` takes.
#[pyfunction]
fn tenant_id<'py>(py: Python<'py>, cache_salt: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    let salt: Vec<u8> = match cache_salt.cast::<PyBytes>() {
        Ok(b) => b.as_bytes().to_vec(),
        Err(_) => cache_salt.extract::<String>()?.into_bytes(),
    };
    Ok(PyBytes::new(py, &kvtier_core::tenant_id(&salt)))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let _ = pyo3_log::try_init();
    m.add_class::<PyStore>()?;
    m.add_class::<PyServiceClient>()?;
    m.add_class::<PyService>()?;
    m.add_class::<PyCopyGate>()?;
    m.add_function(wrap_pyfunction!(options, m)?)?;
    m.add_function(wrap_pyfunction!(tenant_id, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // What an engine reports of itself to the service, in the service's order: the metrics and the
    // benchmarks read the names from here rather than keep a copy.
    m.add("ENGINE_REPORTED", kvtier_core::service::ENGINE_REPORTED.to_vec())?;
    m.add("ENGINE_FALLBACKS", kvtier_core::service::ENGINE_FALLBACKS.to_vec())?;
    // Every tier in load order, as (name, remote): the Python side derives its tier lists from it.
    let tiers: Vec<(&str, bool)> = kvtier_core::TIER_ROWS.iter().map(|row| (row.name, row.remote)).collect();
    m.add("TIERS", tiers)?;
    Ok(())
}
