"""The extender's three questions, answered through the placement core the simulator runs.

- ``filter``: which of these nodes can take the pod (GPUs, allowed models, and the CPU and memory the
  extender accounts on GPU nodes), with a readable reason for each node that cannot;
- ``prioritize``: the policy's scores of the feasible nodes (``Policy.node_scores`` with the learned
  workload's context, as ``kubegpu simulate`` calls it), mapped to the extender scale so that the node
  the simulator would pick (ties: lowest node name) is the only one at the top;
- ``choose`` (bind): the exact GPUs, by the GPU-level policy on the node's array row with the same
  context (``choose_gpus``), or placement's per-node ``fit`` for pods with several GPU containers.

Everything here reads; accounting changes only through :class:`~kubegpu.scheduler.accounting.Ledger`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import compress
from typing import Any

import numpy as np

from kubegpu.model.allocation import ContainerAllocation, PodAllocation
from kubegpu.model.request import PodRequest
from kubegpu.placement import Demand, choose_gpus, fit, pick_best
from kubegpu.placement.node import grants_on
from kubegpu.scheduler.accounting import Ledger
from kubegpu.scheduler.handoff import HandoffQueue
from kubegpu.scheduler.mirror import ArrayMirror
from kubegpu.scheduler.nodes import NOT_LINKED, NodeRecord, all_linked, for_node
from kubegpu.scheduler.plan import PodPlan
from kubegpu.scheduler.reasons import NameTable, ReasonMap, TextTable
from kubegpu.scheduler.reservations import Reservations
from kubegpu.scheduler.scoring import Scoring
from kubegpu.scheduler.shape_locks import ExtenderShapeLocks
from kubegpu.scheduler.wire import HeldNames, HostTable, NameWindow, RowNames, encode_priorities

MAX_PRIORITY = 10  # kube-scheduler's MaxExtenderPriority


@dataclass(frozen=True, slots=True)
class FilterOutcome:
    passed: Sequence[str]  # RowNames on the array path
    failed: Mapping[str, str]  # a ReasonMap (sent as the JSON it holds), or a dict
    unresolvable: Mapping[str, str]
    reasons: Counter[str]  # short reason category -> nodes, for metrics
    passed_json: bytes | None = None  # the canonical JSON of ``passed`` when the filter built it


def _resources_short(cluster: Any, rows: np.ndarray, demand: Demand) -> list[str]:
    out = []
    for r in rows.tolist():
        if cluster.cpu_free[r] < demand.cpu_milli:
            out.append(f"{demand.cpu_milli}m CPU requested, {int(cluster.cpu_free[r])}m free on this GPU node")
        else:
            out.append(f"{demand.memory_bytes / 2**30:.1f} GiB memory requested, "
                       f"{int(cluster.mem_free[r]) / 2**30:.1f} GiB free on this GPU node")
    return out


class Verbs:
    """filter, prioritize and choose over the mirror, the ledger and the scoring objects."""

    nodes: dict[str, NodeRecord]
    mirror: ArrayMirror
    ledger: Ledger
    handoffs: HandoffQueue
    scoring: Scoring
    exact_fit_enough: int
    reservations: Reservations | None = None  # GPUs kept for waiting wide pods (None: no reservations)
    _shape_locks: ExtenderShapeLocks | None = None  # strict MPS: one share shape per GPU (built on first use)
    # Kept per array layout (rows change only with it): the names' JSON by row, the rows of the name list
    # kube-scheduler sends (as NameMemo holds it), and the last filter's passing names and rows where they are
    # a plain list (prioritize is sent that very list).
    _name_table: tuple[int, NameTable] | None = None
    _host_table: tuple[int, HostTable | None] | None = None
    _held_rows: tuple[HeldNames, int, np.ndarray] | None = None
    _passed: tuple[Sequence[str], int, np.ndarray] | None = None

    # ---- rows and names --------------------------------------------------------------------------
    def node_rows(self, names: Sequence[str], remember: bool = True) -> np.ndarray:
        """Array rows of ``names`` (-1 for unknown nodes; read-only). A window of the list kube-scheduler
        sends (:class:`~kubegpu.scheduler.wire.NameWindow`) is a slice of that list's rows, mapped once per
        layout; a filter's passing nodes (:class:`~kubegpu.scheduler.wire.RowNames`) are their rows;
        anything else is looked up."""
        layout = self.mirror.cluster.layout  # current arrays (rebuilt here if they must be)
        if isinstance(names, NameWindow):
            kept = self._held_rows
            if kept is None or kept[0] is not names.held or kept[1] != layout:
                half = self.mirror.rows_of(names.held.names[:len(names.held)], remember=False)
                rows = np.concatenate([half, half])
                rows.flags.writeable = False
                kept = self._held_rows = (names.held, layout, rows)
            return kept[2][names.start:names.start + len(names)]
        if isinstance(names, RowNames) and names.by_row is self.mirror.names_by_row:  # rows of these arrays
            return names.rows
        passed = self._passed
        if passed is not None and names is passed[0] and passed[1] == layout and len(names) == len(passed[2]):
            return passed[2]
        return self.mirror.rows_of(names, remember)

    def name_table(self) -> NameTable:
        """The rows' names as JSON (:class:`~kubegpu.scheduler.reasons.NameTable`), kept per layout."""
        cluster = self.mirror.cluster
        kept = self._name_table
        if kept is None or kept[0] != cluster.layout:
            kept = self._name_table = (cluster.layout, NameTable(cluster.names))
        return kept[1]

    def host_table(self) -> HostTable | None:
        """The rows' prioritize answer entries (:class:`~kubegpu.scheduler.wire.HostTable`), kept per layout."""
        cluster = self.mirror.cluster
        kept = self._host_table
        if kept is None or kept[0] != cluster.layout:
            kept = self._host_table = (cluster.layout, HostTable.build(cluster.names))
        return kept[1]

    def _remember_passed(self, passed: Sequence[str], rows: np.ndarray) -> None:
        rows.flags.writeable = False
        self._passed = (passed, self.mirror.cluster.layout, rows)

    # ---- filter ----------------------------------------------------------------------------------
    def filter(self, plan: PodPlan, names: Sequence[str]) -> FilterOutcome:
        """The array filter: for a refused pod, a pod without GPUs and a vectorised one (one app container
        asking whole GPUs or a share, no NVLink need). Every other GPU pod is fitted node by node, in
        :func:`kubegpu.scheduler.limits.bounded_filter`."""
        passed: list[str] = []
        failed = ReasonMap()
        reasons: Counter[str] = Counter()
        if why := plan.refusal:
            reasons["refused"] += len(names)
            return FilterOutcome(passed, failed, dict.fromkeys(names, f"request refused: {why}"), reasons)
        request = plan.request
        cluster = self.mirror.cluster
        # One pass over the names (kube-scheduler sends thousands): rows, -1 for unknown nodes. The whole list
        # kube-scheduler sent, so that its next (rotated) list is answered from the memo.
        all_rows = self.node_rows(names)
        known = all_rows >= 0
        if not request.wants_gpu:
            # Nodes without kubegpu GPUs are kube-scheduler's alone; GPU nodes must have the CPU and memory.
            ok = ~known
            ok[known] = cluster.feasible(plan.demand)[all_rows[known]]
            passed.extend(compress(names, ok.tolist()))
            self._remember_passed(passed, all_rows[ok])
            bad = all_rows[~ok]  # GPU nodes short of CPU or memory
            if len(bad):
                failed.add_texts(self.mirror.names_by_row, bad, self.name_table(),
                                 _resources_short(cluster, bad, plan.demand))
                reasons["insufficient-cpu-memory"] += len(bad)
            return FilterOutcome(passed, failed, {}, reasons)
        assert plan.vectorised and not plan.nvlink, "pods fitted node by node go through bounded_filter"
        if not known.any():
            self.known_and_allowed(names, all_rows, request, failed, reasons)
            return FilterOutcome(passed, failed, {}, reasons)
        _, rows, ok = self.known_and_allowed(names, all_rows, request, failed, reasons)
        by_row = self.mirror.names_by_row  # a mask's names as one numpy take, not a Python loop over them all
        table = self.name_table()
        need = plan.demand
        # Over every row at once (contiguous), then one take in the order given.
        roomy = ((cluster.cpu_free >= need.cpu_milli) & (cluster.mem_free >= need.memory_bytes))[rows]
        short = ok & ~roomy
        if short.any():
            sub = rows[short]
            failed.add_texts(by_row, sub, table, _resources_short(cluster, sub, need))
            reasons["insufficient-cpu-memory"] += len(sub)
            ok = ok & roomy
        demand = plan.gpu_demand
        enough = (self.mirror.candidate_counts(demand) >= demand.count)[rows]
        reserved = self.reservation_mask(plan)
        allowed = self.allowed_mask(plan, reserved)
        mine = self.reservations.own_row(plan.key) if self.reservations is not None else None
        if allowed is not None:  # GPUs it may not take (kept for a wide pod, locked to a shape) count as taken
            held_back = ok & enough & ~((self.mirror.candidates(demand) & allowed).sum(axis=1) >= demand.count)[rows]
            if held_back.any():
                sub = rows[held_back]
                kept_off = [self._kept_off(plan, r, reserved, mine) for r in sub.tolist()]
                failed.add_texts(by_row, sub, table, [why for _, why in kept_off])
                reasons.update(key for key, _ in kept_off)
                ok = ok & ~held_back
        good = rows[ok & enough]
        good.flags.writeable = False
        short = ok & ~enough
        if mine is not None and mine[0] in rows[short]:
            # The wide pod's own node: its event says where it will run and what it waits for.
            short = short & (rows != mine[0])
            failed[by_row[mine[0]]] = mine[1]
            reasons["reserved"] += 1
        if short.any():
            sub = rows[short]
            failed.add_rows(by_row, sub, table,
                            *self.mirror.reasons.codes(cluster, sub, demand, self.mirror.candidates(demand)))
            reasons["insufficient-gpu"] += len(sub)
        return FilterOutcome(RowNames(by_row, good), failed, {}, reasons, table.list_json(good))

    def reservation_mask(self, plan: PodPlan) -> np.ndarray | None:
        """(N, G) bool: the GPUs this pod may take without delaying a waiting wide pod (None: all of them)."""
        return None if self.reservations is None else self.reservations.allowed(plan)

    def shape_locks(self) -> ExtenderShapeLocks:
        if self._shape_locks is None:
            self._shape_locks = ExtenderShapeLocks(self.nodes, self.mirror, self.ledger)
        return self._shape_locks

    def allowed_mask(self, plan: PodPlan, reserved: np.ndarray | None) -> np.ndarray | None:
        """(N, G) bool: the GPUs this pod may take (None: all of them): those ``reserved`` lets it take (its
        :meth:`reservation_mask`), and on a strict MPS GPU only its own share shape (scheduler/shape_locks.py).
        Filter, prioritize and bind all AND this one mask."""
        locked = self.shape_locks().allowed(plan.demand) if plan.demand.is_share else None
        if locked is None or reserved is None:
            return locked if reserved is None else reserved
        out: np.ndarray = reserved & locked
        return out

    def _kept_off(self, plan: PodPlan, row: int, reserved: np.ndarray | None,
                  mine: tuple[int, str] | None) -> tuple[str, str]:
        """(reason key, reason) for node ``row``, whose GPUs have room for the pod but too few it may take:
        the shape lock where the wide pods' reservations alone would let it on, else the reservation."""
        cand = self.mirror.candidates(plan.gpu_demand)[row]
        if reserved is not None:
            cand = cand & reserved[row]
        if reserved is None or int(cand.sum()) >= plan.demand.count:
            return "shape-lock", self.shape_locks().why(row, plan.demand, cand)
        assert self.reservations is not None
        return "reserved", self.reservations.holding(row, mine)

    def known_and_allowed(self, names: Sequence[str], all_rows: np.ndarray, request: PodRequest,
                          failed: ReasonMap, reasons: Counter[str],
                          ) -> tuple[Sequence[str], np.ndarray, np.ndarray]:
        """The filter's first cut, for the plain and the bounded filter alike: nodes without a readable
        Device object, nodes whose node daemon does not serve now, then nodes whose GPU model the pod does not
        allow, each failed with its reason.
        Returns the known names, their rows and which of them allow the pod's models."""
        known = all_rows >= 0
        if known.all():
            names_known, rows = names, all_rows
        else:
            for i in np.flatnonzero(~known).tolist():
                rec = self.nodes.get(names[i])
                failed[names[i]] = (f"its Device object is unreadable: {rec.device_error}"
                                    if rec and rec.device_error else
                                    "no GPUs known (no kubegpu Device object; is `kubegpu node` running?)")
                reasons["no-device-object"] += 1
            names_known, rows = list(compress(names, known.tolist())), all_rows[known]
        models = request.allowed_models
        ok = np.ones(len(rows), bool)
        if (down := self.handoffs.not_serving) and len(rows):  # node daemons restarting (scheduler/nodes.py)
            for j in np.flatnonzero(self.named(names_known, rows, down)).tolist():
                failed[names_known[j]] = down[names_known[j]]
                reasons["node-daemon"] += 1
                ok[j] = False
        if models is None:
            return names_known, rows, ok
        allows = self.mirror.model_mask(models)[rows] if len(rows) else np.zeros(0, bool)
        if not (allows | ~ok).all():
            sub = rows[ok & ~allows]
            codes, present = self._models_present()
            allowed = ", ".join(sorted(models))
            texts = TextTable()
            for p in present:
                texts.code(f"GPU model {p} not in the allowed {allowed}")  # code i: present[i]
            failed.add_rows(self.mirror.names_by_row, sub, self.name_table(), texts, codes[sub])
            reasons["gpu-model"] += len(sub)
        return names_known, rows, ok & allows

    _models_kept: tuple[int, np.ndarray, list[str]] | None = None

    def _models_present(self) -> tuple[np.ndarray, list[str]]:
        """Each row's GPU model names as a reason shows them (``A, B``, or ``none``), as a code per row into
        the distinct texts; kept per layout (labels and models change only with it)."""
        cluster = self.mirror.cluster
        kept = self._models_kept
        if kept is None or kept[0] != cluster.layout:
            texts = [", ".join(sorted(self.nodes[n].models)) or "none" for n in cluster.names]
            distinct, codes = np.unique(np.array(texts, object), return_inverse=True)
            kept = self._models_kept = (cluster.layout, codes.reshape(-1), distinct.tolist())
        return kept[1], kept[2]

    def exact_fit(self, node: str, plan: PodPlan) -> tuple[str, str] | None:
        """Whether a pod with several GPU containers (or MIG, replicas, NVLink) fits ``node`` as bind
        would place it: the pod's CPU and memory, the policy object, the learned context. None when it
        fits, else (reason key, reason). The one exact test of the filter."""
        rec = self.nodes.get(node)
        if rec is None or rec.state is None:  # went away (the bounded filter gives the loop back)
            return "no-device-object", "no GPUs known (no kubegpu Device object; is `kubegpu node` running?)"
        need = plan.demand
        result = fit(rec.state, for_node(plan.request, rec), need.cpu_milli, need.memory_bytes,
                     gpu_policy=self.scoring.policy(plan.gpu_policy), ctx=self.scoring.context())
        if result.ok and plan.nvlink and result.choice is not None and not all_linked(rec, result.choice.containers):
            return "nvlink", NOT_LINKED
        if not result.ok:
            return "insufficient-gpu", result.reason
        if result.choice is not None:
            return self._fit_kept_off(plan, rec, result.choice.to_allocation())
        return None

    def _fit_kept_off(self, plan: PodPlan, rec: NodeRecord, alloc: PodAllocation) -> tuple[str, str] | None:
        """(reason key, reason) when the GPUs a node-by-node fit chose (whose choice ignores the mask) would delay
        a wide pod's reservation or break a strict GPU's shape lock; None when they may be given."""
        if why := self._delays_reservation(plan, rec, alloc):
            return "reserved", why
        if why := self.shape_locks().breaks(rec, [c.grants for c in alloc.containers]):
            return "shape-lock", why
        return None

    def _delays_reservation(self, plan: PodPlan, rec: NodeRecord, alloc: PodAllocation) -> str:
        """Why placing ``alloc`` on ``rec``'s node would delay a reservation ('' when it would not): the check
        for a pod fitted node by node, whose GPU choice ignores reservations (filter and bind make the same)."""
        allowed = self.reservation_mask(plan)
        row = self.mirror.row(rec.name)
        if allowed is None or row is None or rec.state is None:
            return ""
        slot = {g.uuid: i for i, g in enumerate(rec.state.gpus)}
        if all(allowed[row, slot[g.uuid]] for g in alloc.grants() if g.uuid in slot):
            return ""
        assert self.reservations is not None
        return self.reservations.holding(row, None)

    # ---- prioritize ------------------------------------------------------------------------------
    def prioritize(self, plan: PodPlan, names: Sequence[str]) -> list[int]:
        """Scores 0..10 (the extender scale), in the order of ``names``; nodes that do not fit get 0.

        The node the policy picks among the feasible ones (the simulator's pick: highest score, ties to the
        lowest node name) alone gets 10; the others 0..9 by their raw score. Nodes without kubegpu GPUs get
        0 for a GPU pod, and 10 for a pod without GPUs (which should leave GPU nodes' CPU to GPU pods)."""
        return self._prioritize(plan, names)[0].tolist()

    def prioritize_json(self, plan: PodPlan, names: Sequence[str], raw: bytes | None = None) -> bytes:
        """:meth:`prioritize`'s answer as kube-scheduler reads it (``HostPriority`` JSON), built from the
        rows' kept name tokens. ``raw``: the names' JSON when the caller has it."""
        scores, all_rows = self._prioritize(plan, names)
        table = self.host_table()
        out = table.answer(all_rows, scores) if table is not None and (all_rows >= 0).all() else None
        return out if out is not None else encode_priorities(list(names), scores.tolist(), raw)

    def _prioritize(self, plan: PodPlan, names: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(scores, rows) of ``names``: :meth:`prioritize`'s scores as an array, and the names' rows."""
        request = plan.request
        all_rows = self.node_rows(names, remember=False)
        if plan.refusal:
            return np.zeros(len(names), np.int64), all_rows
        cluster = self.mirror.cluster
        demand = plan.demand
        if request.wants_gpu and not plan.vectorised and demand.count == 0:
            # MIG or replicas only: no array demand to score; every known node is as good.
            return np.where(all_rows >= 0, 5, 0), all_rows
        every = all_rows >= 0
        known = None if every.all() else np.flatnonzero(every)  # None: every name is a known node
        scores = np.full(len(names), 0 if request.wants_gpu else MAX_PRIORITY, np.int64)
        rows = all_rows if known is None else all_rows[known]
        if len(rows):
            # Over every row at once (contiguous), then one take in the order given.
            cand = self.mirror.candidates(demand)
            allowed = self.allowed_mask(plan, self.reservation_mask(plan))
            if allowed is not None:
                cand = cand & allowed
            feasible = ((cluster.cpu_free >= demand.cpu_milli) & (cluster.mem_free >= demand.memory_bytes)
                        & ((self.mirror.candidate_counts(demand) if allowed is None else cand.sum(axis=1))
                           >= demand.count))
            if demand.count and demand.models is not None:
                feasible &= self.mirror.model_mask(demand.models)
            feasible = feasible[rows]
            if known is None:
                scores[:] = 0
            else:
                scores[known] = 0
            if feasible.any():
                fit_rows = rows[feasible]
                raw = self.node_scores(plan.node_policy, demand, fit_rows, cand[fit_rows])
                best = pick_best(raw, None, self.mirror.rank[fit_rows])
                lo, hi = float(raw.min()), float(raw.max())
                scaled = np.zeros(len(raw), np.int64) if hi - lo < 1e-12 else np.floor(
                    (MAX_PRIORITY - 1) * (raw - lo) / (hi - lo)).astype(np.int64)
                scaled[best] = MAX_PRIORITY
                at = np.flatnonzero(feasible) if known is None else known[feasible]
                scores[at] = scaled
                blocked = self.handoffs.blocked(plan.key, plan.shapes)
                if blocked:
                    fits = np.zeros(len(names), bool)
                    fits[at] = True
                    scores = np.asarray(away_from_handoffs(names, scores, self.named(names, all_rows, blocked), fits,
                                                           self.handoffs.waiting_binds), np.int64)
        return scores, all_rows

    def named(self, names: Sequence[str], all_rows: np.ndarray, which: Mapping[str, Any]) -> np.ndarray:
        """Which of ``names`` (their rows ``all_rows``, -1 unknown) are keys of ``which``, as a mask: by
        row for known nodes (no Python pass over thousands of names), by name for the rest."""
        rows = self.mirror.rows_of(list(which), remember=False)
        # A flag per row and one take (np.isin sorts both sides); the extra last flag, never set, is where
        # unknown names' -1 lands.
        hit = np.zeros(self.mirror.cluster.n_nodes + 1, bool)
        hit[rows[rows >= 0]] = True
        mask = hit[all_rows]
        for i in np.flatnonzero(all_rows < 0).tolist():
            mask[i] = names[i] in which
        return mask

    def node_scores(self, policy_name: str, demand: Demand, rows: np.ndarray, cand: np.ndarray) -> np.ndarray:
        """The policy's raw scores of ``rows`` (the very call the simulator makes; the policy keeps its own
        per-row scores by row version, so a pod pays only for the nodes changed since)."""
        policy = self.scoring.policy(policy_name)
        return np.asarray(policy.node_scores(self.mirror.cluster, demand, rows, cand, self.scoring.context()),
                          np.float64)

    # ---- bind ------------------------------------------------------------------------------------
    def choose(self, plan: PodPlan, node: str) -> tuple[PodAllocation | None, str]:
        """The exact GPUs for a pod on a node, or why not. Does not hold anything."""
        rec = self.nodes.get(node)
        if rec is None or rec.state is None:
            return None, f"node {node}: no GPUs known (no kubegpu Device object)"
        request = plan.request
        if why := plan.refusal:
            return None, f"request refused: {why}"
        if request.allowed_models is not None and not rec.allowed_gpu_models(request.allowed_models):
            return None, f"node {node}: GPU model not in the allowed {', '.join(sorted(request.allowed_models))}"
        ctx = self.scoring.context()
        policy = self.scoring.policy(plan.gpu_policy)
        row = self.mirror.row(node)
        demand = plan.demand
        if plan.vectorised and row is not None:
            # The simulator's GPU choice: the GPU-level policy on the node's row, same context.
            cluster = self.mirror.cluster
            if cluster.cpu_free[row] < demand.cpu_milli or cluster.mem_free[row] < demand.memory_bytes:
                return None, f"node {node}: " + _resources_short(cluster, np.array([row]), demand)[0]
            reserved = self.reservation_mask(plan)
            allowed = self.allowed_mask(plan, reserved)
            try:
                slots = choose_gpus(cluster, row, demand, policy, ctx, allowed)
            except ValueError as exc:
                if allowed is None:
                    return None, str(exc)
                try:
                    choose_gpus(cluster, row, demand, policy, ctx)
                except ValueError:
                    return None, str(exc)
                mine = self.reservations.own_row(plan.key) if self.reservations is not None else None
                key, why = self._kept_off(plan, row, reserved, mine)
                return None, why if key == "shape-lock" else f"node {node}: {why}"
            c = request.gpu_containers[0]
            assert c.request is not None
            alloc = PodAllocation((ContainerAllocation(c.name, grants_on(rec.state, demand, slots,
                                                                          c.request.memory_ratio or 0)),))
            reason = f"{node}: fits"
        else:
            result = fit(rec.state, for_node(request, rec), demand.cpu_milli, demand.memory_bytes,
                         gpu_policy=policy, ctx=ctx)
            if not result.ok or result.choice is None:
                return None, result.reason
            alloc, reason = result.choice.to_allocation(), result.reason
            if kept := self._fit_kept_off(plan, rec, alloc):
                key, why = kept
                return None, why if key == "shape-lock" else f"node {node}: {why}"
        if plan.nvlink and not all_linked(rec, alloc.containers):
            return None, f"node {node}: {NOT_LINKED}"
        return alloc, reason


def away_from_handoffs(names: Sequence[str], scores: np.ndarray, blocked: np.ndarray, fits: np.ndarray,
                       waiting_binds: Mapping[str, int]) -> list[int]:
    """Nodes where a pod of this kind is being handed to the kubelet score 0 while another node it fits scores
    at least 1: bind would wait there for its turn (docs/handoff.md), so a burst of identical pods spreads
    over nodes and their handoffs overlap instead of queueing behind one node's. Where every node it fits
    is handing one over, the node with the fewest binds waiting scores highest (the shortest queue).
    ``scores``, ``blocked`` (handing one over) and ``fits`` are per position of ``names``."""
    scores = np.asarray(scores, np.int64)
    if not (fits & ~blocked).any():
        out = scores.copy()
        for i in np.flatnonzero(fits).tolist():  # all of them hand one over: as few as such nodes
            out[i] = MAX_PRIORITY - min(MAX_PRIORITY - 1, waiting_binds.get(names[i], 0))
        return out.tolist()
    return np.where(blocked, 0, np.where(fits, np.maximum(scores, 1), scores)).tolist()
