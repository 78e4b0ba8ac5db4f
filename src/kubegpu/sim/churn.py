"""A stand-in for the recorded churn that starved wide pods on a real control plane.

The recording (10 nodes x 8 A100-SXM4-80GB, 400 pods arriving at 1.7 pods/s,
each held 20-90 s from the moment it runs; 155 shares, 166 x 1, 27 x 2,
26 x 4 and 26 x 8 GPUs; a pod not running 120 s after its creation was
withdrawn) is rebuilt here as pods for :func:`~kubegpu.sim.queue.replay_queue`,
so the starvation it showed, and what reservations change, can be measured
offline through the same pure placement core the extender runs.

That churn asks for about 1.8 times the cluster's GPUs while it arrives, so some
pods must wait past the 120 s and be withdrawn whatever the policy; the same pods
arriving slower (:meth:`Churn.at_load`) show the trade-off where every pod can run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from kubegpu.placement.cluster import MILLI, ClusterState, Demand
from kubegpu.sim.queue import QueuedPod

GIB = 2**30
SHARE_CORES = (10, 25, 30, 50, 70)  # percent of a GPU, drawn uniformly
SHARE_MEMORY_GIB = (8, 20, 24, 40, 56)  # the fixed-memory variant of each core size
A100_MEMORY = 80 * GIB


@dataclass(frozen=True, slots=True)
class Churn:
    """The recorded churn's shape (the defaults are the recording's)."""

    nodes: int = 10
    gpus_per_node: int = 8
    rate: float = 1.7  # pods per second, Poisson
    life_s: tuple[float, float] = (20.0, 90.0)  # uniform, from the moment a pod runs
    counts: tuple[tuple[str, int], ...] = (("share", 155), ("1", 166), ("2", 27), ("4", 26), ("8", 26))
    give_up_s: float = 120.0
    seed: int = 20261128

    def cluster(self) -> ClusterState:
        names = [f"gpu-node-{i + 2}" for i in range(self.nodes)]
        return ClusterState.from_arrays(
            names, ["A100-SXM4-80GB"] * self.nodes, [self.gpus_per_node] * self.nodes,
            [256_000] * self.nodes, [2048 * GIB] * self.nodes, [A100_MEMORY] * self.nodes,
        )

    @property
    def offered_load(self) -> float:
        """The GPUs the pods ask for while they arrive (each for its lifetime, shares by their compute), as a
        multiple of the cluster's GPUs."""
        pods = self.pods()
        gpu_s = sum(p.demand.gpu_milli_total / MILLI * (p.duration or 0.0) for p in pods)
        span = max(p.arrive for p in pods) - min(p.arrive for p in pods)
        return gpu_s / max(1e-9, self.nodes * self.gpus_per_node * span)

    def at_load(self, load: float) -> Churn:
        """The same pods (mix, lifetimes, order) arriving at the rate that offers ``load`` times the GPUs."""
        if not load > 0:
            raise ValueError(f"load must be above 0, not {load}")
        return replace(self, rate=self.rate * load / self.offered_load)

    def pods(self) -> list[QueuedPod]:
        rng = np.random.default_rng(self.seed)
        kinds = [k for k, n in self.counts for _ in range(n)]
        kinds = [kinds[i] for i in rng.permutation(len(kinds))]
        arrive = np.cumsum(rng.exponential(1.0 / self.rate, len(kinds)))
        life = rng.uniform(*self.life_s, len(kinds))
        out = []
        for n, kind in enumerate(kinds):
            if kind == "share":
                c = int(rng.integers(len(SHARE_CORES)))
                by_ratio = bool(rng.integers(2))
                demand = Demand.share(SHARE_CORES[c] * 10, gpu_memory=0 if by_ratio else SHARE_MEMORY_GIB[c] * GIB,
                                      memory_ratio=SHARE_CORES[c] if by_ratio else 0)
            else:
                demand = Demand.whole(int(kind))
            out.append(QueuedPod(f"churn/c-{n:04d}", demand, float(arrive[n]), float(life[n])))
        return out
