"""The extender's view of the cluster: every GPU node's free capacity and who holds what.

Accounting is rebuilt, never trusted from memory: it is the set of
``kubegpu.io/device-allocated`` annotations of live, bound pods (from the pod
watch) plus the allocations this extender assumed at bind time and has not yet
seen echoed by the watch. Each pod is held at most once (keyed by namespace/name
and checked by UID), so an echo, a relist or a restart never counts it twice.

Per node a :class:`~kubegpu.placement.NodeState` answers exact fits and GPU
choices; one :class:`~kubegpu.placement.ClusterState` (N nodes x G GPU slots)
mirrors them as arrays so that filter and prioritize over thousands of nodes
are vectorised. Every change to a node's state is copied into its row.

Pure logic, no I/O: the informers feed events in, the HTTP handlers read out.
Everything runs in one event loop, so a bind's check-and-hold is atomic.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import compress, repeat
from typing import Any

import numpy as np

from kubegpu.model import annotations as A
from kubegpu.model import signing
from kubegpu.model.allocation import PodAllocation
from kubegpu.model.inventory import NodeInventory
from kubegpu.model.records import Shape, ambiguous, read_pod, request_shapes
from kubegpu.model.request import RequestKind, parse_pod
from kubegpu.placement import (
    MILLI,
    ClusterState,
    Demand,
    NodeState,
    PlacementConflict,
    ScoreContext,
    Workload,
    fit,
    get_policy,
    request_demand,
)
from kubegpu.placement.frag import FragTerms, node_frag
from kubegpu.scheduler.nodes import NodeRecord, all_linked, for_node
from kubegpu.scheduler.reasons import insufficient
from kubegpu.scheduler.requests import (
    REQUIRE_NVLINK,
    demands_of_allocation,
    pod_policies,
    requires_nvlink,
    scoring_demand,
    simple_demand,
)
from kubegpu.scheduler.summary import node_summary

log = logging.getLogger(__name__)

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
HANDOFF_WAIT_ENV = "KUBEGPU_HANDOFF_WAIT"
# Policies whose node score is a function of that node's row alone, so kept scores stay right (not
# "random": it draws per call; not "kubegpu": its tie-break compares the nodes scored together, though
# its share scores are row-local, which ``Policy.row_local`` says per demand).
# tests/scheduler/test_scheduler_accounting.py checks this property against the placement core.
ROW_LOCAL_POLICIES = frozenset({"fgd", "bestfit", "dotprod", "packing", "clustering", "spread"})
# Policies whose scores are a row-local policy's, refined by the policy itself among the nodes tied at the
# top (the same test checks that scoring only those reproduces scoring all).
TIE_BREAKS = {"kubegpu": "fgd"}
# A request shape mix used for fragmentation-aware scoring before any pod has been seen.
_DEFAULT_SHAPES: tuple[Demand, ...] = (
    *(Demand.whole(1),) * 4, *(Demand.share(500),) * 3, *(Demand.share(250),) * 2, Demand.whole(2),
    Demand.whole(4), Demand.whole(8),
)


@dataclass(slots=True)
class Held:
    """One pod's allocation as this extender accounts it."""

    key: str  # namespace/name
    uid: str
    node: str
    alloc: PodAllocation
    assumed_at: float | None = None  # set while only this extender knows (bind not yet echoed)
    binding: bool = False  # a bind is in flight: never expire it


@dataclass(frozen=True, slots=True)
class FilterOutcome:
    passed: list[str]
    failed: dict[str, str]
    unresolvable: dict[str, str]
    reasons: Counter[str]  # short reason category -> nodes, for metrics


class ClusterView:
    """Nodes, their GPU states and the held allocations; the arrays behind filter and prioritize."""

    def __init__(self, *, assume_ttl_s: float = 120.0, workload_refresh_s: float = 30.0,
                 exact_fit_enough: int = 100, clock: Any = time.monotonic) -> None:
        self.nodes: dict[str, NodeRecord] = {}
        self.held: dict[str, Held] = {}
        self.by_node: dict[str, set[str]] = {}
        self.assume_ttl_s = assume_ttl_s
        self._clock = clock
        self.conflicts = 0  # annotations that could not be held (double allocation seen in the cluster)
        self.corrupt = 0  # annotations that could not be read
        self.forged = 0  # records the extender did not sign (not accounted)
        self.record_key = signing.load_key()
        # Live records that exceed a GPU's capacity (pod -> why): held anyway, so the GPU is full.
        self.collisions: dict[str, str] = {}
        # node -> pod -> (resource, count) of its containers bound but not yet served by the node:
        # another pod with one of those shapes waits (docs/handoff.md, "one waiting record per shape").
        self.pending: dict[str, dict[str, frozenset[Shape]]] = {}
        # Off only where no kubegpu node serves the records (simulations, extender-only tests): there a
        # bound pod is never acknowledged and would hold its shape forever.
        self.handoff_wait = os.environ.get(HANDOFF_WAIT_ENV, "1") not in ("0", "false", "no")
        self._cluster: ClusterState | None = None
        self._row: dict[str, int] = {}
        self._slots = 8
        self._model_masks: dict[frozenset[str], np.ndarray] = {}
        self._ctx: ScoreContext | None = None
        # The last node list, its rows and each name's position (see rows_of).
        self._rows_memo: tuple[list[str], np.ndarray, dict[str, int]] | None = None
        self._passed_memo: tuple[list[str], np.ndarray] | None = None  # the last filter's passing nodes
        # Node scores per (policy, demand), with the row versions they were computed at (see _node_scores).
        self._row_version = np.zeros(0, np.int64)
        self._scores: dict[tuple[str, Demand], tuple[np.ndarray, np.ndarray]] = {}
        self._assumed: set[str] = set()  # keys of held entries not yet echoed by the watch
        self._shapes: Counter[Demand] = Counter()  # request shapes of the held pods (the target workload)
        self.workload_refresh_s = workload_refresh_s
        self.exact_fit_enough = exact_fit_enough
        self._workload_at = -float("inf")

    # ---- nodes ---------------------------------------------------------------------------------
    def _record(self, name: str) -> NodeRecord:
        rec = self.nodes.get(name)
        if rec is None:
            rec = self.nodes[name] = NodeRecord(name)
        return rec

    def set_node_labels(self, name: str, labels: Mapping[str, str] | None) -> None:
        rec = self._record(name)
        new = dict(labels or {})
        if new != rec.labels:
            rec.labels = new
            self._model_masks.clear()

    def remove_node(self, name: str) -> None:
        """The Node object is gone: forget its labels (its GPUs go with its Device object)."""
        rec = self.nodes.get(name)
        if rec is not None:
            rec.labels = {}
            self._model_masks.clear()

    def set_inventory(self, name: str, inventory: NodeInventory | None, error: str = "") -> None:
        """A node's GPUs from its Device object (None when it is gone or unreadable)."""
        rec = self._record(name)
        rec.device_error = error
        if inventory == rec.inventory and rec.state is not None:
            return
        rec.inventory = inventory
        rec.state = None
        if inventory is not None:
            pods = [(self.held[k].alloc, 0, 0) for k in sorted(self.by_node.get(name, ()))]
            rec.state, problems = NodeState.rebuild(inventory, pods)
            for p in problems:
                self.conflicts += 1
                log.error("node %s: a recorded allocation does not fit its GPUs: %s", name, p)
        if not self._update_row(rec):
            self._invalidate()
        self._model_masks.clear()

    def _invalidate(self) -> None:
        self._cluster = None
        self._model_masks.clear()
        self._ctx = None
        self._rows_memo = None
        self._passed_memo = None

    # ---- arrays --------------------------------------------------------------------------------
    @property
    def cluster(self) -> ClusterState:
        if self._cluster is None:
            self._rebuild_arrays()
        assert self._cluster is not None
        return self._cluster

    def _rebuild_arrays(self) -> None:
        recs = [r for r in self.nodes.values() if r.state is not None]
        g = max([1, *(len(r.state.gpus) for r in recs if r.state)])
        st = ClusterState.empty(len(recs), g)
        models = sorted({gpu.model for r in recs if r.inventory for gpu in r.inventory.gpus})
        index = {m: i for i, m in enumerate(models)}
        st.names = [r.name for r in recs]
        st.model_names = tuple(models)
        st._model_index = index
        st.links = np.zeros((len(recs), g, g), np.int32)
        for i, r in enumerate(recs):
            assert r.state is not None and r.inventory is not None
            st.node_model[i] = index.get(r.inventory.model, -1) if r.inventory.gpus else -1
            self._copy_row(st, i, r.state)
        self._cluster = st
        self._row = {r.name: i for i, r in enumerate(recs)}
        self._ctx = None
        self._row_version = np.zeros(len(recs), np.int64)
        self._scores.clear()

    def _update_row(self, rec: NodeRecord) -> bool:
        """Refresh an existing node's row in place (a health change); False when the arrays must be rebuilt
        (a new or removed node, more GPUs than the arrays hold, a GPU model not seen before)."""
        st, i = self._cluster, self._row.get(rec.name)
        if st is None or i is None or rec.state is None or rec.inventory is None:
            return False
        if rec.state.arrays.n_slots > st.n_slots or (rec.inventory.gpus and rec.inventory.model not in
                                                       st._model_index):
            return False
        st.node_model[i] = st._model_index.get(rec.inventory.model, -1) if rec.inventory.gpus else -1
        self._copy_row(st, i, rec.state)
        self._row_version[i] += 1
        return True

    @staticmethod
    def _copy_row(st: ClusterState, i: int, ns: NodeState) -> None:
        a = ns.arrays
        k = a.n_slots
        st.gpu_ok[i] = False
        st.core_free[i] = 0
        st.gmem_cap[i] = 0
        st.gmem_free[i] = 0
        if st.links is not None:
            st.links[i] = 0
        st.cpu_cap[i], st.cpu_free[i] = a.cpu_cap[0], a.cpu_free[0]
        st.mem_cap[i], st.mem_free[i] = a.mem_cap[0], a.mem_free[0]
        st.gpu_ok[i, :k] = a.gpu_ok[0]
        st.core_free[i, :k] = a.core_free[0]
        st.gmem_cap[i, :k] = a.gmem_cap[0]
        st.gmem_free[i, :k] = a.gmem_free[0]
        if a.links is not None and st.links is not None:
            st.links[i, :k, :k] = a.links[0]
        if a.tags.shape[0] and st.tags.shape[0]:
            st.tags[i] = a.tags[0]

    def _sync(self, node: str) -> None:
        rec = self.nodes.get(node)
        if self._cluster is None or rec is None or rec.state is None:
            return
        i = self._row.get(node)
        if i is None:
            self._invalidate()
            return
        self._copy_row(self._cluster, i, rec.state)
        self._row_version[i] += 1

    def rows_of(self, names: Sequence[str], remember: bool = True) -> np.ndarray:
        """Array rows of the named nodes (-1 for unknown ones).

        kube-scheduler sends filter the same node list again and again, each time starting at a
        rotating index, and sends prioritize the very list filter passed: both are kept with their
        rows, and a repeat (or a rotation of the filter list) is answered without looking each name up."""
        self.cluster  # noqa: B018 - rows current
        if self._passed_memo is not None and self._passed_memo[0] == names:
            return self._passed_memo[1]
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

    def model_mask(self, models: frozenset[str] | None) -> np.ndarray:
        """(N,) bool over the array rows: nodes whose GPU model (or product label) is allowed."""
        cluster = self.cluster
        if models is None:
            return np.ones(cluster.n_nodes, bool)
        mask = self._model_masks.get(models)
        if mask is None:
            mask = np.array([bool(self.nodes[n].allowed_gpu_models(models)) for n in cluster.names], bool)
            self._model_masks[models] = mask
        return mask

    # ---- accounting ----------------------------------------------------------------------------
    def hold(self, key: str, uid: str, node: str, alloc: PodAllocation, *, assumed: bool = False,
             force: bool = False, pod: Mapping[str, Any] | None = None) -> None:
        """Account a pod's allocation on a node (replacing what was held for it). Raises
        PlacementConflict when it does not fit; then nothing changes. ``force`` holds it anyway (a
        live record that collides: the GPU is then full, never silently over-filled). With ``pod``
        (a bind) its GPU containers wait for the node's handoff until the watch shows them served."""
        if pod is not None:
            self.pending.setdefault(node, {})[key] = request_shapes(parse_pod(pod))
        old = self.held.get(key)
        if old is not None and old.uid == uid and old.node == node and old.alloc == alloc:
            if not assumed:
                old.assumed_at = None
                old.binding = False
                self._assumed.discard(key)
            return
        rec = self.nodes.get(node)
        if old is not None:
            self.release(key)
        if rec is not None and rec.state is not None:
            try:
                rec.state.apply_allocation(alloc.held(), force=force)
            except PlacementConflict:
                if old is not None:  # put back what was there
                    self.hold(key, old.uid, old.node, old.alloc, assumed=old.assumed_at is not None)
                raise
            self._sync(node)
        self.held[key] = Held(key, uid, node, alloc, self._clock() if assumed else None, binding=assumed)
        self.by_node.setdefault(node, set()).add(key)
        if assumed:
            self._assumed.add(key)
        self._shapes.update(demands_of_allocation(alloc))

    def release(self, key: str, uid: str | None = None) -> Held | None:
        h = self.held.get(key)
        if h is None or (uid is not None and h.uid != uid):
            return None
        del self.held[key]
        self._assumed.discard(key)
        self.collisions.pop(key, None)
        if (waiting := self.pending.get(h.node)) is not None:
            waiting.pop(key, None)
        self.by_node.get(h.node, set()).discard(key)
        rec = self.nodes.get(h.node)
        if rec is not None and rec.state is not None:
            rec.state.release_allocation(h.alloc.held())
            self._sync(h.node)
        self._shapes.subtract(demands_of_allocation(h.alloc))
        return h

    @property
    def assumed_count(self) -> int:
        return len(self._assumed)

    def mark_bound(self, key: str) -> None:
        """The bind of an assumed pod went through: wait up to the TTL for the watch to echo it."""
        h = self.held.get(key)
        if h is not None and h.assumed_at is not None:
            h.binding = False
            h.assumed_at = self._clock()

    def expire_assumed(self) -> list[str]:
        """Drop assumptions whose bind finished but never showed in the watch within the TTL."""
        now = self._clock()
        ttl = self.assume_ttl_s
        gone = [k for k in self._assumed
                if (h := self.held[k]).assumed_at is not None and not h.binding and now - h.assumed_at > ttl]
        for k in gone:
            log.warning("pod %s: assumed allocation expired (bind never seen in the watch); released", k)
            self.release(k)
        return gone

    def observe_pod(self, pod: Mapping[str, Any], deleted: bool = False) -> None:
        """A pod from the watch (a dict shaped like a v1.Pod)."""
        meta = pod.get("metadata") or {}
        key = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
        uid = str(meta.get("uid") or "")
        phase = (pod.get("status") or {}).get("phase")
        if deleted or phase in TERMINAL_PHASES:
            self.release(key, uid or None)
            return
        node = (pod.get("spec") or {}).get("nodeName") or ""
        records = read_pod(pod, self.record_key) if node else None
        alloc = records.allocation() if records is not None else None
        current = self.held.get(key)
        if records is not None and records.problems and (current is None or current.uid != uid):
            if records.forged:
                self.forged += 1
            elif records.record is None and A.DEVICE_ALLOCATED in (meta.get("annotations") or {}):
                self.corrupt += 1
            log.error("pod %s: %s; not accounted", key, "; ".join(records.problems))
        if not node or alloc is None:
            # Not bound yet (or no GPUs recorded): keep an in-flight assumption, drop anything else.
            if current is not None and current.assumed_at is None and current.uid == uid:
                self.release(key)
            return
        assert records is not None
        try:
            self.hold(key, uid, node, alloc)
        except PlacementConflict as e:
            self.conflicts += 1
            self.collisions[key] = f"{node}: {e}"
            log.error("pod %s on %s: recorded GPUs exceed a GPU's capacity with other pods' (%s); held anyway: "
                      "that GPU is full for new placements", key, node, e)
            self.hold(key, uid, node, alloc, force=True)
        waiting = request_shapes(parse_pod(pod), records.acks) if records.record is not None else frozenset()
        if waiting:
            self.pending.setdefault(node, {})[key] = waiting
        elif (per := self.pending.get(node)) is not None:
            per.pop(key, None)

    # ---- filter --------------------------------------------------------------------------------
    def filter(self, pod: Mapping[str, Any], names: Sequence[str], gpu_policy: str) -> FilterOutcome:
        request = parse_pod(pod)
        passed: list[str] = []
        failed: dict[str, str] = {}
        unresolvable: dict[str, str] = {}
        reasons: Counter[str] = Counter()
        if not request.ok:
            why = "request refused: " + "; ".join(str(r) for r in request.refusals)
            for n in names:
                unresolvable[n] = why
            reasons["refused"] += len(names)
            return FilterOutcome(passed, failed, unresolvable, reasons)
        if not request.wants_gpu:
            return FilterOutcome(list(names), failed, unresolvable, reasons)
        blocked = self.handoff_blocked(pod, request)
        if blocked:
            names = [n for n in names if n not in blocked]
            failed.update(blocked)
            reasons["handoff-pending"] += len(blocked)
        cluster = self.cluster
        # One pass over the names (kube-scheduler sends thousands): rows, -1 for unknown nodes.
        all_rows = self.rows_of(names)
        known = all_rows >= 0
        for i in np.flatnonzero(~known):
            n = names[i]
            rec = self.nodes.get(n)
            if rec is not None and rec.device_error:
                failed[n] = f"its Device object is unreadable: {rec.device_error}"
            else:
                failed[n] = "no GPUs known (no kubegpu Device object; is `kubegpu node` running?)"
            reasons["no-device-object"] += 1
        if not known.any():
            return FilterOutcome(passed, failed, unresolvable, reasons)
        names_known = [names[i] for i in np.flatnonzero(known)] if not known.all() else list(names)
        rows_known = all_rows[known]
        rows = rows_known
        models = request.allowed_models
        ok = self.model_mask(models)[rows]
        for i in np.flatnonzero(~ok):
            n = names_known[i]
            present = ", ".join(sorted(self.nodes[n].models)) or "none"
            failed[n] = f"GPU model {present} not in the allowed {', '.join(sorted(models or ()))}"
            reasons["gpu-model"] += 1
        simple = simple_demand(request)
        nvlink = requires_nvlink(pod)
        if simple is not None and not nvlink:
            demand = simple
            cand = cluster.gpu_candidates(demand)[rows]
            enough = cand.sum(axis=1) >= demand.count
            good = ok & enough
            passed.extend(compress(names_known, good.tolist()))
            self._passed_memo = (list(passed), rows[good])
            short = ok & ~enough
            if short.any():
                texts = insufficient(cluster, rows[short], demand)
                failed.update(zip(compress(names_known, short.tolist()), texts, strict=True))
                reasons["insufficient-gpu"] += len(texts)
            return FilterOutcome(passed, failed, unresolvable, reasons)
        # Exact path (several GPU containers, MIG, replicas, NVLink): first what the arrays can rule out
        # (each container alone, and the whole GPUs of all app containers together), then placement's
        # fit node by node, in the order given, until enough nodes are found feasible: like
        # kube-scheduler's percentageOfNodesToScore, and for the same reason (an exact fit costs ~0.2 ms).
        whole_total = 0
        for c in request.gpu_containers:
            req = c.request
            if req is None or req.kind not in (RequestKind.WHOLE, RequestKind.SHARE):
                continue
            d = request_demand(req, None)
            short = ok & (cluster.gpu_candidates(d)[rows].sum(axis=1) < d.count)
            bad = np.flatnonzero(short)
            if len(bad):
                for i, text in zip(bad, insufficient(cluster, rows[bad], d), strict=True):
                    failed[names_known[i]] = f"container {c.name!r}: {text}"
                reasons["insufficient-gpu"] += len(bad)
                ok = ok & ~short
            if d.exclusive and not c.init:
                whole_total += d.count
        if whole_total:
            free_whole = cluster.gpu_candidates(Demand.whole(1))[rows].sum(axis=1)
            short = ok & (free_whole < whole_total)
            for i in np.flatnonzero(short):
                failed[names_known[i]] = f"{whole_total} whole GPUs requested in all, {int(free_whole[i])} free"
            reasons["insufficient-gpu"] += int(short.sum())
            ok = ok & ~short
        candidates = np.flatnonzero(ok)
        for done, i in enumerate(candidates):
            n = names_known[i]
            if len(passed) >= self.exact_fit_enough:
                for j in candidates[done:]:
                    failed[names_known[j]] = (f"not examined: {len(passed)} feasible nodes were found first "
                                              "(pods with several GPU containers are fitted node by node)")
                reasons["not-examined"] += len(candidates) - done
                break
            rec = self.nodes[n]
            assert rec.state is not None
            result = fit(rec.state, for_node(request, rec), gpu_policy=gpu_policy)
            if result.ok and nvlink and result.choice is not None and not all_linked(rec, result.choice):
                failed[n] = "no free set of GPUs is fully NVLink-connected for this pod"
                reasons["nvlink"] += 1
            elif result.ok:
                passed.append(n)
            else:
                failed[n] = result.reason
                reasons["insufficient-gpu"] += 1
        return FilterOutcome(passed, failed, unresolvable, reasons)

    def handoff_blocked(self, pod: Mapping[str, Any], request: Any) -> dict[str, str]:
        """Nodes where another pod is bound, not yet served by the node, and asks the same (resource,
        device count): the kubelet's calls carry no pod identity, so with two such pods waiting the
        node could steer one onto the other's record. One at a time per shape and node keeps every
        Allocate unambiguous (docs/handoff.md)."""
        if not self.pending or not self.handoff_wait:
            return {}
        meta = pod.get("metadata") or {}
        key = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
        shapes = request_shapes(request)
        out: dict[str, str] = {}
        for node, per in self.pending.items():
            for other, waiting in per.items():
                same = ambiguous(waiting, shapes) if other != key else None
                if same is not None:
                    res, count, _ = same
                    out[node] = (f"pod {other} is being handed to the kubelet with {count} {res}; the "
                                 "kubelet's calls carry no pod, so one such pod at a time per node")
                    break
        return out

    # ---- prioritize ----------------------------------------------------------------------------
    def workload(self) -> Workload:
        """The target workload of fragmentation-aware scoring: the shapes of the pods held now (a
        default mix until there are a few), as frequencies."""
        shapes = +self._shapes
        total = sum(shapes.values())
        if total < 10:
            shapes.update(_DEFAULT_SHAPES)
            total = sum(shapes.values())
        # Frequencies are all that matter: a scaled-down sample keeps building it cheap on big clusters.
        sample = [d for d, n in shapes.items() for _ in range(max(1, round(n * 1000 / total)))]
        return Workload.from_demands(sample)

    def warm_up(self) -> None:
        """Build the arrays and the scoring context now rather than in the first verbs."""
        self.cluster  # noqa: B018
        self.score_context()

    def score_context(self) -> ScoreContext:
        """Scoring context; the workload is refreshed every ``workload_refresh_s`` (it moves slowly, and
        rebuilding it resets the policies' caches)."""
        now = self._clock()
        if self._ctx is None or now - self._workload_at > self.workload_refresh_s:
            self._ctx = ScoreContext(workload=self.workload())
            self._workload_at = now
            self._scores.clear()
        return self._ctx

    def prioritize(self, pod: Mapping[str, Any], names: Sequence[str], node_policy: str) -> list[int]:
        """Scores 0..10 (the extender scale), in the order of ``names``; nodes that do not fit get 0."""
        request = parse_pod(pod)
        if not request.ok or not request.wants_gpu:
            return [0] * len(names)
        demand = scoring_demand(request)
        cluster = self.cluster
        all_rows = self.rows_of(names, remember=False)
        if demand is not None and demand.models is not None:
            demand = replace(demand, models=None)  # models are matched here (GFD spellings), not by exact name
        if demand is None:  # MIG or replicas only: no array demand to score; every known node is as good
            return np.where(all_rows >= 0, 5, 0).tolist()
        known = np.flatnonzero(all_rows >= 0)
        scores = np.zeros(len(names), np.int64)
        if len(known):
            rows = all_rows[known]
            cand = cluster.gpu_candidates(demand)[rows]
            feasible = (cand.sum(axis=1) >= demand.count) & self.model_mask(request.allowed_models)[rows]
            if feasible.any():
                raw = self._node_scores(node_policy, demand, rows[feasible], cand[feasible])
                lo, hi = float(raw.min()), float(raw.max())
                scores[known[feasible]] = 10 if hi - lo < 1e-12 else np.rint(1 + 9 * (raw - lo) / (hi - lo))
        return scores.tolist()

    def _node_scores(self, policy_name: str, demand: Demand, rows: np.ndarray, cand: np.ndarray) -> np.ndarray:
        """The policy's scores of ``rows``.

        For a row-local policy (ROW_LOCAL_POLICIES) scores are kept per (policy, demand) with the version
        of the row they were computed at, and only rows changed since (a bind, a departure, a health
        change) are rescored; so are a policy's scores for demands it calls row-local (``kubegpu``'s
        shares). A policy that refines a row-local one among its best nodes (TIE_BREAKS: ``kubegpu``
        is FGD plus a tie-break among FGD's best for whole GPUs) gets the kept primary scores,
        and only the nodes tied at the top are scored by the policy itself, together, as it would."""
        ctx = self.score_context()
        policy = get_policy(policy_name)
        row_local = policy.name in ROW_LOCAL_POLICIES or policy.row_local(demand)
        primary_name = None if row_local else TIE_BREAKS.get(policy.name)
        if primary_name is not None:
            primary = self._kept_scores(get_policy(primary_name), demand, rows, cand, ctx)
            top = np.flatnonzero(primary == primary.max())
            if len(top) < 2:
                return primary
            out = primary.copy()
            out[top] = self._kept_scores(policy, demand, rows[top], cand[top], ctx, tied=True)
            return out
        if not row_local:
            return np.asarray(policy.node_scores(self.cluster, demand, rows, cand, ctx), np.float64)
        return self._kept_scores(policy, demand, rows, cand, ctx)

    def _kept_scores(self, policy: Any, demand: Demand, rows: np.ndarray, cand: np.ndarray,
                     ctx: ScoreContext, tied: bool = False) -> np.ndarray:
        """Kept scores of ``rows``, rescoring only rows changed since. With ``tied`` the rows are a tie
        at the top of a TIE_BREAKS policy's primary, and what is kept is each row's score when tied
        there (row-local too); rescored rows are always scored in company, as a tie."""
        key = (f"{policy.name}:tied" if tied else policy.name, demand)
        entry = self._scores.get(key)
        if entry is None:
            if len(self._scores) >= 64:  # a bounded set of request shapes; start over beyond it
                self._scores.clear()
            n = self.cluster.n_nodes
            entry = self._scores[key] = (np.zeros(n, np.float64), np.full(n, -1, np.int64))
        scores, version = entry
        stale = version[rows] != self._row_version[rows]
        if stale.any():
            fresh, fresh_cand = rows[stale], cand[stale]
            if tied and len(fresh) == 1:  # a tie-break needs company: score the row beside itself
                fresh_cand = np.repeat(fresh_cand, 2, axis=0)
                got = policy.node_scores(self.cluster, demand, np.repeat(fresh, 2), fresh_cand, ctx)[:1]
            else:
                got = policy.node_scores(self.cluster, demand, fresh, fresh_cand, ctx)
            scores[fresh] = np.asarray(got, np.float64)
            version[fresh] = self._row_version[fresh]
        return scores[rows]

    # ---- bind ----------------------------------------------------------------------------------
    def choose(self, pod: Mapping[str, Any], node: str, gpu_policy: str) -> tuple[PodAllocation | None, str]:
        """The exact GPUs for a pod on a node, or why not. Does not hold anything."""
        rec = self.nodes.get(node)
        if rec is None or rec.state is None:
            return None, f"node {node}: no GPUs known (no kubegpu Device object)"
        request = parse_pod(pod)
        if not request.ok:
            return None, "request refused: " + "; ".join(str(r) for r in request.refusals)
        if request.allowed_models is not None and not rec.allowed_gpu_models(request.allowed_models):
            return None, f"node {node}: GPU model not in the allowed {', '.join(sorted(request.allowed_models))}"
        result = fit(rec.state, for_node(request, rec), gpu_policy=gpu_policy)
        if not result.ok or result.choice is None:
            return None, result.reason
        if requires_nvlink(pod) and not all_linked(rec, result.choice):
            return None, f"node {node}: no free set of GPUs is fully NVLink-connected for this pod"
        return result.choice.to_allocation(), result.reason

    # ---- views ---------------------------------------------------------------------------------
    def fragmentation(self) -> float:
        """Cluster fragmentation (milli-GPU of free compute the target workload cannot use)."""
        cluster = self.cluster
        if cluster.n_nodes == 0:
            return 0.0
        terms = FragTerms.build(cluster, self.workload())
        return float(node_frag(cluster, terms).sum())

    def summary(self, node: str) -> dict[str, Any] | None:
        """The seed's node device summary (``allocateSet``, ``deviceTotal``/``Free``/``Used`` and details)."""
        rec = self.nodes.get(node)
        if rec is None or rec.state is None or rec.inventory is None:
            return None
        return node_summary(rec.state, {k: self.held[k].alloc for k in sorted(self.by_node.get(node, ()))})

    def gpu_allocation(self) -> Iterable[tuple[str, int, float, float]]:
        """(node, minor, compute used 0..1, memory used 0..1) per healthy GPU."""
        for name, rec in self.nodes.items():
            if rec.state is None:
                continue
            for gpu in rec.state.gpus:
                if not gpu.healthy or gpu.mig_enabled or gpu.memory_bytes <= 0:
                    continue
                yield (name, gpu.minor, 1 - rec.state.core_free(gpu.uuid) / 100,
                       1 - rec.state.memory_free(gpu.uuid) / gpu.memory_bytes)


__all__ = ["MILLI", "REQUIRE_NVLINK", "ClusterView", "FilterOutcome", "Held", "NodeRecord", "pod_policies"]
