"""The ``cluster`` fixture: the stand-in API server with the fixture's nodes, and the extender."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sched_harness import Cluster, start_cluster


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    api, ext = start_cluster(tmp_path)
    try:
        yield Cluster(api, ext)
    finally:
        ext.stop()
        api.stop()
