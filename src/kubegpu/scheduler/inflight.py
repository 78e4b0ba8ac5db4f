"""Pods in flight: passed by the extender's filter (or named by a bind that has not held its GPUs yet) and not
yet in the accounting, so that filter and bind agree.

kube-scheduler runs scheduling cycles one after another but binds asynchronously: once pod A's cycle has picked
node X, A's bind goes out on its own while pod B's cycle starts, so B's filter can reach the extender before A's
bind does. A bind may also wait in the extender for its node's previous handoff (:mod:`.handoff`) before it holds
anything. Either way the accounting does not count A yet, and a filter reading it alone would pass X for B even
where X has room for only one of them; B's bind would then find its room taken.

This module keeps those pods (a flight each: the pod's plan and the nodes it may land on) and answers one
question per filter: which of the nodes it passes for B would no longer have room for B were the pods in flight
that may land there counted? Only there is a collision possible. For such a node:

- while a pod that may land there has not had its bind arrive, the filter waits for that bind (bounded by
  :data:`DEFAULT_FILTER_WAIT_S`, on an event set by every change of a flight: never a poll), then answers from the
  accounting as it is then; a pod whose bind did not come in that bound (kube-scheduler failed it after the
  filter, or holds it in a later phase) counts no more until its bind arrives, and its next filters put it in
  flight uncounted (a pod kube-scheduler fails after the filter again and again costs one wait, not one per try);
- a pod whose bind names the node and waits there (its turn, the node daemon) holds its room: the node fails for
  B with a reason that names it.

Everywhere else (nothing in flight, or room for all of them) the filter answers as it would have, without a wait.
The test of room is first a bound, over every node at once: a node surely has room when its CPU and memory cover
all of them and it has at least as many GPUs that could take B's part as B needs plus every GPU the others may
touch. Where the bound fails, placement decides on a copy of the node's state with the others placed first, up to
a fixed number of container placements per filter (past them a collision is taken as possible): so one filter's
check costs at most that many placements, whatever the pods in flight ask.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from kubegpu.placement import fit
from kubegpu.scheduler.nodes import for_node
from kubegpu.scheduler.plan import PodPlan
from kubegpu.scheduler.state import ClusterView, FilterOutcome

log = logging.getLogger(__name__)

# How long a filter waits for the binds of pods that may collide with it. kube-scheduler sends a bind as soon as
# the pod's cycle ends, before it filters the next pod, so the bind is normally milliseconds away; a bind not in
# by then belongs to a pod kube-scheduler failed after the filter or holds in a later phase. Far below the
# rendered filter extender's httpTimeout (install/values.py: 10 s), so the answer always arrives.
DEFAULT_FILTER_WAIT_S = 1.0
# A pod passed by filter and never bound nor deleted (kube-scheduler failed it after the filter) is forgotten
# this long after its filter, whether or not a filter ever waited on it: the flights stay few.
FILTERED_TTL_S = 30.0
# Container placements per filter where the count bound fails (a node's check places every container of every pod
# that may land there, then this pod's): a pod of many containers in flight must not make each filter fit it on
# many nodes.
MAX_PLACED_CONTAINERS = 64
# Pods whose bind did not come when waited for, remembered (oldest forgotten first) so that they are not waited for
# again.
MAX_VAIN = 4096
REASON_KEY = "in-flight"  # the filter's reason category for nodes refused here (metrics)


@dataclass(slots=True)
class Flight:
    """One pod the accounting does not count yet, and where it may land."""

    plan: PodPlan
    nodes: Sequence[str]  # the nodes its filter passed; the one node its bind names once that arrived
    since: float  # loop time of its filter or its bind's arrival
    bound_for: str = ""  # the node its bind names ('' until the bind arrives)
    counted: bool = True  # False once a filter waited for its bind in vain: kept only to say when it was filtered

    @property
    def gpus(self) -> int:
        """The most GPUs it can touch on a node: every device its containers ask for (init ones too)."""
        return sum(c.request.count for c in self.plan.request.gpu_containers if c.request is not None)


class InFlight:
    """The pods in flight, their changes as an event, and the filter's wait on them (see the module)."""

    def __init__(self, view: ClusterView, *, wait_s: float = DEFAULT_FILTER_WAIT_S,
                 ttl_s: float = FILTERED_TTL_S) -> None:
        self.view = view
        self.wait_s = wait_s
        self.ttl_s = ttl_s
        self.flights: dict[str, Flight] = {}  # pod key -> its flight, oldest first
        self._vain: dict[str, None] = {}  # pod keys waited for in vain, oldest first (MAX_VAIN)
        self._changed: asyncio.Event | None = None  # set (and replaced) at every change of a flight
        # What the filters did: answered with nothing else in flight, checked against flights, waited for
        # binds, nodes refused for a bind in progress there, flights no longer counted after a wait for their bind.
        self.unchecked = 0
        self.checked = 0
        self.waited = 0
        self.refused = 0
        self.expired = 0

    # ---- flights -----------------------------------------------------------------------------------
    def filtered(self, plan: PodPlan, passed: Sequence[str]) -> None:
        """``plan``'s pod was just passed ``passed`` by filter (none: it is in flight no more)."""
        now = asyncio.get_running_loop().time()
        self.flights.pop(plan.key, None)
        if len(passed):
            self.flights[plan.key] = Flight(plan, passed, now, counted=plan.key not in self._vain)
        while self.flights:  # the oldest first: stop at the first one still young
            key, oldest = next(iter(self.flights.items()))
            if oldest.bound_for or now - oldest.since <= self.ttl_s:
                break
            del self.flights[key]
        self._notify()

    def binding(self, plan: PodPlan, node: str) -> None:
        """``plan``'s pod's bind to ``node`` arrived and has not held its GPUs yet (it may wait for its turn)."""
        self.flights.pop(plan.key, None)
        self._vain.pop(plan.key, None)  # its bind came: it is waited for again next time
        self.flights[plan.key] = Flight(plan, (node,), asyncio.get_running_loop().time(), bound_for=node)
        self._notify()

    def filtered_at(self, key: str) -> float | None:
        """When ``key``'s pod was last passed by filter (loop time; None: not since its last bind, or unknown)."""
        f = self.flights.get(key)
        return None if f is None or f.bound_for else f.since

    def done(self, key: str, uid: str = "") -> None:
        """``key`` is in flight no more: held by the accounting, its bind over, bound elsewhere, or gone (``uid``:
        only that pod's flight, not a flight of a pod recreated under its name)."""
        f = self.flights.get(key)
        if f is not None and (not uid or not f.plan.uid or f.plan.uid == uid):
            del self.flights[key]
            self._notify()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def _changes(self, timeout_s: float) -> None:
        """Until the next change of a flight, or ``timeout_s``."""
        if self._changed is None:
            self._changed = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout_s)

    # ---- the filter ----------------------------------------------------------------------------------
    async def settle(self, plan: PodPlan, run: Callable[[], Awaitable[FilterOutcome]]) -> FilterOutcome:
        """The filter's answer (``run`` computes it from the accounting) with the pods in flight counted: run
        again after each change of the flights it waits for (see the module); the pod is in flight from then."""
        out = await run()
        if not any(k != plan.key and f.counted for k, f in self.flights.items()):
            self.unchecked += 1
            self.filtered(plan, out.passed)
            return out
        self.checked += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        waited = False
        while True:
            hits = self.collisions(plan, out.passed)
            unsent = {f.plan.key for flights in hits.values() for f in flights if not f.bound_for}
            if not unsent:
                break
            left = deadline - loop.time()
            if left <= 0:
                for key in unsent:
                    log.info("pod %s: its bind did not come within %g s of pod %s's filter; counted no more",
                             key, self.wait_s, plan.key)
                    self.flights[key].counted = False
                    self._vain[key] = None
                while len(self._vain) > MAX_VAIN:
                    del self._vain[next(iter(self._vain))]
                self.expired += len(unsent)
                hits = self.collisions(plan, out.passed)
                break
            if not waited:
                waited = True
                self.waited += 1
            await self._changes(left)
            out = await run()
        out = self._refuse(out, hits)
        self.filtered(plan, out.passed)
        return out

    def collisions(self, plan: PodPlan, passed: Sequence[str]) -> dict[str, list[Flight]]:
        """The nodes of ``passed`` that would have no room for ``plan``'s pod were the other pods in flight
        that may land there counted, with those pods."""
        flights = [f for k, f in self.flights.items() if k != plan.key and f.counted]
        view = self.view
        if not flights or not len(passed) or plan.refusal or not view.mirror.built:
            return {}
        rows = view.node_rows(passed, remember=False)
        n = view.mirror.cluster.n_nodes
        gpus = np.zeros(n + 1, np.int64)  # the last entry is where unknown nodes' -1 lands: never read
        cpu = np.zeros(n + 1, np.int64)
        mem = np.zeros(n + 1, np.int64)
        landing: list[tuple[Flight, np.ndarray]] = []
        for f in flights:
            at = np.zeros(n + 1, bool)
            if f.bound_for:
                row = view.mirror.row(f.bound_for)
                if row is None:
                    continue
                at[row] = True
            else:
                theirs = view.node_rows(f.nodes, remember=False)
                at[theirs[theirs >= 0]] = True
            at[n] = False
            landing.append((f, at))
            gpus[at] += f.gpus
            cpu[at] += f.plan.demand.cpu_milli
            mem[at] += f.plan.demand.memory_bytes
        shared = np.zeros(len(rows), bool)
        for _, at in landing:
            shared |= at[rows]
        if not shared.any():
            return {}
        sub = rows[shared]
        doubt = ~self._surely_room(plan, sub, gpus[sub], cpu[sub], mem[sub])
        out: dict[str, list[Flight]] = {}
        budget = MAX_PLACED_CONTAINERS
        for r in sub[doubt].tolist():
            here = [f for f, at in landing if at[r]]
            node = str(view.mirror.names_by_row[r])
            cost = len(plan.request.gpu_containers) + sum(len(f.plan.request.gpu_containers) for f in here)
            # Past the budget a collision is taken as possible unplaced (its cost is a wait for binds under way).
            if cost > budget or not self._fits_after(plan, node, here):
                out[node] = here
            budget -= min(cost, budget)
        return out

    def _surely_room(self, plan: PodPlan, rows: np.ndarray, gpus: np.ndarray, cpu: np.ndarray,
                     mem: np.ndarray) -> np.ndarray:
        """Per row, whether ``plan``'s pod has room there whatever the others (``gpus`` GPUs they may touch,
        ``cpu``, ``mem``) take: each GPU they touch is at most one fewer GPU that could take its part."""
        view = self.view
        cluster = view.mirror.cluster
        need = plan.demand
        ok = (cluster.cpu_free[rows] >= need.cpu_milli + cpu) & (cluster.mem_free[rows] >= need.memory_bytes + mem)
        if not plan.request.wants_gpu:
            return cast(np.ndarray, ok)
        if not plan.vectorised or plan.nvlink:
            return np.zeros(len(rows), bool)  # fitted node by node: no count bounds it; placement decides
        demand = plan.gpu_demand
        allowed = view.allowed_mask(plan, view.reservation_mask(plan))  # what its filter ANDed: reservations, locks
        counts = (view.mirror.candidate_counts(demand) if allowed is None
                  else (view.mirror.candidates(demand) & allowed).sum(axis=1))
        return cast(np.ndarray, ok & (counts[rows] >= demand.count + gpus))

    def _fits_after(self, plan: PodPlan, node: str, flights: list[Flight]) -> bool:
        """Whether ``plan``'s pod fits ``node`` once every pod of ``flights`` holds there what placement gives it
        (one after another; a pod that does not fit takes nothing)."""
        view = self.view
        rec = view.nodes.get(node)
        if rec is None or rec.state is None:
            return True  # the filter's own reason stands
        state = rec.state.copy()
        ctx = view.scoring.context()
        for f in flights:
            need = f.plan.demand
            theirs = fit(state, for_node(f.plan.request, rec), need.cpu_milli, need.memory_bytes,
                         gpu_policy=view.scoring.policy(f.plan.gpu_policy), ctx=ctx)
            if theirs.ok and theirs.choice is not None:
                state.apply(theirs.choice, need.cpu_milli, need.memory_bytes)
        need = plan.demand
        return fit(state, for_node(plan.request, rec), need.cpu_milli, need.memory_bytes,
                   gpu_policy=view.scoring.policy(plan.gpu_policy), ctx=ctx).ok

    def _refuse(self, out: FilterOutcome, hits: dict[str, list[Flight]]) -> FilterOutcome:
        """``out`` without the nodes whose room a bind in progress there holds, each failed with who holds it."""
        if not hits:
            return out
        failed = out.failed
        for node, flights in hits.items():
            who = ", ".join(sorted(f.plan.key for f in flights))
            failed[node] = (f"its room is promised to {who}, whose bind to this node is in progress (waiting for the "  # type: ignore[index]
                            "node's previous handoff or its node daemon); retried once it is bound")
        self.refused += len(hits)
        reasons = out.reasons + Counter({REASON_KEY: len(hits)})
        return FilterOutcome([n for n in out.passed if n not in hits], failed, out.unresolvable, reasons)
