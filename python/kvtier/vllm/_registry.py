"""Process-wide registries of the integration (guarded by one lock)."""

from __future__ import annotations

import threading

registry_lock = threading.Lock()
