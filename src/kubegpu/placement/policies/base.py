"""The policy interface, the context a scoring call may consult, and the caches policies keep.

A policy answers two questions, each on arrays and without changing anything:
which of these feasible nodes is best for this demand (``node_scores``), and
which of this node's GPUs is best for one GPU's part of it (``gpu_scores``).
Higher is better. The node level and the GPU level are chosen separately.

Every cache here is keyed by explicit generations, never by ``id()``: the
cluster's ``layout`` (a new one for every :class:`ClusterState` object, copy
and change of rows or models), the row ``version`` (bumped on every change of
a node) and the context's ``workload_gen`` (a new one for every target
workload). A stale entry can therefore never be returned, whatever objects are
freed and reallocated.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

import numpy as np

from kubegpu.placement.cluster import ClusterState, Demand
from kubegpu.placement.fill import cpu_floor, cpu_per_milli, cpu_pressure, fill_value
from kubegpu.placement.frag import FragCache, FragTerms
from kubegpu.placement.workload import Workload

# Normalisers of the FGD simulator (largest node in the Alibaba trace): 128 cores, 8 GPUs.
MAX_SPEC_CPU: Final = 128_000
MAX_SPEC_GPU: Final = 8_000
MAX_SCORE: Final = 100

_WORKLOAD_GENS = itertools.count(1)


@dataclass
class ScoreContext:
    """What a scoring call may consult besides the cluster: the target workload and a random source.

    ``rng`` drives the ``random`` policy, and breaks ties only when
    ``random_ties`` is set (as stock kube-scheduler does). Otherwise ties go
    to the node with the lowest ``node_rank`` (default: the lowest index), so
    results are deterministic; the FGD paper's simulator breaks ties by node
    name after prefixing names with a random permutation, which a random
    ``node_rank`` reproduces.

    The workload is fixed for the context's life (``workload_gen`` names it);
    a new workload is a new context. Derived tables (fragment terms and sums,
    fill tables) are kept per (cluster layout, workload generation).
    """

    workload: Workload | None = None
    rng: np.random.Generator | None = None
    random_ties: bool = False
    node_rank: np.ndarray | None = None
    use_memory: bool = False
    workload_gen: int = 0
    _store: OrderedDict[Hashable, Any] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if not self.workload_gen:
            self.workload_gen = next(_WORKLOAD_GENS)

    def _need_workload(self) -> Workload:
        if self.workload is None:
            raise ValueError("this policy needs a target workload (ScoreContext.workload)")
        return self.workload

    def derived(self, key: Hashable, cluster: ClusterState | None, build: Callable[[], Any]) -> Any:
        """A table derived from this context's workload (and ``cluster``'s layout), built once."""
        full = (key, None if cluster is None else cluster.layout)
        out = self._store.get(full)
        if out is None:
            while len(self._store) >= 64:  # one-node trial clusters come and go: drop the least recent
                self._store.popitem(last=False)
            out = self._store[full] = build()
        else:
            self._store.move_to_end(full)
        return out

    def frag_terms(self, cluster: ClusterState, use_memory: bool | None = None) -> FragTerms:
        """The workload's fragment terms for this cluster."""
        mem = self.use_memory if use_memory is None else use_memory
        wl = self._need_workload()
        return self.derived(("terms", mem), cluster, lambda: FragTerms.build(cluster, wl, use_memory=mem))

    def frag_cache(self, cluster: ClusterState, use_memory: bool | None = None) -> FragCache:
        """Per-node fragment sums of this cluster, refreshed where rows changed (``ClusterState.version``)."""
        mem = self.use_memory if use_memory is None else use_memory
        terms = self.frag_terms(cluster, mem)
        cache: FragCache = self.derived(("frag", mem), cluster, lambda: FragCache(cluster, terms))
        cache.sync(cluster)
        return cache

    def fill_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """The workload's (``fill_value``, ``cpu_floor``) tables (see :mod:`kubegpu.placement.fill`)."""
        wl = self._need_workload()
        return self.derived("fill", None, lambda: (fill_value(wl), cpu_floor(wl)))

    def cpu_feed(self, cluster: ClusterState) -> float:
        """CPU per milli of GPU to count GPUs stranded behind CPU with: the workload's GPU pods' ratio when
        its CPU would run out before the cluster's GPUs (:func:`~kubegpu.placement.fill.cpu_pressure` >= 1),
        else 0 (off)."""
        wl = self._need_workload()
        return self.derived(
            "feed", cluster, lambda: cpu_per_milli(wl) if cpu_pressure(cluster, wl) >= 1.0 else 0.0
        )


class RowCache:
    """Per-row values of a row-local computation, kept with the row version they were computed at.

    ``get(key, cluster, rows, compute)`` returns the values of ``rows``; only
    rows changed since (or never computed) are passed to ``compute`` (as
    positions into ``rows``). Keys must name everything else the values depend
    on (the demand, the workload generation); the cluster's layout is added
    here. At most ``limit`` keys are kept, least recently used dropped.
    """

    def __init__(self, limit: int = 256, dtype: type | np.dtype[Any] = np.float64) -> None:
        self.limit = limit
        self.dtype = dtype  # of the kept values (``object`` for texts)
        self._entries: OrderedDict[Hashable, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def clear(self) -> None:
        self._entries.clear()

    def get(
        self,
        key: Hashable,
        cluster: ClusterState,
        rows: np.ndarray,
        compute: Callable[[np.ndarray], np.ndarray],
        width: tuple[int, ...] = (),
    ) -> np.ndarray:
        full = (key, cluster.layout)
        entry = self._entries.get(full)
        if entry is None:
            while len(self._entries) >= self.limit:
                self._entries.popitem(last=False)
            entry = self._entries[full] = (
                np.zeros((cluster.n_nodes, *width), self.dtype),
                np.full(cluster.n_nodes, -1, np.int64),
            )
        else:
            self._entries.move_to_end(full)
        values, version = entry
        # over every row (contiguous), then one take: cheaper than taking both versions of thousands of rows
        stale = np.flatnonzero((version != cluster.version)[rows])
        if len(stale):
            fresh = rows[stale]
            values[fresh] = compute(stale)
            version[fresh] = cluster.version[fresh]
        return values[rows]


class Policy:
    """A scoring policy. Subclasses override one or both methods; scores are higher-better floats.

    A policy declares its own properties instead of callers restating them:
    ``row_local(demand)`` says whether a node's score depends on that node's
    row alone (given the cluster-wide tables), so a kept score stays right
    until the row changes; ``refines`` names the row-local policy whose ties
    this one settles (its scores equal that policy's except among the nodes
    tied at the top). Each instance carries its caches (:class:`RowCache`),
    keyed by generations, so one instance may serve many clusters and contexts.
    """

    name: ClassVar[str] = ""
    gpu_default: ClassVar[str] = "bestfit"  # the GPU-level policy it is paired with by default
    needs_workload: ClassVar[bool] = False
    refines: ClassVar[str | None] = None

    def __init__(self) -> None:
        self.rows = RowCache()

    def row_local(self, demand: Demand) -> bool:
        """Whether a node's score for ``demand`` depends on that node's row alone (and the whole cluster's
        fixed tables), never on which other nodes are scored with it."""
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
