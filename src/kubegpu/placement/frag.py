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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kubegpu.placement.cluster import MILLI, ClusterState, Demand
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

    @classmethod
    def build(cls, cluster: ClusterState, workload: Workload, use_memory: bool = False) -> FragTerms:
        shapes = workload.shapes
        access = np.ones((len(shapes), cluster.n_nodes), bool)
        for t, s in enumerate(shapes):
            if s.models is not None:
                access[t] = cluster.model_mask(s.models)
        return cls(
            milli=np.array([s.milli for s in shapes], np.int64),
            count=np.array([s.count for s in shapes], np.int64),
            cpu=np.array([s.cpu_milli for s in shapes], np.int64),
            memory=np.array([s.memory_bytes for s in shapes], np.int64),
            freq=np.asarray(workload.freq, np.float64),
            gpu_shape=np.array([s.count > 0 and s.milli > 0 for s in shapes], bool),
            access=access,
            use_memory=use_memory,
        )


def _free(cluster: ClusterState, rows: np.ndarray | slice) -> np.ndarray:
    return np.where(cluster.gpu_ok[rows], cluster.core_free[rows], 0).astype(np.int64)


def _runs(terms: FragTerms, rows: np.ndarray | slice, cpu: np.ndarray, mem: np.ndarray) -> np.ndarray:
    """(T, n) bool: shape t could run on node (apart from GPU room), given CPU and memory left."""
    ok = terms.gpu_shape[:, None] & terms.access[:, rows] & (cpu[None, :] >= terms.cpu[:, None])
    if terms.use_memory:
        ok &= mem[None, :] >= terms.memory[:, None]
    return ok


def node_frag(cluster: ClusterState, terms: FragTerms, rows: np.ndarray | slice = slice(None)) -> np.ndarray:
    """(n,) fragment (milli) of the selected nodes as they are now."""
    left = _free(cluster, rows)
    return frag_of(terms, rows, left, cluster.cpu_free[rows], cluster.mem_free[rows])


def frag_of(
    terms: FragTerms, rows: np.ndarray | slice, left: np.ndarray, cpu: np.ndarray, mem: np.ndarray
) -> np.ndarray:
    """(n,) fragment of nodes given explicit free compute ``left`` (n, G), CPU and memory."""
    s = left.sum(axis=1)
    if terms.freq.size == 0:
        return s.astype(np.float64)
    ge = left[None, :, :] >= terms.milli[:, None, None]  # (T, n, G)
    a = (left[None, :, :] * ge).sum(axis=2)
    c = ge.sum(axis=2)
    runs = _runs(terms, rows, cpu, mem) & (c >= terms.count[:, None])
    return s - (terms.freq[:, None] * (runs * a)).sum(axis=0)


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
        self.s = np.zeros(n, np.int64)
        self.version = np.full(n, -1, np.int64)
        self.sync(cluster)

    def sync(self, cluster: ClusterState) -> None:
        rows = np.flatnonzero(cluster.version != self.version)
        if len(rows) == 0:
            return
        left = _free(cluster, rows)
        ge = left[None, :, :] >= self.terms.milli[:, None, None]
        self.a[:, rows] = (left[None, :, :] * ge).sum(axis=2)
        self.c[:, rows] = ge.sum(axis=2)
        self.s[rows] = left.sum(axis=1)
        self.version[rows] = cluster.version[rows]

    def frag(self, cluster: ClusterState, rows: np.ndarray) -> np.ndarray:
        """(n,) fragment of the nodes ``rows`` now."""
        t = self.terms
        runs = _runs(t, rows, cluster.cpu_free[rows], cluster.mem_free[rows]) & (self.c[:, rows] >= t.count[:, None])
        return self.s[rows] - t.freq @ (runs * self.a[:, rows])


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
    before = cache.frag(cluster, rows)
    ni, gi = np.nonzero(candidates)
    if len(ni) == 0:
        return out
    node = rows[ni]
    f = np.where(cluster.gpu_ok[node, gi], cluster.core_free[node, gi], 0).astype(np.int64)  # (K,)
    # A GPU going from f to f - m changes shape t's A by d_a[t, f] and drops it from C when d_c is -1.
    # Tables over the distinct values of f, then the sums over shapes become small matrix products.
    values, inverse = np.unique(f, return_inverse=True)
    tm = terms.milli[:, None]
    ge_b = values[None, :] >= tm
    ge_a = (values[None, :] - m) >= tm
    d_a = ((values[None, :] - m) * ge_a - values[None, :] * ge_b).astype(np.float64)  # (T, V)
    drop = ge_b & ~ge_a  # (T, V)
    runs = _runs(terms, rows, cluster.cpu_free[rows] - demand.cpu_milli, cluster.mem_free[rows] - demand.memory_bytes)
    c = cache.c[:, rows]
    a = cache.a[:, rows].astype(np.float64)
    p = terms.freq[:, None]
    keep_q = p * (runs & (c >= terms.count[:, None]))  # shape still runs if this GPU stays in C
    drop_q = p * (runs & (c >= terms.count[:, None] + 1))  # shape still runs if it leaves C
    base = (keep_q * a).sum(axis=0)  # (n,)
    change = (
        keep_q.T @ np.where(drop, 0.0, d_a) + ((drop_q - keep_q) * a).T @ drop + drop_q.T @ np.where(drop, d_a, 0.0)
    )
    after = (cache.s[rows] - m - base)[:, None] - change  # (n, V)
    out[ni, gi] = after[ni, inverse] - before[ni]
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
        before = cache.frag(cluster, rows)
        k = demand.count if demand.milli > 0 else 0
        a = cache.a[:, rows] - (MILLI * k) * t.gpu_shape[:, None]
        c = cache.c[:, rows] - k * t.gpu_shape[:, None]
        runs = _runs(t, rows, cpu_after, mem_after) & (c >= t.count[:, None])
        after = (cache.s[rows] - MILLI * k) - t.freq @ (runs * a)
        return after - before
    left = _free(cluster, rows)
    before = frag_of(terms, rows, left, cluster.cpu_free[rows], cluster.mem_free[rows])
    after_left = left.copy()
    if gpu_choice is not None and demand.count > 0:
        r = np.arange(len(after_left))[:, None]
        take = MILLI if demand.exclusive else demand.milli
        after_left[r, gpu_choice] = np.maximum(after_left[r, gpu_choice] - take, 0)
    after = frag_of(terms, rows, after_left, cpu_after, mem_after)
    return after - before
