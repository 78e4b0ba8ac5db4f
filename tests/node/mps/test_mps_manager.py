"""The node's MPS daemons through the stand-in: defaults before clients, readiness, restart, stop."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from kubegpu.node.mps import MpsError, MpsManager, share_spec
from kubegpu_standins.mps_control import PID_FILE, connect_client

GIB = 2**30


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _wait_dead(pid: int) -> None:
    for _ in range(200):
        try:
            os.kill(pid, 0)
        except OSError:
            return
        time.sleep(0.01)


def test_serve_sets_defaults_before_any_client_and_stop_quits(mps_binary: str, sockdir: Path) -> None:
    root = sockdir / "mps"
    m = MpsManager(mps_binary, str(root))
    spec = share_spec([("GPU-a", 25, 16 * GIB)])
    b = m.serve(spec, ["GPU-a"])
    host_pipe = dict((c, h) for h, c in b.mounts)[dict(b.env)["CUDA_MPS_PIPE_DIRECTORY"]]
    assert host_pipe == str(root / spec.name / "pipe")
    got = connect_client({"CUDA_MPS_PIPE_DIRECTORY": host_pipe, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100",
                          "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=140G"}, ["GPU-a"])
    assert got["thread_percentage"] == 25 and got["memory_limit_mib"] == {"GPU-a": 16384}
    # What the daemon was told, in order: the defaults (checked) before the first client.
    lines = (root / spec.name / "log" / "control.log").read_text().splitlines()
    said = [ln.split("] ", 1)[1] for ln in lines if "Cmd:" in ln or "NEW CLIENT" in ln]
    assert said[:5] == ["Cmd:set_default_active_thread_percentage 25",
                        "Cmd:set_default_device_pinned_mem_limit GPU-a 16384M",
                        "Cmd:get_default_active_thread_percentage", "Cmd:get_server_list",
                        f"NEW CLIENT {os.getpid()} from user 0: Server already exists"]
    assert m.serve(spec, ["GPU-a"]) == b  # the same shape reaches the same daemon
    assert [s.up for s in m.states()] == [True]
    m.stop()
    assert connect_client({"CUDA_MPS_PIPE_DIRECTORY": host_pipe}, ["GPU-a"]) == {"mps": False}


def test_a_dead_daemon_is_reported_and_restarted_with_backoff(mps_binary: str, sockdir: Path) -> None:
    clock = Clock()
    m = MpsManager(mps_binary, str(sockdir / "mps"), backoff_s=10, clock=clock)
    changes: list[bool] = []
    m.add_listener(lambda: changes.append(all(s.up for s in m.states())))
    spec = share_spec([("GPU-a", 50, 8 * GIB)])
    m.serve(spec)
    pid = int((sockdir / "mps" / spec.name / "pipe" / PID_FILE).read_text())
    os.kill(pid, signal.SIGKILL)
    _wait_dead(pid)
    # Restart fails while the binary is gone: the daemon stays down, with the reason, until its back-off.
    m.binary = str(sockdir / "gone")
    for e in m._entries.values():
        e.control.binary = m.binary
    m.supervise()
    (state,) = m.states()
    assert not state.up and "cannot run" in state.reason
    assert m.down() == {"GPU-a": (state,)}
    with pytest.raises(MpsError, match="is down"):
        m.serve(spec)
    for e in m._entries.values():
        e.control.binary = mps_binary
    m.supervise()
    assert not m.states()[0].up  # still backing off
    clock.now += 11
    m.supervise()
    (state,) = m.states()
    assert state.up and state.restarts == 1
    assert changes[-1] is True and False in changes
    assert connect_client({"CUDA_MPS_PIPE_DIRECTORY": str(sockdir / "mps" / spec.name / "pipe")},
                          ["GPU-a"])["thread_percentage"] == 50
    m.stop()


def test_no_binary_no_limits(sockdir: Path) -> None:
    m = MpsManager(None, str(sockdir / "mps"))
    with pytest.raises(MpsError, match="not found"):
        m.serve(share_spec([("GPU-a", 25, GIB)]))


def test_a_restarted_node_starts_the_recorded_daemons_again(mps_binary: str, sockdir: Path) -> None:
    root = sockdir / "mps"
    first = MpsManager(mps_binary, str(root))
    spec = share_spec([("GPU-a", 25, 16 * GIB)])
    other = share_spec([("GPU-gone", 50, 8 * GIB)])
    first.serve(spec)
    first.serve(other)
    first.stop()  # the node daemon went away; the kubelet still holds containers with these pipes
    (root / "junk").mkdir()
    (root / "junk" / "spec.json").write_text("{not json")
    pipe = str(root / spec.name / "pipe")
    assert connect_client({"CUDA_MPS_PIPE_DIRECTORY": pipe}, ["GPU-a"]) == {"mps": False}
    second = MpsManager(mps_binary, str(root))
    assert second.recover(["GPU-a"]) == 1  # GPU-gone is not on the node any more; junk is skipped
    got = connect_client({"CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}, ["GPU-a"])
    assert got["thread_percentage"] == 25 and got["memory_limit_mib"] == {"GPU-a": 16384}
    second.stop()
