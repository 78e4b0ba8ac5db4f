"""The driver-side state the fake NVML and the stand-in MPS control share: compute modes and GPU contexts.

On a real node the driver holds them: ``nvidia-smi -c`` / ``nvmlDeviceSetComputeMode`` set a GPU's compute
mode, and every process (an MPS server or a CUDA program that skips MPS) that opens a context on a GPU holds
one. The driver refuses a context as NVIDIA documents: in ``Prohibited`` always; in ``Exclusive_Process``
when another process holds one (with MPS, the one process is the MPS server). Here the fake backend (in the
node daemon's process) and the stand-in daemons and clients (other processes) meet in one directory:
``<uuid>.mode`` holds a mode, ``<uuid>.ctx/<holder>`` is a context; a lock file makes check-and-claim one
step across processes. A holder is named ``<OS pid>-<what>``: as the driver frees the contexts of a process
that died, a context whose process is gone does not count.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final

# As kubegpu.inventory.compute_modes spells them; this module stays standard-library only, because every run
# of the stand-in nvidia-cuda-mps-control (one per command) imports it.
DEFAULT: Final = "Default"
EXCLUSIVE_PROCESS: Final = "Exclusive_Process"
PROHIBITED: Final = "Prohibited"
MODES: Final = (DEFAULT, EXCLUSIVE_PROCESS, PROHIBITED)
ENV_DRIVER_STATE: Final = "KUBEGPU_STANDIN_DRIVER_STATE"  # where the stand-in processes find the directory


class FakeDriverState:
    """Compute modes and contexts of the fake GPUs, in ``directory`` (shared by every process)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.dir / ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def mode(self, uuid: str) -> str:
        try:
            return (self.dir / f"{uuid}.mode").read_text().strip() or DEFAULT
        except FileNotFoundError:
            return DEFAULT

    def set_mode(self, uuid: str, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown compute mode {mode!r} (one of {', '.join(MODES)})")
        with self._locked():
            (self.dir / f"{uuid}.mode").write_text(mode)

    def contexts(self, uuid: str) -> list[str]:
        """The live contexts on ``uuid`` (holders whose process still runs)."""
        d = self.dir / f"{uuid}.ctx"
        return sorted(p.name for p in d.iterdir() if _alive(p.name)) if d.is_dir() else []

    def refusal(self, uuid: str, holder: str = "") -> str:
        """Why the driver would refuse a new context on ``uuid`` now ("" when it would give one)."""
        mode = self.mode(uuid)
        if mode == PROHIBITED:
            return f"GPU {uuid} is in compute mode {PROHIBITED}: no context may be created"
        others = [c for c in self.contexts(uuid) if c != holder]
        if mode == EXCLUSIVE_PROCESS and others:
            return (f"GPU {uuid} is in compute mode {EXCLUSIVE_PROCESS} and {others[0]} holds its context: "
                    "all CUDA-capable devices are busy or unavailable")
        return ""

    def claim(self, uuid: str, holder: str) -> str:
        """Open a context for ``holder`` (``<OS pid>-<name>``); "" when given, else the driver's refusal."""
        with self._locked():
            why = self.refusal(uuid, holder)
            if not why:
                d = self.dir / f"{uuid}.ctx"
                d.mkdir(exist_ok=True)
                (d / holder).touch()
            return why

    def release(self, uuid: str, holder: str) -> None:
        with self._locked():
            (self.dir / f"{uuid}.ctx" / holder).unlink(missing_ok=True)


def holder(name: str, pid: int | None = None) -> str:
    """A context holder's name for process ``pid`` (this one by default)."""
    return f"{os.getpid() if pid is None else pid}-{name}"


def _alive(holder_name: str) -> bool:
    pid = holder_name.split("-", 1)[0]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
