"""The array mirror: every GPU node's :class:`NodeState` copied into one :class:`ClusterState` row.

Filter and prioritize over thousands of nodes are vectorised over these rows,
with the same policy code the simulator runs. Rows are written only through
``ClusterState``'s public API (``set_models``, ``set_row``,
``set_model_matcher``), which bumps the row versions and layout generations
every kept score is keyed by. A new node, a removed one, more GPUs than the
arrays hold or a GPU model not seen before rebuild the arrays (a new layout).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import repeat

import numpy as np

from kubegpu.placement import ClusterState, Demand
from kubegpu.scheduler.nodes import NodeRecord
from kubegpu.scheduler.reasons import ReasonCache

MAX_MODEL_MASKS = 256  # distinct allowed-model lists whose node masks are kept (N bytes each)


class _Kept:
    """One GPU shape's candidates (N, G), their count per row (N,), and the row versions they are of."""

    __slots__ = ("cand", "counts", "epoch", "read_only", "version")

    def __init__(self, cand: np.ndarray, counts: np.ndarray, version: np.ndarray, epoch: int) -> None:
        self.cand, self.counts, self.version, self.epoch = cand, counts, version, epoch
        views = cand.view(), counts.view()
        for v in views:
            v.flags.writeable = False  # callers read; only a refresh writes (through the owning arrays)
        self.read_only = views


class ArrayMirror:
    """The ClusterState of the nodes with a known GPU state, with name -> row lookups."""

    def __init__(self, nodes: dict[str, NodeRecord]) -> None:
        self._nodes = nodes
        self._cluster: ClusterState | None = None
        self._row: dict[str, int] = {}
        self.names_by_row = np.zeros(0, object)  # (N,) each row's node name, for the current arrays
        self.rank = np.zeros(0, np.int64)  # (N,) position of each row's name in name order: the tie order
        self._model_masks: dict[frozenset[str], np.ndarray] = {}
        # The last node list, its rows and each name's position (see rows_of).
        self._rows_memo: tuple[list[str], np.ndarray, dict[str, int]] | None = None
        # gpu_candidates per GPU shape, and their count per row, with the row versions they are current
        # at (see candidates): a pod's filter, the texts of the nodes it fails and its prioritize share them,
        # and the next pod's refresh only the rows changed since.
        self._candidates: dict[tuple[int, int, int, int, bool], _Kept] = {}
        self._candidates_at = -1  # the layout they are kept for
        self.reasons = ReasonCache()  # the filter's per-node texts, kept by row version
        self.on_rebuild: Callable[[], None] = lambda: None

    # ---- arrays ----------------------------------------------------------------------------------
    @property
    def cluster(self) -> ClusterState:
        if self._cluster is None:
            self._rebuild()
        assert self._cluster is not None
        return self._cluster

    @property
    def built(self) -> bool:
        return self._cluster is not None

    def row(self, name: str) -> int | None:
        self.cluster  # noqa: B018 - rows current
        return self._row.get(name)

    def invalidate(self) -> None:
        self._cluster = None
        self._model_masks.clear()
        self._candidates.clear()
        self.reasons.clear()  # keyed by layout: the next arrays have a new one
        self._rows_memo = None

    def _rebuild(self) -> None:
        recs = [r for r in self._nodes.values() if r.state is not None]
        g = max([1, *(len(r.state.gpus) for r in recs if r.state)])
        st = ClusterState.empty(len(recs), g)
        st.names = [r.name for r in recs]
        st.set_models(sorted({gpu.model for r in recs if r.inventory for gpu in r.inventory.gpus}))
        st.links = np.zeros((len(recs), g, g), np.int32)
        for i, r in enumerate(recs):
            assert r.state is not None and r.inventory is not None
            st.set_row(i, r.state.arrays, r.inventory.model if r.inventory.gpus else "")
        st.set_model_matcher(self.model_mask)
        self._cluster = st
        self._row = {r.name: i for i, r in enumerate(recs)}
        self.names_by_row = np.array(st.names, dtype=object)  # (N,) each row's node name (the filter's answers)
        order = np.argsort(np.array(st.names, dtype=object), kind="stable") if recs else np.zeros(0, np.int64)
        self.rank = np.empty(len(recs), np.int64)
        self.rank[order] = np.arange(len(recs))
        self._model_masks.clear()
        self.on_rebuild()

    def update(self, rec: NodeRecord) -> None:
        """Copy a node's state into its row; rebuild the arrays when the row cannot take it."""
        st, i = self._cluster, self._row.get(rec.name)
        if st is None:
            return
        if i is None or rec.state is None or rec.inventory is None:
            if i is not None or rec.state is not None:
                self.invalidate()
            return
        model = rec.inventory.model if rec.inventory.gpus else ""
        if rec.state.arrays.n_slots > st.n_slots or (model and st.model_id(model) < 0):
            self.invalidate()
            return
        st.set_row(i, rec.state.arrays, model)

    def sync(self, node: str) -> None:
        """A node's state changed (a pod held or released): copy it into its row."""
        rec = self._nodes.get(node)
        if self._cluster is None or rec is None or rec.state is None:
            return
        self.update(rec)

    def labels_changed(self) -> None:
        """Model masks depend on labels: drop them, and give the cluster a new layout (kept terms go)."""
        self._model_masks.clear()
        if self._cluster is not None:
            self._cluster.set_model_matcher(self.model_mask)

    # ---- lookups ---------------------------------------------------------------------------------
    def rows_of(self, names: Sequence[str], remember: bool = True) -> np.ndarray:
        """Array rows of the named nodes (-1 for unknown ones).

        kube-scheduler sends filter the same node list again and again, each time starting at a
        rotating index: it is kept with its rows, and a repeat (or a rotation) is answered without looking
        each name up. Prioritize's list (the one filter passed) comes with its rows from the filter
        (:class:`~kubegpu.scheduler.verbs.Verbs` keeps them), not from here."""
        self.cluster  # noqa: B018 - rows current
        memo = self._rows_memo
        if memo is not None and len(memo[0]) == len(names) and names:
            prev, rows, where = memo
            p = where.get(names[0])
            if p is not None and list(names) == prev[p:] + prev[:p]:
                return rows if p == 0 else np.roll(rows, -p)
        names = list(names)
        rows = np.fromiter(map(self._row.get, names, repeat(-1)), np.int64, len(names))
        if remember:  # only filter's full lists: prioritize's would evict them for nothing
            self._rows_memo = (names, rows, {n: i for i, n in enumerate(names)})
        return rows

    def candidates(self, demand: Demand) -> np.ndarray:
        """``cluster.gpu_candidates(demand)`` (read-only), kept per GPU shape and refreshed only on the rows
        changed since (a bind changes one row of thousands)."""
        return self._kept(demand)[0]

    def candidate_counts(self, demand: Demand) -> np.ndarray:
        """(N,) read-only: how many GPUs of each row could take one of the demand's GPU parts."""
        return self._kept(demand)[1]

    def _kept(self, demand: Demand) -> tuple[np.ndarray, np.ndarray]:
        cluster = self.cluster
        key = (demand.count, demand.milli, demand.gpu_memory, demand.memory_ratio, demand.exclusive)
        entry = self._candidates.get(key)
        if entry is None or self._candidates_at != cluster.layout:
            if self._candidates_at != cluster.layout or len(self._candidates) >= MAX_MODEL_MASKS:
                self._candidates.clear()  # a new layout; or pods choose the shapes: keep it bounded
                self._candidates_at = cluster.layout
            cand = cluster.gpu_candidates(demand)
            entry = self._candidates[key] = _Kept(cand, cand.sum(axis=1), cluster.version.copy(), cluster.epoch)
        elif entry.epoch != cluster.epoch:
            stale = np.flatnonzero(entry.version != cluster.version)
            if len(stale):
                entry.cand[stale] = cluster.gpu_candidates(demand, stale)
                entry.counts[stale] = entry.cand[stale].sum(axis=1)
                entry.version[stale] = cluster.version[stale]
            entry.epoch = cluster.epoch
        return entry.read_only


    def model_mask(self, models: frozenset[str] | None) -> np.ndarray:
        """(N,) bool over the rows: nodes whose GPU model (or product label) is allowed (GFD and trace
        spellings alike; see :meth:`NodeRecord.allowed_gpu_models`)."""
        cluster = self.cluster
        if models is None:
            return np.ones(cluster.n_nodes, bool)
        mask = self._model_masks.get(models)
        if mask is None:
            mask = np.array([bool(self._nodes[n].allowed_gpu_models(models)) for n in cluster.names], bool)
            if len(self._model_masks) >= MAX_MODEL_MASKS:  # pods choose the lists: keep the cache bounded
                self._model_masks.clear()
            self._model_masks[models] = mask
        return mask
