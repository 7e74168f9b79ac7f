//! Typed errors of the core, one kind per failure class; the Python binding maps each kind to one
//! exception class. Messages name the cause and the fix.

use std::path::PathBuf;

/// Result alias used across the core.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A configuration value is missing, malformed or inconsistent.
    #[error("invalid option `{option}`: {message}")]
    Config { option: &'static str, message: String },

    /// An operating-system I/O call failed.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },

    /// Bytes on disk are not a kvtier structure of this version.
    #[error("{path}: {message}")]
    Format { path: PathBuf, message: String },

    /// A file belongs to another namespace (another model, dtype, layout or parallel rank).
    #[error("{path}: belongs to namespace {found}, not {expected}; open it with its own namespace or choose another directory")]
    Namespace { path: PathBuf, expected: String, found: String },

    /// The requested capacity does not fit the machine.
    #[error("{message}")]
    Capacity { message: String },

    /// Another process holds the store directory.
    #[error("{path} is in use by another process (lock held); close that store first or use another directory")]
    Locked { path: PathBuf },

    /// The host service could not be reached, or refused a request; the message says which and why.
    #[error("{message}")]
    Service { message: String },

    /// The store was closed.
    #[error("the store is closed")]
    Closed,

    /// A wait exceeded its limit.
    #[error("timed out after {timeout_ms} ms waiting for {what}")]
    Timeout { what: String, timeout_ms: u64 },
}

impl Error {
    pub(crate) fn config(option: &'static str, message: impl Into<String>) -> Self {
        Error::Config { option, message: message.into() }
    }

    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io { context: context.into(), source }
    }

    pub(crate) fn format(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::Format { path: path.into(), message: message.into() }
    }
}
