"""One share shape per GPU at a time: the placement side of strict MPS enforcement (docs/sharing.md).

Under strict enforcement a GPU runs one MPS server in ``EXCLUSIVE_PROCESS``, and only that server's
defaults bind a tenant (its environment can only lower them). So a GPU serves one share shape at a time: the
first share on an empty GPU fixes the shape, only shares of that shape join it, and the lock falls when its
last share leaves. A shape is what the node enforces on that GPU (model/share_shape.py: active-thread percent,
memory limit in MiB with a ratio resolved on that GPU's memory, GPUs spanned), so the node, the simulator and
the extender compare the same thing. The node refuses a share of another shape; this module makes the
placement core (simulator, extender) never ask for one. Pure, array-based, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kubegpu.model.share_shape import ShareShape, enforced_memory, enforced_percent, memory_mib
from kubegpu.placement.cluster import ClusterState, Demand

NO_LOCK = 0
NO_SHARE = -1  # a GPU's percent when no new share may join it (its shares disagree on their shape)


def demand_shapes(cluster: ClusterState, demand: Demand) -> tuple[int, np.ndarray]:
    """What each GPU's server would enforce for one GPU part of share ``demand``: (percent, (N, G) MiB), as the
    grant of that GPU records it (placement/node.py ``grants_on``: compute milli // 10, memory resolved there)."""
    mib = memory_mib(enforced_memory(cluster.gpu_memory_need(demand), cluster.gmem_cap))
    return enforced_percent(demand.milli // 10), mib


@dataclass(slots=True)
class ShapeLocks:
    """Per GPU slot of a cluster: the shape it is locked to and how many shares hold it.

    ``strict``: the GPUs the lock applies to (the simulator: all of them; the extender: the GPUs whose node
    enforces strictly)."""

    cluster: ClusterState
    percent: np.ndarray  # (N, G) int32: NO_LOCK, NO_SHARE, or the locked active-thread percent
    memory_mib: np.ndarray  # (N, G) int64
    spans: np.ndarray  # (N, G) int32
    shares: np.ndarray  # (N, G) int32
    strict: np.ndarray  # (N, G) bool

    @classmethod
    def of(cls, cluster: ClusterState, strict: np.ndarray | None = None) -> ShapeLocks:
        shape = cluster.core_free.shape
        return cls(cluster, np.zeros(shape, np.int32), np.zeros(shape, np.int64), np.zeros(shape, np.int32),
                   np.zeros(shape, np.int32), np.ones(shape, bool) if strict is None else strict)

    def allowed(self, demand: Demand) -> np.ndarray | None:
        """(N, G) bool: GPUs the lock lets ``demand`` join; None when the lock does not concern it (whole
        GPUs need an empty GPU anyway, and an empty GPU holds no lock)."""
        if not demand.is_share:
            return None
        free = self.percent == NO_LOCK
        if demand.count > 1:
            # One server over exactly the share's GPUs: a running server of another GPU set is another server,
            # so a share spanning GPUs takes unlocked ones (it does not look for its twin's GPU set).
            out: np.ndarray = free | ~self.strict
            return out
        percent, mib = demand_shapes(self.cluster, demand)
        same = (self.percent == percent) & (self.memory_mib == mib) & (self.spans == 1)
        out = free | same | ~self.strict
        return out

    def set_slot(self, node: int, slot: int, shape: ShareShape | None, shares: int) -> None:
        """Lock one GPU to ``shape`` held by ``shares`` shares (None: unlocked); the extender's rebuild."""
        if shape is None:
            self.percent[node, slot], self.memory_mib[node, slot], self.spans[node, slot] = NO_LOCK, 0, 0
        else:
            self.percent[node, slot], self.memory_mib[node, slot] = shape.percent, shape.memory_mib
            self.spans[node, slot] = shape.spans
        self.shares[node, slot] = shares

    def clear_row(self, node: int) -> None:
        """No GPU of ``node`` strict or locked (before the extender rebuilds its row)."""
        self.percent[node], self.memory_mib[node], self.spans[node], self.shares[node] = NO_LOCK, 0, 0, 0
        self.strict[node] = False

    def block(self, node: int, slot: int) -> None:
        """No new share joins this GPU until it is rebuilt (its running shares disagree on the shape)."""
        self.percent[node, slot] = NO_SHARE

    def take(self, node: int, gpus: Sequence[int], demand: Demand) -> None:
        """Record a placed demand (after ``ClusterState.take``). Raises ValueError on a lock it breaks."""
        if not demand.is_share:
            return
        ok = self.allowed(demand)
        assert ok is not None
        for j in gpus:
            if not ok[node, j]:
                raise ValueError(f"GPU slot {j} of node row {node} is locked to another share shape")
        percent, mib = demand_shapes(self.cluster, demand)
        for j in gpus:
            self.set_slot(node, j, ShareShape(percent, int(mib[node, j]), len(gpus)),
                          int(self.shares[node, j]) + 1)

    def give_back(self, node: int, gpus: Sequence[int], demand: Demand) -> None:
        """Undo :meth:`take`; the lock falls with the GPU's last share."""
        if not demand.is_share:
            return
        for j in gpus:
            left = max(0, int(self.shares[node, j]) - 1)
            self.shares[node, j] = left
            if left == 0:
                self.set_slot(node, j, None, 0)

    def describe(self, node: int, slot: int) -> ShareShape | None:
        """The shape slot ``slot`` of ``node`` is locked to, if any."""
        if self.percent[node, slot] <= NO_LOCK:
            return None
        return ShareShape(int(self.percent[node, slot]), int(self.memory_mib[node, slot]),
                          int(self.spans[node, slot]))
