"""The one question both kubelet paths ask: "which MPS daemon holds this container, and what does it get?".

:class:`ShareEnforcer` joins the operator's setting (``shareEnforcement``), what each GPU allows
(:mod:`.capability`) and the daemons (:class:`~kubegpu.node.mps.manager.MpsManager`). It answers a
:class:`~kubegpu.node.mps.spec.Binding` (pipe, shared memory, limits), ``None`` when nothing is to be
enforced (a whole GPU, or enforcement off), or raises :class:`MpsError` with the reason, which the caller
turns into a refusal: a share on an enforced node is never served with limits that nothing holds.

Under ``strict`` it delegates to :class:`~kubegpu.node.mps.strict.StrictShares`, and the kubelet paths tell it
when GPUs change hands: :meth:`release_share` when a share ends (DRA unprepare), :meth:`claim_whole` before a
whole-GPU container gets a GPU (and :meth:`release_whole` after), :meth:`reconcile` with the holders alive
(the device-plugin path, which hears of no container's end), :meth:`stop` when the node daemon stops.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kubegpu.inventory.compute_modes import EXCLUSIVE_PROCESS
from kubegpu.model.inventory import NodeInventory
from kubegpu.model.share_shape import enforced_memory, enforced_percent, is_whole_part
from kubegpu.node.mps.capability import (
    ENFORCED_MODES,
    MODE_MPS,
    MODE_STRICT,
    MODE_UNENFORCED,
    Enforcement,
    gpu_enforcement,
    refusal,
)
from kubegpu.node.mps.compute_mode import ComputeModeGuard
from kubegpu.node.mps.control import MpsError
from kubegpu.node.mps.manager import MpsManager
from kubegpu.node.mps.spec import Binding, DaemonSpec, ShareShapeError, share_spec
from kubegpu.node.mps.strict import StrictShares


@dataclass(frozen=True, slots=True)
class GpuView:
    """One GPU's enforcement as an operator sees it."""

    mode: str  # strict, mps, none, unenforced
    reason: str
    compute_mode: str  # as kubegpu set or found it under strict ("" where kubegpu does not manage it)
    shape_lock: str  # strict: the share shape the GPU serves until it is empty ("" = none)
    escapable: bool  # whether a container could take more than its share by editing what it was given


class ShareEnforcer:
    """Thread-safe; ``replica_specs`` are the daemons of ``sharing.mps`` resources (by resource name)."""

    def __init__(self, manager: MpsManager | None, selected: str, inventory: NodeInventory, *,
                 time_sliced: Iterable[str] = (), replica_specs: Mapping[str, DaemonSpec] | None = None,
                 compute_modes: ComputeModeGuard | None = None, server_uid: int = 0) -> None:
        """``compute_modes`` is needed for ``strict`` (without it every strict share is refused, with the
        reason); ``server_uid``: the user strict MPS servers run for."""
        self.manager = manager
        self.strict = (StrictShares(manager, compute_modes, server_uid)
                       if selected == MODE_STRICT and manager is not None and compute_modes is not None else None)
        self.selected = selected
        self.inventory = inventory
        self.time_sliced = frozenset(time_sliced)
        self.replica_specs = dict(replica_specs or {})
        self._memory = {g.uuid: g.memory_bytes for g in inventory.gpus}
        self._shareable = frozenset(g.uuid for g in inventory.gpus if not g.mig_enabled)
        self._lock = threading.Lock()

    # ----- per GPU --------------------------------------------------------------------------------

    def replica_gpus(self) -> dict[str, DaemonSpec]:
        return {u: s for s in self.replica_specs.values() for u in s.uuids}

    def table(self) -> dict[str, Enforcement]:
        """GPU UUID -> how the shares on it are enforced now."""
        down = self.manager.down() if self.manager is not None else {}
        missing = self.manager.missing_reason if self.manager is not None else "no MPS manager"
        replicas = self.replica_gpus()
        out: dict[str, Enforcement] = {}
        for g in self.inventory.gpus:
            spec = replicas.get(g.uuid)
            reasons = "; ".join(f"MPS daemon {d.name} is down: {d.reason}" for d in down.get(g.uuid, ()))
            if spec is not None:  # sharing.mps: its daemon enforces the replicas
                why = missing or reasons
                out[g.uuid] = Enforcement(MODE_UNENFORCED, why) if why else Enforcement(MODE_MPS)
            else:
                out[g.uuid] = gpu_enforcement(g, self.selected, time_sliced=g.uuid in self.time_sliced,
                                              daemon_down=reasons, binary_missing=missing)
        return out

    def views(self) -> dict[str, GpuView]:
        """GPU UUID -> what status, the Device object, DRA slice attributes and metrics show of it."""
        modes = self.strict.modes() if self.strict is not None else {}
        locks = self.strict.locks() if self.strict is not None else {}
        out = {}
        for u, e in self.table().items():
            mode = modes[u].mode if u in modes else ""
            # Strict holds only once the GPU is exclusive; before its first share nothing runs there to escape.
            escapable = e.escapable or (u in modes and modes[u].shares > 0 and mode != EXCLUSIVE_PROCESS)
            out[u] = GpuView(e.mode, e.reason, mode, locks.get(u, ""), escapable)
        return out

    # ----- what Allocate / NodePrepareResources ask -------------------------------------------------

    def for_replicas(self, resource: str, order: Sequence[str]) -> Binding:
        spec = self.replica_specs.get(resource)
        if spec is None:
            raise MpsError(f"{resource}: no MPS daemon is configured for these replicas")
        if self.manager is None:
            raise MpsError(f"{resource}: no MPS manager runs on this node")
        return self.manager.serve(spec, order)

    def for_share(self, parts: Sequence[tuple[str, int, int]], order: Sequence[str] | None = None,
                  holder: str = "") -> Binding | None:
        """``parts``: (GPU uuid, core percent, memory bytes; 0 = all of it). None when nothing is enforced.
        ``holder`` names the share (pod UID/container, or claim UID) for :meth:`release_share`; without one,
        strict shares of one shape are one holder, released by :meth:`reconcile`."""
        if self.selected not in ENFORCED_MODES:
            return None
        # What the GPU's server enforces for each part, by the rule the placement core locks GPUs by
        # (model/share_shape.py): a memory-only share runs with every thread, a share without memory has all.
        full = [(u, enforced_percent(c), enforced_memory(m, self._memory.get(u, 0))) for u, c, m in parts]
        if all(u in self._memory and is_whole_part(c, m, self._memory[u]) for u, c, m in parts):
            return None  # whole GPUs: nothing to share, nothing to enforce
        gpus = {g.uuid: g for g in self.inventory.gpus}
        for u, _, _ in full:
            g = gpus.get(u)
            if g is None:
                raise MpsError(f"{u} is not a GPU of this node that MPS can share (a MIG device?)")
            why = refusal(g, u in self.time_sliced)
            if why:
                raise MpsError(f"GPU {g.index} ({u}): {why}")
        if self.manager is None:
            raise MpsError("no MPS manager runs on this node")
        try:
            spec = share_spec(full)
        except ShareShapeError as exc:
            raise MpsError(str(exc)) from exc
        seq = order or [u for u, _, _ in full]
        if self.selected == MODE_STRICT:
            return self._strict().serve(spec, seq, holder or spec.name)
        return self.manager.serve(spec, seq)

    # ----- GPUs changing hands (strict; no-ops otherwise) -------------------------------------------

    def _strict(self) -> StrictShares:
        if self.strict is None:
            raise MpsError("strict share enforcement needs the GPUs' compute modes (NVML) and MPS; this node "
                           "has no compute-mode control, so strict shares are refused")
        return self.strict

    def release_share(self, holder: str, uuids: Iterable[str]) -> None:
        if self.strict is not None:
            self.strict.release(holder, uuids)

    def claim_whole(self, uuid: str, holder: str) -> None:
        """Before a whole-GPU container gets ``uuid``; raises MpsError (the reason) while strict shares hold it.
        A MIG device (or a GPU with MIG on) takes no strict shares: nothing to claim."""
        if self.strict is not None and uuid in self._shareable:
            self.strict.claim_whole(uuid, holder)

    def release_whole(self, uuid: str, holder: str) -> None:
        if self.strict is not None and uuid in self._shareable:
            self.strict.release_whole(uuid, holder)

    def holders(self, uuid: str) -> tuple[frozenset[str], frozenset[str]]:
        """(share holders, whole-GPU holders) strict enforcement knows on ``uuid`` (empty otherwise)."""
        return self.strict.guard.holders(uuid) if self.strict is not None else (frozenset(), frozenset())

    def reconcile(self, shares: Mapping[str, Iterable[str]], whole: Mapping[str, Iterable[str]]) -> list[str]:
        return self.strict.reconcile(shares, whole) if self.strict is not None else []

    def stop(self) -> dict[str, str]:
        """GPU UUID -> why it keeps ``EXCLUSIVE_PROCESS`` after the node daemon stops (shares still run)."""
        return self.strict.stop() if self.strict is not None else {}
