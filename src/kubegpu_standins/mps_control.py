"""A stand-in ``nvidia-cuda-mps-control``: the control interface as recorded on the H200 (fixtures
``kubegpu-on-h200/mps-enforcement.log`` and ``mps-design.log``), for tests and the GPU-less benchmark.

What it reproduces:

- ``-d`` daemonizes (the command returns 0 once the daemon listens on ``$CUDA_MPS_PIPE_DIRECTORY/control``),
  ``-f`` runs in the foreground; ``CUDA_MPS_LOG_DIRECTORY/control.log`` gets the daemon's lines;
- with no argument, commands are read from standard input and each answer printed:
  ``set_default_active_thread_percentage 25`` prints ``25.0``; ``set_default_device_pinned_mem_limit
  <index|UUID> 16G`` prints nothing; ``get_default_*`` print the value; ``get_server_list`` prints one
  server PID per line; ``quit`` stops the servers and the daemon;
- defaults apply to servers started *later*: a server keeps the defaults it started with, and all of them
  are lost on ``quit``;
- a client's limits are its environment's, capped by its server's defaults (the environment can only lower
  them); a client whose pipe directory has no daemon behind it runs without MPS and is limited by nothing;
- compute modes, when ``KUBEGPU_STANDIN_DRIVER_STATE`` names the fake driver's directory
  (:mod:`kubegpu_standins.fake_driver`, shared with the fake NVML): a server holds a context on each GPU of
  the daemon's ``CUDA_VISIBLE_DEVICES`` from its start to its exit, so under ``Exclusive_Process`` a second
  server (another daemon) or a client that skips MPS is refused while one runs, and under ``Prohibited``
  every one is, as NVIDIA documents.

The CUDA side is not emulated beyond that: :func:`connect_client` is what a CUDA runtime would get (used by
tests and ``bench/enforcement.py``). ``<pipe>/standin-control.pid`` holds the daemon's PID so tests can kill
it (the real daemon has no such file).
"""

from __future__ import annotations

import json
import os
import re
import socket
import socketserver
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubegpu_standins.fake_driver import ENV_DRIVER_STATE, FakeDriverState, holder

DEFAULT_PIPE = "/tmp/nvidia-mps"
DEFAULT_LOG = "/var/log/nvidia-mps"
PID_FILE = "standin-control.pid"
LIMIT_RE = re.compile(r"^(\d+(?:\.\d+)?)([MG])$")


def _pipe_dir(env: dict[str, str] | os._Environ[str]) -> Path:
    return Path(env.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE)


def _mib(limit: str) -> float:
    m = LIMIT_RE.match(limit.strip())
    if not m:
        raise ValueError(limit)
    return float(m.group(1)) * (1024 if m.group(2) == "G" else 1)


@dataclass
class _Server:
    pid: int
    uid: int
    threads: float
    mem: dict[str, str]  # defaults at server start, by index or UUID
    clients: set[int] = field(default_factory=set)


class _Refused(Exception):
    """The driver refused a server its context (the message is the driver's reason)."""


def _driver(env: dict[str, str] | os._Environ[str]) -> FakeDriverState | None:
    where = env.get(ENV_DRIVER_STATE)
    return FakeDriverState(where) if where else None


class _Daemon:
    def __init__(self, pipe: Path, log_dir: Path, visible: list[str], driver: FakeDriverState | None = None) -> None:
        self.pipe, self.log_dir, self.visible, self.driver = pipe, log_dir, visible, driver
        self.threads = 100.0
        self.mem: dict[str, str] = {}
        self.servers: dict[int, _Server] = {}
        self.next_pid = os.getpid() + 1
        self.lock = threading.Lock()
        self.done = threading.Event()

    def log(self, text: str) -> None:
        try:
            with open(self.log_dir / "control.log", "a") as f:
                stamp = time.strftime("%Y-%m-%d %H:%M:%S")
                f.write(f"[{stamp} Control {os.getpid():>5}] {text}\n")
        except OSError:
            pass

    def _server_for(self, uid: int) -> _Server:
        for s in self.servers.values():
            if s.uid == uid:
                return s
        pid = self.next_pid
        self.next_pid += 1
        self._open_contexts(pid)
        s = _Server(pid, uid, self.threads, dict(self.mem))
        self.servers[pid] = s
        self.log(f"Starting new server {pid} for user {uid}")
        return s

    def _open_contexts(self, pid: int) -> None:
        """A new server opens a context on each of the daemon's GPUs; all or none."""
        if self.driver is None:
            return
        done: list[str] = []
        for uuid in self.visible:
            why = self.driver.claim(uuid, holder(f"mps-server-{pid}"))
            if why:
                for u in done:
                    self.driver.release(u, holder(f"mps-server-{pid}"))
                self.log(f"Server {pid} failed to start: {why}")
                raise _Refused(why)
            done.append(uuid)

    def _end_server(self, pid: int) -> None:
        self.servers.pop(pid, None)
        if self.driver is not None:
            for uuid in self.visible:
                self.driver.release(uuid, holder(f"mps-server-{pid}"))

    def command(self, line: str) -> str:
        parts = line.split()
        if not parts:
            return ""
        cmd, args = parts[0], parts[1:]
        self.log("NEW UI")
        self.log(f"Cmd:{line}")
        with self.lock:
            if cmd == "get_server_list":
                return "\n".join(str(p) for p in self.servers)
            if cmd == "set_default_active_thread_percentage" and len(args) == 1:
                value = float(args[0])
                if not 0 < value <= 100:
                    return "Invalid percentage"
                self.threads = value
                return f"{value:.1f}"
            if cmd == "get_default_active_thread_percentage":
                return f"{self.threads:.1f}"
            if cmd == "set_default_device_pinned_mem_limit" and len(args) == 2:
                _mib(args[1])
                self.mem[args[0]] = args[1]
                return ""
            if cmd == "get_default_device_pinned_mem_limit" and len(args) == 1:
                return self.mem.get(args[0], "")
            if cmd == "start_server" and len(args) == 2 and args[0] == "-uid":
                self._server_for(int(args[1]))
                return ""
            if cmd == "shutdown_server" and args:
                self._end_server(int(args[0]))
                return ""
            if cmd == "quit":
                for pid in list(self.servers):
                    self.log(f"Try shutting down server {pid}, backoff is disabled")
                    self.log(f"Server {pid} exited with status 0")
                    self._end_server(pid)
                self.log("Exit with status 0")
                self.done.set()
                return ""
        raise ValueError(line)

    def client(self, req: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            try:
                s = self._server_for(int(req.get("uid", 0)))
            except _Refused as exc:
                return {"mps": True, "error": str(exc)}
            s.clients.add(int(req.get("pid", 0)))
            self.log(f"NEW CLIENT {req.get('pid', 0)} from user {req.get('uid', 0)}: Server already exists")
            env_threads = req.get("threads")
            threads = min(s.threads, float(env_threads)) if env_threads is not None else s.threads
            env_mem: dict[str, str] = req.get("mem") or {}
            mem: dict[str, float | None] = {}
            for ordinal, uuid in enumerate(req.get("gpus") or []):
                caps = []
                if uuid in s.mem:
                    caps.append(_mib(s.mem[uuid]))
                # A default by index counts in the daemon's CUDA_VISIBLE_DEVICES; without one the stand-in
                # knows no node order and takes the client's ordinal (the H200 had one GPU: the same).
                index = str(self.visible.index(uuid)) if uuid in self.visible else (
                    str(ordinal) if not self.visible else "")
                if index in s.mem:
                    caps.append(_mib(s.mem[index]))
                if str(ordinal) in env_mem:
                    caps.append(_mib(env_mem[str(ordinal)]))
                mem[uuid] = min(caps) if caps else None
            return {"mps": True, "server": s.pid, "thread_percentage": threads, "memory_limit_mib": mem}


def _serve(daemon: _Daemon) -> None:
    path = daemon.pipe / "control"

    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            line = self.rfile.readline().decode().strip()
            kind, _, rest = line.partition(" ")
            try:
                if kind == "PING":  # the stand-in's own readiness probe (-d waits on it); not a command
                    out = {"ok": True, "out": ""}
                elif kind == "UI":
                    out = {"ok": True, "out": daemon.command(rest)}
                elif kind == "CLIENT":
                    out = {"ok": True, "out": daemon.client(json.loads(rest))}
                else:
                    out = {"ok": False, "out": f"bad request {kind!r}"}
            except _Refused as exc:
                out = {"ok": False, "out": str(exc)}
            except (ValueError, KeyError) as exc:
                out = {"ok": False, "out": f"Invalid command: {exc}"}
            self.wfile.write(json.dumps(out).encode() + b"\n")

    with __import__("contextlib").suppress(FileNotFoundError):
        path.unlink()
    server = socketserver.ThreadingUnixStreamServer(str(path), Handler)
    server.daemon_threads = True
    (daemon.pipe / PID_FILE).write_text(str(os.getpid()))
    daemon.log(f"Starting control daemon using socket {path}")
    daemon.log(f"To connect CUDA applications to this daemon, set env CUDA_MPS_PIPE_DIRECTORY={daemon.pipe}")
    daemon.log("CUDA MPS Control binary version: 13000 (kubegpu stand-in)")
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    # A test that removed the directory without quitting leaves no daemon behind (the stand-in's only
    # departure from the real one, which would keep running).
    while not daemon.done.wait(0.5):
        if not path.exists():
            daemon.done.set()
    server.shutdown()
    server.server_close()
    for name in ("control", PID_FILE):
        with __import__("contextlib").suppress(FileNotFoundError):
            (daemon.pipe / name).unlink()


def _request(pipe: Path, line: str, timeout_s: float = 5.0) -> dict[str, Any] | None:
    """One request to the daemon on ``pipe``; None when nothing listens there."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(str(pipe / "control"))
            s.sendall(line.encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return None
    return json.loads(data) if data else None


def connect_client(env: dict[str, str], gpus: list[str], uid: int = 0, pid: int = 0,
                   driver_state: str | None = None) -> dict[str, Any]:
    """What a CUDA client with ``env`` on ``gpus`` (its visible GPUs, in order) gets: MPS limits, or
    ``{"mps": False}`` (no daemon behind its pipe directory: it runs on the GPU directly, unlimited); with
    ``"error"`` when the driver refuses it a context (its server's, or its own: the compute mode).
    ``driver_state``: the fake driver's directory (default: ``$KUBEGPU_STANDIN_DRIVER_STATE``)."""
    mem: dict[str, str] = {}
    for item in (env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT") or "").split(","):
        if "=" in item:
            k, v = item.split("=", 1)
            mem[k.strip()] = v.strip()
    threads = env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    req = {"uid": uid, "pid": pid or os.getpid(), "gpus": gpus, "mem": mem,
           "threads": float(threads) if threads else None}
    got = _request(_pipe_dir(env), "CLIENT " + json.dumps(req))
    if got is None or not got.get("ok"):
        driver = FakeDriverState(driver_state) if driver_state else _driver(os.environ)
        why = next((w for u in gpus if driver is not None and (w := driver.refusal(u))), "")
        return {"mps": False, "error": why} if why else {"mps": False}
    out: dict[str, Any] = got["out"]
    return out


def install(directory: str | os.PathLike[str]) -> str:
    """Write an executable ``nvidia-cuda-mps-control`` into ``directory`` that runs this stand-in."""
    path = Path(directory) / "nvidia-cuda-mps-control"
    src = str(Path(__file__).resolve().parent.parent)
    path.write_text(f"#!/bin/sh\nPYTHONPATH={src}${{PYTHONPATH:+:$PYTHONPATH}} "
                    f"exec {sys.executable} -m kubegpu_standins.mps_control \"$@\"\n")
    path.chmod(0o755)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    pipe = _pipe_dir(os.environ)
    log_dir = Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY") or DEFAULT_LOG)
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v]
    if args in (["-d"], ["-f"]):
        if _request(pipe, "PING", 1.0) is not None:
            print("An instance of this daemon is already running", file=sys.stderr)
            return 1
        pipe.mkdir(parents=True, exist_ok=True)
        log_dir.mkdir(parents=True, exist_ok=True)
        if args == ["-f"]:
            _serve(_Daemon(pipe, log_dir, visible, _driver(os.environ)))
            return 0
        subprocess.Popen([sys.executable, "-m", "kubegpu_standins.mps_control", "-f"], start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if _request(pipe, "PING", 1.0) is not None:
                return 0
            time.sleep(0.02)
        print("Failed to start the MPS control daemon", file=sys.stderr)
        return 1
    if args:
        print(f"unknown arguments {' '.join(args)} (want -d, -f or commands on stdin)", file=sys.stderr)
        return 2
    rc = 0
    for line in sys.stdin.read().splitlines():
        if not line.strip():
            continue
        got = _request(pipe, "UI " + line.strip())
        if got is None:
            print("Cannot find MPS control daemon process", file=sys.stderr)
            return 1
        if got["out"]:
            print(got["out"], file=sys.stdout if got["ok"] else sys.stderr)
        rc = rc or (0 if got["ok"] else 1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
