"""A stand-in API server per test, and a kubeconfig pointing at it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kubegpu_standins.apiserver import ApiServer


@pytest.fixture
def apiserver() -> Iterator[ApiServer]:
    server = ApiServer(history=200, bookmark_interval_s=0.1).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def kubeconfig(apiserver: ApiServer, tmp_path: Path) -> Path:
    return apiserver.write_kubeconfig(tmp_path / "kubeconfig")
