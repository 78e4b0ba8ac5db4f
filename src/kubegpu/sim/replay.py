"""One replay of a pod list through one policy, with the FGD paper's protocol.

Protocol: pods shuffled by a seed; pods resampled with replacement from the
list and appended until the GPU request reaches ``inflate`` x the cluster's
GPU capacity; no departures; a pod that fits nowhere is dropped; CPU and
memory are hard limits; after every pod, the arrived GPU request and the
allocated GPU are recorded (as % of capacity). The target workload for the
fragmentation-aware policies is the set of most frequent request shapes
covering 95 % of the pod list.

Two options serve the proof that the extender places as the simulator does
(``bench/extender_replay.py``): ``learned=True`` scores with the target
workload learned online from the pods placed so far
(:class:`~kubegpu.placement.workload.LearnedWorkload`, exactly as a running
extender learns it), and ``ties="name"`` breaks ties by node name (the
extender's order) instead of the paper's random node order.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kubegpu.placement.cluster import MILLI, ClusterState
from kubegpu.placement.engine import place
from kubegpu.placement.frag import node_frag
from kubegpu.placement.policies import ScoreContext, get_policy
from kubegpu.placement.shape_lock import ShapeLocks
from kubegpu.placement.workload import LearnedWorkload, Workload
from kubegpu.sim.trace import TraceNodes, TracePod

# Arrived-GPU checkpoints (% of capacity) of the paper's figure 9a / table.
CHECKPOINTS: tuple[int, ...] = (80, 90, 95, 100, 110, 120, 130)


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """What one (policy, seed) replay measured."""

    policy: str
    gpu_policy: str
    seed: int
    pods: int
    arrived_pct: np.ndarray  # (pods,) after each pod
    allocated_pct: np.ndarray  # (pods,)
    failed: dict[str, int]
    fragment_pct: dict[int, float]  # fragment of the free GPU (% of capacity) at checkpoints
    seconds: float
    checkpoints: tuple[int, ...] = CHECKPOINTS
    extra: dict[str, float] = field(default_factory=dict)
    # Per pod in arrival order (with ``record=True``): (node row, GPU slots), or None when it was dropped.
    placements: list[tuple[int, tuple[int, ...]] | None] = field(default_factory=list)
    order: list[int] = field(default_factory=list)

    def unallocated_at(self, pct: float) -> float | None:
        """100 - allocated % at the first pod where arrived % reaches ``pct`` (None if never)."""
        i = int(np.searchsorted(self.arrived_pct, pct - 1e-9))
        if i >= len(self.arrived_pct):
            return None
        return float(100.0 - self.allocated_pct[i])


def arrival_order(pods: Sequence[TracePod], capacity_milli: int, seed: int, inflate: float) -> list[int]:
    """Pod indexes in arrival order: shuffled, then resampled until the GPU request reaches ``inflate``."""
    rng = np.random.default_rng(seed)
    order = [int(i) for i in rng.permutation(len(pods))]
    request = np.array([p.demand.gpu_milli_total for p in pods], np.int64)
    total = int(request.sum())
    target = inflate * capacity_milli
    if total <= 0:
        return order
    while total < target:
        i = int(rng.integers(len(pods)))
        order.append(i)
        total += int(request[i])
    return order


def target_workload(pods: Sequence[TracePod], coverage: float = 0.95) -> Workload:
    """The FGD paper's target workload: the most frequent request shapes covering ``coverage`` of the pods."""
    return Workload.from_demands((p.demand for p in pods), coverage)


def replay(
    nodes: TraceNodes,
    pods: Sequence[TracePod],
    policy: str,
    seed: int,
    inflate: float = 1.3,
    gpu_policy: str | None = None,
    workload: Workload | None = None,
    progress: Callable[[int, int], None] | None = None,
    *,
    learned: bool = False,
    ties: str = "random",
    record: bool = False,
    order: Sequence[int] | None = None,
    shape_locks: bool = False,
) -> ReplayResult:
    """Replay ``pods`` on an empty cluster of ``nodes`` under ``policy``; see the module docstring.

    ``order`` replaces the seeded arrival order (pod indexes); ``record`` keeps every pod's placement;
    ``shape_locks`` places as strict MPS enforcement does (one share shape per GPU, placement/shape_lock.py).
    """
    if ties not in ("random", "name"):
        raise ValueError(f"ties must be 'random' or 'name', not {ties!r}")
    if learned and workload is not None:
        raise ValueError("a learned workload and a given one exclude each other")
    start = time.perf_counter()
    pol = get_policy(policy)
    gpol = gpu_policy or pol.gpu_default
    gpu = pol if gpol == pol.name else get_policy(gpol)  # one instance each, so their caches last the run
    cluster: ClusterState = nodes.cluster()
    locks = ShapeLocks.of(cluster) if shape_locks else None
    capacity = int(cluster.gpu_ok.sum()) * MILLI
    if capacity <= 0:
        raise ValueError("the node list has no GPUs")
    order = list(order) if order is not None else arrival_order(pods, capacity, seed, inflate)
    learner = LearnedWorkload() if learned else None
    if workload is None and learner is None:
        workload = target_workload(pods)
    rng = np.random.default_rng(seed + 1_000_003)
    # Ties go to the lowest rank of a random node order fixed for the run (the FGD simulator
    # prefixes node names with a random permutation and picks the lowest name); with ties="name",
    # to the lowest node name (node lists are read in name order).
    rank = rng.permutation(cluster.n_nodes) if ties == "random" else None
    ctx = ScoreContext(workload=learner.current if learner else workload, rng=rng, node_rank=rank)
    ctx_gen = learner.generation if learner else 0
    placements: list[tuple[int, tuple[int, ...]] | None] = []
    arrived = np.zeros(len(order))
    allocated = np.zeros(len(order))
    failed: Counter[str] = Counter()
    frag: dict[int, float] = {}
    next_cp = 0
    cum_arrived = cum_alloc = 0
    for k, i in enumerate(order):
        pod = pods[i]
        d = pod.demand
        cum_arrived += d.gpu_milli_total
        if learner is not None and learner.generation != ctx_gen:
            ctx = ScoreContext(workload=learner.current, rng=rng, node_rank=rank)
            ctx_gen = learner.generation
        where = place(cluster, d, pol, gpu, ctx, locks.allowed(d) if locks is not None else None)
        if record:
            placements.append(None if where is None else (where.node, where.gpus))
        if where is None:
            failed[pod.kind] += 1
        else:
            cluster.take(where.node, where.gpus, d)
            if locks is not None:
                locks.take(where.node, where.gpus, d)
            cum_alloc += d.gpu_milli_total
            if learner is not None:
                learner.add(LearnedWorkload.shape_of(d))
        arrived[k] = 100.0 * cum_arrived / capacity
        allocated[k] = 100.0 * cum_alloc / capacity
        while next_cp < len(CHECKPOINTS) and arrived[k] >= CHECKPOINTS[next_cp]:
            frag[CHECKPOINTS[next_cp]] = (
                100.0 * float(node_frag(cluster, ctx.frag_terms(cluster, False)).sum()) / capacity
            )
            next_cp += 1
        if progress is not None and (k % 256 == 0 or k == len(order) - 1):
            progress(k + 1, len(order))
    return ReplayResult(
        pol.name, gpol, seed, len(order), arrived, allocated, dict(failed), frag, time.perf_counter() - start,
        placements=placements, order=order,
    )
