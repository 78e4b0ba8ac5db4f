"""One share shape per GPU at a time: the placement side of strict MPS enforcement (docs/sharing.md).

Under strict enforcement a GPU runs one MPS server in ``EXCLUSIVE_PROCESS``, and only that server's
defaults bind a tenant (its environment can only lower them). So a GPU serves one share shape at a time: the
first share on an empty GPU fixes the shape (compute milli, memory), only shares of that shape join it, and
the lock falls when its last share leaves. The node refuses a share of another shape; this module makes the
placement core (simulator, extender, DRA allocation) never ask for one. Pure, array-based, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kubegpu.placement.cluster import ClusterState, Demand

NO_LOCK = 0


def shape_key(demand: Demand) -> tuple[int, int, int]:
    """What the node's MPS server enforces for one GPU part of ``demand``: compute, memory bytes, ratio."""
    return (demand.milli, demand.gpu_memory, demand.memory_ratio)


@dataclass(slots=True)
class ShapeLocks:
    """Per GPU slot of a cluster: the shape id it is locked to (0 = none) and how many shares hold it."""

    lock: np.ndarray  # (N, G) int32 shape id
    shares: np.ndarray  # (N, G) int32
    _ids: dict[tuple[int, int, int], int] = field(default_factory=dict)

    @classmethod
    def of(cls, cluster: ClusterState) -> ShapeLocks:
        shape = cluster.core_free.shape
        return cls(np.zeros(shape, np.int32), np.zeros(shape, np.int32))

    def shape_id(self, demand: Demand) -> int:
        key = shape_key(demand)
        got = self._ids.get(key)
        if got is None:
            got = self._ids[key] = len(self._ids) + 1
        return got

    def allowed(self, demand: Demand) -> np.ndarray | None:
        """(N, G) bool: GPUs the lock lets ``demand`` join; None when the lock does not concern it (whole
        GPUs need an empty GPU anyway, and an empty GPU holds no lock)."""
        if not demand.is_share:
            return None
        sid = self.shape_id(demand)
        out: np.ndarray = (self.lock == NO_LOCK) | (self.lock == sid)
        return out

    def take(self, node: int, gpus: Sequence[int], demand: Demand) -> None:
        """Record a placed demand (after ``ClusterState.take``). Raises ValueError on a lock it breaks."""
        if not demand.is_share:
            return
        sid = self.shape_id(demand)
        for j in gpus:
            if self.lock[node, j] not in (NO_LOCK, sid):
                raise ValueError(f"GPU slot {j} of node row {node} is locked to another share shape")
        for j in gpus:
            self.lock[node, j] = sid
            self.shares[node, j] += 1

    def give_back(self, node: int, gpus: Sequence[int], demand: Demand) -> None:
        """Undo :meth:`take`; the lock falls with the GPU's last share."""
        if not demand.is_share:
            return
        for j in gpus:
            if self.shares[node, j] > 0:
                self.shares[node, j] -= 1
            if self.shares[node, j] == 0:
                self.lock[node, j] = NO_LOCK

    def describe(self, node: int, slot: int) -> tuple[int, int, int] | None:
        """The (compute milli, memory bytes, memory ratio) slot ``slot`` of ``node`` is locked to, if any."""
        sid = int(self.lock[node, slot])
        if sid == NO_LOCK:
            return None
        return next(k for k, v in self._ids.items() if v == sid)
