"""GPU fragmentation against a target workload, vectorised over nodes and candidate GPUs.

The measure is the FGD paper's (Weng et al., ATC '23): for a node and a request
shape of the workload, the node's free GPU compute is a fragment when the shape
cannot run there at all (wrong model, not enough CPU, not enough GPUs with room),
and otherwise the part on GPUs with less room than the shape's per-GPU need.
The node's fragment is the frequency-weighted sum over shapes. Writing ``S``
for the node's free compute and ``A_t`` for the free compute on GPUs that can
hold shape ``t``, that is::

    frag = S - sum_t p_t * runs_t * A_t

which lets a placement's effect be computed from a few per-node counts instead
of re-scanning every GPU. Options extend the "can run" test with node memory
(``use_memory``), which the paper's simulator leaves out.

The frequencies are kept as integer pod counts (``FragTerms.weight``, over ``total``): the weighted
sums are then exact, and a node's fragment is the same bits whatever other nodes it is computed with
(:mod:`kubegpu.placement.ordered`), so the extender, scoring the nodes kube-scheduler sends in its
order, agrees with the simulator bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kubegpu.placement.cluster import MILLI, ClusterState, Demand
from kubegpu.placement.ordered import EXACT_LIMIT, exact_dot, weighted_sum
from kubegpu.placement.workload import Workload


@dataclass(frozen=True, slots=True)
class FragTerms:
    """Per-shape arrays of a workload, aligned with one cluster's model table."""

    milli: np.ndarray  # (T,) per-GPU compute
    count: np.ndarray  # (T,)
    cpu: np.ndarray  # (T,)
    memory: np.ndarray  # (T,)
    freq: np.ndarray  # (T,)
    gpu_shape: np.ndarray  # (T,) bool: the shape asks for GPUs
    access: np.ndarray  # (T, N) bool: the node's GPU model is allowed for the shape
    use_memory: bool = False
    # (T,) integer-valued float64 weights with ``freq == weight / total``: sums weighted by them are exact.
    weight: np.ndarray = field(default_factory=lambda: np.zeros(0))
    total: float = 1.0

    @classmethod
    def build(cls, cluster: ClusterState, workload: Workload, use_memory: bool = False) -> FragTerms:
        shapes = workload.shapes
        access = np.ones((len(shapes), cluster.n_nodes), bool)
        for t, s in enumerate(shapes):
            if s.models is not None:
                access[t] = cluster.model_mask(s.models)
        weight = exact_weights(workload, cluster.n_slots)
        return cls(
            milli=np.array([s.milli for s in shapes], np.int64),
            count=np.array([s.count for s in shapes], np.int64),
            cpu=np.array([s.cpu_milli for s in shapes], np.int64),
            memory=np.array([s.memory_bytes for s in shapes], np.int64),
            freq=np.asarray(workload.freq, np.float64),
            gpu_shape=np.array([s.count > 0 and s.milli > 0 for s in shapes], bool),
            access=access,
            use_memory=use_memory,
            weight=weight,
            total=float(weight.sum()) if len(weight) else 1.0,
        )


def exact_weights(workload: Workload, slots: int) -> np.ndarray:
    """Integer-valued weights proportional to the workload's frequencies, small enough that a sum over the
    shapes of weight x (a node's free compute) stays exact: the pod counts, scaled down (a function of the
    workload alone) only for windows far beyond any cluster's pods."""
    freq = np.asarray(workload.freq, np.float64)
    weight = np.asarray(workload.weight, np.float64)
    if len(weight) != len(freq):  # a workload given as frequencies only: 2**20 steps of resolution
        weight = np.maximum(np.round(freq / max(float(freq.sum()), 1e-300) * 2**20), 1.0)
    # |sum| <= total * (largest free compute of a node) * 2 (before and after a placement).
    bound = float(weight.sum()) * max(slots, 1) * MILLI * 4
    if bound > EXACT_LIMIT:
        weight = np.maximum(np.floor(weight * (EXACT_LIMIT / (2 * bound))), 1.0)  # half: room for the ones
    return weight


def _runs(terms: FragTerms, rows: np.ndarray | slice, cpu: np.ndarray, mem: np.ndarray) -> np.ndarray:
    """(T, n) bool: shape t could run on node (apart from GPU room), given CPU and memory left."""
    ok = terms.gpu_shape[:, None] & terms.access[:, rows] & (cpu[None, :] >= terms.cpu[:, None])
    if terms.use_memory:
        ok &= mem[None, :] >= terms.memory[:, None]
    return ok


def node_frag(cluster: ClusterState, terms: FragTerms, rows: np.ndarray | slice = slice(None)) -> np.ndarray:
    """(n,) fragment (milli) of the selected nodes as they are now."""
    left = cluster.usable_free(rows)
    return frag_of(terms, rows, left, cluster.cpu_free[rows], cluster.mem_free[rows])


def frag_of(
    terms: FragTerms, rows: np.ndarray | slice, left: np.ndarray, cpu: np.ndarray, mem: np.ndarray
) -> np.ndarray:
    """(n,) fragment of nodes given explicit free compute ``left`` (n, G), CPU and memory."""
    s = left.sum(axis=1)
    if terms.freq.size == 0:
        return s.astype(np.float64)
    return s - _used_of(terms, rows, left, cpu, mem) / terms.total


def _used_of(terms: FragTerms, rows: np.ndarray | slice, left: np.ndarray, cpu: np.ndarray,
             mem: np.ndarray) -> np.ndarray:
    """(n,) the weighted usable compute sum_t weight_t * runs_t * A_t (exact) given free compute ``left``."""
    ge = left[None, :, :] >= terms.milli[:, None, None]  # (T, n, G)
    a = (left[None, :, :] * ge).sum(axis=2)
    c = ge.sum(axis=2)
    runs = _runs(terms, rows, cpu, mem) & (c >= terms.count[:, None])
    return exact_dot(terms.weight, runs * a)


def _unique(f: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(f, return_inverse=True)`` for free compute (milli), by a table over 0..MILLI where every
    value lies there (exactly the same arrays, without numpy's general sort: a few GPUs' values per call)."""
    if len(f) == 0 or f.min() < 0 or f.max() > MILLI:
        return np.unique(f, return_inverse=True)
    present = np.zeros(MILLI + 1, bool)
    present[f] = True
    values = np.flatnonzero(present).astype(f.dtype)
    index = np.cumsum(present) - 1
    return values, index[f]


class FragCache:
    """Per-node sums behind the fragment of one cluster, refreshed only where nodes changed.

    ``a[t, n]``: free compute on node n's GPUs that can hold shape t; ``c[t, n]``:
    how many such GPUs; ``s[n]``: all free compute. Rows are recomputed when
    ``ClusterState.version`` says the node changed.
    """

    def __init__(self, cluster: ClusterState, terms: FragTerms) -> None:
        self.terms = terms
        n = cluster.n_nodes
        self.a = np.zeros((len(terms.freq), n), np.int64)
        self.c = np.zeros((len(terms.freq), n), np.int64)
        self.slots = np.zeros((len(terms.freq), n), np.int64)
        self.s = np.zeros(n, np.int64)
        self.version = np.full(n, -1, np.int64)
        self._seen = (-1, -1)  # (layout, epoch) of the cluster at the last sync
        self.sync(cluster)

    def sync(self, cluster: ClusterState) -> None:
        seen = (cluster.layout, cluster.epoch)
        if seen == self._seen:
            return
        self._seen = seen
        rows = np.flatnonzero(cluster.version != self.version)
        if len(rows) == 0:
            return
        left = cluster.usable_free(rows)
        ge = left[None, :, :] >= self.terms.milli[:, None, None]
        self.a[:, rows] = (left[None, :, :] * ge).sum(axis=2)
        self.c[:, rows] = ge.sum(axis=2)
        self.slots[:, rows] = (left[None, :, :] // np.maximum(self.terms.milli, 1)[:, None, None]).sum(axis=2)
        self.s[rows] = left.sum(axis=1)
        self.version[rows] = cluster.version[rows]

    def frag(self, cluster: ClusterState, rows: np.ndarray) -> np.ndarray:
        """(n,) fragment of the nodes ``rows`` now."""
        return self.s[rows] - self.used(cluster, rows) / self.terms.total

    def used(self, cluster: ClusterState, rows: np.ndarray) -> np.ndarray:
        """(n,) the exact weighted usable compute of the nodes ``rows`` now (fragment = s - used / total)."""
        t = self.terms
        runs = _runs(t, rows, cluster.cpu_free[rows], cluster.mem_free[rows]) & (self.c[:, rows] >= t.count[:, None])
        return exact_dot(t.weight, runs * self.a[:, rows])


def frag_delta_per_gpu(
    cluster: ClusterState,
    terms: FragTerms,
    rows: np.ndarray,
    demand: Demand,
    candidates: np.ndarray,
    cache: FragCache | None = None,
) -> np.ndarray:
    """(n, G) change of fragment if a one-GPU share ``demand`` went on GPU g of node rows[i].

    Entries where ``candidates`` (n, G) is False are ``+inf``.
    """
    if cache is None:
        cache = FragCache(cluster, terms)
    else:
        cache.sync(cluster)
    out = np.full(candidates.shape, np.inf)
    m = int(demand.milli)
    if terms.freq.size == 0:
        out[candidates] = -m
        return out
    used_before = cache.used(cluster, rows)
    ni, gi = np.nonzero(candidates)
    if len(ni) == 0:
        return out
    node = rows[ni]
    f = np.where(cluster.gpu_ok[node, gi], cluster.core_free[node, gi], 0).astype(np.int64)  # (K,)
    # A GPU going from f to f - m changes shape t's A by d_a[t, f] and drops it from C when d_c is -1.
    # Tables over the distinct values of f, then the sums over shapes become small matrix products.
    values, inverse = _unique(f)
    tm = terms.milli[:, None]
    ge_b = values[None, :] >= tm
    ge_a = (values[None, :] - m) >= tm
    d_a = ((values[None, :] - m) * ge_a - values[None, :] * ge_b).astype(np.float64)  # (T, V)
    drop = ge_b & ~ge_a  # (T, V)
    runs = _runs(terms, rows, cluster.cpu_free[rows] - demand.cpu_milli, cluster.mem_free[rows] - demand.memory_bytes)
    c = cache.c[:, rows]
    a = cache.a[:, rows].astype(np.float64)
    # Integer-valued weights: every product and sum below is an exact integer (ordered.py), so the result
    # for a node is the same whatever other nodes share the batch.
    p = terms.weight[:, None]
    keep_q = p * (runs & (c >= terms.count[:, None]))  # shape still runs if this GPU stays in C
    drop_q = p * (runs & (c >= terms.count[:, None] + 1))  # shape still runs if it leaves C
    base = exact_dot(terms.weight, (runs & (c >= terms.count[:, None])) * a)  # (n,)
    change = (
        keep_q.T @ np.where(drop, 0.0, d_a) + ((drop_q - keep_q) * a).T @ drop + drop_q.T @ np.where(drop, d_a, 0.0)
    )
    # fragment after - before = -m - (used after - used before) / total, with the used sums exact.
    used_change = (base - used_before)[:, None] + change  # (n, V)
    out[ni, gi] = -m - used_change[ni, inverse] / terms.total
    return out


def frag_delta_per_node(
    cluster: ClusterState,
    terms: FragTerms,
    rows: np.ndarray,
    demand: Demand,
    gpu_choice: np.ndarray | None,
    cache: FragCache | None = None,
) -> np.ndarray:
    """(n,) change of fragment if ``demand`` went on each node of ``rows`` on the GPUs ``gpu_choice`` (n, k).

    ``gpu_choice`` may be None for a CPU-only demand.
    """
    cpu_after = cluster.cpu_free[rows] - demand.cpu_milli
    mem_after = cluster.mem_free[rows] - demand.memory_bytes
    if cache is not None and (demand.count == 0 or demand.exclusive):
        # Whole free GPUs leave every shape's A by a full GPU each and C by one each.
        cache.sync(cluster)
        t = terms
        used_before = cache.used(cluster, rows)
        k = demand.count if demand.milli > 0 else 0
        a = cache.a[:, rows] - (MILLI * k) * t.gpu_shape[:, None]
        c = cache.c[:, rows] - k * t.gpu_shape[:, None]
        runs = _runs(t, rows, cpu_after, mem_after) & (c >= t.count[:, None])
        # after - before = -(free compute taken) - (used after - used before) / total, the used sums exact.
        return -float(MILLI * k) - (exact_dot(t.weight, runs * a) - used_before) / t.total
    left = cluster.usable_free(rows)
    used_before = _used_of(terms, rows, left, cluster.cpu_free[rows], cluster.mem_free[rows])
    after_left = left.copy()
    if gpu_choice is not None and demand.count > 0:
        r = np.arange(len(after_left))[:, None]
        take = MILLI if demand.exclusive else demand.milli
        after_left[r, gpu_choice] = np.maximum(after_left[r, gpu_choice] - take, 0)
    used_after = _used_of(terms, rows, after_left, cpu_after, mem_after)
    return (after_left.sum(axis=1) - left.sum(axis=1)) - (used_after - used_before) / terms.total


# ---- the capacity-aware measure (kubegpu's own) ------------------------------------------------------
#
# FGD asks whether ONE pod of a shape still fits a node. A node with seven free GPUs and CPU for
# one more pod passes that test, yet six of its GPUs are stranded. The capacity-aware measure
# scales each shape's usable compute by the share of its GPU slots that the node's CPU and memory
# can also serve:  usable_t = A_t * min(1, pods_by_cpu_and_memory / pods_by_gpu).


def _usable(
    terms: FragTerms, rows: np.ndarray, a: np.ndarray, slots: np.ndarray, cpu: np.ndarray, mem: np.ndarray
) -> np.ndarray:
    """(X,) expected usable free compute of X node states given per-shape sums (T, X)."""
    pods_gpu = slots // np.maximum(terms.count, 1)[:, None]
    runs = _runs(terms, rows, cpu, mem) & (pods_gpu >= 1)
    supply = np.where(terms.cpu[:, None] > 0, cpu[None, :] // np.maximum(terms.cpu, 1)[:, None], 1 << 30)
    if terms.use_memory:
        by_mem = np.where(terms.memory[:, None] > 0, mem[None, :] // np.maximum(terms.memory, 1)[:, None], 1 << 30)
        supply = np.minimum(supply, by_mem)
    ratio = np.minimum(1.0, supply / np.maximum(pods_gpu, 1))
    # Float terms: added shape by shape, elementwise (ordered.py), so a node's value never depends on the batch.
    return weighted_sum(terms.freq, runs * ratio * a)


def capacity_frag(cluster: ClusterState, cache: FragCache, rows: np.ndarray) -> np.ndarray:
    """(n,) capacity-aware fragment of the nodes ``rows`` now."""
    cache.sync(cluster)
    return cache.s[rows] - _usable(
        cache.terms, rows, cache.a[:, rows], cache.slots[:, rows], cluster.cpu_free[rows], cluster.mem_free[rows]
    )


def capacity_delta_per_gpu(
    cluster: ClusterState, cache: FragCache, rows: np.ndarray, demand: Demand, candidates: np.ndarray
) -> np.ndarray:
    """Like :func:`frag_delta_per_gpu`, for the capacity-aware measure."""
    terms = cache.terms
    out = np.full(candidates.shape, np.inf)
    before = capacity_frag(cluster, cache, rows)
    ni, gi = np.nonzero(candidates)
    if len(ni) == 0:
        return out
    m = int(demand.milli)
    node = rows[ni]
    f = np.where(cluster.gpu_ok[node, gi], cluster.core_free[node, gi], 0).astype(np.int64)
    values, inverse = _unique(f)
    tm = terms.milli[:, None]
    ge_b = values[None, :] >= tm
    ge_a = (values[None, :] - m) >= tm
    d_a = (values[None, :] - m) * ge_a - values[None, :] * ge_b
    mt = np.maximum(terms.milli, 1)[:, None]
    d_slots = (values[None, :] - m) // mt - values[None, :] // mt
    a = cache.a[:, node] + d_a[:, inverse]
    slots = cache.slots[:, node] + d_slots[:, inverse]
    after = (cache.s[node] - m) - _usable(
        terms, node, a, slots, cluster.cpu_free[node] - demand.cpu_milli, cluster.mem_free[node] - demand.memory_bytes
    )
    out[ni, gi] = after - before[ni]
    return out


def capacity_delta_per_node(
    cluster: ClusterState, cache: FragCache, rows: np.ndarray, demand: Demand, gpu_choice: np.ndarray | None
) -> np.ndarray:
    """Like :func:`frag_delta_per_node`, for the capacity-aware measure."""
    terms = cache.terms
    before = capacity_frag(cluster, cache, rows)
    cpu_after = cluster.cpu_free[rows] - demand.cpu_milli
    mem_after = cluster.mem_free[rows] - demand.memory_bytes
    if demand.count == 0 or demand.milli <= 0:
        a, slots, s_after = cache.a[:, rows], cache.slots[:, rows], cache.s[rows]
    elif demand.exclusive:
        k = demand.count
        gpu = terms.gpu_shape[:, None]
        a = cache.a[:, rows] - (MILLI * k) * gpu
        slots = cache.slots[:, rows] - k * (MILLI // np.maximum(terms.milli, 1))[:, None] * gpu
        s_after = cache.s[rows] - MILLI * k
    else:
        left = cluster.usable_free(rows)
        r = np.arange(len(rows))[:, None]
        left[r, gpu_choice] = np.maximum(left[r, gpu_choice] - demand.milli, 0)
        ge = left[None, :, :] >= terms.milli[:, None, None]
        a = (left[None, :, :] * ge).sum(axis=2)
        slots = (left[None, :, :] // np.maximum(terms.milli, 1)[:, None, None]).sum(axis=2)
        s_after = left.sum(axis=1)
    after = s_after - _usable(terms, rows, a, slots, cpu_after, mem_after)
    return after - before
