"""The FGD paper's policies (Weng et al., ATC '23): its five baselines and FGD itself.

They keep that simulator's integer scores (0..100, truncated), so ties, broken
by a node order fixed per run, fall where they fell in the paper: kubegpu's
``bestfit`` and ``fgd`` pick the paper's node for every pod of its arrival
order. All but ``random`` score each node from its own row (``row_local``).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from kubegpu.placement.cluster import MILLI, ClusterState, Demand, demand_tag
from kubegpu.placement.frag import frag_delta_per_gpu, frag_delta_per_node
from kubegpu.placement.policies.base import (
    MAX_SCORE,
    MAX_SPEC_CPU,
    MAX_SPEC_GPU,
    Policy,
    ScoreContext,
    bestfit_choice,
)


class RandomPolicy(Policy):
    """Any feasible node, any GPU with room, uniformly at random."""

    name = "random"
    gpu_default = "random"

    def node_scores(
        self, cluster: ClusterState, demand: Demand, rows: np.ndarray, candidates: np.ndarray, ctx: ScoreContext
    ) -> np.ndarray:
        rng = ctx.rng or np.random.default_rng(0)
        return rng.random(len(rows))

    def gpu_scores(
        self, cluster: ClusterState, node: int, demand: Demand, candidates: np.ndarray, ctx: ScoreContext
    ) -> np.ndarray:
        rng = ctx.rng or np.random.default_rng(0)
        return rng.random(cluster.n_slots)


class _RowLocal(Policy):
    def row_local(self, demand: Demand) -> bool:
        return True


class BestFitPolicy(_RowLocal):
    """The node left with the least CPU and GPU (equal weights, normalised by the largest node)."""

    name = "bestfit"

    def node_scores(
        self, cluster: ClusterState, demand: Demand, rows: np.ndarray, candidates: np.ndarray, ctx: ScoreContext
    ) -> np.ndarray:
        gpu_left = cluster.usable_free(rows).sum(axis=1)
        cpu_left = cluster.cpu_free[rows]
        waste = (
            0.5 * (cpu_left - demand.cpu_milli) / MAX_SPEC_CPU
            + 0.5 * (gpu_left - demand.gpu_milli_total) / MAX_SPEC_GPU
        )
        return np.trunc((1.0 - waste) * MAX_SCORE)


class DotProductPolicy(_RowLocal):
    """Tetris: the smallest dot product of free (CPU, GPU) and the request, normalised by max spec."""

    name = "dotprod"

    def node_scores(
        self, cluster: ClusterState, demand: Demand, rows: np.ndarray, candidates: np.ndarray, ctx: ScoreContext
    ) -> np.ndarray:
        gpu_left = cluster.usable_free(rows).sum(axis=1)
        cpu_left = cluster.cpu_free[rows]
        dot = (cpu_left / MAX_SPEC_CPU) * (demand.cpu_milli / MAX_SPEC_CPU) + (gpu_left / MAX_SPEC_GPU) * (
            demand.gpu_milli_total / MAX_SPEC_GPU
        )
        return np.trunc((1.0 - dot / 2.0) * MAX_SCORE)


class PackingPolicy(_RowLocal):
    """GPU packing: first shared GPUs with room, then free GPUs on used nodes, then idle nodes."""

    name = "packing"

    def node_scores(
        self, cluster: ClusterState, demand: Demand, rows: np.ndarray, candidates: np.ndarray, ctx: ScoreContext
    ) -> np.ndarray:
        if demand.count == 0 or demand.milli <= 0:
            return np.zeros(len(rows))
        left = cluster.usable_free(rows)
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


class ClusteringPolicy(_RowLocal):
    """GPU clustering: put requests of one kind (share, 1 GPU, 2 GPUs, ...) on the same nodes."""

    name = "clustering"

    def node_scores(
        self, cluster: ClusterState, demand: Demand, rows: np.ndarray, candidates: np.ndarray, ctx: ScoreContext
    ) -> np.ndarray:
        tag = demand_tag(demand)
        if tag < 0:
            return np.zeros(len(rows))
        tags = cluster.tags[rows]
        kinds = (tags > 0).sum(axis=1)
        same = tags[:, tag] > 0
        used = (MAX_SCORE // 4) * (MAX_SPEC_GPU - cluster.usable_free(rows).sum(axis=1)) // MAX_SPEC_GPU
        base = np.where(same, np.where(kinds == 1, 3, 2), np.where(kinds == 0, 1, 0)) * (MAX_SCORE // 4)
        return (base + used).astype(float)


class FgdPolicy(_RowLocal):
    """Fragmentation gradient descent: the placement that grows the expected fragment least.

    Needs ``ScoreContext.workload``; without one it scores like ``bestfit``.
    Scores are kept per (workload, demand) and row version (:class:`RowCache`):
    a pod rescores only the nodes changed since the last pod of its shape. A
    one-GPU share's per-GPU scores are kept too, so the GPU choice on the
    chosen node reads them instead of scoring the node again.
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

    @staticmethod
    def _has_workload(ctx: ScoreContext) -> bool:
        return ctx.workload is not None and len(ctx.workload) > 0

    @staticmethod
    def _single(demand: Demand) -> Demand:
        """One GPU's part of a share over one or more GPUs."""
        return Demand.share(
            demand.milli, 1, demand.gpu_memory, demand.memory_ratio, demand.cpu_milli, demand.memory_bytes,
            demand.models,
        )

    def _gpu_matrix(
        self, cluster: ClusterState, demand: Demand, rows: np.ndarray, candidates: np.ndarray, ctx: ScoreContext
    ) -> np.ndarray:
        """(n, G) score of each candidate GPU of node rows[i] for a one-GPU share; -inf elsewhere (kept)."""

        def compute(pos: np.ndarray) -> np.ndarray:
            return self._share_scores(cluster, demand, rows[pos], candidates[pos], ctx)

        return self.rows.get(("gpu", ctx.workload_gen, demand), cluster, rows, compute, (cluster.n_slots,))

    def _share_scores(
        self, cluster: ClusterState, demand: Demand, rows: np.ndarray, candidates: np.ndarray, ctx: ScoreContext
    ) -> np.ndarray:
        terms = ctx.frag_terms(cluster, self.use_memory)
        cache = ctx.frag_cache(cluster, self.use_memory)
        score = self._score(frag_delta_per_gpu(cluster, terms, rows, demand, candidates, cache))
        return np.where(candidates, score, -np.inf)

    def _node_primary(
        self, cluster: ClusterState, demand: Demand, rows: np.ndarray, candidates: np.ndarray, ctx: ScoreContext
    ) -> np.ndarray:
        if demand.count == 1 and not demand.exclusive:
            # The node's best GPU, kept per row too: a max over each of thousands of short rows costs more
            # than the rest of a steady answer.
            def best(pos: np.ndarray) -> np.ndarray:
                return self._gpu_matrix(cluster, demand, rows[pos], candidates[pos], ctx).max(axis=1)

            return self.rows.get(("gpu-best", ctx.workload_gen, demand), cluster, rows, best)

        def compute(pos: np.ndarray) -> np.ndarray:
            sub, cand = rows[pos], candidates[pos]
            terms = ctx.frag_terms(cluster, self.use_memory)
            cache = ctx.frag_cache(cluster, self.use_memory)
            choice = bestfit_choice(cluster.usable_free(sub), cand, demand.count) if demand.count else None
            return self._score(frag_delta_per_node(cluster, terms, sub, demand, choice, cache))

        return self.rows.get(("node", ctx.workload_gen, demand), cluster, rows, compute)

    def node_scores(
        self, cluster: ClusterState, demand: Demand, rows: np.ndarray, candidates: np.ndarray, ctx: ScoreContext
    ) -> np.ndarray:
        if not self._has_workload(ctx):
            # No target workload known (a fresh extender): best fit is the sensible fallback.
            return BestFitPolicy.node_scores(self, cluster, demand, rows, candidates, ctx)  # type: ignore[arg-type]
        return self._node_primary(cluster, demand, rows, candidates, ctx)

    def gpu_scores(
        self, cluster: ClusterState, node: int, demand: Demand, candidates: np.ndarray, ctx: ScoreContext
    ) -> np.ndarray:
        if demand.exclusive or demand.count == 0 or not self._has_workload(ctx):
            return super().gpu_scores(cluster, node, demand, candidates, ctx)
        single = self._single(demand)
        return self._gpu_matrix(cluster, single, np.array([node]), candidates[None, :], ctx)[0]
