"""kubegpu's placement core: pure, deterministic, vectorised; shared by the device plugin,
the scheduler extender and the simulator. No I/O, no global mutable state.

Stable public API (other packages import only these names):

Topology (device plugin, GetPreferredAllocation)
    :func:`choose_gpu_set` ``(gpus, available, must_include, size) -> list[str]`` — the
    NVLink-best set of GPU UUIDs; :data:`LINK_SCORES`, :func:`pair_score`, :class:`GpuSetError`.

One node (extender filter/bind, node daemon checks)
    :class:`NodeState` ``(inventory)`` — free compute/memory per GPU, free MIG devices, CPU and
    memory; ``apply(choice)`` / ``release(choice)`` commit and undo (all or nothing),
    ``apply_allocation(PodAllocation, cpu, mem)`` and :meth:`NodeState.rebuild` rebuild from
    annotations. :func:`fit` ``(state, pod_request, cpu_milli, memory_bytes, gpu_policy) -> Fit``
    with ``ok``, a readable ``reason`` and a :class:`PodChoice` (``to_allocation()`` gives the
    annotation's :class:`~kubegpu.model.allocation.PodAllocation`). :class:`PlacementConflict`.

Many nodes (extender prioritize, simulator)
    :class:`ClusterState` — free capacity as arrays (N nodes x G GPU slots), built with
    ``from_inventories`` or ``from_arrays``; ``take``/``give_back`` commit and undo.
    :class:`Demand` — one request flattened (``Demand.whole``, ``Demand.share``; from a
    container request with :func:`request_demand`). :func:`score_nodes`, :func:`place`,
    :func:`choose_gpus` return scores and a :class:`Placement` without changing the state.

Policies
    :class:`Policy` (``node_scores``, ``gpu_scores``; higher is better), :func:`get_policy` by
    name, :data:`POLICY_NAMES`, :data:`PAPER_POLICIES`, :data:`DEFAULT_POLICY` (``"kubegpu"``),
    :class:`ScoreContext` (target :class:`Workload`; ``rng`` for ``random``; ties go to the lowest
    ``node_rank``/index unless ``random_ties``).
    Names: random, dotprod, clustering, packing, bestfit (the FGD paper's baselines), fgd,
    spread, kubegpu. The node level and the GPU level are chosen separately.

Fragmentation
    :class:`Workload` (``Workload.from_demands(demands, coverage=0.95)``), :func:`node_frag`,
    :class:`FragTerms`.

Units: compute in milli-GPU (1000 = one GPU; percent x 10) in the array API, percent in
grants; memory in bytes; CPU in millicores.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kubegpu.placement.cluster import MILLI, ClusterState, Demand
    from kubegpu.placement.engine import Placement, choose_gpus, pick_best, place, score_nodes
    from kubegpu.placement.frag import FragTerms, node_frag
    from kubegpu.placement.node import (
        ContainerChoice,
        Fit,
        NodeState,
        PlacementConflict,
        PodChoice,
        fit,
        request_demand,
    )
    from kubegpu.placement.policies import (
        DEFAULT_POLICY,
        PAPER_POLICIES,
        POLICY_NAMES,
        Policy,
        ScoreContext,
        get_policy,
    )
    from kubegpu.placement.topology import LINK_SCORES, GpuSetError, LinkType, choose_gpu_set, pair_score
    from kubegpu.placement.workload import Workload, WorkloadShape

# Each name's module, imported on first use (PEP 562): the node daemon needs only the NVLink choice
# (`topology`, pure Python) and should not pay numpy's memory with the array API.
_WHERE = {
    "MILLI": "cluster", "ClusterState": "cluster", "Demand": "cluster",
    "Placement": "engine", "choose_gpus": "engine", "pick_best": "engine", "place": "engine",
    "score_nodes": "engine",
    "FragTerms": "frag", "node_frag": "frag",
    "ContainerChoice": "node", "Fit": "node", "NodeState": "node", "PlacementConflict": "node",
    "PodChoice": "node", "fit": "node", "request_demand": "node",
    "DEFAULT_POLICY": "policies", "PAPER_POLICIES": "policies", "POLICY_NAMES": "policies", "Policy": "policies",
    "ScoreContext": "policies", "get_policy": "policies",
    "LINK_SCORES": "topology", "GpuSetError": "topology", "LinkType": "topology", "choose_gpu_set": "topology",
    "pair_score": "topology",
    "Workload": "workload", "WorkloadShape": "workload",
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{where}"), name)
    globals()[name] = value
    return value


__all__ = [
    "DEFAULT_POLICY",
    "LINK_SCORES",
    "MILLI",
    "PAPER_POLICIES",
    "POLICY_NAMES",
    "ClusterState",
    "ContainerChoice",
    "Demand",
    "Fit",
    "FragTerms",
    "GpuSetError",
    "LinkType",
    "NodeState",
    "Placement",
    "PlacementConflict",
    "PodChoice",
    "Policy",
    "ScoreContext",
    "Workload",
    "WorkloadShape",
    "choose_gpu_set",
    "choose_gpus",
    "fit",
    "get_policy",
    "node_frag",
    "pair_score",
    "pick_best",
    "place",
    "request_demand",
    "score_nodes",
]
