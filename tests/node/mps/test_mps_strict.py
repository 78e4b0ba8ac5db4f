"""Strict share enforcement through the stand-ins: the fake NVML's compute modes, the stand-in MPS control
obeying them as the driver does, and every transition of a GPU (empty -> shares -> empty -> whole -> empty,
a daemon crash, a node restart with shares running)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kubegpu.inventory.compute_modes import DEFAULT, EXCLUSIVE_PROCESS, MODES, PROHIBITED
from kubegpu.inventory.fake import FakeBackend
from kubegpu.node.mps import (
    MODE_STRICT,
    ComputeModeError,
    ComputeModeGuard,
    MpsControl,
    MpsError,
    MpsManager,
    share_spec,
)
from kubegpu.node.mps.dra import DraEnforcement
from kubegpu.node.mps.enforcer import ShareEnforcer
from kubegpu_standins import fake_driver
from kubegpu_standins.fake_driver import ENV_DRIVER_STATE, FakeDriverState
from kubegpu_standins.mps_control import PID_FILE, connect_client

GIB = 2**30


@pytest.fixture
def node(mps_binary: str, sockdir: Path) -> Iterator[tuple[FakeBackend, Path, dict[str, str]]]:
    """A fake node whose compute modes the stand-in daemons and clients see; (backend, MPS root, env)."""
    state = sockdir / "driver"
    backend = FakeBackend("t4x4", driver_state=state)
    env = {**os.environ, ENV_DRIVER_STATE: str(state)}
    yield backend, sockdir / "mps", env
    backend.close()


def _enforcer(backend: FakeBackend, root: Path, env: dict[str, str], binary: str) -> ShareEnforcer:
    manager = MpsManager(binary, str(root), base_env=env)
    return ShareEnforcer(manager, MODE_STRICT, backend.discover(), compute_modes=ComputeModeGuard(backend, root))


def _pipe(binding_env: tuple[tuple[str, str], ...], root: Path) -> str:
    container = dict(binding_env)["CUDA_MPS_PIPE_DIRECTORY"]
    return str(root / container.split("/")[2] / "pipe")


def _wait_dead(pid: int) -> None:
    for _ in range(500):
        try:
            os.kill(pid, 0)
        except OSError:
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not end")


def _client(env: dict[str, str], uuid: str, state: Path) -> dict[str, object]:
    return connect_client(env, [uuid], driver_state=str(state))


def test_standin_obeys_compute_modes_as_the_driver(mps_binary: str, sockdir: Path) -> None:
    state = FakeDriverState(sockdir / "driver")
    env = {**os.environ, ENV_DRIVER_STATE: str(state.dir)}
    a = MpsControl(mps_binary, str(sockdir / "mps"), share_spec([("GPU-a", 25, GIB)]), base_env=env)
    b = MpsControl(mps_binary, str(sockdir / "mps"), share_spec([("GPU-a", 50, GIB)]), base_env=env)
    empty = str(sockdir / "empty")
    try:
        # Default: a second server and a client without MPS both get the GPU (the escape of docs/security.md).
        a.start()
        b.start()
        a.command("start_server -uid 0")
        b.command("start_server -uid 0")
        assert _client({"CUDA_MPS_PIPE_DIRECTORY": empty}, "GPU-a", state.dir) == {"mps": False}
        b.quit()
        a.quit()
        # Exclusive_Process: the first server holds the one context; a second server and every client that
        # skips MPS (pipe directory empty, or unset) are refused; the server's own clients are served.
        state.set_mode("GPU-a", EXCLUSIVE_PROCESS)
        a.start()
        b.start()
        a.set_defaults()
        a.command("start_server -uid 0")
        with pytest.raises(MpsError, match="busy or unavailable"):
            b.command("start_server -uid 0")
        assert "error" in _client({"CUDA_MPS_PIPE_DIRECTORY": str(b.paths.pipe)}, "GPU-a", state.dir)
        assert "busy" in str(_client({"CUDA_MPS_PIPE_DIRECTORY": empty}, "GPU-a", state.dir)["error"])
        assert "busy" in str(_client({}, "GPU-a", state.dir)["error"])
        got = _client({"CUDA_MPS_PIPE_DIRECTORY": str(a.paths.pipe), "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"},
                      "GPU-a", state.dir)
        assert got["mps"] is True and got["thread_percentage"] == 25  # the environment only lowers
        a.quit()
        # With no server left the GPU is free again: the next context (here the other daemon's) gets it.
        b.command("start_server -uid 0")
        b.quit()
        state.set_mode("GPU-a", PROHIBITED)
        a.start()
        with pytest.raises(MpsError, match=PROHIBITED):
            a.command("start_server -uid 0")
        assert PROHIBITED in str(_client({"CUDA_MPS_PIPE_DIRECTORY": empty}, "GPU-a", state.dir)["error"])
    finally:
        a.quit()
        b.quit()


def test_fake_nvml_compute_modes(sockdir: Path) -> None:
    shared = FakeBackend("t4x4", driver_state=sockdir / "driver")
    alone = FakeBackend("t4x4")
    uuid = shared.discover().gpus[0].uuid
    for backend in (shared, alone):
        assert backend.compute_mode(uuid) == DEFAULT
        backend.set_compute_mode(uuid, EXCLUSIVE_PROCESS)
        assert backend.compute_mode(uuid) == EXCLUSIVE_PROCESS
        with pytest.raises(Exception, match="Invalid Argument"):
            backend.set_compute_mode(uuid, "Exclusive_Thread")
        with pytest.raises(Exception, match="Not Found"):
            backend.compute_mode("GPU-nope")
    assert FakeDriverState(sockdir / "driver").mode(uuid) == EXCLUSIVE_PROCESS  # what the stand-ins read
    assert fake_driver.MODES == MODES  # one spelling, though the stand-in's copy stays standard-library only


def test_every_transition_of_a_strict_gpu(node: tuple[FakeBackend, Path, dict[str, str]], mps_binary: str,
                                          sockdir: Path) -> None:
    backend, root, env = node
    state = sockdir / "driver"
    enf = _enforcer(backend, root, env, mps_binary)
    gpu = backend.discover().gpus[0].uuid
    empty = str(sockdir / "empty")
    assert backend.compute_mode(gpu) == DEFAULT
    # empty -> shares: exclusive before the server starts, the server up before any container.
    b1 = enf.for_share([(gpu, 25, 4 * GIB)], [gpu], holder="pod-1/c")
    assert b1 is not None and backend.compute_mode(gpu) == EXCLUSIVE_PROCESS
    pipe = _pipe(b1.env, root)
    assert "busy" in str(_client({"CUDA_MPS_PIPE_DIRECTORY": empty}, gpu, state)["error"])  # escape 1: empty pipe
    assert "busy" in str(_client({}, gpu, state)["error"])  # escape 2: pipe unset
    raised = _client({"CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100",
                      "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=15G"}, gpu, state)
    assert raised["thread_percentage"] == 25 and raised["memory_limit_mib"] == {gpu: 4096}  # escape 3: env
    # Same shape joins; another shape is refused with the reason; a whole GPU waits for the shares.
    assert enf.for_share([(gpu, 25, 4 * GIB)], [gpu], holder="pod-2/c") == b1
    with pytest.raises(MpsError, match="locked to the share shape 25% / 4096M"):
        enf.for_share([(gpu, 50, 8 * GIB)], [gpu], holder="pod-3/c")
    with pytest.raises(ComputeModeError, match="2 MPS-enforced share"):
        enf.claim_whole(gpu, "pod-w/c")
    # shares -> empty: the daemon quits, then the mode goes back.
    enf.release_share("pod-1/c", [gpu])
    assert backend.compute_mode(gpu) == EXCLUSIVE_PROCESS
    enf.release_share("pod-2/c", [gpu])
    assert backend.compute_mode(gpu) == DEFAULT
    assert connect_client({"CUDA_MPS_PIPE_DIRECTORY": pipe}, [gpu], driver_state=str(state)) == {"mps": False}
    assert enf.manager is not None and enf.manager.states() == []
    # empty -> whole: no switch under it; a share waits for it; whole -> empty -> a new shape takes the GPU.
    enf.claim_whole(gpu, "pod-w/c")
    with pytest.raises(ComputeModeError, match="held whole by pod-w/c"):
        enf.for_share([(gpu, 50, 8 * GIB)], [gpu], holder="pod-3/c")
    assert backend.compute_mode(gpu) == DEFAULT
    enf.release_whole(gpu, "pod-w/c")
    assert enf.for_share([(gpu, 50, 8 * GIB)], [gpu], holder="pod-3/c") is not None
    assert enf.strict is not None and enf.strict.locks() == {gpu: "50% / 8192M"}
    assert enf.table()[gpu].mode == MODE_STRICT and not enf.table()[gpu].escapable
    view = enf.views()[gpu]
    assert (view.mode, view.compute_mode, view.shape_lock, view.escapable) == (
        MODE_STRICT, EXCLUSIVE_PROCESS, "50% / 8192M", False)
    # The device-plugin path learns of ends from the live pods: none left -> restored.
    assert enf.reconcile({}, {}) == [gpu]
    assert backend.compute_mode(gpu) == DEFAULT


def test_the_operator_mode_found_is_restored_and_prohibited_is_respected(
        node: tuple[FakeBackend, Path, dict[str, str]], mps_binary: str) -> None:
    backend, root, env = node
    enf = _enforcer(backend, root, env, mps_binary)
    a, b = (g.uuid for g in backend.discover().gpus[:2])
    backend.set_compute_mode(a, EXCLUSIVE_PROCESS)
    backend.set_compute_mode(b, PROHIBITED)
    enf.for_share([(a, 50, GIB)], [a], holder="p")
    with pytest.raises(ComputeModeError, match="Prohibited"):
        enf.for_share([(b, 50, GIB)], [b], holder="q")
    enf.release_share("p", [a])
    assert backend.compute_mode(a) == EXCLUSIVE_PROCESS and backend.compute_mode(b) == PROHIBITED


def test_a_crashed_daemon_comes_back_with_its_server_and_the_gpu_stays_exclusive(
        node: tuple[FakeBackend, Path, dict[str, str]], mps_binary: str, sockdir: Path) -> None:
    backend, root, env = node
    enf = _enforcer(backend, root, env, mps_binary)
    gpu = backend.discover().gpus[1].uuid
    b = enf.for_share([(gpu, 25, 2 * GIB)], [gpu], holder="p")
    assert b is not None and enf.manager is not None
    pipe = _pipe(b.env, root)
    pid = int((Path(pipe) / PID_FILE).read_text())
    os.kill(pid, signal.SIGKILL)
    _wait_dead(pid)  # the driver frees a context once its process is gone
    enf.manager.supervise()
    (st,) = enf.manager.states()
    assert st.up and st.restarts == 1
    assert backend.compute_mode(gpu) == EXCLUSIVE_PROCESS
    assert enf.manager.serve(share_spec([(gpu, 25, 2 * GIB)])) == enf.for_share([(gpu, 25, 2 * GIB)], [gpu], "p")
    assert "busy" in str(_client({}, gpu, sockdir / "driver")["error"])  # the new server holds the context
    enf.release_share("p", [gpu])
    assert backend.compute_mode(gpu) == DEFAULT


def test_a_node_restart_with_shares_running_keeps_them_bound(
        node: tuple[FakeBackend, Path, dict[str, str]], mps_binary: str, sockdir: Path) -> None:
    backend, root, env = node
    first = _enforcer(backend, root, env, mps_binary)
    gpu = backend.discover().gpus[2].uuid
    b = first.for_share([(gpu, 25, 2 * GIB)], [gpu], holder="p")
    assert b is not None
    # The node daemon stops with a share running: the GPU stays exclusive (its containers outlive us).
    assert gpu in first.stop()
    assert backend.compute_mode(gpu) == EXCLUSIVE_PROCESS
    second = _enforcer(backend, root, env, mps_binary)
    assert second.manager is not None and second.manager.recover([gpu], server_uid=0) == 1
    assert "busy" in str(_client({}, gpu, sockdir / "driver")["error"])
    got = _client({"CUDA_MPS_PIPE_DIRECTORY": _pipe(b.env, root)}, gpu, sockdir / "driver")
    assert got["thread_percentage"] == 25
    second.release_share("p", [gpu])  # the holder recorded by the first daemon, released by the second
    assert backend.compute_mode(gpu) == DEFAULT
    assert second.stop() == {}


def test_allocate_asks_the_daemon_once_per_shape(mps_binary: str, sockdir: Path) -> None:
    counter = sockdir / "calls"
    wrapper = sockdir / "counting-mps-control"
    wrapper.write_text(f"#!/bin/sh\necho x >> {counter}\nexec {mps_binary} \"$@\"\n")
    wrapper.chmod(0o755)
    m = MpsManager(str(wrapper), str(sockdir / "mps"))
    spec = share_spec([("GPU-a", 25, GIB)])
    first = m.serve(spec, ["GPU-a"])
    calls = counter.read_text().count("x")
    for _ in range(20):
        assert m.serve(spec, ["GPU-a"]) == first
    assert counter.read_text().count("x") == calls
    m.stop()


def test_the_dra_path_switches_and_restores_as_the_device_plugin_path(
        node: tuple[FakeBackend, Path, dict[str, str]], mps_binary: str, sockdir: Path) -> None:
    backend, root, env = node
    dra = DraEnforcement(str(root), "/", mps_binary, selected=MODE_STRICT, compute_modes=backend)
    dra.manager.base_env = env
    inv = backend.discover()
    dra.start(inv)
    gpu = inv.gpus[3].uuid
    try:
        b = dra.for_share([(gpu, 30, 3 * GIB)], [gpu], holder="claim-uid-1")
        assert b is not None and backend.compute_mode(gpu) == EXCLUSIVE_PROCESS
        assert "busy" in str(_client({}, gpu, sockdir / "driver")["error"])
        with pytest.raises(ComputeModeError, match="1 MPS-enforced share"):
            dra.claim_whole(gpu, "claim-uid-2")
        dra.release("claim-uid-1", [gpu])
        assert backend.compute_mode(gpu) == DEFAULT
        dra.claim_whole(gpu, "claim-uid-2")
        with pytest.raises(ComputeModeError, match="held whole by claim-uid-2"):
            dra.for_share([(gpu, 30, 3 * GIB)], [gpu], holder="claim-uid-3")
        dra.release_whole(gpu, "claim-uid-2")
    finally:
        dra.stop()
