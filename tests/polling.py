"""Waiting in tests for something another thread or process does: one poll loop for every package's tests
(``pythonpath = ["tests"]`` in pyproject.toml makes it importable from each)."""

from __future__ import annotations

import time
from collections.abc import Callable


def until(predicate: Callable[[], object], timeout_s: float = 10.0, interval_s: float = 0.01) -> bool:
    """Whether ``predicate`` becomes true within ``timeout_s``, polled every ``interval_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return False
