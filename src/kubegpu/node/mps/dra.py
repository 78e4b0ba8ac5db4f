"""The MPS side of the DRA driver: consumable-capacity shares enforced like device-plugin shares.

``NodePrepareResources`` asks :meth:`DraEnforcement.for_share` for a claim's binding (pipe, shared memory,
limits); a share that cannot be enforced is refused with the reason. While a GPU's shares cannot be
enforced (daemon down, binary missing, GPU MPS cannot limit) :meth:`DraEnforcement.blocked` names it with
the reason, and the driver taints its shared device, so the scheduler places no new share there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

from kubegpu.model.inventory import NodeInventory
from kubegpu.node.mps.capability import MODE_MPS, MODE_STRICT, Enforcement
from kubegpu.node.mps.compute_mode import ComputeModeGuard, ComputeModes
from kubegpu.node.mps.control import MpsError, find_binary
from kubegpu.node.mps.enforcer import GpuView, ShareEnforcer
from kubegpu.node.mps.manager import MpsManager
from kubegpu.node.mps.spec import Binding


class DraEnforcement:
    """One MPS manager for the DRA driver; ``on_change()`` is called when a daemon goes up or down."""

    def __init__(self, mps_root: str, driver_root: str, binary: str = "", *,
                 on_change: Callable[[], None] | None = None, interval_s: float = 5.0, selected: str = MODE_MPS,
                 compute_modes: ComputeModes | None = None, server_uid: int = 0,
                 base_env: Mapping[str, str] | None = None) -> None:
        """``selected``: ``mps`` or ``strict`` (then ``compute_modes``, the inventory backend, switches GPUs)."""
        self.manager = MpsManager(find_binary(driver_root, binary), mps_root, interval_s=interval_s,
                                  base_env=base_env)
        self.selected = selected
        self.server_uid = server_uid
        self.guard = ComputeModeGuard(compute_modes, mps_root) if compute_modes is not None else None
        if on_change is not None:
            self.manager.add_listener(on_change)
        self._enforcer: ShareEnforcer | None = None
        self._lock = threading.Lock()

    def start(self, inventory: NodeInventory) -> None:
        self.set_inventory(inventory)
        if self.manager.binary is not None:
            self.manager.recover((g.uuid for g in inventory.gpus),
                                 self.server_uid if self.selected == MODE_STRICT else None)
        self.manager.start()

    def set_inventory(self, inventory: NodeInventory) -> None:
        with self._lock:
            self._enforcer = ShareEnforcer(self.manager, self.selected, inventory, compute_modes=self.guard,
                                           server_uid=self.server_uid)

    def _current(self) -> ShareEnforcer:
        with self._lock:
            if self._enforcer is None:
                raise MpsError("the MPS side of the DRA driver has no inventory yet")
            return self._enforcer

    def for_share(self, parts: Sequence[tuple[str, int, int]], order: Sequence[str],
                  holder: str = "") -> Binding | None:
        """``holder``: the claim (UID) the share is prepared for; :meth:`release` with it at unprepare."""
        return self._current().for_share(parts, order, holder)

    def release(self, holder: str, uuids: Sequence[str]) -> None:
        """A claim's share was unprepared (strict: the GPU's daemon quits and its mode goes back with the last)."""
        self._current().release_share(holder, uuids)

    def claim_whole(self, uuid: str, holder: str) -> None:
        """Before a claim gets GPU ``uuid`` whole; raises MpsError (the reason) while strict shares hold it."""
        self._current().claim_whole(uuid, holder)

    def release_whole(self, uuid: str, holder: str) -> None:
        self._current().release_whole(uuid, holder)

    def views(self) -> dict[str, GpuView]:
        """Per GPU what the slices, status and metrics show (:meth:`ShareEnforcer.views`)."""
        try:
            return self._current().views()
        except MpsError:
            return {}

    def table(self) -> dict[str, Enforcement]:
        try:
            return self._current().table()
        except MpsError:
            return {}

    def blocked(self) -> dict[str, str]:
        """GPU UUID -> why shares on it cannot be enforced now."""
        return {u: f"shares cannot be enforced: {e.reason}" for u, e in self.table().items() if not e.enforced}

    def stop(self) -> dict[str, str]:
        """GPU UUID -> why it keeps its mode and its server (strict: prepared shares still run)."""
        kept = self._enforcer.stop() if self._enforcer is not None else {}
        self.manager.stop(keep=kept)
        return kept
