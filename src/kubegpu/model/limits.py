"""The cap on GPU containers per pod: one rule, read by the webhook (refused at admission) and the
extender (refused by filter and bind), so both say the same thing about the same pod.

Each GPU container of a pod needs its own exact fit on every candidate node, so the extender's cost
grows with their number; a cap keeps one pod from costing seconds per filter. Counted on the raw pod,
before it is parsed, so the count itself costs one pass over the containers' resource keys.
"""

from __future__ import annotations

from collections.abc import Mapping

from kubegpu.model import resources as R

DEFAULT_MAX_GPU_CONTAINERS = 32
_CONTAINER_KEYS = ("initContainers", "containers")


def count_gpu_containers(pod: object, replica_resources: frozenset[str] = frozenset()) -> int:
    """Containers (init and app) whose limits or requests name a GPU resource, counted on the raw pod
    without parsing it (so a pod of 100,000 containers costs one pass over their resource keys)."""
    spec = pod.get("spec") if isinstance(pod, Mapping) else None
    if not isinstance(spec, Mapping):
        return 0
    n = 0
    for key in _CONTAINER_KEYS:
        items = spec.get(key)
        for c in items if isinstance(items, list) else ():
            res = c.get("resources") if isinstance(c, Mapping) else None
            if not isinstance(res, Mapping):
                continue
            for section in (res.get("limits"), res.get("requests")):
                if isinstance(section, Mapping) and any(
                        isinstance(k, str) and R.is_gpu_resource(k, replica_resources) for k in section):
                    n += 1
                    break
    return n


def too_many_gpu_containers(pod: object, cap: int, replica_resources: frozenset[str] = frozenset()) -> str:
    """Why the pod is refused for its number of GPU containers ('' when it is within ``cap``)."""
    if cap <= 0:
        return ""
    n = count_gpu_containers(pod, replica_resources)
    if n <= cap:
        return ""
    return (f"the pod has {n} containers that ask for GPUs; kubegpu places at most {cap} per pod "
            "(each needs an exact fit on every candidate node); merge containers or ask the "
            "administrator to raise --max-gpu-containers")
