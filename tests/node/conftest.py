"""Fixtures for the node daemon tests: short unix-socket dirs, a stand-in kubelet, a daemon factory."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kubegpu.inventory.fake import FakeBackend
from kubegpu.node.daemon import NodeDaemon, NodeOptions
from kubegpu.node.options import load_node_options
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
    """``make_daemon(topology, flags={...}, env={...}, settings={...}, backend=..., **NodeOptions fields)``.

    ``flags`` go through the real config loader; the plugin dir, CDI dir and MIG-minors file
    are redirected under the test's socket dir."""
    started: list[tuple[NodeDaemon, FakeBackend]] = []

    def factory(topology: str = "dgx1-v100", *, flags: dict[str, Any] | None = None,
                env: dict[str, str] | None = None, settings: dict[str, Any] | None = None,
                start: bool = True, resolver: Any = None, backend: FakeBackend | None = None,
                **opts: Any) -> tuple[NodeDaemon, FakeBackend]:
        backend = backend or FakeBackend(topology)
        fl = {"shared-slots": 0, **(flags or {})}
        st = {"cdi_dir": str(sockdir / "cdi"), "mig_minors_file": str(sockdir / "mig-minors"),
              **(settings or {})}
        kw = {"plugin_dir": str(sockdir / "dp"), "stream_wait_s": 2.0, "resync_s": 0.4, **opts}

        def load() -> NodeOptions:
            return load_node_options(fl, env or {}, settings=st, **kw)

        # The test is the node's entry: its environment (monkeypatched) reaches the MPS stand-ins.
        d = NodeDaemon(backend, load, resolver=resolver, env=os.environ)
        d.flags = fl  # type: ignore[attr-defined]  # tests mutate it before reload()
        started.append((d, backend))
        if start:
            d.start()
        return d, backend

    yield factory
    for d, b in started:
        d.stop()
        b.close()


@pytest.fixture
def mps_binary(sockdir: Path) -> Iterator[str]:
    """The stand-in ``nvidia-cuda-mps-control``; any daemon it left running is killed afterwards."""
    import signal

    from kubegpu_standins.mps_control import PID_FILE, install

    bindir = sockdir / "bin"
    bindir.mkdir()
    yield install(bindir)
    for pid_file in sockdir.rglob(PID_FILE):
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
