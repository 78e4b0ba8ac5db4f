"""A study: several policies over several seeds, summarised the way the FGD paper reports them.

Per policy: mean and standard deviation over seeds of the unallocated GPU %
at each arrived-GPU checkpoint, the fragment of the free GPU at arrived 100 %,
failed pods by kind (mean per run), and the wall time per run. The JSON form is
``{"trace": ..., "policies": {NAME: {"unallocated_pct_at": {"80": x, ...},
"unallocated_pct_sd_at": {...}, "seconds": s, ...}}}``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kubegpu.sim.replay import CHECKPOINTS, ReplayResult, replay, target_workload
from kubegpu.sim.trace import TraceNodes, TracePod

# The openb pod lists the FGD paper evaluates on (ATC '23, section 6): the default list and the
# lists that vary CPU per GPU, shared-GPU pods, model-constrained pods and multi-GPU pods.
PAPER_LISTS: tuple[str, ...] = (
    "default",
    "cpu050",
    "cpu100",
    "cpu200",
    "cpu250",
    "gpushare40",
    "gpushare60",
    "gpushare80",
    "gpushare100",
    "gpuspec10",
    "gpuspec20",
    "gpuspec25",
    "gpuspec33",
    "multigpu20",
    "multigpu30",
    "multigpu40",
    "multigpu50",
)

# The FGD paper's unallocated GPU % at arrived = 100 % on the default trace (ATC '23, fig. 9a).
PAPER_AT_100: dict[str, float] = {
    "random": 13.70,
    "dotprod": 9.38,
    "clustering": 8.35,
    "packing": 8.22,
    "bestfit": 7.14,
    "fgd": 4.77,
}


@dataclass(slots=True)
class PolicySummary:
    """One policy's results over all seeds."""

    policy: str
    gpu_policy: str
    runs: list[ReplayResult] = field(default_factory=list)

    def _values(self, pct: int) -> list[float]:
        return [v for r in self.runs if (v := r.unallocated_at(pct)) is not None]

    def mean_at(self, pct: int) -> float | None:
        v = self._values(pct)
        return float(np.mean(v)) if v else None

    def sd_at(self, pct: int) -> float | None:
        v = self._values(pct)
        return float(np.std(v)) if v else None

    @property
    def seconds(self) -> float:
        return float(np.mean([r.seconds for r in self.runs])) if self.runs else 0.0

    @property
    def fragment_pct_at_100(self) -> float | None:
        v = [r.fragment_pct[100] for r in self.runs if 100 in r.fragment_pct]
        return float(np.mean(v)) if v else None

    @property
    def failed(self) -> dict[str, float]:
        kinds = sorted({k for r in self.runs for k in r.failed})
        n = max(1, len(self.runs))
        return {k: sum(r.failed.get(k, 0) for r in self.runs) / n for k in kinds}

    def to_json(self) -> dict[str, Any]:
        def rounded(x: float | None) -> float | None:
            return None if x is None else round(x, 3)

        return {
            "gpu_policy": self.gpu_policy,
            "unallocated_pct_at": {str(p): rounded(self.mean_at(p)) for p in CHECKPOINTS},
            "unallocated_pct_sd_at": {str(p): rounded(self.sd_at(p)) for p in CHECKPOINTS},
            "fragment_pct_at_100": rounded(self.fragment_pct_at_100),
            "failed_pods": {k: round(v, 1) for k, v in self.failed.items()},
            "seconds": round(self.seconds, 2),
            "seeds": [r.seed for r in self.runs],
            "pods": self.runs[0].pods if self.runs else 0,
        }


def run_study(
    nodes: TraceNodes,
    pods: Sequence[TracePod],
    policies: Sequence[str],
    seeds: Sequence[int],
    inflate: float = 1.3,
    gpu_policy: str | None = None,
    progress: Callable[[str, int, int, int], None] | None = None,
    *,
    learned: bool = False,
    ties: str = "random",
) -> dict[str, PolicySummary]:
    """Replay every (policy, seed); ``progress(policy, seed, done, total)`` is called as pods go.

    ``learned`` scores with the workload learned online from the pods placed (as the extender does)
    instead of the pod list's; ``ties="name"`` breaks ties by node name (the extender's order)."""
    workload = None if learned else target_workload(pods)
    out: dict[str, PolicySummary] = {}
    for name in policies:
        summary: PolicySummary | None = None
        for seed in seeds:
            cb = None
            if progress is not None:

                def cb(done: int, total: int, _n: str = name, _s: int = seed) -> None:
                    progress(_n, _s, done, total)

            r = replay(nodes, pods, name, seed, inflate, gpu_policy, workload, cb, learned=learned, ties=ties)
            if summary is None:
                summary = PolicySummary(r.policy, r.gpu_policy)
            summary.runs.append(r)
        if summary is not None:
            out[name] = summary
    return out


def study_json(trace: dict[str, Any], results: dict[str, PolicySummary]) -> dict[str, Any]:
    """The ``--json`` object."""
    return {"trace": trace, "policies": {name: s.to_json() for name, s in results.items()}}
