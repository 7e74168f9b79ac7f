"""Exceptions raised by kvtier, one class per error kind of the Rust core.

The binding (``kvtier._core``) raises these classes; they also derive from the matching builtin
exception so that callers can catch ``ValueError`` or ``OSError`` as usual.
"""

import builtins


class KvtierError(Exception):
    """Base class of every kvtier error."""


class ConfigError(KvtierError, ValueError):
    """An option is unknown, missing or invalid; the message names it and the fix."""


class IoError(KvtierError, OSError):
    """An operating-system I/O call failed at start-up (run-time I/O failures are counted misses)."""


class FormatError(KvtierError):
    """A file is not a kvtier file of this format version, or has another geometry."""


class NamespaceError(KvtierError):
    """A file belongs to another namespace (model, dtype, layout or parallel rank)."""


class CapacityError(KvtierError):
    """The requested DRAM or disk capacity does not fit the machine."""


class LockedError(KvtierError):
    """Another process has the store directory open."""


class ClosedError(KvtierError):
    """The store was closed."""


class TimeoutError(KvtierError, builtins.TimeoutError):
    """A wait exceeded its limit."""


class ServiceError(KvtierError, ConnectionError):
    """The host service could not be reached or refused a request (the message says why)."""


__all__ = [
    "CapacityError",
    "ClosedError",
    "ConfigError",
    "FormatError",
    "IoError",
    "KvtierError",
    "LockedError",
    "NamespaceError",
    "ServiceError",
    "TimeoutError",
]
