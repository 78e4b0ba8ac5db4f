"""The one question both kubelet paths ask: "which MPS daemon holds this container, and what does it get?".

:class:`ShareEnforcer` joins the operator's setting (``shareEnforcement``), what each GPU allows
(:mod:`.capability`) and the daemons (:class:`~kubegpu.node.mps.manager.MpsManager`). It answers a
:class:`~kubegpu.node.mps.spec.Binding` (pipe, shared memory, limits), ``None`` when nothing is to be
enforced (a whole GPU, or enforcement off), or raises :class:`MpsError` with the reason, which the caller
turns into a refusal: a share on an enforced node is never served with limits that nothing holds.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence

from kubegpu.model.inventory import NodeInventory
from kubegpu.node.mps.capability import MODE_MPS, MODE_UNENFORCED, Enforcement, gpu_enforcement, refusal
from kubegpu.node.mps.control import MpsError
from kubegpu.node.mps.manager import MpsManager
from kubegpu.node.mps.spec import Binding, DaemonSpec, ShareShapeError, share_spec


class ShareEnforcer:
    """Thread-safe; ``replica_specs`` are the daemons of ``sharing.mps`` resources (by resource name)."""

    def __init__(self, manager: MpsManager | None, selected: str, inventory: NodeInventory, *,
                 time_sliced: Iterable[str] = (), replica_specs: Mapping[str, DaemonSpec] | None = None) -> None:
        self.manager = manager
        self.selected = selected
        self.inventory = inventory
        self.time_sliced = frozenset(time_sliced)
        self.replica_specs = dict(replica_specs or {})
        self._memory = {g.uuid: g.memory_bytes for g in inventory.gpus}
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

    # ----- what Allocate / NodePrepareResources ask -------------------------------------------------

    def for_replicas(self, resource: str, order: Sequence[str]) -> Binding:
        spec = self.replica_specs.get(resource)
        if spec is None:
            raise MpsError(f"{resource}: no MPS daemon is configured for these replicas")
        if self.manager is None:
            raise MpsError(f"{resource}: no MPS manager runs on this node")
        return self.manager.serve(spec, order)

    def for_share(self, parts: Sequence[tuple[str, int, int]], order: Sequence[str] | None = None) -> Binding | None:
        """``parts``: (GPU uuid, core percent, memory bytes; 0 = all of it). None when nothing is enforced."""
        if self.selected != MODE_MPS:
            return None
        # A memory-only share (gpu-memory without gpu-core: recorded with 0 % compute) reserves no compute, so
        # its daemon limits memory and leaves the threads at 100 %.
        full = [(u, c if 1 <= c <= 100 else 100, m or self._memory.get(u, 0)) for u, c, m in parts]
        if all(c >= 100 and m >= self._memory.get(u, m + 1) for u, c, m in full):
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
        return self.manager.serve(spec, order or [u for u, _, _ in full])
