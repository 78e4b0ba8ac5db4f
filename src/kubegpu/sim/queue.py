"""Replaying pods that wait: a pod that fits nowhere queues (as in kube-scheduler) instead of being dropped.

Wide pods starve only when pods wait: a dropped pod cannot starve. So this
replay keeps every pod that does not fit in a queue (higher priority first,
then the oldest) and retries it whenever capacity frees up, which is exactly
when it can start: between two events nothing changes, so the replay jumps
from event to event (an arrival, a departure, a pod reaching the reservation
threshold or giving up) instead of ticking. A pod runs for its duration from
the moment it is placed.

With a :class:`~kubegpu.placement.reservations.ReservationConfig`, every
scheduling round first asks the pure core for the reservations in force
(:func:`~kubegpu.placement.reservations.choose_reservations`, as the extender
does) and places every other pod only where
:meth:`~kubegpu.placement.reservations.ReservationPlan.allowed` says it delays
no reservation. It measures, per pod width, the waits (creation to placement)
and the pods never placed (withdrawn after ``give_up_s``, or still waiting when
the last event is replayed), the GPU capacity in use, and the capacity
reservations kept idle: held GPUs that were free (``held_idle``), and the part of
it while a pod that would have fit there waited (``idle_cost``, what
reservations really cost).
"""

from __future__ import annotations

import bisect
import heapq
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kubegpu.placement.cluster import MILLI, ClusterState, Demand
from kubegpu.placement.engine import place
from kubegpu.placement.policies import Policy, ScoreContext, get_policy
from kubegpu.placement.reservations import (
    ReservationConfig,
    ReservationPlan,
    RunningPod,
    WaitingPod,
    choose_reservations,
    width_of,
)
from kubegpu.placement.workload import Workload
from kubegpu.sim.timeline import arrival_times
from kubegpu.sim.trace import TracePod

WIDTHS = ("share", "1", "2", "4", "8")  # the widths every report lists, others when present


@dataclass(frozen=True, slots=True)
class QueuedPod:
    """One pod of a queued replay: when it arrives, how long it runs once placed (None: never leaves)."""

    key: str
    demand: Demand
    arrive: float
    duration: float | None
    priority: int = 0


@dataclass(frozen=True, slots=True)
class WidthStats:
    """Waits of some pods (seconds, creation to placement, over the pods placed)."""

    pods: int
    never_placed: int
    wait_p50_s: float
    wait_p99_s: float
    wait_max_s: float

    @classmethod
    def of(cls, waits: Sequence[float], never_placed: int) -> WidthStats:
        if not waits:
            return cls(never_placed, never_placed, 0.0, 0.0, 0.0)
        w = np.asarray(waits, np.float64)
        return cls(len(w) + never_placed, never_placed, float(np.percentile(w, 50)), float(np.percentile(w, 99)),
                   float(w.max()))

    def to_json(self) -> dict[str, object]:
        return {"pods": self.pods, "never_placed": self.never_placed, "wait_p50_s": round(self.wait_p50_s, 3),
                "wait_p99_s": round(self.wait_p99_s, 3), "wait_max_s": round(self.wait_max_s, 3)}


@dataclass(frozen=True, slots=True)
class QueueResult:
    """What a queued replay measured."""

    reservations: bool
    pods: int
    waits_s: dict[str, tuple[float, ...]]  # by width: the wait of each pod placed
    never_placed: dict[str, int]  # by width: still waiting at the end, or gave up
    gave_up: dict[str, int]  # by width: of those, withdrawn after waiting ``give_up_s``
    span_s: float  # first arrival to last event
    gpus: int
    used_gpu_s: float  # GPU capacity in use (shares by their compute)
    held_idle_gpu_s: float  # held GPUs that were free
    idle_cost_gpu_s: float  # ... while a pod that would have fit without reservations waited
    max_reserved_gpus: int
    reservations_made: int  # distinct pods that got one
    seconds: float

    def stats(self, widths: Sequence[str]) -> WidthStats:
        """The waits of the pods of these widths together."""
        waits = [w for k in widths for w in self.waits_s.get(k, ())]
        return WidthStats.of(waits, sum(self.never_placed.get(k, 0) for k in widths))

    @property
    def widths(self) -> dict[str, WidthStats]:
        """Per width: the reported ones first, then any other in the trace."""
        seen = set(self.waits_s) | set(self.never_placed)
        extra = sorted(seen - set(WIDTHS), key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else 0, k))
        return {k: self.stats((k,)) for k in (*WIDTHS, *extra)}

    def _pct(self, gpu_s: float) -> float:
        return 100.0 * gpu_s / max(1e-9, self.gpus * self.span_s)

    @property
    def idle_gpu_cost_pct(self) -> float:
        """The idle cost as % of the run's GPU capacity (GPUs x span)."""
        return self._pct(self.idle_cost_gpu_s)

    @property
    def held_idle_pct(self) -> float:
        return self._pct(self.held_idle_gpu_s)

    @property
    def used_pct(self) -> float:
        """The GPU capacity in use, % of the run's: how full the cluster was kept."""
        return self._pct(self.used_gpu_s)

    def to_json(self) -> dict[str, object]:
        return {
            "reservations": self.reservations,
            "pods": self.pods,
            "widths": {w: s.to_json() for w, s in self.widths.items()},
            "never_placed": sum(self.never_placed.values()),
            "gave_up": sum(self.gave_up.values()),
            "span_s": round(self.span_s, 1),
            "gpu_used_pct": round(self.used_pct, 3),
            "held_idle_gpu_hours": round(self.held_idle_gpu_s / 3600, 3),
            "held_idle_pct": round(self.held_idle_pct, 3),
            "idle_cost_gpu_hours": round(self.idle_cost_gpu_s / 3600, 3),
            "idle_gpu_cost_pct": round(self.idle_gpu_cost_pct, 3),
            "max_reserved_gpus": self.max_reserved_gpus,
            "reservations_made": self.reservations_made,
            "seconds": round(self.seconds, 2),
        }


@dataclass(slots=True)
class _Run:
    """The mutable state of one queued replay."""

    cluster: ClusterState
    pods: Sequence[QueuedPod]
    config: ReservationConfig | None
    declared: bool
    queue: list[tuple[int, float, int]]  # (-priority, arrival, index), sorted: the scheduling order
    running: dict[int, RunningPod]
    leaving: list[tuple[float, int, int, tuple[int, ...]]]  # (time, index, node, gpus)
    plan: ReservationPlan | None = None
    reserved_for: set[str] | None = None

    def waiting(self, config: ReservationConfig) -> list[WaitingPod]:
        """The waiting pods the reservation policy may serve (the others it would skip anyway)."""
        return [WaitingPod(self.pods[i].key, self.pods[i].demand, self.pods[i].arrive, self.pods[i].priority)
                for _, _, i in self.queue if config.is_wide(self.pods[i].demand)]

    def replan(self, now: float) -> bool:
        """Recompute the reservations; whether the held GPUs changed."""
        if self.config is None:
            return False
        before = self.plan
        has_wide = any(
            self.config.is_wide(self.pods[i].demand) and now - a >= self.config.wait_seconds for _, a, i in self.queue
        )
        if has_wide:
            self.plan = choose_reservations(
                self.cluster, self.waiting(self.config), list(self.running.values()), now, self.config, before
            )
        else:
            self.plan = None
        if self.reserved_for is not None and self.plan is not None:
            self.reserved_for.update(r.pod for r in self.plan.items)
        if before is None or self.plan is None:
            return (before is None) != (self.plan is None)
        return not np.array_equal(before.held, self.plan.held)


def replay_queue(
    cluster: ClusterState,
    pods: Sequence[QueuedPod],
    policy: str = "kubegpu",
    gpu_policy: str | None = None,
    reservations: ReservationConfig | None = None,
    *,
    workload: Workload | None = None,
    declared_runtime: bool = False,
    give_up_s: float | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> QueueResult:
    """Replay ``pods`` on ``cluster`` (changed in place) with a waiting queue; see the module docstring.

    ``reservations``: None (or ``enabled=False``) places as today. ``declared_runtime``: every pod declares
    its duration (as ``activeDeadlineSeconds`` would), so backfill may use held GPUs. ``give_up_s``: a pod
    still waiting that long after its arrival is withdrawn (counted as never placed).
    """
    start = time.perf_counter()
    if reservations is not None and not reservations.enabled:
        reservations = None
    pol = get_policy(policy)
    gname = gpu_policy or pol.gpu_default
    gpu = pol if gname == pol.name else get_policy(gname)
    ctx = ScoreContext(workload=workload or Workload.from_demands(p.demand for p in pods))
    gpus = int(cluster.gpu_ok.sum())
    if gpus <= 0:
        raise ValueError("the cluster has no GPUs")
    arrivals = sorted(range(len(pods)), key=lambda i: (pods[i].arrive, i))
    # (time, gives up, index): a wide pod reaching the reservation threshold (0), a pod giving up (1)
    wakeups: list[tuple[float, int, int]] = []
    run = _Run(cluster, pods, reservations, declared_runtime, [], {}, [], None, set())
    waits: dict[str, list[float]] = defaultdict(list)
    never: dict[str, int] = defaultdict(int)
    gave_up: dict[str, int] = defaultdict(int)
    held_idle = cost = used = 0.0
    max_reserved = 0
    blocked = False
    next_arrival = 0
    first_t = pods[arrivals[0]].arrive if arrivals else 0.0
    t = first_t
    while next_arrival < len(arrivals) or run.leaving or wakeups:
        nt = min(
            pods[arrivals[next_arrival]].arrive if next_arrival < len(arrivals) else np.inf,
            run.leaving[0][0] if run.leaving else np.inf,
            wakeups[0][0] if wakeups else np.inf,
        )
        if nt > t:
            used += float((MILLI - cluster.core_free[cluster.gpu_ok]).sum()) / MILLI * (nt - t)
        if run.plan is not None:
            idle = run.plan.held_free(cluster) * (nt - t)
            held_idle += idle
            cost += idle if blocked else 0.0
        t = nt
        changed = False
        while run.leaving and run.leaving[0][0] <= t:
            _, i, node, slots = heapq.heappop(run.leaving)
            cluster.give_back(node, slots, pods[i].demand)
            del run.running[i]
            changed = True
        while wakeups and wakeups[0][0] <= t:
            _, gives_up, i = heapq.heappop(wakeups)
            entry = (-pods[i].priority, pods[i].arrive, i)
            if gives_up:
                k = bisect.bisect_left(run.queue, entry)
                if k < len(run.queue) and run.queue[k] == entry:
                    run.queue.pop(k)
                    never[width_of(pods[i].demand)] += 1
                    gave_up[width_of(pods[i].demand)] += 1
        fresh: list[int] = []
        while next_arrival < len(arrivals) and pods[arrivals[next_arrival]].arrive <= t:
            i = arrivals[next_arrival]
            next_arrival += 1
            bisect.insort(run.queue, (-pods[i].priority, pods[i].arrive, i))
            fresh.append(i)
            if reservations is not None and reservations.is_wide(pods[i].demand):
                heapq.heappush(wakeups, (pods[i].arrive + reservations.wait_seconds, 0, i))
            if give_up_s is not None:
                heapq.heappush(wakeups, (pods[i].arrive + give_up_s, 1, i))
        retry_all = changed
        while True:
            retry_all = run.replan(t) or retry_all
            placed_reserved, now_blocked = _round(run, t, pol, gpu, ctx, waits, None if retry_all else set(fresh))
            # A pass over the new arrivals only leaves the pods blocked before as they were.
            blocked = now_blocked or (blocked and not retry_all)
            if run.plan is not None:
                max_reserved = max(max_reserved, int(run.plan.held.sum()))
            if not placed_reserved:
                break
            retry_all = True  # its reservation ends: what it held is open again
        if progress is not None:
            progress(next_arrival, len(arrivals))
    for _, _, i in run.queue:
        never[width_of(pods[i].demand)] += 1
    return QueueResult(
        reservations is not None, len(pods), {k: tuple(v) for k, v in waits.items()}, dict(never), dict(gave_up),
        max(1e-9, t - first_t), gpus, used, held_idle, cost, max_reserved, len(run.reserved_for or ()),
        time.perf_counter() - start,
    )


def _round(
    run: _Run, t: float, pol: Policy, gpu: Policy, ctx: ScoreContext, waits: dict[str, list[float]],
    only: set[int] | None,
) -> tuple[bool, bool]:
    """One scheduling pass over the queue (or only the pods in ``only``); (a reserved pod was placed, a pod waits
    that would fit without the reservations)."""
    cluster, pods, plan = run.cluster, run.pods, run.plan
    failed: set[Demand] = set()  # a demand that did not fit cannot fit later in the same pass
    placed_reserved = blocked = False
    k = 0
    while k < len(run.queue):
        i = run.queue[k][2]
        pod = pods[i]
        if only is not None and i not in only:
            k += 1
            continue
        d = pod.demand
        ends = t + pod.duration if run.declared and pod.duration is not None else None
        special = plan is not None and (ends is not None or plan.for_pod(pod.key) is not None)
        if not special and d in failed:
            k += 1
            continue
        allowed = plan.allowed(pod.key, ends) if plan is not None else None
        where = place(cluster, d, pol, gpu, ctx, allowed)
        if where is None:
            if not special:
                failed.add(d)
            if allowed is not None and not blocked and cluster.feasible(d).any():
                blocked = True
            k += 1
            continue
        cluster.take(where.node, where.gpus, d)
        run.queue.pop(k)
        waits[width_of(d)].append(t - pod.arrive)
        run.running[i] = RunningPod(pod.key, where.node, where.gpus, ends)
        if pod.duration is not None:
            heapq.heappush(run.leaving, (t + pod.duration, i, where.node, where.gpus))
        if plan is not None and plan.for_pod(pod.key) is not None:
            placed_reserved = True
    return placed_reserved, blocked


def trace_queue(pods: Sequence[TracePod], load: float = 1.0) -> list[QueuedPod]:
    """The pods of a trace with a creation time, arrivals compressed by ``load`` (as ``replay_time`` does)."""
    idx, arrive, leave = arrival_times(pods, load)
    return [
        QueuedPod(pods[i].name, pods[i].demand, float(a), float(e - a) if e > a else None)
        for i, a, e in zip(idx.tolist(), arrive.tolist(), leave.tolist(), strict=True)
    ]
