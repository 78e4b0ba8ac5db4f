"""One MPS control daemon, driven through ``nvidia-cuda-mps-control`` exactly as an operator would.

``nvidia-cuda-mps-control -d`` with ``CUDA_MPS_PIPE_DIRECTORY`` / ``CUDA_MPS_LOG_DIRECTORY`` under the MPS
root starts it; each command is one run of the same binary with the command on its standard input, as
NVIDIA's device plugin does. ``CUDA_VISIBLE_DEVICES`` names the daemon's GPUs, so its servers never touch
another GPU. Every call has a timeout: a hung daemon is a daemon that does not answer.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kubegpu.node.mps.spec import ENV_LOG, ENV_PIPE, SHM_DIR, DaemonSpec, GpuLimit

log = logging.getLogger(__name__)

CONTROL_BINARY = "nvidia-cuda-mps-control"
# Where NVIDIA's driver packages put it, relative to the driver root (the H200's container had the
# first; driver containers mount the host's under /run/nvidia/driver with the same layout).
BINARY_DIRS = ("usr/local/nvidia/bin", "usr/bin", "usr/local/bin", "bin")


SPEC_FILE = "spec.json"


def read_spec(path: Path) -> DaemonSpec:
    """A spec recorded by :meth:`MpsControl.start`; raises ValueError (ShareShapeError) when it is not one."""
    d = json.loads(path.read_text())
    spec = DaemonSpec(name=str(d["name"]), kind=str(d["kind"]), thread_percentage=int(d["threadPercentage"]),
                      gpus=tuple(GpuLimit(str(u), int(m)) for u, m in d["gpus"]))
    if spec.name != path.parent.name:
        raise ValueError(f"{path}: names daemon {spec.name!r}")
    return spec


class MpsError(RuntimeError):
    """The control daemon could not be started or did not answer; the message says what it said."""


def find_binary(driver_root: str, override: str = "") -> str | None:
    """The control binary: ``override``, else under the driver root, else on PATH (where the NVIDIA container
    runtime puts it with the compute capability); None when there is none."""
    candidates = [override] if override else [
        *(os.path.join(driver_root, d, CONTROL_BINARY) for d in BINARY_DIRS), shutil.which(CONTROL_BINARY) or ""]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


@dataclass(frozen=True, slots=True)
class ControlPaths:
    root: Path  # <mps root>/<daemon name>

    @property
    def pipe(self) -> Path:
        return self.root / "pipe"

    @property
    def log(self) -> Path:
        return self.root / "log"


class MpsControl:
    """Start, command, check and stop the control daemon of one :class:`DaemonSpec`."""

    def __init__(self, binary: str, mps_root: str, spec: DaemonSpec, *, timeout_s: float = 5.0,
                 base_env: Mapping[str, str] | None = None) -> None:
        self.binary = binary
        self.spec = spec
        self.paths = ControlPaths(Path(mps_root) / spec.name)
        self.shm = Path(mps_root) / SHM_DIR
        self.timeout_s = timeout_s
        env = dict(base_env or {})  # the node's environment, passed down from its entry
        env[ENV_PIPE] = str(self.paths.pipe)
        env[ENV_LOG] = str(self.paths.log)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(spec.uuids)
        self.env = env

    def _run(self, args: list[str], stdin: str = "") -> tuple[int, str, str]:
        try:
            p = subprocess.run([self.binary, *args], input=stdin, capture_output=True, text=True,
                               env=self.env, timeout=self.timeout_s, check=False)
        except subprocess.TimeoutExpired as exc:
            raise MpsError(f"{self.binary} {' '.join(args)}: no answer within {self.timeout_s:g}s") from exc
        except OSError as exc:
            raise MpsError(f"cannot run {self.binary}: {exc}") from exc
        return p.returncode, p.stdout.strip(), p.stderr.strip()

    def command(self, text: str) -> str:
        """Send one command; its output. Raises MpsError when the daemon does not take it."""
        rc, out, err = self._run([], text + "\n")
        if rc != 0:
            raise MpsError(f"MPS daemon {self.spec.name}: {text.split()[0]!r} failed (exit {rc}): "
                           f"{(err or out)[:300] or 'no output'}")
        return out

    def start(self) -> None:
        """Create the directories and run ``-d``. An instance already running on the pipe is kept."""
        for d in (self.paths.pipe, self.paths.log, self.shm):
            d.mkdir(parents=True, exist_ok=True)
        # Clients run as any user: they must reach the pipe and write the shared memory.
        os.chmod(self.paths.pipe, 0o755)
        os.chmod(self.shm, 0o1777)
        self._remember()
        rc, out, err = self._run(["-d"])
        if rc != 0:
            if self.answers():
                log.info("MPS daemon %s was already running; adopting it", self.spec.name)
                return
            raise MpsError(f"MPS daemon {self.spec.name}: {self.binary} -d failed (exit {rc}): "
                           f"{(err or out)[:300] or 'no output'}")
        log.info("MPS daemon %s started (%s on %s)", self.spec.name, self.spec.describe(),
                 ",".join(self.spec.uuids))

    def _remember(self) -> None:
        """Record the spec beside its pipe: a restarted node daemon starts this daemon again from it, so a
        container whose allocation the kubelet kept (it does not call Allocate again on a container restart)
        finds its daemon behind its pipe."""
        body = json.dumps({"name": self.spec.name, "kind": self.spec.kind,
                           "threadPercentage": self.spec.thread_percentage,
                           "gpus": [[g.uuid, g.memory_mib] for g in self.spec.gpus]})
        tmp = self.paths.root / f".{SPEC_FILE}.tmp"
        tmp.write_text(body)
        os.replace(tmp, self.paths.root / SPEC_FILE)

    def set_defaults(self) -> None:
        for cmd in self.spec.default_commands():
            self.command(cmd)

    def check_defaults(self) -> str:
        """"" when the daemon holds this spec's thread default, else what it holds."""
        got = self.command("get_default_active_thread_percentage")
        try:
            value = float(got.split()[-1])
        except (ValueError, IndexError):
            return f"unreadable active thread default {got[:80]!r}"
        if abs(value - self.spec.thread_percentage) > 0.01:
            return f"active thread default {value:g} instead of {self.spec.thread_percentage}"
        return ""

    def server_list(self) -> list[int]:
        out = self.command("get_server_list")
        return [int(t) for t in out.split() if t.isdigit()]

    def answers(self) -> bool:
        try:
            self.server_list()
        except MpsError:
            return False
        return True

    def listening(self) -> bool:
        """Whether the daemon's control pipe is there (it goes with the daemon): a look, not a question."""
        return (self.paths.pipe / "control").exists()

    def forget(self) -> None:
        """Remove the record :meth:`start` wrote (the daemon is retired, not to be started again)."""
        (self.paths.root / SPEC_FILE).unlink(missing_ok=True)

    def quit(self) -> None:
        try:
            self.command("quit")
        except MpsError as exc:
            log.info("MPS daemon %s: quit: %s", self.spec.name, exc)
