"""The target workload: which request shapes a cluster expects, and how often.

Fragmentation only means something against a workload: free GPU compute is a
fragment when the requests that usually arrive cannot use it. Following the
FGD paper, the target workload is the set of most frequent request shapes
(CPU, per-GPU compute, GPU count, GPU model constraint) that together cover a
share of all pods (95 % by default), with their normalised frequencies.
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

    @classmethod
    def from_demands(cls, demands: Iterable[Demand], coverage: float = 0.95, memory_quantile: float = 50.0) -> Workload:
        """The most frequent shapes covering ``coverage`` of the demands, renormalised.

        A shape is (CPU, per-GPU compute, GPU count, models), as in the FGD
        paper; its ``memory_bytes`` is the ``memory_quantile`` percentile of the
        memory its pods ask for (used only by memory-aware policies). Ties in
        frequency are ordered by the shape, larger first, so the result never
        depends on input order.
        """
        counts: Counter[WorkloadShape] = Counter()
        memory: dict[WorkloadShape, list[int]] = {}
        total = 0
        for d in demands:
            shape = WorkloadShape(d.cpu_milli, d.milli if d.count else 0, d.count, d.models)
            counts[shape] += 1
            memory.setdefault(shape, []).append(d.memory_bytes)
            total += 1
        if total == 0:
            return cls((), np.zeros(0))
        # Most frequent first; equal counts by the larger shape first (the FGD simulator's order).
        ordered = sorted(counts.items(), key=lambda kv: (kv[1], _shape_key(kv[0])), reverse=True)
        every = [
            (replace(shape, memory_bytes=int(np.percentile(np.asarray(memory[shape], np.float64), memory_quantile))), n)
            for shape, n in ordered
        ]
        chosen: list[tuple[WorkloadShape, int]] = []
        covered = 0
        for shape, n in every:
            if covered >= coverage * total:
                break
            chosen.append((shape, n))
            covered += n
        freq = np.array([n for _, n in chosen], np.float64)
        every_freq = np.array([n for _, n in every], np.float64) / total
        return cls(tuple(s for s, _ in chosen), freq / freq.sum(), tuple(s for s, _ in every), every_freq)

    def __len__(self) -> int:
        return len(self.shapes)


def _shape_key(s: WorkloadShape) -> tuple[int, int, int, str, int]:
    return (s.cpu_milli, s.milli, s.count, "|".join(sorted(s.models)) if s.models else "", s.memory_bytes)
