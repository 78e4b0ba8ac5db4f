"""What the extender reads from a pod besides its GPU request: per-pod policies, the NVLink requirement,
and the array-level demands it is filtered and scored with."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kubegpu.model import annotations as A
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
