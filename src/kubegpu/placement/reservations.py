"""Reservations for wide pods: which GPUs wait for a pod that needs many whole GPUs, and what may use them meanwhile.

Packing small pods well keeps almost no node empty under churn, so a pod that
needs 4 or 8 whole GPUs on one node can wait forever: every GPU that frees up is
taken again by the next small pod. Once such a pod has waited long enough, this
module chooses a node for it (the one that will fit it soonest, at the least
cost by what runs there now) and holds GPUs there: nothing new goes on them, so
the node drains towards the pod, while everything else keeps flowing on the
other GPUs and nodes.

Backfill rule (:meth:`ReservationPlan.allowed`): another pod may use a reserved
node's GPUs beyond the ones held (they are not needed by the wide pod), and a
held GPU only when it declares when it ends (``activeDeadlineSeconds``, which
Kubernetes enforces, so it cannot overrun) and that end is no later than the
time the wide pod could start there, which is only known when every pod still
on the held GPUs declares its end too. Anything else could push the wide pod's
start later, so it is refused.

Everything here is a pure function of what the caller passes (the cluster's
free capacity, the pods running and waiting, the time): no I/O, no clock, no
state kept between calls. The plan is derived state, recomputed from the API
after a restart; a reservation disappears with its pod (deleted or placed) or
its node (no longer in the cluster). Passing the previous plan keeps each
reservation on its node while that node can still take the pod, so the GPUs
already drained there are not wasted by a switch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kubegpu.placement.cluster import MILLI, ClusterState, Demand

INF = float("inf")


@dataclass(frozen=True, slots=True)
class ReservationConfig:
    """When a waiting pod gets a reservation, and how much of the cluster reservations may hold.

    ``min_gpus``: a pod asking at least this many whole GPUs is wide. ``wait_seconds``: it gets a
    reservation after waiting this long. ``max_share``: reservations hold at most this fraction of the
    cluster's usable GPUs (the oldest wide pod is always served, so one wider than the budget is not
    starved for ever). ``enabled=False`` makes no reservation at all.
    """

    min_gpus: int = 4
    wait_seconds: float = 60.0
    max_share: float = 0.25
    enabled: bool = True

    def __post_init__(self) -> None:
        if self.min_gpus < 1:
            raise ValueError(f"min_gpus must be at least 1, not {self.min_gpus}")
        if not self.wait_seconds >= 0:
            raise ValueError(f"wait_seconds must be 0 or more, not {self.wait_seconds}")
        if not 0.0 <= self.max_share <= 1.0:
            raise ValueError(f"max_share must be from 0 to 1, not {self.max_share}")

    def is_wide(self, demand: Demand) -> bool:
        """A pod this policy may reserve for: whole GPUs, at least ``min_gpus`` of them."""
        return demand.exclusive and demand.count >= self.min_gpus


@dataclass(frozen=True, slots=True)
class WaitingPod:
    """A pod not placed yet: ``key`` (namespace/name), its demand, when it was created (s), its priority."""

    key: str
    demand: Demand
    created: float
    priority: int = 0


@dataclass(frozen=True, slots=True)
class RunningPod:
    """A placed pod: the node row and GPU slots it holds, and when it ends if it declares it (else None)."""

    key: str
    node: int
    gpus: tuple[int, ...]
    ends: float | None = None


@dataclass(frozen=True, slots=True)
class Reservation:
    """GPUs held on one node for one wide pod."""

    pod: str
    width: int
    priority: int
    node: int
    node_name: str
    gpus: tuple[int, ...]  # slots held (as many as the pod needs)
    free: int  # of those, free now
    holders: tuple[str, ...]  # pods still on the held GPUs, by key
    start: float | None  # when the pod can start there (every holder declares its end); None when unknown
    waited: float  # seconds since the pod was created
    made_at: float  # the time the plan was made

    @property
    def reason(self) -> str:
        """The wide pod's event: where it will run and what it waits for."""
        text = f"waiting for {self.width} GPUs on {self.node_name}: {self.free} free"
        if self.free < self.width:
            by = ", ".join(self.holders) or "pods kubegpu did not place"
            text += f", {self.width - self.free} held by {by}"
            if self.start is not None:
                text += f" (declared to end within {max(0.0, self.start - self.made_at):.0f} s)"
        return text


@dataclass(frozen=True, slots=True)
class ReservationPlan:
    """The reservations in force, and the (N, G) views placement reads."""

    items: tuple[Reservation, ...]
    held: np.ndarray  # (N, G) bool: GPU held for a wide pod
    owner: np.ndarray  # (N, G) int: index into items of the holder (-1 = none)
    unreserved: tuple[str, ...]  # wide pods past the threshold without a reservation (budget, or no node)
    now: float = 0.0

    @classmethod
    def empty(cls, cluster: ClusterState, now: float = 0.0) -> ReservationPlan:
        shape = (cluster.n_nodes, cluster.n_slots)
        return cls((), np.zeros(shape, bool), np.full(shape, -1, np.int64), (), now)

    def for_pod(self, key: str) -> Reservation | None:
        return next((r for r in self.items if r.pod == key), None)

    def allowed(self, pod: str | None = None, ends: float | None = None) -> np.ndarray | None:
        """(N, G) bool: the GPUs ``pod`` may be placed on without delaying a reservation (None: every GPU).

        A wide pod may use its own held GPUs; a pod that declares its end (``ends``) may use a held GPU
        when it ends no later than that reservation's start (see the module docstring).
        """
        if not self.items:
            return None
        ok = ~self.held
        for i, r in enumerate(self.items):
            mine = r.pod == pod
            backfill = ends is not None and r.start is not None and ends <= r.start
            if mine or backfill:
                ok |= self.owner == i
        return ok

    def may_place(self, node: int, gpus: Sequence[int], pod: str | None = None, ends: float | None = None) -> bool:
        """Whether ``pod`` on these GPU slots of ``node`` delays no reservation (the check for a chosen placement)."""
        ok = self.allowed(pod, ends)
        return ok is None or bool(all(ok[node, g] for g in gpus))

    def held_free(self, cluster: ClusterState) -> int:
        """Held GPUs that are free now: capacity idle while the node drains."""
        whole = (cluster.core_free >= MILLI) & (cluster.gmem_free >= cluster.gmem_cap) & cluster.gpu_ok
        return int((self.held & whole).sum())

    def summary(self) -> dict[str, object]:
        """For the status command, the debug API and metrics: reserved GPUs and who waits where."""
        by_width: dict[str, int] = defaultdict(int)
        for r in self.items:
            by_width[str(r.width)] += len(r.gpus)
        return {
            "reserved_gpus": int(self.held.sum()),
            "reserved_gpus_by_width": dict(sorted(by_width.items(), key=lambda kv: int(kv[0]))),
            "reservations": [
                {"pod": r.pod, "node": r.node_name, "gpus": list(r.gpus), "width": r.width, "free": r.free,
                 "held_by": list(r.holders), "start": r.start, "waited_s": round(r.waited, 3), "reason": r.reason}
                for r in self.items
            ],
            "without_reservation": list(self.unreserved),
        }


def width_of(demand: Demand) -> str:
    """The width a pod is counted under (wait metrics, reports): cpu, share, or its number of whole GPUs."""
    if demand.count == 0:
        return "cpu"
    return str(demand.count) if demand.exclusive else "share"


def waits_by_width(waiting: Sequence[WaitingPod], now: float) -> dict[str, dict[str, float]]:
    """Per width, how many pods wait and the longest wait so far (seconds): the wait metrics' values."""
    out: dict[str, dict[str, float]] = {}
    for p in waiting:
        w = out.setdefault(width_of(p.demand), {"pods": 0, "max_wait_s": 0.0})
        w["pods"] += 1
        w["max_wait_s"] = max(w["max_wait_s"], now - p.created)
    return out


def _gpu_release(cluster: ClusterState, running: Sequence[RunningPod], now: float) -> np.ndarray:
    """(N, G) time each GPU is whole-free: now when free now, inf when a holder's end is unknown."""
    release = np.full((cluster.n_nodes, cluster.n_slots), now, np.float64)
    cells = [(p.node, g, INF if p.ends is None else p.ends) for p in running for g in p.gpus
             if 0 <= p.node < cluster.n_nodes and 0 <= g < cluster.n_slots]
    if cells:
        node, slot, end = (np.asarray(c) for c in zip(*cells, strict=True))
        np.maximum.at(release, (node.astype(np.int64), slot.astype(np.int64)), end.astype(np.float64))
    # A GPU not whole-free that no known pod holds (a pod outside kubegpu's view) ends at an unknown time.
    busy = (cluster.core_free < MILLI) | (cluster.gmem_free < cluster.gmem_cap)
    return np.where(busy & (release <= now), INF, release)


def _best_node(
    release: np.ndarray, used: np.ndarray, usable: np.ndarray, count: int, rows: np.ndarray, keep: int | None
) -> tuple[int, np.ndarray] | None:
    """The node of ``rows`` to hold ``count`` GPUs on, and which: on each node the start is when its ``count``
    usable slots that free up soonest are all free; between nodes the soonest start, then the fewest busy GPUs
    held, then the least in use, then the lowest row; ``keep`` (a reservation's previous node) first when it is
    among them. The slots held are those of :func:`_narrowest`."""
    rows = rows[usable[rows].sum(axis=1) >= count]
    if not len(rows):
        return None
    rel, use, ok = release[rows], used[rows], usable[rows]
    slot = np.broadcast_to(np.arange(rel.shape[1]), rel.shape)
    soonest = np.lexsort((slot, use, rel, ~ok), axis=-1)[:, :count]  # usable slots first
    start = np.take_along_axis(rel, soonest, axis=-1).max(axis=1)
    chosen = _narrowest(rel, use, ok, start, soonest)
    chosen_use = np.take_along_axis(use, chosen, axis=-1)
    busy, in_use = (chosen_use > 0).sum(axis=1), chosen_use.sum(axis=1)
    # The node it had keeps it: the GPUs drained there so far are not thrown away by a switch.
    first = rows != keep if keep is not None else np.ones(len(rows), bool)
    best = int(np.lexsort((rows, in_use, busy, start, first))[0])
    return int(rows[best]), np.sort(chosen[best])


def _narrowest(rel: np.ndarray, use: np.ndarray, ok: np.ndarray, start: np.ndarray, soonest: np.ndarray) -> np.ndarray:
    """Per row, the slots to hold for a pod that can start at ``start``: where the start is known, the usable
    slots free by then that free up latest, so a GPU free now is held only when the pod cannot start as soon
    without it (the others keep working meanwhile; the start is the same); where it is not known (a holder
    declares no end), ``soonest`` (free GPUs first: nothing says which busy one frees first)."""
    known = np.isfinite(start)
    by_start = ok & (rel <= start[:, None]) & known[:, None]
    slot = np.broadcast_to(np.arange(rel.shape[1]), rel.shape)
    latest = np.lexsort((slot, use, -rel, ~by_start), axis=-1)[:, : soonest.shape[1]]
    return np.where(known[:, None], latest, soonest)


def choose_reservations(
    cluster: ClusterState,
    waiting: Sequence[WaitingPod],
    running: Sequence[RunningPod],
    now: float,
    config: ReservationConfig,
    previous: ReservationPlan | None = None,
) -> ReservationPlan:
    """The reservations for the wide pods of ``waiting`` that waited ``config.wait_seconds`` or more.

    Order: higher priority first, then the oldest, then by key. Each gets the node that can take it soonest
    (by the declared ends of what runs on the GPUs it would hold; unknown ends count as never), then the one
    with the fewest busy GPUs and the least compute in use there, then the lowest row; the node must be able
    to take the pod once drained (GPU model, GPU count, CPU and memory capacity). GPUs held for an earlier pod
    are not held twice. Reservations stop at the first pod the GPU budget (``max_share``) cannot hold, so a
    younger pod never overtakes an older one. ``previous`` keeps each pod on the node it had when that node
    can still take it.
    """
    plan = ReservationPlan.empty(cluster, now)
    if not config.enabled or config.max_share <= 0:
        return plan
    wide = sorted(
        (p for p in waiting if config.is_wide(p.demand) and now - p.created >= config.wait_seconds),
        key=lambda p: (-p.priority, p.created, p.key),
    )
    if not wide:
        return plan
    release = _gpu_release(cluster, running, now)
    used = np.where(cluster.gpu_ok, MILLI - cluster.core_free, 0).astype(np.int64)
    budget = int(config.max_share * int(cluster.gpu_ok.sum()))
    sticky: Mapping[str, int] = {} if previous is None else {r.pod: r.node for r in previous.items}
    held = plan.held.copy()
    owner = plan.owner.copy()
    items: list[Reservation] = []
    unreserved: list[str] = []
    spent = 0
    for pod in wide:
        d = pod.demand
        if items and spent + d.count > budget:
            unreserved.extend(p.key for p in wide[wide.index(pod):])
            break
        fits_ever = (
            cluster.model_mask(d.models)
            & (cluster.cpu_cap >= d.cpu_milli)
            & (cluster.mem_cap >= d.memory_bytes)
        )
        best = _best_node(release, used, cluster.gpu_ok & ~held, d.count, np.flatnonzero(fits_ever),
                          sticky.get(pod.key))
        if best is None:
            unreserved.append(pod.key)
            continue
        node, chosen = best
        gslots = tuple(int(g) for g in chosen)
        held[node, list(gslots)] = True
        owner[node, list(gslots)] = len(items)
        start = float(release[node, list(gslots)].max())
        names = sorted({p.key for p in running if p.node == node and set(p.gpus) & set(gslots)})
        free = int(sum(1 for g in gslots if release[node, g] <= now))
        items.append(Reservation(
            pod.key, d.count, pod.priority, node, cluster.names[node], gslots, free, tuple(names),
            None if start == INF else start, now - pod.created, now,
        ))
        spent += d.count
    return ReservationPlan(tuple(items), held, owner, tuple(unreserved), now)


__all__ = [
    "Reservation",
    "ReservationConfig",
    "ReservationPlan",
    "RunningPod",
    "WaitingPod",
    "choose_reservations",
    "waits_by_width",
    "width_of",
]
