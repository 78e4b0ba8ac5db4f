"""Strict MPS enforcement in the extender: a share never goes to a strict GPU that serves another share shape.

A strict GPU runs one MPS server, so it serves one share shape at a time (placement/shape_lock.py; the node
refuses the rest as its backstop). The lock is derived here, never stored apart: a GPU is strict when its
node's Device object says so (``shareEnforcement.mode: strict``), and its lock is the shape of the shares the
ledger holds on it (model/share_shape.py: what the node enforces per GPU), together with the lock the node
reports for shares the ledger may not know (a share still running after its pod went, a pod another scheduler
bound). Where the two disagree the GPU takes no new share until they agree again.

Kept per array layout, refreshed on the rows changed since (a bind changes one row of thousands), like the
mirror's candidates; a cluster without strict GPUs costs one check per call.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from kubegpu.model.allocation import DeviceGrant
from kubegpu.model.inventory import Gpu
from kubegpu.model.share_enforcement import is_strict
from kubegpu.model.share_shape import ShareShape, is_whole_part, parse_shape, share_shape
from kubegpu.placement import Demand
from kubegpu.placement.shape_lock import NO_LOCK, ShapeLocks
from kubegpu.scheduler.accounting import Ledger
from kubegpu.scheduler.mirror import ArrayMirror
from kubegpu.scheduler.nodes import NodeRecord


def grant_shapes(grants: tuple[DeviceGrant, ...], gpus: Mapping[str, Gpu]) -> dict[str, ShareShape]:
    """GPU UUID -> the shape one container's share is enforced with there (empty for whole GPUs and MIG): the
    node serves a container's parts with one daemon unless every part is a whole GPU (node/mps/enforcer.py)."""
    parts = [g for g in grants if g.mig_uuid is None and g.uuid in gpus]
    if all(is_whole_part(g.core, g.memory_bytes, gpus[g.uuid].memory_bytes) for g in parts):
        return {}
    return {g.uuid: share_shape(g.core, g.memory_bytes, gpus[g.uuid].memory_bytes, len(parts)) for g in parts}


class ExtenderShapeLocks:
    """The lock of every strict GPU, as a :class:`ShapeLocks` over the mirror's rows."""

    def __init__(self, nodes: dict[str, NodeRecord], mirror: ArrayMirror, ledger: Ledger) -> None:
        self.nodes = nodes
        self.mirror = mirror
        self.ledger = ledger
        self._locks: ShapeLocks | None = None
        self._layout = -1
        self._epoch = -1
        self._version = np.zeros(0, np.int64)
        self._strict_rows = np.zeros(0, bool)
        self._any_strict = False  # _strict_rows.any(), as of the last refresh

    def current(self) -> ShapeLocks | None:
        """The locks of the current arrays; None when no GPU is strict (nothing to keep to)."""
        cluster = self.mirror.cluster
        locks = self._locks
        if locks is None or self._layout != cluster.layout:
            locks = self._locks = ShapeLocks.of(cluster, np.zeros(cluster.core_free.shape, bool))
            self._strict_rows = np.zeros(cluster.n_nodes, bool)
            stale, fresh = np.arange(cluster.n_nodes), True  # new arrays: nothing to clear first
            self._layout = cluster.layout
        elif self._epoch != cluster.epoch:
            stale, fresh = np.flatnonzero(self._version != cluster.version), False
        else:  # nothing changed since the last call (filter, prioritize and bind of one pod): nothing to copy
            return locks if self._any_strict else None
        for row in stale.tolist():
            self._strict_rows[row] = self._rebuild_row(locks, row, cluster.names[row], fresh)
        self._version = cluster.version.copy()
        self._epoch = cluster.epoch
        self._any_strict = bool(self._strict_rows.any())
        return locks if self._any_strict else None

    def allowed(self, demand: Demand) -> np.ndarray | None:
        """(N, G) bool: the GPUs the lock lets one part of ``demand`` join (None: every GPU)."""
        locks = self.current()
        return None if locks is None else locks.allowed(demand)

    def why(self, row: int, demand: Demand, candidates: np.ndarray) -> str:
        """Why the lock keeps ``demand`` off node ``row`` whose GPUs ``candidates`` (its row) have the room."""
        locks = self.current()
        name = self.mirror.cluster.names[row]
        rec = self.nodes.get(name)
        shown = []
        allowed = locks.allowed(demand) if locks is not None else None
        if locks is not None and allowed is not None and rec is not None and rec.state is not None:
            gpus = rec.state.gpus
            for j in np.flatnonzero(candidates & ~allowed[row]).tolist():
                if j >= len(gpus):
                    continue
                shape = locks.describe(row, j)
                shown.append(f"GPU {gpus[j].index} serves shares of {shape.human()} only" if shape is not None else
                             f"GPU {gpus[j].index} runs shares of differing shapes until they end")
        if not shown:
            shown.append("its GPUs serve other share shapes")
        over = " (a share over several GPUs takes GPUs no share holds)" if demand.count > 1 else ""
        return f"node {name}: {'; '.join(shown)} (strict MPS){over}"

    def breaks(self, rec: NodeRecord, grants_by_container: list[tuple[DeviceGrant, ...]]) -> str:
        """Why giving these containers' grants on ``rec``'s node would break a GPU's lock ('' when it would not):
        the check for a pod fitted node by node, whose GPU choice ignores the lock."""
        locks = self.current()
        row = self.mirror.row(rec.name)
        if locks is None or row is None or rec.state is None or not self._strict_rows[row]:
            return ""
        gpus = {g.uuid: g for g in rec.state.gpus}
        slot = {g.uuid: j for j, g in enumerate(rec.state.gpus)}
        mine: dict[str, ShareShape] = {}  # what this pod's earlier containers lock
        for grants in grants_by_container:
            for uuid, shape in grant_shapes(grants, gpus).items():
                j = slot[uuid]
                if not locks.strict[row, j]:
                    continue
                # The rule of ShapeLocks.allowed: a locked GPU takes its own one-GPU shape only.
                lock = locks.describe(row, j) if locks.percent[row, j] != NO_LOCK else mine.get(uuid)
                locked = locks.percent[row, j] != NO_LOCK or uuid in mine
                if locked and (lock != shape or shape.spans > 1):
                    what = lock.human() if lock is not None else "differing shapes"
                    return (f"node {rec.name}: GPU {gpus[uuid].index} serves shares of {what} only (strict MPS); "
                            f"this pod's share there is {shape.human()}")
                mine[uuid] = shape
        return ""

    # ---- internals -------------------------------------------------------------------------------

    def _rebuild_row(self, locks: ShapeLocks, row: int, name: str, fresh: bool) -> bool:
        """Row ``row``'s strict GPUs and their locks, from the node's GPUs and the ledger (``fresh``: the row is
        known clear). True when any is strict."""
        rec = self.nodes.get(name)
        strict = rec is not None and rec.state is not None and any(
            is_strict(g) for g in rec.state.gpus)
        if not fresh and (strict or self._strict_rows[row]):
            locks.clear_row(row)
        if not strict:
            return False
        assert rec is not None and rec.state is not None
        gpus = {g.uuid: g for g in rec.state.gpus}
        held: dict[str, list[ShareShape]] = {}
        for key in self.ledger.by_node.get(name, ()):
            h = self.ledger.held.get(key)
            for c in h.alloc.containers if h is not None else ():
                for uuid, shape in grant_shapes(c.grants, gpus).items():
                    held.setdefault(uuid, []).append(shape)
        for j, g in enumerate(rec.state.gpus):
            if not is_strict(g):
                continue
            locks.strict[row, j] = True
            shapes = set(held.get(g.uuid, ()))
            reported = parse_shape(g.share_shape_lock)
            if reported is not None:
                shapes.add(reported)
            if len(shapes) == 1:
                locks.set_slot(row, j, shapes.pop(), len(held.get(g.uuid, ())))
            elif shapes:
                locks.block(row, j)
        return True
