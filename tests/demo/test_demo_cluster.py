"""The local cluster's start-up: a role whose port was taken meanwhile is started again on another;
a role that fails for any other reason is reported with its log, and nothing is left running."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kubegpu.demo.cluster as cluster_mod
from kubegpu.demo.cluster import ClusterError, LocalCluster, NodeSpec


@pytest.fixture
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="kgc-", dir="/tmp") as d:
        yield Path(d)


def test_roles_whose_port_was_taken_start_again(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(1)
    taken = squatter.getsockname()[1]
    ports = iter([taken, taken])  # the first webhook and the first extender both get a busy port
    real = cluster_mod.free_port
    monkeypatch.setattr(cluster_mod, "free_port", lambda: next(ports, None) or real())
    said: list[str] = []
    try:
        with LocalCluster(workdir, [], say=said.append, startup_timeout_s=60) as c:
            assert not c.webhook_url.endswith(f":{taken}") and not c.extender_url.endswith(f":{taken}")
            assert c.alive() == []
            procs = [p.popen for p in c.procs]
        assert sum("port was taken" in m for m in said) == 2
        assert all(p.poll() is not None for p in procs)
    finally:
        squatter.close()


def test_a_node_the_daemon_would_refuse_is_reported_and_nothing_left(workdir: Path) -> None:
    c = LocalCluster(workdir, [NodeSpec("n1", "t4x4", ("--mig-strategy", "sideways"))], startup_timeout_s=30)
    with pytest.raises(ClusterError, match=r"node n1 .*sideways"), c:
        pytest.fail("started")
    assert c.api is None and c.kubelets == {}
    assert all(p.popen.poll() is not None for p in c.procs)


def test_a_role_that_exits_is_reported_with_its_log(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A topology file the daemon cannot read at start (it is deleted after the demo read it).
    topo = workdir / "gone.yaml"
    topo.write_text((Path(cluster_mod.__file__).parents[1] / "inventory/topologies/t4x4.yaml").read_text())
    real = cluster_mod.expected_resources

    def read_then_delete(spec: NodeSpec) -> set[str]:
        out = real(spec)
        topo.unlink()
        return out

    monkeypatch.setattr(cluster_mod, "expected_resources", read_then_delete)
    c = LocalCluster(workdir, [NodeSpec("n1", str(topo))], startup_timeout_s=30)
    with pytest.raises(ClusterError, match="node-n1 exited with code") as err, c:
        pytest.fail("started")
    assert "gone.yaml" in str(err.value)  # the role's own log says why
    assert all(p.popen.poll() is not None for p in c.procs)


def test_a_role_started_as_the_demo_is_interrupted_is_stopped_with_the_rest(
        workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM lands while a role is being started, the moment its process exists: the demo's stop
    still ends it (a handle lost to the interrupt would leave it running after the demo)."""
    started: list[subprocess.Popen[bytes]] = []
    real = subprocess.Popen

    def popen_then_interrupted(*args: Any, **kw: Any) -> subprocess.Popen[bytes]:
        p = real(*args, **kw)
        started.append(p)
        signal.raise_signal(signal.SIGTERM)
        return p

    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    monkeypatch.setattr(cluster_mod.subprocess, "Popen", popen_then_interrupted)
    (workdir / "logs").mkdir()
    cluster = LocalCluster(workdir, [])
    try:
        with pytest.raises(KeyboardInterrupt):
            cluster._spawn("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"])
    finally:
        signal.signal(signal.SIGTERM, previous)
        cluster.stop()
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait()
                pytest.fail("the role started as the demo was interrupted is still running after its stop")
    assert len(started) == 1
