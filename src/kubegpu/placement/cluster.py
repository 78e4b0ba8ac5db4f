"""A cluster's free capacity as numpy arrays, and a request flattened to what fit needs.

The extender scores thousands of nodes per pod and the simulator places tens of
thousands of pods, so placement works on arrays: one row per node, one column
per GPU slot (nodes with fewer GPUs leave the extra slots unusable). A single
node is simply a one-row cluster, so the extender, the device plugin and the
simulator run the same code.

Units: compute in thousandths of a GPU ("milli", 1000 = a whole GPU; a
``kubegpu.io/gpu-core`` percent is milli / 10), memory in bytes, CPU in
millicores.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kubegpu.model.inventory import NodeInventory
from kubegpu.placement.topology import score_matrix

MILLI = 1000  # compute of one whole GPU
# Pods per request kind on each node (column 0: GPU shares, k: k whole GPUs, 9: more); the
# clustering policy reads it.
TAG_COLUMNS = 10
# Layout generations: every ClusterState (and every copy) gets its own, never reused (unlike id()).
_LAYOUTS = itertools.count(1)
_ALL = slice(None)  # every row


def demand_tag(demand: Demand) -> int:
    """Column of ``ClusterState.tags`` for a demand (-1 for a CPU-only one)."""
    if demand.count == 0 or demand.milli <= 0:
        return -1
    if not demand.exclusive:
        return 0
    return min(demand.count, TAG_COLUMNS - 1)


@dataclass(frozen=True, slots=True)
class Demand:
    """One container's (or one trace pod's) need, flattened for the array code.

    ``count`` GPUs, each with ``milli`` compute and ``gpu_memory`` bytes or
    ``memory_ratio`` percent of its memory; ``exclusive`` means each GPU must be
    entirely free and is then taken whole. ``models`` restricts GPU models
    (``None`` = any). ``cpu_milli``/``memory_bytes`` are the pod's CPU and memory.
    """

    count: int = 0
    milli: int = 0
    gpu_memory: int = 0
    memory_ratio: int = 0
    exclusive: bool = False
    cpu_milli: int = 0
    memory_bytes: int = 0
    models: frozenset[str] | None = None

    @property
    def is_share(self) -> bool:
        """A fraction of one or more GPUs (not whole, not CPU-only)."""
        return self.count > 0 and not self.exclusive

    @property
    def gpu_milli_total(self) -> int:
        """Total GPU compute asked for, in milli (the trace's 'GPU request')."""
        return self.count * self.milli

    @classmethod
    def whole(
        cls, count: int, cpu_milli: int = 0, memory_bytes: int = 0, models: frozenset[str] | None = None
    ) -> Demand:
        return cls(count, MILLI, 0, 100, True, cpu_milli, memory_bytes, models)

    @classmethod
    def share(
        cls,
        milli: int,
        count: int = 1,
        gpu_memory: int = 0,
        memory_ratio: int = 0,
        cpu_milli: int = 0,
        memory_bytes: int = 0,
        models: frozenset[str] | None = None,
    ) -> Demand:
        exclusive = milli >= MILLI and (memory_ratio >= 100 or (gpu_memory == 0 and memory_ratio == 0))
        return cls(count, milli, gpu_memory, memory_ratio, exclusive, cpu_milli, memory_bytes, models)


@dataclass(slots=True)
class ClusterState:
    """Free and total capacity of N nodes with up to G GPUs each (mutable; copy before trying)."""

    names: list[str]
    model_names: tuple[str, ...]  # distinct GPU models; node_model indexes it (-1 = no GPU)
    node_model: np.ndarray  # (N,) int
    cpu_cap: np.ndarray  # (N,) int64 millicores
    cpu_free: np.ndarray  # (N,) int64
    mem_cap: np.ndarray  # (N,) int64 bytes
    mem_free: np.ndarray  # (N,) int64
    gpu_ok: np.ndarray  # (N, G) bool: slot holds a healthy GPU placement may use (not MIG-enabled)
    core_free: np.ndarray  # (N, G) int32 milli (0 where not ok)
    gmem_cap: np.ndarray  # (N, G) int64 bytes
    gmem_free: np.ndarray  # (N, G) int64 bytes
    links: np.ndarray | None = None  # (N, G, G) int32 pair scores from topology.LINK_SCORES; None = flat
    tags: np.ndarray = field(default_factory=lambda: np.zeros((0, TAG_COLUMNS), np.int32))
    _model_index: dict[str, int] = field(default_factory=dict)
    # Bumped on every change of a node, so derived caches know which rows to refresh. Code that
    # writes the arrays directly must call touch(node).
    version: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # Which GPU models a demand's ``models`` admit: exact names by default; the extender plugs in its
    # own matcher (GFD spellings, trace names) with :meth:`set_model_matcher`.
    _matcher: Callable[[frozenset[str]], np.ndarray] | None = None
    # This object's layout generation: caches derived from a cluster are keyed by (layout, row version).
    # A new one for every object, every copy and every change of rows, slots or models; never reused.
    layout: int = 0
    # Row changes so far (every version bump): a cache that saw this epoch has nothing to refresh.
    epoch: int = 0

    def __post_init__(self) -> None:
        if self.version.shape != self.cpu_cap.shape:
            self.version = np.zeros(self.cpu_cap.shape, np.int64)
        self.layout = next(_LAYOUTS)

    def touch(self, node: int) -> None:
        """Record that a node's arrays changed."""
        self.version[node] += 1
        self.epoch += 1

    # ---- what the extender writes -----------------------------------------------------------
    def set_models(self, names: Sequence[str]) -> None:
        """Name the GPU models (``node_model`` indexes them); a new layout generation."""
        self.model_names = tuple(names)
        self._model_index = {m: i for i, m in enumerate(self.model_names)}
        self.layout = next(_LAYOUTS)

    def model_id(self, name: str) -> int:
        """Index of a GPU model in ``model_names``; -1 when unknown."""
        return self._model_index.get(name, -1)

    def set_model_matcher(self, matcher: Callable[[frozenset[str]], np.ndarray] | None) -> None:
        """Answer :meth:`model_mask` with ``matcher`` (an (N,) bool per allowed set); a new layout generation."""
        self._matcher = matcher
        self.layout = next(_LAYOUTS)

    def set_row(self, node: int, src: ClusterState, model: str, src_row: int = 0) -> None:
        """Copy row ``src_row`` of ``src`` (a node's own one-row state) into row ``node``; bumps its version.

        Raises ValueError when ``src`` has more GPU slots than this cluster or an unknown GPU model.
        """
        k = src.n_slots
        if k > self.n_slots:
            raise ValueError(f"{self.names[node]}: {k} GPU slots, the cluster holds {self.n_slots}")
        mid = self.model_id(model) if model else -1
        if model and mid < 0:
            raise ValueError(f"{self.names[node]}: GPU model {model!r} not in this cluster's table")
        self.node_model[node] = mid
        self.gpu_ok[node] = False
        self.core_free[node] = 0
        self.gmem_cap[node] = 0
        self.gmem_free[node] = 0
        self.cpu_cap[node], self.cpu_free[node] = src.cpu_cap[src_row], src.cpu_free[src_row]
        self.mem_cap[node], self.mem_free[node] = src.mem_cap[src_row], src.mem_free[src_row]
        self.gpu_ok[node, :k] = src.gpu_ok[src_row]
        self.core_free[node, :k] = src.core_free[src_row]
        self.gmem_cap[node, :k] = src.gmem_cap[src_row]
        self.gmem_free[node, :k] = src.gmem_free[src_row]
        if self.links is not None:
            self.links[node] = 0
            if src.links is not None:
                self.links[node, :k, :k] = src.links[src_row]
        if src.tags.shape[0] and self.tags.shape[0]:
            self.tags[node] = src.tags[src_row]
        self.touch(node)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def empty(cls, n: int, g: int) -> ClusterState:
        return cls(
            names=[f"node-{i}" for i in range(n)],
            model_names=(),
            node_model=np.full(n, -1, np.int32),
            cpu_cap=np.zeros(n, np.int64),
            cpu_free=np.zeros(n, np.int64),
            mem_cap=np.zeros(n, np.int64),
            mem_free=np.zeros(n, np.int64),
            gpu_ok=np.zeros((n, g), bool),
            core_free=np.zeros((n, g), np.int32),
            gmem_cap=np.zeros((n, g), np.int64),
            gmem_free=np.zeros((n, g), np.int64),
            tags=np.zeros((n, TAG_COLUMNS), np.int32),
        )

    @classmethod
    def from_arrays(
        cls,
        names: Sequence[str],
        models: Sequence[str],
        gpu_counts: Sequence[int],
        cpu_milli: Sequence[int],
        memory_bytes: Sequence[int],
        gpu_memory_bytes: Sequence[int] | None = None,
        max_gpus: int | None = None,
    ) -> ClusterState:
        """Identical empty GPUs per node (the trace's node list form)."""
        n = len(names)
        counts = np.asarray(gpu_counts, np.int32)
        g = int(max_gpus if max_gpus is not None else max(1, int(counts.max(initial=0))))
        model_names = tuple(sorted({m for m, c in zip(models, counts, strict=True) if m and c > 0}))
        index = {m: i for i, m in enumerate(model_names)}
        st = cls.empty(n, g)
        st.names = list(names)
        st.model_names = model_names
        st._model_index = index
        st.node_model = np.array(
            [index.get(m, -1) if c > 0 else -1 for m, c in zip(models, counts, strict=True)], np.int32
        )
        st.cpu_cap = np.asarray(cpu_milli, np.int64).copy()
        st.cpu_free = st.cpu_cap.copy()
        st.mem_cap = np.asarray(memory_bytes, np.int64).copy()
        st.mem_free = st.mem_cap.copy()
        st.gpu_ok = np.arange(g)[None, :] < counts[:, None]
        st.core_free = np.where(st.gpu_ok, MILLI, 0).astype(np.int32)
        gm = np.zeros(n, np.int64) if gpu_memory_bytes is None else np.asarray(gpu_memory_bytes, np.int64)
        st.gmem_cap = np.where(st.gpu_ok, gm[:, None], 0).astype(np.int64)
        st.gmem_free = st.gmem_cap.copy()
        return st

    @classmethod
    def from_inventories(cls, nodes: Sequence[NodeInventory], max_gpus: int | None = None) -> ClusterState:
        """Empty nodes from inventories; unhealthy and MIG-enabled GPUs are not usable slots."""
        g = max_gpus if max_gpus is not None else max([1, *(len(n.gpus) for n in nodes)])
        n = len(nodes)
        st = cls.empty(n, g)
        st.names = [x.name for x in nodes]
        st.model_names = tuple(sorted({gpu.model for x in nodes for gpu in x.gpus}))
        st._model_index = {m: i for i, m in enumerate(st.model_names)}
        st.links = np.zeros((n, g, g), np.int32)
        for i, node in enumerate(nodes):
            st.cpu_cap[i] = st.cpu_free[i] = node.cpu_milli
            st.mem_cap[i] = st.mem_free[i] = node.memory_bytes
            st.node_model[i] = st._model_index.get(node.model, -1) if node.gpus else -1
            gpus = sorted(node.gpus, key=lambda x: x.index)[:g]
            for j, gpu in enumerate(gpus):
                usable = gpu.placeable
                st.gpu_ok[i, j] = usable
                st.gmem_cap[i, j] = gpu.memory_bytes
                st.gmem_free[i, j] = gpu.memory_bytes if usable else 0
                st.core_free[i, j] = min(MILLI, gpu.core * 10) if usable else 0
            m = score_matrix(gpus)
            st.links[i, : len(gpus), : len(gpus)] = np.asarray(m, np.int32).reshape(len(gpus), len(gpus))
        return st

    def copy(self) -> ClusterState:
        return ClusterState(
            list(self.names),
            self.model_names,
            self.node_model.copy(),
            self.cpu_cap.copy(),
            self.cpu_free.copy(),
            self.mem_cap.copy(),
            self.mem_free.copy(),
            self.gpu_ok.copy(),
            self.core_free.copy(),
            self.gmem_cap.copy(),
            self.gmem_free.copy(),
            None if self.links is None else self.links.copy(),
            self.tags.copy(),
            dict(self._model_index),
            self.version.copy(),
            self._matcher,
        )

    # ---- shape --------------------------------------------------------------------------------
    @property
    def n_nodes(self) -> int:
        return int(self.cpu_cap.shape[0])

    @property
    def n_slots(self) -> int:
        return int(self.core_free.shape[1])

    def model_of(self, node: int) -> str:
        m = int(self.node_model[node])
        return self.model_names[m] if m >= 0 else ""

    # ---- fit ----------------------------------------------------------------------------------
    def model_mask(self, models: frozenset[str] | None) -> np.ndarray:
        """(N,) bool: nodes whose GPU model is allowed."""
        if models is None:
            return np.ones(self.n_nodes, bool)
        if self._matcher is not None:
            return self._matcher(models)
        allowed = [self._model_index[m] for m in models if m in self._model_index]
        return np.isin(self.node_model, np.asarray(allowed, np.int32))

    def gpu_memory_need(self, demand: Demand, rows: np.ndarray | slice = _ALL) -> np.ndarray:
        """(N, G) bytes each GPU would have to give (a ratio depends on the GPU's size); ``rows``: of those
        rows only."""
        cap = self.gmem_cap[rows]
        if demand.exclusive:
            return cap
        if demand.gpu_memory:
            return np.full(cap.shape, demand.gpu_memory, np.int64)
        return cap * demand.memory_ratio // 100

    def gpu_candidates(self, demand: Demand, rows: np.ndarray | slice = _ALL) -> np.ndarray:
        """(N, G) bool: GPUs that could take one of the demand's GPU parts on their own; ``rows``: of those
        rows only (the extender refreshes the rows changed since it last asked)."""
        ok, core, gmem = self.gpu_ok[rows], self.core_free[rows], self.gmem_free[rows]
        if demand.count == 0:
            return np.zeros(core.shape, bool)
        if demand.exclusive:
            return ok & (core >= MILLI) & (gmem >= self.gmem_cap[rows])
        return ok & (core >= demand.milli) & (gmem >= self.gpu_memory_need(demand, rows))

    def feasible(self, demand: Demand, candidates: np.ndarray | None = None) -> np.ndarray:
        """(N,) bool: nodes where the whole demand fits (CPU, memory, model, enough GPUs)."""
        ok = (self.cpu_free >= demand.cpu_milli) & (self.mem_free >= demand.memory_bytes)
        if demand.count == 0:
            return ok
        if candidates is None:
            candidates = self.gpu_candidates(demand)
        return ok & self.model_mask(demand.models) & (candidates.sum(axis=1) >= demand.count)

    # ---- commit -------------------------------------------------------------------------------
    def usable_free(self, rows: int | np.ndarray | slice) -> np.ndarray:
        """Free compute (milli) of the GPU slots of ``rows``; 0 where a slot is unhealthy or unused."""
        return np.where(self.gpu_ok[rows], self.core_free[rows], 0).astype(np.int64)

    def take(self, node: int, gpus: Sequence[int], demand: Demand) -> None:
        """Subtract a demand placed on ``gpus`` of ``node``. Checks first; changes nothing on error."""
        gpus = list(gpus)
        if len(gpus) != demand.count or len(set(gpus)) != len(gpus):
            raise ValueError(f"{demand.count} distinct GPUs needed, got {gpus}")
        if self.cpu_free[node] < demand.cpu_milli or self.mem_free[node] < demand.memory_bytes:
            raise ValueError(f"{self.names[node]}: not enough CPU or memory")
        cand = self.gpu_candidates(demand)[node]
        for j in gpus:
            if not (0 <= j < self.n_slots) or not cand[j]:
                raise ValueError(f"{self.names[node]}: GPU slot {j} cannot take this demand")
        need = self.gpu_memory_need(demand)[node]
        self.cpu_free[node] -= demand.cpu_milli
        self.mem_free[node] -= demand.memory_bytes
        self.touch(node)
        tag = demand_tag(demand)
        if tag >= 0:
            self.tags[node, tag] += 1
        for j in gpus:
            if demand.exclusive:
                self.core_free[node, j] = 0
                self.gmem_free[node, j] = 0
            else:
                self.core_free[node, j] -= demand.milli
                self.gmem_free[node, j] -= need[j]

    def give_back(self, node: int, gpus: Sequence[int], demand: Demand) -> None:
        """Undo :meth:`take` (departures, rollbacks). Never goes above capacity."""
        need = self.gpu_memory_need(demand)[node]
        self.cpu_free[node] = min(self.cpu_cap[node], self.cpu_free[node] + demand.cpu_milli)
        self.mem_free[node] = min(self.mem_cap[node], self.mem_free[node] + demand.memory_bytes)
        self.touch(node)
        tag = demand_tag(demand)
        if tag >= 0 and self.tags[node, tag] > 0:
            self.tags[node, tag] -= 1
        for j in gpus:
            if not self.gpu_ok[node, j]:
                continue
            if demand.exclusive:
                self.core_free[node, j] = MILLI
                self.gmem_free[node, j] = self.gmem_cap[node, j]
            else:
                self.core_free[node, j] = min(MILLI, self.core_free[node, j] + demand.milli)
                self.gmem_free[node, j] = min(self.gmem_cap[node, j], self.gmem_free[node, j] + need[j])
