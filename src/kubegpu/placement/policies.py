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
from kubegpu.placement.fill import cpu_floor, fill_delta_per_gpu, fill_value
from kubegpu.placement.frag import (
    FragCache,
    FragTerms,
    capacity_delta_per_node,
    frag_delta_per_gpu,
    frag_delta_per_node,
)
from kubegpu.placement.workload import Workload, WorkloadShape

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
    _fill: tuple[np.ndarray, np.ndarray] | None = None
    _reserve: dict[int, ReserveTerms] = field(default_factory=dict)

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

    def fill_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """The workload's (``fill_value``, ``cpu_floor``) tables (see :mod:`kubegpu.placement.fill`)."""
        if self._fill is None:
            if self.workload is None:
                raise ValueError("this policy needs a target workload (ScoreContext.workload)")
            self._fill = (fill_value(self.workload), cpu_floor(self.workload))
        return self._fill

    def reserve_terms(self, cluster: ClusterState) -> ReserveTerms:
        """The workload's rare large shapes for this cluster (cached per cluster object)."""
        if self.workload is None:
            raise ValueError("this policy needs a target workload (ScoreContext.workload)")
        key = id(cluster.gpu_ok)
        terms = self._reserve.get(key)
        if terms is None or terms.access.shape[1] != cluster.n_nodes:
            terms = ReserveTerms.build(cluster, self.workload)
            self._reserve[key] = terms
        return terms

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


@dataclass(frozen=True, slots=True)
class ReserveTerms:
    """The shapes of a workload (rare ones included) that fewer than half of a cluster's nodes could ever host.

    An 8-GPU pod asking for 120 cores fits only the largest nodes. Once the
    hosts still able to take such a shape are no more than the pods of it
    expected while the free GPU lasts, a pod that would take a node's room
    for it loses (``loss``) against tied nodes that keep theirs. Reserving
    earlier measured worse: idle large nodes kept too long fill up with
    shares at the end and strand more.
    """

    cpu: np.ndarray  # (R,)
    memory: np.ndarray  # (R,)
    count: np.ndarray  # (R,) GPUs
    need: np.ndarray  # (R,) index into ``levels``: the free compute a GPU needs for the shape
    levels: np.ndarray  # (V,) distinct per-GPU compute needs
    access: np.ndarray  # (R, N) bool: the node's GPU model is allowed
    freq: np.ndarray  # (R,) share of all pods
    mean_gpu: float  # GPU compute (milli) of the average pod of the workload

    @classmethod
    def build(cls, cluster: ClusterState, workload: Workload, host_share: float = 0.5) -> ReserveTerms:
        gpus = cluster.gpu_ok.sum(axis=1)
        picked: list[tuple[WorkloadShape, float, np.ndarray]] = []
        mean_gpu = float(sum(f * s.count * s.milli for s, f in zip(workload.every, workload.every_freq, strict=True)))
        # A shape expected less than once even on an empty cluster never runs short of hosts: skipped.
        at_most = float(gpus.sum()) * MILLI / max(mean_gpu, 1.0)
        for s, f in zip(workload.every, workload.every_freq, strict=True):
            access = cluster.model_mask(s.models) if s.models is not None else np.ones(cluster.n_nodes, bool)
            hosts = access & (cluster.cpu_cap >= s.cpu_milli) & (cluster.mem_cap >= s.memory_bytes) & (gpus >= s.count)
            if 0 < hosts.sum() < host_share * cluster.n_nodes and f * at_most >= 1.0:
                picked.append((s, float(f), access))
        need = np.array([s.milli if s.count else 0 for s, _, _ in picked], np.int64)
        levels, idx = np.unique(need, return_inverse=True)
        return cls(
            cpu=np.array([s.cpu_milli for s, _, _ in picked], np.int64),
            memory=np.array([s.memory_bytes for s, _, _ in picked], np.int64),
            count=np.array([s.count for s, _, _ in picked], np.int64),
            need=idx.astype(np.int64),
            levels=levels,
            access=np.array([a for _, _, a in picked], bool).reshape(len(picked), cluster.n_nodes),
            freq=np.array([f for _, f, _ in picked], np.float64),
            mean_gpu=mean_gpu,
        )

    def able(
        self,
        rows: np.ndarray,
        free: np.ndarray,
        cpu: np.ndarray,
        mem: np.ndarray,
        shapes: np.ndarray | slice = slice(None),
    ) -> np.ndarray:
        """(R, n) bool: node rows[i], with free compute ``free`` (n, G), CPU and memory, could host shape r."""
        gpus = (free[None, :, :] >= self.levels[:, None, None]).sum(axis=2)  # (V, n)
        return (
            self.access[shapes][:, rows]
            & (cpu[None, :] >= self.cpu[shapes, None])
            & (mem[None, :] >= self.memory[shapes, None])
            & (gpus[self.need[shapes]] >= self.count[shapes, None])
        )

    def loss(self, cluster: ClusterState, rows: np.ndarray, demand: Demand, choice: np.ndarray | None) -> np.ndarray:
        """(n,) how many short-of-hosts shapes node rows[i] could no longer host after ``demand`` (GPUs ``choice``)."""
        if not len(self.cpu):
            return np.zeros(len(rows))
        free = cluster.usable_free(rows)
        before = self.able(rows, free, cluster.cpu_free[rows], cluster.mem_free[rows])
        after_free = free.copy()
        if choice is not None and demand.count > 0:
            r = np.arange(len(rows))[:, None]
            after_free[r, choice] = np.maximum(after_free[r, choice] - (MILLI if demand.exclusive else demand.milli), 0)
        after = self.able(
            rows, after_free, cluster.cpu_free[rows] - demand.cpu_milli, cluster.mem_free[rows] - demand.memory_bytes
        )
        lost = before & ~after
        shapes = np.flatnonzero(lost.any(axis=1))
        if not len(shapes):
            return np.zeros(len(rows))
        # Only the shapes some tied node would lose pay for counting their hosts over the whole cluster.
        every = np.arange(cluster.n_nodes)
        free_all = cluster.usable_free(every)
        hosts = self.able(every, free_all, cluster.cpu_free, cluster.mem_free, shapes).sum(axis=1)
        # Pods of each shape expected while the free GPU lasts (at the workload's mix): a shape is
        # short of hosts once no more hosts can take it than pods of it are still to come.
        expected = self.freq[shapes] * free_all.sum() / max(self.mean_gpu, 1.0)
        return (expected >= hosts).astype(np.float64) @ lost[shapes]


class Policy:
    """A scoring policy. Subclasses override one or both methods; scores are higher-better floats."""

    name: ClassVar[str] = ""
    gpu_default: ClassVar[str] = "bestfit"  # the GPU-level policy it is paired with by default
    needs_workload: ClassVar[bool] = False

    def row_local(self, demand: Demand) -> bool:
        """Whether a node's score for ``demand`` depends on that node's row alone (and the whole cluster),
        never on which other nodes are scored with it, so kept scores stay right (the extender's cache)."""
        return False

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
        return -cluster.usable_free(node).astype(np.float64)  # best fit by default


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
        gpu_left = cluster.usable_free(rows).sum(axis=1)
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
        gpu_left = cluster.usable_free(rows).sum(axis=1)
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
        used = (MAX_SCORE // 4) * (MAX_SPEC_GPU - cluster.usable_free(rows).sum(axis=1)) // MAX_SPEC_GPU
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
        choice = bestfit_choice(cluster.usable_free(rows), candidates, demand.count) if demand.count else None
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
        gpu = cluster.usable_free(rows).sum(axis=1) / gpu_cap
        cpu = cluster.cpu_free[rows] / np.maximum(cluster.cpu_cap[rows], 1)
        return gpu + 0.1 * cpu

    def gpu_scores(
        self, cluster: ClusterState, node: int, demand: Demand, candidates: np.ndarray, ctx: ScoreContext
    ) -> np.ndarray:
        return cluster.usable_free(node).astype(np.float64)


class KubegpuPolicy(FgdPolicy):
    """kubegpu's default: FGD, with shares packed by what can still fill a GPU and ties settled by what
    the rest of the workload will need.

    GPU shares (one GPU, not whole) score each GPU by FGD's rounded score
    minus ``fill_weight`` per milli of growth of the node's expected stranded
    compute (:mod:`kubegpu.placement.fill`): an 810 goes where a 160 already
    is rather than open a GPU only a rare small share could top up, a 320 waits
    on an idle GPU for a 650 rather than leave 210 beside a 470, and a share
    does not take the last CPU of a node whose other GPUs still have room. The
    node's score is its best GPU's; the same score picks the GPU.

    Whole-GPU and CPU-only pods keep FGD's rounded score as the primary key
    (its ties, settled by a fixed node order, pack pods onto few nodes and
    keep whole nodes free for multi-GPU requests). Among the tied nodes, by
    weight:

    - host reservation (``ReserveTerms``): a pod avoids taking the room for a
      rare large shape on one of the few nodes able to host it, once those
      hosts get as few as the pods of that shape still expected (FGD's target
      workload drops such shapes, so it hands the largest nodes to small pods
      first and the 8-GPU, 120-core pods then fail early);
    - model scarcity: a GPU pod free to run on any model avoids the models
      that model-constrained shapes of the workload need most
      (``ScoreContext.model_scarcity``);
    - the placement that grows the capacity-aware fragment least: FGD counts a
      node's free GPUs as usable as soon as one pod of a shape fits, this
      measure also asks how many such pods the node's CPU and memory can feed
      (:func:`kubegpu.placement.frag.capacity_frag`).

    Only tied candidates pay for these extra measures; each depends on the
    node and the whole cluster, never on which other nodes are tied, except
    for the scaling of the scarcity term by its largest tied value.
    """

    name = "kubegpu"
    gpu_default = "kubegpu"
    use_memory = False  # for the primary (FGD) term
    capacity_memory: ClassVar[bool] = True
    # On: beside the fill measure it measured even on the default trace (4.01 vs 4.02 %, 4 seeds) and the
    # 120-core 8-GPU pods that failed at 10-44 % arrived went from four to two (seed 42).
    reserve_weight: ClassVar[float] = 1.0
    scarcity_weight: ClassVar[float] = 0.3
    # FGD points per milli of expected stranded compute. Measured on the openb trace (unallocated GPU at
    # arrived 100 %): 0.15 gave 3.94 % on the default list (10 seeds; fgd 4.75) and beat fgd on all 24 lists
    # (seed 42); 0.1 gave 3.99 %. In runs before scores were rounded to make equal placements tie exactly,
    # 0.2 lost to fgd on gpushare100 and gpuspec33, and ranking by this measure first (FGD only to break
    # its ties) lost on three lists.
    fill_weight: ClassVar[float] = 0.15
    secondary_weight: ClassVar[float] = 5e-4  # times a 0..100 score

    def row_local(self, demand: Demand) -> bool:
        return demand.count == 1 and not demand.exclusive

    def _secondary(self, delta: np.ndarray) -> np.ndarray:
        return self.secondary_weight * np.trunc(MAX_SCORE / (1.0 + np.exp(np.clip(delta, -5e5, 5e5) / 1000.0)))

    def _share_scores(
        self, cluster: ClusterState, demand: Demand, rows: np.ndarray, candidates: np.ndarray, ctx: ScoreContext
    ) -> np.ndarray:
        """(n, G) score of each candidate GPU of node rows[i] for a one-GPU share; -inf elsewhere."""
        terms = ctx.frag_terms(cluster, self.use_memory)
        cache = ctx.frag_cache(cluster, self.use_memory)
        primary = self._score(frag_delta_per_gpu(cluster, terms, rows, demand, candidates, cache))
        value, floor = ctx.fill_tables()
        stranded = fill_delta_per_gpu(cluster, rows, demand, candidates, value, floor)
        # Rounded so that equal placements tie exactly (and go to the node order), whatever the float noise.
        score = np.round(primary - self.fill_weight * np.where(candidates, stranded, 0.0), 6)
        return np.where(candidates, score, -np.inf)

    def node_scores(
        self, cluster: ClusterState, demand: Demand, rows: np.ndarray, candidates: np.ndarray, ctx: ScoreContext
    ) -> np.ndarray:
        if ctx.workload is None or not len(ctx.workload):
            return super().node_scores(cluster, demand, rows, candidates, ctx)
        if self.row_local(demand):
            return self._share_scores(cluster, demand, rows, candidates, ctx).max(axis=1)
        primary = super().node_scores(cluster, demand, rows, candidates, ctx)
        if len(rows) < 2:
            return primary
        top = np.flatnonzero(primary == primary.max())
        if len(top) < 2:
            return primary
        sub, cand = rows[top], candidates[top]
        out = primary.astype(np.float64).copy()
        choice = bestfit_choice(cluster.usable_free(sub), cand, demand.count) if demand.count else None
        if self.reserve_weight > 0:
            loss = ctx.reserve_terms(cluster).loss(cluster, sub, demand, choice)
            out[top] += self.reserve_weight * (1.0 - np.minimum(loss, 1.0))
        if demand.count > 0 and demand.models is None:
            # A pod that may run anywhere leaves the GPU models that constrained pods need to them.
            scarce = ctx.model_scarcity(cluster)[sub]
            if scarce.max() > 0:
                out[top] += self.scarcity_weight * (1.0 - scarce / scarce.max())
        cache = ctx.frag_cache(cluster, self.capacity_memory)
        out[top] += self._secondary(capacity_delta_per_node(cluster, cache, sub, demand, choice))
        return out

    def gpu_scores(
        self, cluster: ClusterState, node: int, demand: Demand, candidates: np.ndarray, ctx: ScoreContext
    ) -> np.ndarray:
        if not self.row_local(demand) or ctx.workload is None or not len(ctx.workload):
            return super().gpu_scores(cluster, node, demand, candidates, ctx)
        return self._share_scores(cluster, demand, np.array([node]), candidates[None, :], ctx)[0]


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
