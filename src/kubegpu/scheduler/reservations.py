"""The extender's reservations for wide pods: who waits, and which GPUs the verbs keep free for them.

The policy is the pure core's (:mod:`kubegpu.placement.reservations`, the simulator runs the same function);
this component feeds it what the extender sees and keeps its answer between calls:

- the waiting GPU pods, recorded when kube-scheduler asks the extender to filter them, and from the pod watch
  for pending pods of the profiles that call this extender (their ``spec.schedulerName``, learnt from the
  filters): kube-scheduler calls the extender only with the nodes its own filters passed, so a wide pod no node
  has room for by kube-scheduler's count is never filtered here, and the watch is how it is seen waiting.
  Creation time from ``metadata.creationTimestamp``, priority from ``spec.priority``; forgotten when the watch
  shows them bound (here or by anyone else), deleted or finished;
- the bound pods that declare when they end (``status.startTime`` + ``spec.activeDeadlineSeconds``), the
  only ones a held GPU can be backfilled behind;
- the plan, recomputed only when its inputs change (the arrays' layout or any row, the waiting wide pods,
  or a wide pod crossing the wait threshold), so every node of every verb reads one mask.

Everything is derived from the API: after a restart the waiting set refills as kube-scheduler retries its
pending pods (their creation times say how long they waited), and the same rule picks the same node (the one
drained towards the pod has the most free GPUs), so no record is written on the pod. Everything runs on the
extender's event loop, like the accounting.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import datetime
from typing import Any

import numpy as np

from kubegpu.kube.slim import SlimPod
from kubegpu.placement.reservations import (
    ReservationConfig,
    ReservationPlan,
    RunningPod,
    WaitingPod,
    choose_reservations,
    waits_by_width,
    width_of,
)
from kubegpu.scheduler.accounting import TERMINAL_PHASES, Ledger
from kubegpu.scheduler.mirror import ArrayMirror
from kubegpu.scheduler.nodes import NodeRecord
from kubegpu.scheduler.pending import asks_extended_resource
from kubegpu.scheduler.plan import PodPlan


def api_time(value: object) -> float | None:
    """An API timestamp (RFC 3339, ``2026-11-29T06:00:00Z``) as seconds since the epoch; None when unreadable."""
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _priority(pod: Mapping[str, Any]) -> int:
    spec = pod.get("spec")
    value = spec.get("priority") if isinstance(spec, Mapping) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


class Reservations:
    """The waiting pods, the bound pods' declared ends, and the reservation plan the verbs read."""

    def __init__(self, nodes: Mapping[str, NodeRecord], mirror: ArrayMirror, ledger: Ledger,
                 config: ReservationConfig | None = None, clock: Callable[[], float] = time.time,
                 on_placed: Callable[[str, float], None] | None = None) -> None:
        self.nodes = nodes
        self.mirror = mirror
        self.ledger = ledger
        self.config = config or ReservationConfig()
        self.clock = clock  # wall clock: creation times and start times are the API server's
        # A waiting pod leaves the set bound: its width and wait (creation to the watch showing it bound).
        self.on_placed = on_placed or (lambda width, wait: None)
        self.waiting: dict[str, tuple[str, WaitingPod]] = {}  # key -> (uid, the pod)
        self._wide: dict[str, WaitingPod] = {}  # the wide ones of them: what the plan reads (each verb asks)
        self.ends: dict[str, float] = {}  # bound pods that declare their end: key -> when
        self.profiles: set[str] = set()  # schedulerNames of the pods filtered here: the profiles served
        self._changes = 0  # of the wide waiting pods and of the declared ends: the plan depends on both
        self._plan: ReservationPlan | None = None
        self._inputs: tuple[int, int, int, int, int] | None = None

    # ---- what the verbs and the watch feed in ----------------------------------------------------
    def saw_filter(self, plan: PodPlan, pod: Mapping[str, Any]) -> None:
        """kube-scheduler asks where ``pod`` (unbound, planned as ``plan``) may go: it waits."""
        spec = pod.get("spec")
        if isinstance(spec, Mapping) and spec.get("nodeName"):
            return
        if isinstance(spec, Mapping) and isinstance(spec.get("schedulerName"), str):
            self.profiles.add(spec["schedulerName"])
        meta = pod.get("metadata")
        self._wait(plan, api_time(meta.get("creationTimestamp")) if isinstance(meta, Mapping) else None,
                   _priority(pod))

    def _wait(self, plan: PodPlan, created: float | None, priority: int) -> None:
        """The pod waits (a GPU pod the arrays place: only those can be reserved for or counted by width)."""
        if plan.refusal or not plan.vectorised or plan.demand.count == 0:
            return
        kept = self.waiting.get(plan.key)
        if kept is not None and kept[0] == plan.uid and created is None:
            created = kept[1].created  # a body without its creation time: the first sighting stands
        entry = (plan.uid, WaitingPod(plan.key, plan.demand, self.clock() if created is None else created, priority))
        if kept != entry:
            self.waiting[plan.key] = entry
            was_wide = self._wide.pop(plan.key, None) is not None
            if self.config.is_wide(plan.demand):
                self._wide[plan.key] = entry[1]
            if was_wide or plan.key in self._wide:
                self._changes += 1

    def observe_pod(self, pod: SlimPod, deleted: bool, plan: Callable[[dict[str, Any]], PodPlan]) -> None:
        """A pod event from the watch (``plan``: the extender's plan of a pod): a pending pod of a profile served
        here waits; a waiting pod bound, deleted or finished leaves the set (and its reservation with it); a
        bound pod's declared end is kept while it runs."""
        meta, spec, status = pod.metadata, pod.spec, pod.status
        if meta is None:
            return
        key = f"{meta.namespace}/{meta.name}"
        node = spec.nodeName if spec is not None else None
        gone = deleted or (status is not None and status.phase in TERMINAL_PHASES)
        if (not node and not gone and spec is not None and spec.schedulerName in self.profiles
                and asks_extended_resource(spec)):
            self._wait(plan(pod.to_dict()), api_time(meta.creationTimestamp), spec.priority or 0)
            return
        kept = self.waiting.get(key)
        if kept is not None and (gone or node) and (not meta.uid or kept[0] == meta.uid):
            del self.waiting[key]
            if self._wide.pop(key, None) is not None:
                self._changes += 1
            if node and not gone:
                self.on_placed(width_of(kept[1].demand), max(0.0, self.clock() - kept[1].created))
        deadline = spec.activeDeadlineSeconds if spec is not None else None
        started = api_time(status.startTime) if status is not None else None
        ends = started + deadline if node and not gone and deadline is not None and started is not None else None
        if ends is None:
            if self.ends.pop(key, None) is not None:
                self._changes += 1
        elif self.ends.get(key) != ends:
            self.ends[key] = ends
            self._changes += 1

    # ---- the plan --------------------------------------------------------------------------------
    def current(self) -> ReservationPlan | None:
        """The reservations in force now (None: none), recomputed only when what they depend on changed."""
        if not self.config.enabled or not self._wide:
            self._plan = None
            return None
        now = self.clock()
        # A pod bound here is held from its bind on; the watch's echo that ends its wait comes later, and until
        # then it must not be given GPUs elsewhere (nor move the reservations after it).
        held = self.ledger.held
        wide = [w for k, w in self._wide.items() if k not in held]
        due = sum(1 for w in wide if now - w.created >= self.config.wait_seconds)
        if not due:
            self._plan = None
            return None
        cluster = self.mirror.cluster
        inputs = (cluster.layout, cluster.epoch, self._changes, due, len(wide))
        if self._plan is not None and inputs == self._inputs:
            return self._plan
        plan = choose_reservations(cluster, wide, self._running(), now, self.config, self._previous())
        self._plan, self._inputs = self._with_holders(plan), inputs
        return self._plan

    def allowed(self, plan: PodPlan) -> np.ndarray | None:
        """(N, G) bool: the GPUs ``plan``'s pod may take without delaying a reservation (None: all of them).
        A pod that declares its run time is counted as ending that long from now (it is not bound yet)."""
        current = self.current()
        if current is None:
            return None
        ends = None if plan.deadline_s is None else self.clock() + plan.deadline_s
        return current.allowed(plan.key, ends)

    def own_row(self, key: str) -> tuple[int, str] | None:
        """The array row pod ``key`` holds GPUs on, and its reservation's reason (None: it holds none)."""
        r = None if self._plan is None else self._plan.for_pod(key)
        return None if r is None else (r.node, r.reason)

    def holding(self, row: int, mine: tuple[int, str] | None = None) -> str:
        """Why a node's GPUs are kept back from a pod: the reservations on array row ``row``; for the wide pod
        whose own node it is (``mine``, from :meth:`own_row`), its reservation's reason."""
        if mine is not None and mine[0] == row:
            return mine[1]
        current = self._plan
        items = [] if current is None else [r for r in current.items if r.node == row]
        held = ", ".join(f"{r.pod} ({r.width} GPUs, waiting {r.waited:.0f} s)" for r in items)
        return f"GPUs held for a waiting wide pod: {held or 'none'}"

    def summary(self) -> dict[str, Any]:
        """The debug API's and ``kubegpu status``'s view: the policy, the reservations, the waits by width."""
        plan = self.current()
        out: dict[str, Any] = {"config": {"enabled": self.config.enabled, "minGpus": self.config.min_gpus,
                                          "waitSeconds": self.config.wait_seconds,
                                          "maxShare": self.config.max_share}}
        if plan is None:
            out.update({"reserved_gpus": 0, "reserved_gpus_by_width": {}, "reservations": [],
                        "without_reservation": []})
        else:
            out.update(plan.summary())
        out["waiting"] = waits_by_width([w for _, w in self.waiting.values()], self.clock())
        return out

    def _previous(self) -> ReservationPlan | None:
        """The last plan with each reservation's node at its row in the current arrays (a gone node: dropped)."""
        last = self._plan
        if last is None:
            return None
        items = tuple(replace(r, node=row) for r in last.items if (row := self.mirror.row(r.node_name)) is not None)
        return replace(last, items=items)

    def _running(self) -> list[RunningPod]:
        """The pods on every node where a pod declares its end: all of them, since a GPU frees only when its
        last holder ends (elsewhere busy GPUs count as never freeing, which needs no pod listed)."""
        nodes = {h.node for k in self.ends if (h := self.ledger.held.get(k)) is not None}
        out = []
        for node in sorted(nodes):
            row, slot = self.mirror.row(node), self._slots(node)
            if row is None or slot is None:
                continue
            for key in sorted(self.ledger.by_node.get(node, ())):
                gpus = tuple(sorted({slot[g.uuid] for g in self.ledger.held[key].alloc.grants() if g.uuid in slot}))
                if gpus:
                    out.append(RunningPod(key, row, gpus, self.ends.get(key)))
        return out

    def _with_holders(self, plan: ReservationPlan) -> ReservationPlan:
        """Each reservation's holders: every accounted pod on its GPUs (the policy saw only some pods)."""
        items = []
        for r in plan.items:
            slot = self._slots(r.node_name) or {}
            mine = set(r.gpus)
            holders = tuple(k for k in sorted(self.ledger.by_node.get(r.node_name, ()))
                            if any(slot.get(g.uuid) in mine for g in self.ledger.held[k].alloc.grants()))
            items.append(replace(r, holders=holders))
        return replace(plan, items=tuple(items))

    def _slots(self, node: str) -> dict[str, int] | None:
        rec = self.nodes.get(node)
        if rec is None or rec.state is None:
            return None
        return {g.uuid: i for i, g in enumerate(rec.state.gpus)}


__all__ = ["Reservations", "api_time"]
