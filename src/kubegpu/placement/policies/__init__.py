"""Scoring policies behind one narrow interface, and the registry that names them.

- :mod:`.base`: :class:`Policy`, :class:`ScoreContext` (the target workload, the random source, the
  tie order) and :class:`RowCache` (per-row values kept by row version);
- :mod:`.paper`: the FGD paper's baselines (random, dotprod, clustering, packing, bestfit) and FGD;
- :mod:`.kubegpu`: ``kubegpu`` (the default) and ``spread``;
- :mod:`.dra`: ``dra``, the stock kube-scheduler placing DRA claims (to replay a trace as DRA would).

The node level and the GPU level are chosen separately
(``place(..., node_policy="fgd", gpu_policy="bestfit")``), the way the FGD
paper's simulator pairs a score plugin with a GPU selection method.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from kubegpu.placement.policies.base import (
    MAX_SCORE,
    MAX_SPEC_CPU,
    MAX_SPEC_GPU,
    Policy,
    RowCache,
    ScoreContext,
    bestfit_choice,
)
from kubegpu.placement.policies.dra import DraSchedulerPolicy
from kubegpu.placement.policies.kubegpu import KubegpuPolicy, ReserveTerms, SpreadPolicy
from kubegpu.placement.policies.paper import (
    BestFitPolicy,
    ClusteringPolicy,
    DotProductPolicy,
    FgdPolicy,
    PackingPolicy,
    RandomPolicy,
)

_POLICIES: Final[dict[str, Callable[[], Policy]]] = {
    p.name: p
    for p in (
        RandomPolicy,
        DotProductPolicy,
        ClusteringPolicy,
        PackingPolicy,
        BestFitPolicy,
        FgdPolicy,
        SpreadPolicy,
        KubegpuPolicy,
        DraSchedulerPolicy,  # stock kube-scheduler with DRA claims (docs/dra.md)
    )
}

#: The FGD paper's policies, in the paper's order.
PAPER_POLICIES: Final = ("random", "dotprod", "clustering", "packing", "bestfit", "fgd")
#: Every registered policy name.
POLICY_NAMES: Final = tuple(_POLICIES)
#: kubegpu's default for both levels.
DEFAULT_POLICY: Final = "kubegpu"


def get_policy(name: str | Policy) -> Policy:
    """A new instance of the policy named ``name`` (with empty caches; a :class:`Policy` passes through).
    KeyError lists the known names."""
    if isinstance(name, Policy):
        return name
    try:
        return _POLICIES[name]()
    except KeyError:
        raise KeyError(f"unknown placement policy {name!r}; known: {', '.join(POLICY_NAMES)}") from None


__all__ = [
    "DEFAULT_POLICY",
    "MAX_SCORE",
    "MAX_SPEC_CPU",
    "MAX_SPEC_GPU",
    "PAPER_POLICIES",
    "POLICY_NAMES",
    "BestFitPolicy",
    "ClusteringPolicy",
    "DotProductPolicy",
    "FgdPolicy",
    "KubegpuPolicy",
    "PackingPolicy",
    "Policy",
    "RandomPolicy",
    "ReserveTerms",
    "RowCache",
    "ScoreContext",
    "SpreadPolicy",
    "bestfit_choice",
    "get_policy",
]
