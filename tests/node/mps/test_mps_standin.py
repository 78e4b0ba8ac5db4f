"""The stand-in control daemon behaves as the real one did on the H200 (fixtures kubegpu-on-h200)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from kubegpu_standins.mps_control import connect_client


def _run(binary: str, env: dict[str, str], *args: str, stdin: str = "") -> tuple[int, str]:
    p = subprocess.run([binary, *args], input=stdin, capture_output=True, text=True, env=env, timeout=20)
    return p.returncode, p.stdout.strip()


def test_control_interface_as_recorded(mps_binary: str, sockdir: Path) -> None:
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(sockdir / "pipe"),
           "CUDA_MPS_LOG_DIRECTORY": str(sockdir / "log")}
    assert _run(mps_binary, env, "-d") == (0, "")
    assert _run(mps_binary, env, "-d")[0] != 0  # one daemon per pipe directory
    # mps-enforcement.log: "A.set_thread: [0, "25.0", ""]", "A.set_mem: [0, "", ""]".
    assert _run(mps_binary, env, stdin="set_default_active_thread_percentage 25\n") == (0, "25.0")
    assert _run(mps_binary, env, stdin="set_default_device_pinned_mem_limit 0 16G\n") == (0, "")
    assert _run(mps_binary, env, stdin="get_server_list\n") == (0, "")
    # The environment can only lower the defaults: 100 % / 140G got 25 % / 16G, 10 % / 8G got 10 % / 8G.
    high = connect_client({"CUDA_MPS_PIPE_DIRECTORY": env["CUDA_MPS_PIPE_DIRECTORY"],
                           "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100",
                           "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=140G"}, ["GPU-x"])
    low = connect_client({"CUDA_MPS_PIPE_DIRECTORY": env["CUDA_MPS_PIPE_DIRECTORY"],
                          "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "10",
                          "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8G"}, ["GPU-x"])
    assert (high["thread_percentage"], high["memory_limit_mib"]) == (25, {"GPU-x": 16384})
    assert (low["thread_percentage"], low["memory_limit_mib"]) == (10, {"GPU-x": 8192})
    rc, servers = _run(mps_binary, env, stdin="get_server_list\n")
    assert rc == 0 and servers == str(high["server"]) == str(low["server"])
    # Defaults apply to servers started later: the running server keeps 25 %.
    assert _run(mps_binary, env, stdin="set_default_active_thread_percentage 50\n") == (0, "50.0")
    assert connect_client(env, ["GPU-x"])["thread_percentage"] == 25
    assert _run(mps_binary, env, stdin="quit\n") == (0, "")
    assert _run(mps_binary, env, stdin="get_server_list\n")[0] != 0
    # Without a daemon behind the pipe a client runs on the GPU directly: nothing limits it.
    assert connect_client(env, ["GPU-x"]) == {"mps": False}
    # Defaults are lost on quit.
    assert _run(mps_binary, env, "-d") == (0, "")
    assert _run(mps_binary, env, stdin="get_default_active_thread_percentage\n") == (0, "100.0")
    assert _run(mps_binary, env, stdin="quit\n") == (0, "")
    assert "Starting control daemon using socket" in (sockdir / "log" / "control.log").read_text()
