"""The ``cluster`` fixture: the stand-in API server with the fixture's nodes, and the extender."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sched_harness import Cluster, start_cluster


@pytest.fixture(autouse=True)
def no_node_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests run the extender alone: no node ever acknowledges a bound pod, so pods bound with
    different amounts would wait on each other forever (the handoff wait; tests/handoff runs it)."""
    monkeypatch.setenv("KUBEGPU_HANDOFF_WAIT", "0")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    api, ext = start_cluster(tmp_path)
    try:
        yield Cluster(api, ext)
    finally:
        ext.stop()
        api.stop()
