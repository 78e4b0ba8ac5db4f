"""Strict share enforcement on a node: one MPS server per GPU, the GPU exclusive, one share shape at a time.

A GPU serving strict shares runs one control daemon whose defaults are the share shape (the environment can
only lower them), with its server started at once, in ``EXCLUSIVE_PROCESS``: the server holds the GPU's one
context, so a container that skips it (pipe directory emptied or unset) is refused the GPU. Only shares of
the GPU's running shape join it (the placement core keeps to the same lock, placement/shape_lock.py; this is
the node's backstop). When the GPU's last share ends, its daemon quits and then its mode goes back; a
whole-GPU container gets the GPU only then. :class:`ShareEnforcer` delegates here for ``strict``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence

from kubegpu.node.mps.compute_mode import ComputeModeGuard, GpuMode
from kubegpu.node.mps.control import MpsError
from kubegpu.node.mps.manager import MpsManager
from kubegpu.node.mps.spec import Binding, DaemonSpec


class StrictShares:
    """Thread-safe. ``server_uid``: the user the GPU's server runs for (its clients must run as that user)."""

    def __init__(self, manager: MpsManager, guard: ComputeModeGuard, server_uid: int = 0) -> None:
        self.manager = manager
        self.guard = guard
        self.server_uid = server_uid
        self._lock = threading.Lock()

    def serve(self, spec: DaemonSpec, order: Sequence[str], holder: str) -> Binding:
        """The binding of one share (``holder`` names it: a pod/container or a claim). Raises MpsError."""
        with self._lock:
            for u in spec.uuids:
                other = self.manager.daemon_of(u)
                # The placement core keeps to the same key (model/share_shape.py); a daemon over other GPUs is
                # another server even with the same key, so a share spanning several GPUs joins only its own.
                if other is not None and (other.shape_on(u) != spec.shape_on(u)
                                          or set(other.uuids) != set(spec.uuids)):
                    raise MpsError(
                        f"GPU {u} is locked to the share shape {other.shape_on(u).describe()} while its shares "
                        f"run (strict enforcement: one MPS server per GPU); a {spec.shape_on(u).describe()} "
                        "share waits until it is empty")
            entered: list[str] = []
            try:
                for u in spec.uuids:
                    new = holder not in self.guard.holders(u)[0]
                    self.guard.enter_share(u, holder)  # a known holder: the mode is checked again
                    if new:
                        entered.append(u)
                return self.manager.serve(spec, order, server_uid=self.server_uid)
            except MpsError:
                for u in entered:
                    self._leave(u, holder)
                raise

    def release(self, holder: str, uuids: Iterable[str]) -> None:
        """A share ended (DRA unprepare; a pod gone): its GPUs' daemon quits and their mode goes back with
        the last one."""
        with self._lock:
            for u in uuids:
                self._leave(u, holder)

    def claim_whole(self, uuid: str, holder: str) -> None:
        """Before a whole-GPU container gets ``uuid``. Raises MpsError (with the reason) while shares hold it."""
        with self._lock:
            if not self.guard.holders(uuid)[0]:
                self._retire_on(uuid)  # an idle server must not keep the GPU's one context
            self.guard.enter_whole(uuid, holder)

    def release_whole(self, uuid: str, holder: str) -> None:
        with self._lock:
            self.guard.leave_whole(uuid, holder)

    def reconcile(self, shares: Mapping[str, Iterable[str]], whole: Mapping[str, Iterable[str]]) -> list[str]:
        """The holders alive now, per GPU (the device-plugin path has no call when a container ends): daemons
        of GPUs with no live share quit, then those GPUs' modes go back. Returns the GPUs restored."""
        live = {u: set(h) for u, h in shares.items() if h}
        with self._lock:
            for u in list(self.guard.table()):
                if u not in live:
                    self._retire_on(u)
            return self.guard.reconcile(live, whole)

    def stop(self) -> dict[str, str]:
        """The node daemon stops: GPUs without shares get their mode back; those with shares stay exclusive."""
        with self._lock:
            return self.guard.stop()

    def locks(self) -> dict[str, str]:
        """GPU UUID -> the share shape it is locked to, as the extender reads it back
        (:meth:`~kubegpu.model.share_shape.ShareShape.describe`)."""
        out = {}
        for u in self.guard.table():
            spec = self.manager.daemon_of(u)
            if spec is not None:
                out[u] = spec.shape_on(u).describe()
        return out

    def modes(self) -> dict[str, GpuMode]:
        return self.guard.table()

    # ----- internals (caller holds the lock) ---------------------------------------------------------

    def _leave(self, uuid: str, holder: str) -> None:
        if self.guard.holders(uuid)[0] <= {holder}:
            self._retire_on(uuid)  # the server goes before the mode does
        self.guard.leave_share(uuid, holder)

    def _retire_on(self, uuid: str) -> None:
        spec = self.manager.daemon_of(uuid)
        if spec is not None:
            self.manager.retire(spec.name)
