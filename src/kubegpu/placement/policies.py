"""Scoring policies behind one narrow interface, and the registry that names them.

A policy answers two questions, each on arrays and without changing anything:
which of these feasible nodes is best for this demand (``node_scores``), and
which of this node's GPUs is best for one GPU's part of it (``gpu_scores``).
Higher is better. The node level and the GPU level are chosen separately
(``place(..., node_policy="fgd", gpu_policy="bestfit")``), the way the FGD
paper's simulator pairs a score plugin with a GPU selection method.

The FGD paper's five baselines and FGD keep that simulator's integer scores
(0..100, truncated), so ties, broken at random like kube-scheduler does, fall
where they fell in the paper. ``spread`` and ``kubegpu`` use exact scores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Final

import numpy as np

from kubegpu.placement.cluster import MILLI, ClusterState, Demand, demand_tag
from kubegpu.placement.frag import (
    FragCache,
    FragTerms,
    capacity_delta_per_node,
    frag_delta_per_gpu,
    frag_delta_per_node,
)
from kubegpu.placement.workload import Workload

# Normalisers of the FGD simulator (largest node in the Alibaba trace): 128 cores, 8 GPUs.
MAX_SPEC_CPU: Final = 128_000
MAX_SPEC_GPU: Final = 8_000
MAX_SCORE: Final = 100


@dataclass
class ScoreContext:
    """What a scoring call may consult besides the cluster: the target workload and a random source.

    ``rng`` drives the ``random`` policy, and breaks ties only when
    ``random_ties`` is set (as stock kube-scheduler does). Otherwise ties go
    to the node with the lowest ``node_rank`` (default: the lowest index), so
    results are deterministic; the FGD paper's simulator breaks ties by node
    name after prefixing names with a random permutation, which a random
    ``node_rank`` reproduces. The context caches derived arrays for one
    cluster shape; make one per cluster, never share it globally.
    """

    workload: Workload | None = None
    rng: np.random.Generator | None = None
    random_ties: bool = False
    node_rank: np.ndarray | None = None
    use_memory: bool = False
    _terms: dict[tuple[int, bool], FragTerms] = field(default_factory=dict)
    _caches: dict[tuple[int, bool], FragCache] = field(default_factory=dict)
    _scarcity: dict[int, np.ndarray] = field(default_factory=dict)

    def frag_terms(self, cluster: ClusterState, use_memory: bool | None = None) -> FragTerms:
        """The workload's fragment terms for this cluster (cached per cluster object)."""
        if self.workload is None:
            raise ValueError("this policy needs a target workload (ScoreContext.workload)")
        mem = self.use_memory if use_memory is None else use_memory
        key = (id(cluster.node_model), mem)
        terms = self._terms.get(key)
        if terms is None or terms.access.shape[1] != cluster.n_nodes:
            terms = FragTerms.build(cluster, self.workload, use_memory=mem)
            self._terms[key] = terms
        return terms

    def model_scarcity(self, cluster: ClusterState) -> np.ndarray:
        """(N,) how much of each node's GPU capacity the model-constrained shapes of the workload claim.

        Each constrained shape's GPU demand is spread over the capacity of the
        nodes it may use; a node's value is the sum. Zero everywhere when no
        shape names a model.
        """
        key = id(cluster.gpu_ok)
        out = self._scarcity.get(key)
        if out is None or out.shape[0] != cluster.n_nodes:
            terms = self.frag_terms(cluster, False)
            gpus = cluster.gpu_ok.sum(axis=1).astype(np.float64)
            demand = terms.freq * terms.milli * terms.count
            out = np.zeros(cluster.n_nodes)
            for t in np.flatnonzero(~terms.access.all(axis=1)):
                cap = float((gpus * terms.access[t]).sum())
                if cap > 0:
                    out += terms.access[t] * demand[t] / cap
            self._scarcity[key] = out
        return out

    def frag_cache(self, cluster: ClusterState, use_memory: bool | None = None) -> FragCache:
        """Per-node fragment sums of this cluster, refreshed where nodes changed (see ClusterState.version)."""
        mem = self.use_memory if use_memory is None else use_memory
        terms = self.frag_terms(cluster, mem)
        key = (id(cluster.version), mem)
        cache = self._caches.get(key)
        if cache is None or cache.terms is not terms or cache.version.shape != cluster.version.shape:
            cache = FragCache(cluster, terms)
            self._caches[key] = cache
        return cache


class Policy:
    """A scoring policy. Subclasses override one or both methods; scores are higher-better floats."""

    name: ClassVar[str] = ""
    gpu_default: ClassVar[str] = "bestfit"  # the GPU-level policy it is paired with by default
    needs_workload: ClassVar[bool] = False

    def node_scores(
        self,
        cluster: ClusterState,
        demand: Demand,
        rows: np.ndarray,
        candidates: np.ndarray,
        ctx: ScoreContext,
    ) -> np.ndarray:
        """Scores of the feasible nodes ``rows`` (n,); ``candidates`` (n, G) are their usable GPUs."""
        return np.zeros(len(rows))

    def gpu_scores(
        self, cluster: ClusterState, node: int, demand: Demand, candidates: np.ndarray, ctx: ScoreContext
    ) -> np.ndarray:
        """Scores (G,) of one node's GPUs for one GPU's part of ``demand``; only ``candidates`` count."""
        return -_free(cluster, node).astype(np.float64)  # best fit by default


def _free(cluster: ClusterState, node: int | np.ndarray) -> np.ndarray:
    return np.where(cluster.gpu_ok[node], cluster.core_free[node], 0).astype(np.int64)


def bestfit_choice(left: np.ndarray, candidates: np.ndarray, k: int) -> np.ndarray:
    """(n, k) GPU indexes: the k candidates with the least free compute, lowest index first on ties."""
    key = np.where(candidates, left.astype(np.int64), np.iinfo(np.int64).max)
    return np.argsort(key, axis=1, kind="stable")[:, :k]


# ---- the FGD paper's baselines ---------------------------------------------------------------------


class RandomPolicy(Policy):
    """Any feasible node, any GPU with room, uniformly at random."""

    name = "random"
    gpu_default = "random"

    def node_scores(
        self,
        cluster: ClusterState,
        demand: Demand,
        rows: np.ndarray,
        candidates: np.ndarray,
        ctx: ScoreContext,
    ) -> np.ndarray:
        rng = ctx.rng or np.random.default_rng(0)
        return rng.random(len(rows))

    def gpu_scores(
        self, cluster: ClusterState, node: int, demand: Demand, candidates: np.ndarray, ctx: ScoreContext
    ) -> np.ndarray:
        rng = ctx.rng or np.random.default_rng(0)
        return rng.random(cluster.n_slots)


class BestFitPolicy(Policy):
    """The node left with the least CPU and GPU (equal weights, normalised by the largest node)."""

    name = "bestfit"

    def node_scores(
        self,
        cluster: ClusterState,
        demand: Demand,
        rows: np.ndarray,
        candidates: np.ndarray,
        ctx: ScoreContext,
    ) -> np.ndarray:
        gpu_left = _free(cluster, rows).sum(axis=1)
        cpu_left = cluster.cpu_free[rows]
        waste = (
            0.5 * (cpu_left - demand.cpu_milli) / MAX_SPEC_CPU
            + 0.5 * (gpu_left - demand.gpu_milli_total) / MAX_SPEC_GPU
        )
        return np.trunc((1.0 - waste) * MAX_SCORE)


class DotProductPolicy(Policy):
    """Tetris: the smallest dot product of free (CPU, GPU) and the request, normalised by max spec."""

    name = "dotprod"

    def node_scores(
        self,
        cluster: ClusterState,
        demand: Demand,
        rows: np.ndarray,
        candidates: np.ndarray,
        ctx: ScoreContext,
    ) -> np.ndarray:
        gpu_left = _free(cluster, rows).sum(axis=1)
        cpu_left = cluster.cpu_free[rows]
        dot = (cpu_left / MAX_SPEC_CPU) * (demand.cpu_milli / MAX_SPEC_CPU) + (gpu_left / MAX_SPEC_GPU) * (
            demand.gpu_milli_total / MAX_SPEC_GPU
        )
        return np.trunc((1.0 - dot / 2.0) * MAX_SCORE)


class PackingPolicy(Policy):
    """GPU packing: first shared GPUs with room, then free GPUs on used nodes, then idle nodes."""

    name = "packing"

    def node_scores(
        self,
        cluster: ClusterState,
        demand: Demand,
        rows: np.ndarray,
        candidates: np.ndarray,
        ctx: ScoreContext,
    ) -> np.ndarray:
        if demand.count == 0 or demand.milli <= 0:
            return np.zeros(len(rows))
        left = _free(cluster, rows)
        ok = cluster.gpu_ok[rows]
        n_gpus = ok.sum(axis=1)
        fully_free = ((left == MILLI) & ok).sum(axis=1)
        choice = bestfit_choice(left, candidates, demand.count)
        chosen_left = np.take_along_axis(left, choice, axis=1)
        used_free = (chosen_left == MILLI).sum(axis=1)
        idle_node = np.maximum(MAX_SCORE // 3 - fully_free, fully_free)
        free_on_used = np.maximum(MAX_SCORE // 2 - used_free, MAX_SCORE // 3)
        ratio = (chosen_left * 100 // MILLI).sum(axis=1)
        shared = np.maximum(MAX_SCORE - ratio // 10, MAX_SCORE // 2)
        return np.where(fully_free == n_gpus, idle_node, np.where(used_free > 0, free_on_used, shared)).astype(float)


class ClusteringPolicy(Policy):
    """GPU clustering: put requests of one kind (share, 1 GPU, 2 GPUs, ...) on the same nodes."""

    name = "clustering"

    def node_scores(
        self,
        cluster: ClusterState,
        demand: Demand,
        rows: np.ndarray,
        candidates: np.ndarray,
        ctx: ScoreContext,
    ) -> np.ndarray:
        tag = demand_tag(demand)
        if tag < 0:
            return np.zeros(len(rows))
        tags = cluster.tags[rows]
        kinds = (tags > 0).sum(axis=1)
        same = tags[:, tag] > 0
        used = (MAX_SCORE // 4) * (MAX_SPEC_GPU - _free(cluster, rows).sum(axis=1)) // MAX_SPEC_GPU
        base = np.where(same, np.where(kinds == 1, 3, 2), np.where(kinds == 0, 1, 0)) * (MAX_SCORE // 4)
        return (base + used).astype(float)


class FgdPolicy(Policy):
    """Fragmentation gradient descent: the placement that grows the expected fragment least.

    Needs ``ScoreContext.workload``; without one it scores like ``bestfit``.
    """

    name = "fgd"
    gpu_default = "fgd"
    needs_workload = True
    quantised: ClassVar[bool] = True
    use_memory: ClassVar[bool | None] = None

    def _score(self, delta: np.ndarray) -> np.ndarray:
        if not self.quantised:
            return -delta
        with np.errstate(over="ignore"):
            return np.trunc(MAX_SCORE / (1.0 + np.exp(delta / 1000.0)))

    def node_scores(
        self,
        cluster: ClusterState,
        demand: Demand,
        rows: np.ndarray,
        candidates: np.ndarray,
        ctx: ScoreContext,
    ) -> np.ndarray:
        if ctx.workload is None or not len(ctx.workload):
            # No target workload known (a fresh extender): best fit is the sensible fallback.
            return BestFitPolicy().node_scores(cluster, demand, rows, candidates, ctx)
        terms = ctx.frag_terms(cluster, self.use_memory)
        cache = ctx.frag_cache(cluster, self.use_memory)
        if demand.count == 1 and not demand.exclusive:
            delta = frag_delta_per_gpu(cluster, terms, rows, demand, candidates, cache)
            score = self._score(delta)
            score[~candidates] = -np.inf
            return score.max(axis=1)
        choice = bestfit_choice(_free(cluster, rows), candidates, demand.count) if demand.count else None
        return self._score(frag_delta_per_node(cluster, terms, rows, demand, choice, cache))

    def gpu_scores(
        self, cluster: ClusterState, node: int, demand: Demand, candidates: np.ndarray, ctx: ScoreContext
    ) -> np.ndarray:
        if demand.exclusive or demand.count == 0 or ctx.workload is None or not len(ctx.workload):
            return super().gpu_scores(cluster, node, demand, candidates, ctx)
        terms = ctx.frag_terms(cluster, self.use_memory)
        single = Demand.share(
            demand.milli,
            1,
            demand.gpu_memory,
            demand.memory_ratio,
            demand.cpu_milli,
            demand.memory_bytes,
            demand.models,
        )
        rows = np.array([node])
        delta = frag_delta_per_gpu(
            cluster, terms, rows, single, candidates[None, :], ctx.frag_cache(cluster, self.use_memory)
        )[0]
        return self._score(delta)


class SpreadPolicy(Policy):
    """The least loaded node and the emptiest GPU (availability over density)."""

    name = "spread"
    gpu_default = "spread"

    def node_scores(
        self,
        cluster: ClusterState,
        demand: Demand,
        rows: np.ndarray,
        candidates: np.ndarray,
        ctx: ScoreContext,
    ) -> np.ndarray:
        gpu_cap = np.maximum(cluster.gpu_ok[rows].sum(axis=1) * MILLI, 1)
        gpu = _free(cluster, rows).sum(axis=1) / gpu_cap
        cpu = cluster.cpu_free[rows] / np.maximum(cluster.cpu_cap[rows], 1)
        return gpu + 0.1 * cpu

    def gpu_scores(
        self, cluster: ClusterState, node: int, demand: Demand, candidates: np.ndarray, ctx: ScoreContext
    ) -> np.ndarray:
        return _free(cluster, node).astype(np.float64)


class KubegpuPolicy(FgdPolicy):
    """kubegpu's default: FGD, with ties settled by a capacity-aware fragment measure.

    FGD counts a node's free GPUs as usable by a workload shape as soon as one
    pod of that shape fits. kubegpu also asks how many such pods the node's
    CPU and memory can feed: a node with seven free GPUs and CPU for one more
    pod strands six of them (see :func:`kubegpu.placement.frag.capacity_frag`).
    FGD's rounded score stays the primary key (its ties, settled by a fixed
    node order, pack pods onto few nodes and keep whole nodes free for
    multi-GPU requests). Among the placements tied on it: a GPU pod free to
    run on any model avoids the models that model-constrained shapes of the
    workload need most (``ScoreContext.model_scarcity``); then, for pods that
    take whole GPUs or only CPU and memory, the placement that grows the
    capacity-aware fragment least wins (GPU shares keep FGD's choice, which
    measured better for them on the openb traces). Only tied candidates pay
    for these extra measures.
    """

    name = "kubegpu"
    gpu_default = "kubegpu"  # at the GPU level it is FGD's choice (inherited)
    use_memory = False  # for the primary (FGD) term
    capacity_memory: ClassVar[bool] = True
    secondary_weight: ClassVar[float] = 1e-3  # times a 0..100 score: always below one primary point

    def _secondary(self, delta: np.ndarray) -> np.ndarray:
        return self.secondary_weight * np.trunc(MAX_SCORE / (1.0 + np.exp(np.clip(delta, -5e5, 5e5) / 1000.0)))

    def node_scores(
        self, cluster: ClusterState, demand: Demand, rows: np.ndarray, candidates: np.ndarray, ctx: ScoreContext
    ) -> np.ndarray:
        primary = super().node_scores(cluster, demand, rows, candidates, ctx)
        if ctx.workload is None or not len(ctx.workload) or len(rows) < 2:
            return primary
        top = np.flatnonzero(primary == primary.max())
        if len(top) < 2:
            return primary
        sub, cand = rows[top], candidates[top]
        out = primary.astype(np.float64).copy()
        if demand.count > 0 and demand.models is None:
            # A pod that may run anywhere leaves the GPU models that constrained pods need to them.
            scarce = ctx.model_scarcity(cluster)[sub]
            if scarce.max() > 0:
                out[top] += 0.5 * (1.0 - scarce / scarce.max())
        if not demand.is_share:
            cache = ctx.frag_cache(cluster, self.capacity_memory)
            choice = bestfit_choice(_free(cluster, sub), cand, demand.count) if demand.count else None
            out[top] += self._secondary(capacity_delta_per_node(cluster, cache, sub, demand, choice))
        return out


_POLICIES: Final[dict[str, Callable[[], Policy]]] = {
    p.name: p
    for p in (
        RandomPolicy,
        DotProductPolicy,
        ClusteringPolicy,
        PackingPolicy,
        BestFitPolicy,
        FgdPolicy,
        SpreadPolicy,
        KubegpuPolicy,
    )
}

#: The FGD paper's policies, in the paper's order.
PAPER_POLICIES: Final = ("random", "dotprod", "clustering", "packing", "bestfit", "fgd")
#: Every registered policy name.
POLICY_NAMES: Final = tuple(_POLICIES)
#: kubegpu's default for both levels.
DEFAULT_POLICY: Final = "kubegpu"


def get_policy(name: str | Policy) -> Policy:
    """The policy named ``name`` (a :class:`Policy` passes through); KeyError lists the known names."""
    if isinstance(name, Policy):
        return name
    try:
        return _POLICIES[name]()
    except KeyError:
        raise KeyError(f"unknown placement policy {name!r}; known: {', '.join(POLICY_NAMES)}") from None
