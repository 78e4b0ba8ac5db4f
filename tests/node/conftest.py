"""Fixtures for the node daemon tests: short unix-socket dirs, a stand-in kubelet, a daemon factory."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kubegpu.inventory.fake import FakeBackend
from kubegpu.node.daemon import NodeDaemon, NodeOptions
from kubegpu.node.plan import PlanConfig
from kubegpu.node.plugin_model import PluginSettings
from kubegpu_standins.kubelet import StandinKubelet


@pytest.fixture
def sockdir() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes: pytest's tmp_path is too long.
    d = Path(tempfile.mkdtemp(prefix="kgn-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def kubelet(sockdir: Path) -> Iterator[StandinKubelet]:
    k = StandinKubelet(sockdir / "dp")
    k.start()
    try:
        yield k
    finally:
        k.stop()


DaemonFactory = Callable[..., tuple[NodeDaemon, FakeBackend]]


@pytest.fixture
def make_daemon(sockdir: Path) -> Iterator[DaemonFactory]:
    started: list[tuple[NodeDaemon, FakeBackend]] = []

    def factory(topology: str = "dgx1-v100", *, plan: PlanConfig | None = None,
                settings: PluginSettings | None = None, start: bool = True,
                **opts: Any) -> tuple[NodeDaemon, FakeBackend]:
        backend = FakeBackend(topology)
        s = settings or PluginSettings()
        if s.cdi_dir == PluginSettings().cdi_dir:
            s = replace(s, cdi_dir=str(sockdir / "cdi"), mig_minors_file=str(sockdir / "mig-minors"))
        options = NodeOptions(plugin_dir=str(sockdir / "dp"), plan=plan or PlanConfig(), settings=s,
                              **({"stream_wait_s": 2.0, "resync_s": 0.4} | opts))
        d = NodeDaemon(backend, lambda: options)
        started.append((d, backend))
        if start:
            d.start()
        return d, backend

    yield factory
    for d, b in started:
        d.stop()
        b.close()
