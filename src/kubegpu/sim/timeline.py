"""Replaying a trace in time: pods arrive at their creation time and leave at their deletion time.

This is the "what if my cluster ran this policy" mode: the same pods, in the
order the cluster saw them, with departures freeing their GPUs. A pod that
fits nowhere when it arrives is dropped (counted by kind). Pods without a
creation time are skipped and counted; a deletion before creation means the
pod never leaves.

The openb trace spans five months and its pods rarely overlap (its peak
concurrent GPU request is about 1 % of the cluster), so replayed as recorded
no policy is ever short of room and every policy looks the same. ``load``
compresses the time between arrivals by that factor while each pod keeps its
duration: concurrency grows about ``load`` times, the "what if my cluster ran
this much work" question. :func:`load_for_peak` finds the factor that brings
the peak concurrent GPU request (ignoring where pods fit) to a target share
of capacity (95 % by default: the cluster reaches contention, and the default
openb list, whose pods together ask for 98 % of its GPUs, can get there); the result
states the factor and that peak.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kubegpu.placement.cluster import MILLI
from kubegpu.placement.engine import place
from kubegpu.placement.policies import ScoreContext, get_policy
from kubegpu.sim.replay import target_workload
from kubegpu.sim.trace import TraceNodes, TracePod


@dataclass(frozen=True, slots=True)
class TimelineResult:
    """What a time replay measured (GPU % of capacity, sampled at every event)."""

    policy: str
    pods: int
    skipped: int
    failed: dict[str, int]
    failed_gpu_pct: float  # GPU request of dropped pods, % of capacity
    mean_allocated_pct: float  # time-weighted
    peak_allocated_pct: float
    mean_unallocated_when_pending_pct: float  # free GPU % at the moments a GPU pod was dropped
    seconds: float
    load: float = 1.0  # arrivals compressed by this factor, durations kept
    peak_demand_pct: float = 0.0  # peak concurrent GPU request at that load, % of capacity (placement aside)

    def to_json(self) -> dict[str, object]:
        return {
            "pods": self.pods,
            "skipped_without_time": self.skipped,
            "failed_pods": self.failed,
            "failed_gpu_pct": round(self.failed_gpu_pct, 3),
            "mean_allocated_pct": round(self.mean_allocated_pct, 3),
            "peak_allocated_pct": round(self.peak_allocated_pct, 3),
            "free_gpu_pct_when_dropping": round(self.mean_unallocated_when_pending_pct, 3),
            "seconds": round(self.seconds, 2),
            "load": round(self.load, 3),
            "peak_demand_pct": round(self.peak_demand_pct, 2),
        }


def arrival_times(pods: Sequence[TracePod], load: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pod indexes with a creation time, their compressed arrivals, their departures; -1 = never leaves)."""
    idx = np.array([i for i, p in enumerate(pods) if p.creation >= 0], np.int64)
    if not len(idx):
        return idx, np.zeros(0, np.int64), np.zeros(0, np.int64)
    c = np.array([pods[i].creation for i in idx], np.int64)
    d = np.array([pods[i].deletion for i in idx], np.int64)
    first = int(c.min())
    arrive = first + np.floor((c - first) / load).astype(np.int64)
    leave = np.where(d > c, arrive + (d - c), -1)
    return idx, arrive, leave


def peak_demand(pods: Sequence[TracePod], load: float) -> int:
    """Peak concurrent GPU request (milli) with arrivals compressed by ``load``, wherever pods would fit."""
    idx, arrive, leave = arrival_times(pods, load)
    if not len(idx):
        return 0
    req = np.array([pods[i].demand.gpu_milli_total for i in idx], np.int64)
    ends = np.where(leave < 0, np.iinfo(np.int64).max, leave)
    t = np.concatenate([arrive, ends])
    delta = np.concatenate([req, -req])
    order = np.lexsort((delta, t))  # departures before arrivals at the same instant
    return int(np.cumsum(delta[order]).max(initial=0))


def load_for_peak(pods: Sequence[TracePod], capacity_milli: int, target: float = 0.95) -> float:
    """The time compression that brings the peak concurrent GPU request to ``target`` x capacity."""
    lo, hi = 1.0, 1e7
    if peak_demand(pods, lo) >= target * capacity_milli:
        return lo
    if peak_demand(pods, hi) < target * capacity_milli:
        return hi
    for _ in range(40):  # bisection on a log scale: the peak grows with the factor
        mid = float(np.sqrt(lo * hi))
        if peak_demand(pods, mid) >= target * capacity_milli:
            hi = mid
        else:
            lo = mid
    return hi


def replay_time(
    nodes: TraceNodes,
    pods: Sequence[TracePod],
    policy: str,
    gpu_policy: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    load: float = 1.0,
) -> TimelineResult:
    """Replay in time with arrivals compressed by ``load`` (see the module docstring)."""
    if not load >= 1.0:
        raise ValueError(f"the load factor must be at least 1, not {load}")
    start = time.perf_counter()
    pol = get_policy(policy)
    cluster = nodes.cluster()
    capacity = int(cluster.gpu_ok.sum()) * MILLI
    if capacity <= 0:
        raise ValueError("the node list has no GPUs")
    ctx = ScoreContext(workload=target_workload(pods), rng=np.random.default_rng(0))
    gpu = pol if (gpu_policy or pol.gpu_default) == pol.name else get_policy(gpu_policy or pol.gpu_default)
    idx, arrive, leave = arrival_times(pods, load)
    timed = sorted(zip(arrive.tolist(), idx.tolist(), strict=True))
    ends = dict(zip(idx.tolist(), leave.tolist(), strict=True))
    skipped = len(pods) - len(timed)
    leaving: list[tuple[int, int, int, tuple[int, ...]]] = []  # (time, pod, node, gpus)
    failed: Counter[str] = Counter()
    failed_milli = 0
    allocated = 0
    area = 0.0
    last_t = timed[0][0] if timed else 0
    first_t = last_t
    peak = 0.0
    free_when_dropping: list[float] = []

    def advance(t: int) -> None:
        nonlocal area, last_t
        area += allocated * max(0, t - last_t)
        last_t = max(last_t, t)

    for k, (t, i) in enumerate(timed):
        while leaving and leaving[0][0] <= t:
            lt, j, node, gpus = heapq.heappop(leaving)
            advance(lt)
            cluster.give_back(node, gpus, pods[j].demand)
            allocated -= pods[j].demand.gpu_milli_total
        advance(t)
        d = pods[i].demand
        where = place(cluster, d, pol, gpu, ctx)
        if where is None:
            failed[pods[i].kind] += 1
            failed_milli += d.gpu_milli_total
            if d.count:
                free_when_dropping.append(100.0 * (capacity - allocated) / capacity)
        else:
            cluster.take(where.node, where.gpus, d)
            allocated += d.gpu_milli_total
            peak = max(peak, 100.0 * allocated / capacity)
            end = ends[i]
            if end > t:
                heapq.heappush(leaving, (end, i, where.node, where.gpus))
        if progress is not None and (k % 256 == 0 or k == len(timed) - 1):
            progress(k + 1, len(timed))
    span = max(1, last_t - first_t)
    return TimelineResult(
        pol.name,
        len(timed),
        skipped,
        dict(failed),
        100.0 * failed_milli / capacity,
        100.0 * area / span / capacity,
        peak,
        float(np.mean(free_when_dropping)) if free_when_dropping else 0.0,
        time.perf_counter() - start,
        load,
        100.0 * peak_demand(pods, load) / capacity,
    )
