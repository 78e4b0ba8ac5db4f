"""GPU compute modes under strict share enforcement: which GPU is ``EXCLUSIVE_PROCESS``, since when, and back.

In ``EXCLUSIVE_PROCESS`` only one process may hold a context on a GPU. With MPS that process is the MPS
server, so a container that skips its server (its pipe directory emptied or unset) gets no GPU at all
instead of all of it. :class:`ComputeModeGuard` switches a GPU to that mode before its first enforced share
(and before its MPS server starts), and back to the mode it found once the GPU holds no share, before a
whole-GPU container gets it, and when the node daemon stops. It never switches under a container the switch
would break: a share is refused while a whole-GPU container holds the GPU, and a whole-GPU container while
shares do, each with the reason.

What it found and who holds each GPU is written to one file under the MPS root, so a restarted node daemon
with shares still running keeps the GPU exclusive and still restores the operator's mode later.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Protocol, runtime_checkable

from kubegpu.inventory.compute_modes import EXCLUSIVE_PROCESS, MODES, PROHIBITED
from kubegpu.node.mps.control import MpsError

log = logging.getLogger(__name__)

STATE_FILE: Final = "compute-modes.json"


@runtime_checkable
class ComputeModes(Protocol):
    """Read and set a GPU's compute mode (NVML on a real node, the fake backend elsewhere)."""

    def compute_mode(self, uuid: str) -> str:
        """One of :data:`~kubegpu.inventory.compute_modes.MODES`. Raises InventoryError."""
        ...

    def set_compute_mode(self, uuid: str, mode: str) -> None:
        """Raises InventoryError (root is needed, as for ``nvidia-smi -c``)."""
        ...


class ComputeModeError(MpsError):
    """A compute-mode switch refused or failed; the message says why (the caller refuses the container)."""


@dataclass(slots=True)
class _Held:
    found: str  # the mode the GPU was in before kubegpu switched it
    shares: set[str] = field(default_factory=set)
    whole: set[str] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class GpuMode:
    """What status, the Device object and metrics show of one GPU under strict enforcement."""

    uuid: str
    mode: str
    found: str
    shares: int
    whole: int


class ComputeModeGuard:
    """Thread-safe. ``state_dir`` is the MPS root (host path, survives the node daemon)."""

    def __init__(self, modes: ComputeModes, state_dir: str | os.PathLike[str]) -> None:
        self.modes = modes
        self.path = Path(state_dir) / STATE_FILE
        self._lock = threading.Lock()
        self._gpus: dict[str, _Held] = {}
        self._load()

    # ----- what the kubelet paths call -----------------------------------------------------------

    def enter_share(self, uuid: str, holder: str) -> None:
        """Before a share container (and its MPS server) starts on ``uuid``: the GPU is exclusive after."""
        with self._lock:
            held = self._gpus.get(uuid)
            if held is not None and held.whole:
                raise ComputeModeError(
                    f"GPU {uuid} is held whole by {', '.join(sorted(held.whole))}: switching it to "
                    f"{EXCLUSIVE_PROCESS} for a share would break that container; the share waits until it ends")
            if held is not None and holder in held.shares and self._mode(uuid) == EXCLUSIVE_PROCESS:
                return
            current = self._mode(uuid)
            if current == PROHIBITED:
                raise ComputeModeError(f"GPU {uuid} is in compute mode {PROHIBITED} (set by its operator): "
                                       "no MPS server may run on it")
            if held is None:
                held = self._gpus[uuid] = _Held(found=current)
                self._save()  # what to restore is on disk before the mode changes
            if current != EXCLUSIVE_PROCESS:
                self._set(uuid, EXCLUSIVE_PROCESS)
            held.shares.add(holder)
            self._save()

    def leave_share(self, uuid: str, holder: str) -> bool:
        """A share on ``uuid`` ended; True when it was the last and the GPU's mode was restored."""
        with self._lock:
            held = self._gpus.get(uuid)
            if held is None:
                return False
            held.shares.discard(holder)
            return self._restore_if_free(uuid, held)

    def enter_whole(self, uuid: str, holder: str) -> None:
        """Before a whole-GPU container gets ``uuid``: refused while shares hold it, else its mode restored."""
        with self._lock:
            held = self._gpus.get(uuid)
            if held is not None and held.shares:
                raise ComputeModeError(
                    f"GPU {uuid} holds {len(held.shares)} MPS-enforced share(s) in {EXCLUSIVE_PROCESS}: a whole-GPU "
                    "container cannot get it until they end")
            if held is not None and held.found != self._mode(uuid):
                self._set(uuid, held.found)
            if held is None:
                held = self._gpus[uuid] = _Held(found=self._mode(uuid))
            held.whole.add(holder)
            self._save()

    def leave_whole(self, uuid: str, holder: str) -> None:
        with self._lock:
            held = self._gpus.get(uuid)
            if held is None:
                return
            held.whole.discard(holder)
            self._restore_if_free(uuid, held)

    def reconcile(self, shares: Mapping[str, Iterable[str]], whole: Mapping[str, Iterable[str]]) -> list[str]:
        """The holders that live now, per GPU (the device-plugin path learns ends only from the pods it sees);
        GPUs left with no holder get their mode back. Returns the GPUs restored."""
        restored = []
        with self._lock:
            for uuid, held in list(self._gpus.items()):
                held.shares = set(shares.get(uuid, ()))
                held.whole = set(whole.get(uuid, ()))
                if self._restore_if_free(uuid, held):
                    restored.append(uuid)
            self._save()
        return restored

    def stop(self) -> dict[str, str]:
        """The node daemon stops: every GPU with no share gets its mode back. A GPU whose shares still run
        stays exclusive (its containers outlive the node daemon; switching it back would let any of them
        escape) and is named with the reason; the next node daemon restores it once they end."""
        kept: dict[str, str] = {}
        with self._lock:
            for uuid, held in list(self._gpus.items()):
                held.whole.clear()  # whole-GPU containers are not bound by the mode: nothing to keep for them
                if held.shares:
                    kept[uuid] = f"{len(held.shares)} share(s) still run; it stays {EXCLUSIVE_PROCESS}"
                else:
                    self._restore_if_free(uuid, held)
            self._save()
        return kept

    def table(self) -> dict[str, GpuMode]:
        with self._lock:
            items = list(self._gpus.items())
        out = {}
        for uuid, held in items:
            try:
                mode = self.modes.compute_mode(uuid)
            except Exception as exc:  # an unreadable mode is shown as such, never hidden
                mode = f"unknown ({exc})"
            out[uuid] = GpuMode(uuid, mode, held.found, len(held.shares), len(held.whole))
        return out

    def holders(self, uuid: str) -> tuple[frozenset[str], frozenset[str]]:
        """(share holders, whole-GPU holders) of ``uuid``."""
        with self._lock:
            held = self._gpus.get(uuid)
            return (frozenset(held.shares), frozenset(held.whole)) if held else (frozenset(), frozenset())

    # ----- internals (caller holds the lock) --------------------------------------------------------

    def _mode(self, uuid: str) -> str:
        try:
            return self.modes.compute_mode(uuid)
        except Exception as exc:
            raise ComputeModeError(f"GPU {uuid}: cannot read its compute mode: {exc}") from exc

    def _set(self, uuid: str, mode: str) -> None:
        try:
            self.modes.set_compute_mode(uuid, mode)
        except Exception as exc:
            raise ComputeModeError(f"GPU {uuid}: cannot set compute mode {mode}: {exc}") from exc
        got = self._mode(uuid)
        if got != mode:
            raise ComputeModeError(f"GPU {uuid}: compute mode {got} after setting {mode}")
        log.info("GPU %s: compute mode %s", uuid, mode)

    def _restore_if_free(self, uuid: str, held: _Held) -> bool:
        if held.shares or held.whole:
            self._save()
            return False
        if self._mode(uuid) != held.found:
            self._set(uuid, held.found)
        del self._gpus[uuid]
        self._save()
        return True

    def _save(self) -> None:
        body = {u: {"found": h.found, "shares": sorted(h.shares), "whole": sorted(h.whole)}
                for u, h in self._gpus.items()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{STATE_FILE}.tmp")
        tmp.write_text(json.dumps(body, sort_keys=True))
        os.replace(tmp, self.path)

    def _load(self) -> None:
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            log.error("compute modes: %s unreadable (%s); GPUs it named keep their current mode", self.path, exc)
            return
        for uuid, d in (raw.items() if isinstance(raw, dict) else ()):
            if isinstance(d, dict) and d.get("found") in MODES:
                self._gpus[str(uuid)] = _Held(str(d["found"]), set(map(str, d.get("shares") or ())),
                                              set(map(str, d.get("whole") or ())))
