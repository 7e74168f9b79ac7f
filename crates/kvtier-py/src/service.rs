//! `kvtier._core.Service`: the host service run in this process.

use crate::convert::{config_error, parse_config, to_py};
use kvtier_core::service::{Service, ServiceConfig};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::path::PathBuf;

/// The host service running in this process (`kvtier serve` runs one until it is signalled).
#[pyclass(name = "Service", module = "kvtier._core", frozen)]
pub(crate) struct PyService {
    inner: Mutex<Option<Service>>,
}

#[pymethods]
impl PyService {
    /// Starts serving `socket_path` for stores under `path`; `options` are `Store.open` options
    /// (without `namespace` and `object_bytes`, which come from each engine).
    #[staticmethod]
    /// `host_dram_bytes`: the most DRAM all namespaces' pools take together (0: no host cap).
    /// `idle_timeout_ms`: a namespace no engine has been attached to for this long is closed and its
    /// pool freed (0: never). `reservation_timeout_ms`, `pin_lease_ms`: `ServiceConfig`'s (its
    /// defaults when not given).
    #[pyo3(signature = (socket_path, path, pool_dir = None, fill_timeout_ms = 10000, host_dram_bytes = 0, idle_timeout_ms = 0, reservation_timeout_ms = None, pin_lease_ms = None, **options))]
    #[allow(clippy::too_many_arguments)]
    fn start(
        py: Python<'_>,
        socket_path: PathBuf,
        path: &Bound<'_, PyAny>,
        pool_dir: Option<PathBuf>,
        fill_timeout_ms: u64,
        host_dram_bytes: u64,
        idle_timeout_ms: u64,
        reservation_timeout_ms: Option<u64>,
        pin_lease_ms: Option<u64>,
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
        config.reservation_timeout_ms = reservation_timeout_ms.unwrap_or(config.reservation_timeout_ms);
        config.pin_lease_ms = pin_lease_ms.unwrap_or(config.pin_lease_ms);
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
