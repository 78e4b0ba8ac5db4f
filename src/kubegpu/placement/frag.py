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

from kubegpu.placement.cluster import ClusterState, Demand
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


def frag_delta_per_gpu(
    cluster: ClusterState, terms: FragTerms, rows: np.ndarray, demand: Demand, candidates: np.ndarray
) -> np.ndarray:
    """(n, G) change of fragment if a one-GPU share ``demand`` went on GPU g of node rows[i].

    Entries where ``candidates`` (n, G) is False are ``+inf``.
    """
    left = _free(cluster, rows)  # (n, G)
    m = int(demand.milli)
    cpu_after = cluster.cpu_free[rows] - demand.cpu_milli
    mem_after = cluster.mem_free[rows] - demand.memory_bytes
    s = left.sum(axis=1)
    if terms.freq.size == 0:
        out = np.broadcast_to((-m) * np.ones_like(s, dtype=np.float64)[:, None], left.shape).copy()
        out[~candidates] = np.inf
        return out
    tm = terms.milli[:, None, None]
    ge = left[None] >= tm  # (T, n, G)
    a = (left[None] * ge).sum(axis=2)  # (T, n)
    c = ge.sum(axis=2)
    runs_now = _runs(terms, rows, cluster.cpu_free[rows], cluster.mem_free[rows])
    before = s - (terms.freq[:, None] * ((runs_now & (c >= terms.count[:, None])) * a)).sum(axis=0)

    after_left = left - m  # value of GPU g after the placement
    ge_after = after_left[None] >= tm
    a_after = a[:, :, None] - left[None] * ge + after_left[None] * ge_after  # (T, n, G)
    c_after = c[:, :, None] - ge + ge_after
    runs_after = _runs(terms, rows, cpu_after, mem_after)[:, :, None] & (
        c_after >= terms.count[:, None, None]
    )
    after = (s - m)[:, None] - np.einsum("t,tng->ng", terms.freq, runs_after * a_after)
    out = after - before[:, None]
    out[~candidates] = np.inf
    return out


def frag_delta_per_node(
    cluster: ClusterState, terms: FragTerms, rows: np.ndarray, demand: Demand, gpu_choice: np.ndarray | None
) -> np.ndarray:
    """(n,) change of fragment if ``demand`` went on each node of ``rows`` on the GPUs ``gpu_choice`` (n, k).

    ``gpu_choice`` may be None for a CPU-only demand.
    """
    left = _free(cluster, rows)
    cpu = cluster.cpu_free[rows]
    mem = cluster.mem_free[rows]
    before = frag_of(terms, rows, left, cpu, mem)
    after_left = left.copy()
    if gpu_choice is not None and demand.count > 0:
        r = np.arange(len(after_left))[:, None]
        take = 1000 if demand.exclusive else demand.milli
        after_left[r, gpu_choice] = np.maximum(after_left[r, gpu_choice] - take, 0)
    after = frag_of(terms, rows, after_left, cpu - demand.cpu_milli, mem - demand.memory_bytes)
    return after - before
