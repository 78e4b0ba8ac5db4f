"""What the extender reads from a pod besides its GPU request: per-pod policies, the NVLink requirement,
and the array-level demands it is filtered and scored with."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from kubegpu.model import annotations as A
from kubegpu.model import quantity
from kubegpu.model.allocation import PodAllocation
from kubegpu.model.request import PodRequest, RequestKind
from kubegpu.placement import Demand, get_policy, request_demand

log = logging.getLogger(__name__)

REQUIRE_NVLINK = A.REQUIRE_NVLINK


def requires_nvlink(pod: Mapping[str, Any]) -> bool:
    meta = pod.get("metadata") if isinstance(pod, Mapping) else None
    ann = meta.get("annotations") if isinstance(meta, Mapping) else None
    return isinstance(ann, Mapping) and str(ann.get(REQUIRE_NVLINK, "")).lower() in ("true", "1", "yes")


def pod_policies(pod: Mapping[str, Any], node_default: str, gpu_default: str) -> tuple[str, str]:
    """The node- and GPU-level policies for a pod: its annotations, else the cluster defaults.
    Unknown names fall back to the defaults (the webhook refuses them at admission)."""
    meta = pod.get("metadata") if isinstance(pod, Mapping) else None
    ann = meta.get("annotations") if isinstance(meta, Mapping) else None
    node_p, gpu_p = node_default, gpu_default
    if isinstance(ann, Mapping):
        for key, current in ((A.NODE_POLICY, "node"), (A.GPU_POLICY, "gpu")):
            value = ann.get(key)
            if isinstance(value, str) and value:
                try:
                    get_policy(value)
                except KeyError:
                    log.warning("pod %s: unknown %s policy %r ignored", (meta or {}).get("name"), current, value)
                    continue
                if current == "node":
                    node_p = value
                else:
                    gpu_p = value
    return node_p, gpu_p


def demands_of_allocation(alloc: PodAllocation) -> list[Demand]:
    out = []
    for c in alloc.containers:
        if not c.grants or any(g.mig_uuid for g in c.grants):
            continue
        g = c.grants[0]
        if all(x.core >= 100 and x.memory_ratio >= 100 for x in c.grants):
            out.append(Demand.whole(len(c.grants)))
        else:
            out.append(Demand.share(g.core * 10, len(c.grants), gpu_memory=g.memory_bytes))
    return out


def simple_demand(request: PodRequest) -> Demand | None:
    """The array demand when the pod is one app container asking for whole GPUs or a share
    (the common case, vectorised); None sends the pod through the exact per-node fit."""
    gpu = request.gpu_containers
    if len(gpu) != 1 or gpu[0].init:
        return None
    req = gpu[0].request
    assert req is not None
    if req.kind not in (RequestKind.WHOLE, RequestKind.SHARE):
        return None
    return request_demand(req, request.allowed_models)


def scoring_demand(request: PodRequest) -> Demand | None:
    """The demand prioritize scores with: the largest whole/share container's."""
    best = None
    for c in request.gpu_containers:
        req = c.request
        if req is None or c.init or req.kind not in (RequestKind.WHOLE, RequestKind.SHARE):
            continue
        d = request_demand(req, request.allowed_models)
        if best is None or d.count * d.milli > best.count * best.milli:
            best = d
    return best


def _quantity(value: object, scale: int) -> int:
    try:
        return max(0, int(quantity.parse(value) * scale))
    except (quantity.QuantityError, ValueError, ArithmeticError):
        return 0


def _container_requests(c: Mapping[str, Any]) -> tuple[int, int]:
    res = c.get("resources") if isinstance(c, Mapping) else None
    res = res if isinstance(res, Mapping) else {}
    req: Mapping[str, Any] = res["requests"] if isinstance(res.get("requests"), Mapping) else {}
    lim: Mapping[str, Any] = res["limits"] if isinstance(res.get("limits"), Mapping) else {}
    cpu = req.get("cpu", lim.get("cpu"))  # an unset request defaults to the limit
    mem = req.get("memory", lim.get("memory"))
    return (_quantity(cpu, 1000) if cpu is not None else 0, _quantity(mem, 1) if mem is not None else 0)


def pod_resources(pod: Mapping[str, Any]) -> tuple[int, int]:
    """The pod's CPU (millicores) and memory (bytes) requests as kube-scheduler counts them: the larger of
    the app containers' sum and any one init container, plus the pod overhead. Unreadable values count 0."""
    spec = pod.get("spec") if isinstance(pod, Mapping) else None
    if not isinstance(spec, Mapping):
        return 0, 0
    cpu = mem = 0
    for c in spec.get("containers") or ():
        a, b = _container_requests(c)
        cpu, mem = cpu + a, mem + b
    for c in spec.get("initContainers") or ():
        a, b = _container_requests(c)
        cpu, mem = max(cpu, a), max(mem, b)
    overhead = spec.get("overhead")
    if isinstance(overhead, Mapping):
        cpu += _quantity(overhead.get("cpu", 0), 1000)
        mem += _quantity(overhead.get("memory", 0), 1)
    return cpu, mem


def with_resources(demand: Demand, pod: Mapping[str, Any]) -> Demand:
    """``demand`` with the pod's CPU and memory (what the simulator's trace demands carry)."""
    cpu, mem = pod_resources(pod)
    return replace(demand, cpu_milli=cpu, memory_bytes=mem)


def pod_demand(request: PodRequest, pod: Mapping[str, Any]) -> Demand:
    """The demand the pod is scored and learned with: its largest whole/share container's (none: a CPU-only
    demand) with the pod's CPU, memory and allowed models."""
    d = scoring_demand(request)
    if d is None:
        d = Demand()
    return with_resources(d, pod)
