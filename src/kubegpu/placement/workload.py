"""The target workload: which request shapes a cluster expects, and how often.

Fragmentation only means something against a workload: free GPU compute is a
fragment when the requests that usually arrive cannot use it. Following the
FGD paper, the target workload is the set of most frequent request shapes
(CPU, per-GPU compute, GPU count, GPU model constraint) that together cover a
share of all pods (95 % by default), with their normalised frequencies.
:class:`LearnedWorkload` learns it online from the live pods, the same
way in the extender and in the simulator.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import numpy as np

from kubegpu.placement.cluster import Demand


@dataclass(frozen=True, slots=True)
class WorkloadShape:
    """One request shape of the target workload (memory kept for policies that use it)."""

    cpu_milli: int
    milli: int  # per GPU
    count: int
    models: frozenset[str] | None
    memory_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Workload:
    """Request shapes and their frequencies (summing to 1), as arrays for vectorised use.

    ``every`` and ``every_freq`` keep all shapes seen, rare ones included, with
    their share of all demands: the rare large shapes that the coverage cut
    drops are the ones the ``kubegpu`` policy keeps hosts free for.
    """

    shapes: tuple[WorkloadShape, ...]
    freq: np.ndarray  # (T,) float64
    every: tuple[WorkloadShape, ...] = ()
    every_freq: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # (T,) int64: the pods behind each of ``shapes`` (``freq`` is ``weight / weight.sum()``). Fragment sums
    # weighted by these integers are exact, so a node's fragment never depends on the nodes it is scored with.
    weight: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    @classmethod
    def from_demands(cls, demands: Iterable[Demand], coverage: float = 0.95, memory_quantile: float = 50.0) -> Workload:
        """The most frequent shapes covering ``coverage`` of the demands, renormalised.

        A shape is (CPU, per-GPU compute, GPU count, models), as in the FGD
        paper; its ``memory_bytes`` is the ``memory_quantile`` percentile of the
        memory its pods ask for (used only by memory-aware policies). Ties in
        frequency are ordered by the shape, larger first, so the result never
        depends on input order.
        """
        per: dict[WorkloadShape, list[tuple[int, int]]] = {}
        for d in demands:
            shape = WorkloadShape(d.cpu_milli, d.milli if d.count else 0, d.count, d.models)
            per.setdefault(shape, []).append((d.memory_bytes, 1))
        return cls.from_shape_counts(per, coverage, memory_quantile)

    @classmethod
    def from_shape_counts(
        cls, per: dict[WorkloadShape, list[tuple[int, int]]], coverage: float = 0.95, memory_quantile: float = 50.0
    ) -> Workload:
        """As :meth:`from_demands`, from each shape's (memory, pods) pairs."""
        counts = {shape: sum(n for _, n in pairs) for shape, pairs in per.items()}
        total = sum(counts.values())
        if total == 0:
            return cls((), np.zeros(0))

        def memory(shape: WorkloadShape) -> int:
            pairs = per[shape]
            values = np.repeat(np.array([m for m, _ in pairs], np.float64), [n for _, n in pairs])
            return int(np.percentile(values, memory_quantile))

        # Most frequent first; equal counts by the larger shape first (the FGD simulator's order).
        ordered = sorted(counts.items(), key=lambda kv: (kv[1], _shape_key(kv[0])), reverse=True)
        every = [(replace(shape, memory_bytes=memory(shape)), n) for shape, n in ordered]
        chosen: list[tuple[WorkloadShape, int]] = []
        covered = 0
        for shape, n in every:
            if covered >= coverage * total:
                break
            chosen.append((shape, n))
            covered += n
        weight = np.array([n for _, n in chosen], np.int64)
        freq = weight.astype(np.float64)
        every_freq = np.array([n for _, n in every], np.float64) / total
        return cls(tuple(s for s, _ in chosen), freq / freq.sum(), tuple(s for s, _ in every), every_freq, weight)

    def __len__(self) -> int:
        return len(self.shapes)


def _shape_key(s: WorkloadShape) -> tuple[int, int, int, str, int]:
    return (s.cpu_milli, s.milli, s.count, "|".join(sorted(s.models)) if s.models else "", s.memory_bytes)


def workload_from_counts(counts: Counter[Demand], coverage: float = 0.95) -> Workload:
    """``Workload.from_demands`` over a multiset of demands, in time linear in the distinct demands (the
    result is the same; it never depends on the demands' order)."""
    per: dict[WorkloadShape, list[tuple[int, int]]] = {}
    for d, n in counts.items():
        if n > 0:
            shape = WorkloadShape(d.cpu_milli, d.milli if d.count else 0, d.count, d.models)
            per.setdefault(shape, []).append((d.memory_bytes, n))
    return Workload.from_shape_counts(per, coverage)


# A request mix for fragmentation-aware scoring before enough pods have been seen (no CPU: unknown yet).
PRIOR_SHAPES: tuple[Demand, ...] = (
    *(Demand.whole(1),) * 4, *(Demand.share(500),) * 3, *(Demand.share(250),) * 2, Demand.whole(2),
    Demand.whole(4), Demand.whole(8),
)


class LearnedWorkload:
    """The target workload learned online from the pods a scheduler holds on GPU nodes, identically everywhere.

    The window is the set of live pods (GPU pods, and CPU-only pods bound to
    GPU nodes; :meth:`shape_of`): what the cluster hosts now is the
    demand it must keep room for, departed pods no longer claim capacity, and
    it is exactly what an extender can rebuild after a restart (the
    annotations of live pods; departed pods are gone from the API). Below
    ``min_pods`` live pods the mix is padded with :data:`PRIOR_SHAPES`.

    The workload is rebuilt when the pods added or removed since the last
    rebuild reach ``refresh_fraction`` of the live pods (at least
    ``refresh_min``): frequencies then move by at most about that fraction
    between rebuilds, while a cluster filling from empty rebuilds only
    O(log n) times (each rebuild resets the policies' kept scores). The rebuild
    happens at the event that crosses the threshold, so the result is a
    function of the event sequence alone, whoever calls :attr:`current` and
    when: the simulator and the extender, fed the same pods in the same
    order, score with the same workload. :meth:`rebuild` forces one (an
    extender after its first full list).
    """

    def __init__(self, coverage: float = 0.95, refresh_fraction: float = 0.05, refresh_min: int = 8,
                 min_pods: int = 10) -> None:
        self.coverage = coverage
        self.refresh_fraction = refresh_fraction
        self.refresh_min = refresh_min
        self.min_pods = min_pods
        self._counts: Counter[Demand] = Counter()
        self._live = 0
        self._events = 0
        self._threshold = refresh_min
        self.generation = 0
        self.built_from = 0  # live pods at the last rebuild
        self.current = Workload((), np.zeros(0))
        self.rebuild()

    @staticmethod
    def shape_of(d: Demand) -> Demand | None:
        """What is learned of a demand: GPU pods, and CPU-only pods that ask for CPU (their CPU competes with
        the GPU pods' for the nodes' cores, as in the pod list's workload); None for a pod asking neither."""
        return d if (d.count > 0 and d.milli > 0) or (d.count == 0 and d.cpu_milli > 0) else None

    def add(self, d: Demand | None) -> None:
        if d is None or self.shape_of(d) is None:
            return
        self._counts[d] += 1
        self._live += 1
        self._event()

    def remove(self, d: Demand | None) -> None:
        if d is None or self._counts.get(d, 0) <= 0:
            return
        self._counts[d] -= 1
        if not self._counts[d]:
            del self._counts[d]
        self._live -= 1
        self._event()

    def _event(self) -> None:
        self._events += 1
        if self._events >= self._threshold:
            self.rebuild()

    def rebuild(self) -> Workload:
        counts = Counter(self._counts)
        if self._live < self.min_pods:
            counts.update(PRIOR_SHAPES)
        self.current = workload_from_counts(counts, self.coverage)
        self.generation += 1
        self.built_from = self._live
        self._events = 0
        self._threshold = max(self.refresh_min, int(np.ceil(self.refresh_fraction * self._live)))
        return self.current

    @property
    def live(self) -> int:
        return self._live

    def summary(self) -> dict[str, object]:
        """What the debug API shows: size, generation and the shapes with their frequencies."""
        wl = self.current
        return {
            "live_pods": self._live,
            "generation": self.generation,
            "built_from_pods": self.built_from,
            "rebuild_after_events": self._threshold,
            "events_since_rebuild": self._events,
            "prior_padded": self.built_from < self.min_pods,
            "coverage": self.coverage,
            "shapes": [
                {"cpu_milli": s.cpu_milli, "gpu_milli": s.milli, "gpus": s.count,
                 "models": sorted(s.models) if s.models else None, "memory_bytes": s.memory_bytes,
                 "frequency": round(float(f), 6)}
                for s, f in zip(wl.shapes, wl.freq, strict=True)
            ],
        }
