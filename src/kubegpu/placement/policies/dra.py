"""``dra``: what the stock kube-scheduler does with DRA claims, so a trace can be replayed as DRA would place it.

With DRA (kubegpu's driver publishing ResourceSlices, ``docs/dra.md``) the stock kube-scheduler chooses
both the node and the devices; kubegpu's scoring is out of the loop. This policy models that choice,
so ``kubegpu simulate --policy dra`` answers the same placement-quality questions (fragmentation,
allocation rate, failures) for a DRA cluster:

- **node**: the default score plugins that see a GPU pod's request: ``NodeResourcesFit`` with
  ``LeastAllocated`` over CPU and memory (weight 1 each) plus ``NodeResourcesBalancedAllocation``
  (1 - the standard deviation of the CPU and memory fractions after placing). DRA adds no score;
  GPUs count only as a filter (the claim must fit).
- **devices**: the DRA allocator's first fit, device by device in slice order (``gpu-0``, ``gpu-1``, ...,
  as recorded on v1.36): a whole GPU takes the lowest free ones (without regard to NVLink; the
  traces have none), and a share goes to the first GPU with enough room left in its consumable
  ``compute`` and ``memory`` capacity.
"""

from __future__ import annotations

import numpy as np

from kubegpu.placement.cluster import ClusterState, Demand
from kubegpu.placement.policies.base import MAX_SCORE, Policy, ScoreContext


class DraSchedulerPolicy(Policy):
    """Stock kube-scheduler with DRA: least-allocated + balanced CPU/memory nodes, first-fit devices."""

    name = "dra"
    gpu_default = "dra"

    def row_local(self, demand: Demand) -> bool:
        return True

    def node_scores(
        self, cluster: ClusterState, demand: Demand, rows: np.ndarray, candidates: np.ndarray, ctx: ScoreContext
    ) -> np.ndarray:
        cpu_cap = np.maximum(cluster.cpu_cap[rows], 1).astype(np.float64)
        mem_cap = np.maximum(cluster.mem_cap[rows], 1).astype(np.float64)
        cpu_used = (cluster.cpu_cap[rows] - cluster.cpu_free[rows] + demand.cpu_milli) / cpu_cap
        mem_used = (cluster.mem_cap[rows] - cluster.mem_free[rows] + demand.memory_bytes) / mem_cap
        cpu_used, mem_used = np.clip(cpu_used, 0, 1), np.clip(mem_used, 0, 1)
        least = ((1 - cpu_used) + (1 - mem_used)) / 2 * MAX_SCORE
        balanced = (1 - np.abs(cpu_used - mem_used) / 2) * MAX_SCORE  # std of two values = |a - b| / 2
        return np.trunc(least) + np.trunc(balanced)

    def gpu_scores(
        self, cluster: ClusterState, node: int, demand: Demand, candidates: np.ndarray, ctx: ScoreContext
    ) -> np.ndarray:
        return -np.arange(cluster.n_slots, dtype=np.float64)  # the first device that fits
