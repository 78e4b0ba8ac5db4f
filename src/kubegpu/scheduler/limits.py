"""Bounds on what one extender request may cost, decided before the expensive work.

A pod with many GPU containers cannot take the vectorised filter path: each node needs an exact,
container-by-container fit, whose cost grows with containers times nodes. Unbounded, one pod of a
thousand one-percent containers would cost seconds of CPU per ``/filter`` and stall every other pod's
filter behind it, since the extender serves all verbs from one event loop (docs/performance.md). Four
bounds keep any request cheap and the loop answering:

* a cap on GPU containers per pod (:attr:`Limits.max_gpu_containers`), counted on the raw pod before
  it is parsed; the webhook refuses the same pods at admission with the same message
  (:func:`kubegpu.model.limits.too_many_gpu_containers`);
* an aggregate-capacity prefilter: a node whose free compute, free memory or free whole GPUs summed
  over its GPUs cannot hold the sum of the pod's app containers is ruled out by array arithmetic
  before any per-node fit;
* a time budget per filter (:attr:`Limits.filter_budget_s`): nodes not reached in it fail with a
  reason saying so (kube-scheduler retries the pod and rotates the node list);
* the per-node fits run in slices of :attr:`Limits.slice_s` with the event loop given back between
  slices (and held back while cheaper requests are in flight, :class:`LoopShare`), so a 1-GPU pod's
  filter is answered while a large one is in flight. The view
  is only touched from the loop, so no lock is needed; a node whose state changed between slices is
  simply fitted against its new state (bind re-checks everything anyway).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kubegpu.model.limits import DEFAULT_MAX_GPU_CONTAINERS, count_gpu_containers, too_many_gpu_containers
from kubegpu.model.request import PodRequest, RequestKind
from kubegpu.model.share_enforcement import unenforced_reason
from kubegpu.placement import MILLI, Demand, request_demand
from kubegpu.scheduler.plan import PodPlan
from kubegpu.scheduler.reasons import ReasonMap
from kubegpu.scheduler.state import ClusterView, FilterOutcome


@dataclass(frozen=True, slots=True)
class Limits:
    """What one request may cost (flags of ``kubegpu scheduler`` and ``kubegpu webhook``)."""

    max_gpu_containers: int = DEFAULT_MAX_GPU_CONTAINERS
    filter_budget_s: float = 0.5  # per-node fits of one filter; kube-scheduler's httpTimeout is 10 s
    slice_s: float = 0.002  # the event loop is given back after this much fitting (a request needs several turns)


class LoopShare:
    """Who is being answered right now: an expensive filter steps aside at the end of each slice while
    cheaper requests are in flight (up to ``max_wait_s`` per slice), so a 1-GPU pod's filter does not pay
    one slice per event-loop turn it needs."""

    def __init__(self, max_wait_s: float = 0.05) -> None:
        self.max_wait_s = max_wait_s
        self.inflight = 0
        self.expensive = 0

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1

    @contextlib.contextmanager
    def expensive_work(self) -> Iterator[None]:
        self.expensive += 1
        try:
            yield
        finally:
            self.expensive -= 1

    async def pause(self) -> None:
        await asyncio.sleep(0)
        if self.inflight <= self.expensive:
            return
        loop = asyncio.get_running_loop()
        until = loop.time() + self.max_wait_s
        while self.inflight > self.expensive and loop.time() < until:
            await asyncio.sleep(0.0005)


# ---- aggregate prefilter ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Aggregate:
    """Lower bounds on what the pod's app containers take from one node, summed over its GPUs."""

    milli: int  # compute, thousandths of a GPU
    memory_bytes: int  # GPU memory asked in bytes
    memory_ratio: int  # GPU memory asked in percent of a GPU (summed over GPUs)
    whole: int  # GPUs taken whole
    containers: tuple[str, ...] = ()  # the app containers counted

    @property
    def who(self) -> str:
        shown = ", ".join(repr(c) for c in self.containers[:4])
        more = f" and {len(self.containers) - 4} more" if len(self.containers) > 4 else ""
        return f"containers {shown}{more}" if len(self.containers) > 1 else f"container {shown}"

    @property
    def empty(self) -> bool:
        return not (self.milli or self.memory_bytes or self.memory_ratio or self.whole)


def aggregate(request: PodRequest) -> Aggregate:
    """The sum over app containers (init containers run before them and are checked one by one).
    MIG and replica containers use their own resources and add nothing here."""
    milli = mem = ratio = whole = 0
    names: list[str] = []
    for c in request.gpu_containers:
        req = c.request
        if c.init or req is None or req.kind not in (RequestKind.WHOLE, RequestKind.SHARE):
            continue
        names.append(c.name)
        if req.exclusive:
            whole += req.count
            milli += MILLI * req.count
            ratio += 100 * req.count
            continue
        milli += req.core * (MILLI // 100) * req.count
        if req.memory_bytes is not None:
            mem += req.memory_bytes * req.count
        else:
            ratio += (req.memory_ratio or 0) * req.count
    return Aggregate(milli, mem, ratio, whole, tuple(names))


def aggregate_short(view: ClusterView, rows: np.ndarray, need: Aggregate) -> list[str]:
    """Per row, why the node cannot hold ``need`` in total ('' when it might)."""
    cluster = view.mirror.cluster
    ok = cluster.gpu_ok[rows]
    core = np.where(ok, cluster.core_free[rows], 0).sum(axis=1)
    gmem_free = np.where(ok, cluster.gmem_free[rows], 0).sum(axis=1)
    cap = np.where(ok, cluster.gmem_cap[rows], np.iinfo(np.int64).max)
    smallest = np.where(ok.any(axis=1), cap.min(axis=1), 0)
    # A ratio takes at least ratio % of the node's smallest GPU on each GPU it lands on.
    mem_need = need.memory_bytes + (need.memory_ratio * smallest) // 100
    whole_free = (ok & (cluster.core_free[rows] >= MILLI) & (cluster.gmem_free[rows] >= cluster.gmem_cap[rows])
                  ).sum(axis=1)
    out = [""] * len(rows)
    for i in np.flatnonzero((core < need.milli) | (gmem_free < mem_need) | (whole_free < need.whole)):
        if whole_free[i] < need.whole:
            out[i] = f"{need.who}: {need.whole} whole GPUs requested in all, {int(whole_free[i])} free"
        elif core[i] < need.milli:
            out[i] = (f"{need.who} need {need.milli / 10:g} % of a GPU's compute in all, "
                      f"the node has {int(core[i]) / 10:g} % free")
        else:
            out[i] = (f"{need.who} need {int(mem_need[i]) / 2**30:.1f} GiB of GPU memory in all, "
                      f"the node has {int(gmem_free[i]) / 2**30:.1f} GiB free")
    return out


# ---- the bounded filter -------------------------------------------------------------------------
def fitted_node_by_node(plan: PodPlan) -> bool:
    """Whether filter fits the pod node by node (several GPU containers, MIG, replicas, NVLink) rather than
    on the arrays alone."""
    return not plan.refusal and plan.request.wants_gpu and not (plan.vectorised and not plan.nvlink)


async def bounded_filter(view: ClusterView, plan: PodPlan, names: Sequence[str], limits: Limits,
                         clock: Any = time.perf_counter, share: LoopShare | None = None) -> FilterOutcome:
    """The filter with every bound above: the array filter (:meth:`ClusterView.filter`) for a refused pod,
    a pod without GPUs and a vectorised one; every other GPU pod is fitted node by node here."""
    if not fitted_node_by_node(plan):
        return _say_why_no_shares(view, plan, view.filter(plan, names))
    share = share or LoopShare()
    with share.expensive_work():
        return _say_why_no_shares(view, plan, await _exact(view, plan, names, limits, clock, share))


# ---- nodes that cannot enforce shares ---------------------------------------------------------------
_unenforced_kept: dict[str, tuple[object, str]] = {}  # node -> (the inventory it was read from, the reason or '')


def cannot_enforce_shares(view: ClusterView) -> dict[str, str]:
    """GPU nodes where no GPU can take a share because the node cannot enforce shares as configured (each GPU
    that would take one reports ``unenforced``, e.g. MPS selected and its control binary missing), with why.
    Such a node advertises no share capacity (node/publish/capacity.py), so kube-scheduler rules it out with a
    bare ``Insufficient`` before the extender sees it; the reason is read once per Device object."""
    out: dict[str, str] = {}
    for name, rec in view.nodes.items():
        inv = rec.inventory
        if inv is None:
            _unenforced_kept.pop(name, None)
            continue
        kept = _unenforced_kept.get(name)
        if kept is None or kept[0] is not inv:
            kept = (inv, unenforced_reason(inv))
            _unenforced_kept[name] = kept
        if kept[1]:
            out[name] = kept[1]
    return out


def _say_why_no_shares(view: ClusterView, plan: PodPlan, outcome: FilterOutcome) -> FilterOutcome:
    """A pod asking a share that no node takes is told, for every GPU node that cannot enforce shares, why
    (kube-scheduler adds an extender's reason for a node it ruled out itself to that node's own, so the pod's
    FailedScheduling names it). A pod some node takes is placed and shown nothing: the scan is skipped."""
    if len(outcome.passed) or plan.refusal or not any(
            c.request is not None and c.request.kind is RequestKind.SHARE for c in plan.request.gpu_containers):
        return outcome
    why = cannot_enforce_shares(view)
    if not why:
        return outcome
    failed = outcome.failed
    for node, reason in why.items():
        failed[node] = reason  # type: ignore[index]  # a ReasonMap or a dict: both take a node's reason
    return outcome


async def _exact(view: ClusterView, plan: PodPlan, names: Sequence[str], limits: Limits, clock: Any,
                 share: LoopShare) -> FilterOutcome:
    start = clock()
    request = plan.request
    passed: list[str] = []
    failed = ReasonMap()
    reasons: Counter[str] = Counter()
    cluster = view.mirror.cluster
    all_rows = view.node_rows(names)
    names_known, rows, ok = view.known_and_allowed(names, all_rows, request, failed, reasons)
    # Each distinct container demand alone (a pod of identical containers costs one pass).
    seen: dict[Demand, str] = {}
    for c in request.gpu_containers:
        req = c.request
        if req is None or req.kind not in (RequestKind.WHOLE, RequestKind.SHARE):
            continue
        d = request_demand(req, None)
        if d in seen or not ok.any():
            continue
        seen[d] = c.name
        d_cand = view.mirror.candidates(d)
        short = ok & (d_cand[rows].sum(axis=1) < d.count)
        bad = np.flatnonzero(short)
        if len(bad):
            for j, text in zip(bad.tolist(), view.mirror.reasons.insufficient(cluster, rows[bad], d, d_cand),
                               strict=True):
                failed[names_known[j]] = f"container {c.name!r}: {text}"
            reasons["insufficient-gpu"] += len(bad)
            ok &= ~short
    need = aggregate(request)
    if not need.empty and ok.any():
        cand = np.flatnonzero(ok)
        for j, text in zip(cand.tolist(), aggregate_short(view, rows[cand], need), strict=True):
            if text:
                failed[names_known[j]] = text
                reasons["insufficient-gpu"] += 1
                ok[j] = False
    # Exact fits node by node, in the order given, in slices, until enough nodes pass or time is up.
    candidates = [names_known[i] for i in np.flatnonzero(ok).tolist()]
    slice_end = clock() + limits.slice_s
    for done, n in enumerate(candidates):
        now = clock()
        over = now - start > limits.filter_budget_s
        if len(passed) >= view.exact_fit_enough or over:
            why = (f"not examined: the filter's time budget of {limits.filter_budget_s * 1000:.0f} ms ran out "
                   f"after {done} nodes" if over and len(passed) < view.exact_fit_enough else
                   f"not examined: {len(passed)} feasible nodes were found first "
                   "(pods with several GPU containers are fitted node by node)")
            for m in candidates[done:]:
                failed[m] = why
            reasons["time-budget" if over else "not-examined"] += len(candidates) - done
            break
        if now >= slice_end:
            await share.pause()  # let other requests and watch events in
            slice_end = clock() + limits.slice_s
        miss = view.exact_fit(n, plan)
        if miss is None:
            passed.append(n)
        else:
            failed[n] = miss[1]
            reasons[miss[0]] += 1
    return FilterOutcome(passed, failed, {}, reasons)


__all__ = ["DEFAULT_MAX_GPU_CONTAINERS", "Aggregate", "Limits", "LoopShare", "aggregate", "aggregate_short",
           "bounded_filter", "cannot_enforce_shares", "count_gpu_containers", "fitted_node_by_node",
           "too_many_gpu_containers"]
