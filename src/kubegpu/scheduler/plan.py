"""A pod's plan: everything the extender's verbs and its accounting read of one pod, worked out once.

kube-scheduler runs PreFilter once per scheduling cycle and hands its result to Filter, Score and Bind in
the cycle's ``CycleState``. The extender has no cycle object (each verb is its own HTTP call), so the pod's
UID and resourceVersion stand in for one: the API server gives a pod a new resourceVersion whenever it
changes, so every copy of one version (a ``/filter`` body, the watch's, a GET's) plans to the same thing.
:class:`PlanCache` keeps the plans of recent versions, bounded; the extender owns one instance and every
verb and watch event asks it. A pod without both (a hand-made body) is planned afresh each time.

The verbs' bodies come from kube-scheduler over the extender's own listener: a body is trusted to be the
pod at the version it says, as kube-scheduler trusts its informer's copy.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from kubegpu.model import annotations as A
from kubegpu.model import quantity
from kubegpu.model.limits import DEFAULT_MAX_GPU_CONTAINERS, too_many_gpu_containers
from kubegpu.model.records import Shape, request_shapes
from kubegpu.model.request import PodRequest, RequestKind, parse_pod
from kubegpu.placement import DEFAULT_POLICY, Demand, get_policy, request_demand
from kubegpu.placement.workload import LearnedWorkload

log = logging.getLogger(__name__)

MAX_PLANS = 4096  # pod versions: kube-scheduler asks about a pod in bursts of three calls, a few pods at a time
MIRROR_POD = "kubernetes.io/config.mirror"  # a static pod's mirror on the API server


@dataclass(frozen=True, slots=True)
class PlanSettings:
    """What a plan depends on besides the pod: the cluster's default policies, the cap on GPU containers and
    the renamed GPU resources the deployment declared (``kubegpu scheduler`` reads them at its start)."""

    node_policy: str = DEFAULT_POLICY
    gpu_policy: str = DEFAULT_POLICY
    max_gpu_containers: int = DEFAULT_MAX_GPU_CONTAINERS
    gpu_resources: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class PodPlan:
    """One pod version as the extender places and accounts it."""

    key: str  # namespace/name
    uid: str
    version: str
    too_many: str  # why the pod has more GPU containers than placed ('' when within the cap; then not parsed)
    request: PodRequest
    # The array demand filter and prioritize use: the largest whole/share app container's, with the pod's
    # CPU and memory (a CPU-only demand for a pod without such a container).
    demand: Demand
    vectorised: bool  # one app container asking whole GPUs or a share: the array paths decide alone
    shapes: frozenset[Shape]  # its GPU containers as the kubelet's handoff calls look (model.records)
    nvlink: bool  # every multi-GPU container's GPUs must be NVLink-joined
    node_policy: str
    gpu_policy: str
    learned: Demand | None  # what the learned workload counts for the pod (None: not counted)
    deadline_s: float | None = None  # spec.activeDeadlineSeconds: how long it may run once started (reservations)

    @property
    def refusal(self) -> str:
        """Why no node can take the pod ('' when it can be placed)."""
        if self.too_many:
            return self.too_many
        if not self.request.ok:
            return "; ".join(str(r) for r in self.request.refusals)
        return ""

    @property
    def gpu_demand(self) -> Demand:
        """:attr:`demand` without CPU and memory: what the per-GPU arrays are asked (their caches ignore both)."""
        return replace(self.demand, cpu_milli=0, memory_bytes=0)


def plan_pod(pod: Mapping[str, Any], settings: PlanSettings) -> PodPlan:
    """The plan of ``pod`` (a dict shaped like a v1.Pod). Never raises on bad input."""
    meta = pod.get("metadata") if isinstance(pod, Mapping) else None
    meta = meta if isinstance(meta, Mapping) else {}
    key = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
    too_many = too_many_gpu_containers(pod, settings.max_gpu_containers, settings.gpu_resources)
    # Over the cap the pod is refused unparsed: parsing and fitting grow with its containers.
    request = PodRequest((), ()) if too_many else parse_pod(pod, replica_resources=settings.gpu_resources)
    cpu, mem = pod_resources(pod)
    gpu = _largest_demand(request)
    demand = replace(gpu or Demand(), cpu_milli=cpu, memory_bytes=mem)
    node_policy, gpu_policy = pod_policies(pod, settings.node_policy, settings.gpu_policy)
    learned = LearnedWorkload.shape_of(demand) if request.ok and not too_many and not follows_its_node(pod) else None
    return PodPlan(key, str(meta.get("uid") or ""), str(meta.get("resourceVersion") or ""), too_many, request,
                   demand, _vectorised(request), request_shapes(request), requires_nvlink(pod), node_policy,
                   gpu_policy, learned, _deadline(pod))


class PlanCache:
    """The plans of the most recent pod versions (at most ``limit``), by UID and resourceVersion."""

    def __init__(self, settings: PlanSettings | None = None, limit: int = MAX_PLANS) -> None:
        self.settings = settings or PlanSettings()
        self._limit = limit
        self._kept: OrderedDict[tuple[str, str], PodPlan] = OrderedDict()

    def plan(self, pod: Mapping[str, Any]) -> PodPlan:
        meta = pod.get("metadata") if isinstance(pod, Mapping) else None
        uid = meta.get("uid") if isinstance(meta, Mapping) else None
        version = meta.get("resourceVersion") if isinstance(meta, Mapping) else None
        if not (isinstance(uid, str) and uid and isinstance(version, str) and version):
            return plan_pod(pod, self.settings)
        key = (uid, version)
        kept = self._kept.get(key)
        if kept is not None:
            self._kept.move_to_end(key)
            return kept
        planned = self._kept[key] = plan_pod(pod, self.settings)
        if len(self._kept) > self._limit:
            self._kept.popitem(last=False)
        return planned

    def __len__(self) -> int:
        return len(self._kept)


def _deadline(pod: Mapping[str, Any]) -> float | None:
    spec = pod.get("spec") if isinstance(pod, Mapping) else None
    value = spec.get("activeDeadlineSeconds") if isinstance(spec, Mapping) else None
    return float(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _vectorised(request: PodRequest) -> bool:
    gpu = request.gpu_containers
    if len(gpu) != 1 or gpu[0].init:
        return False
    req = gpu[0].request
    return req is not None and req.kind in (RequestKind.WHOLE, RequestKind.SHARE)


def _largest_demand(request: PodRequest) -> Demand | None:
    """The largest whole/share app container's demand (for a vectorised pod: its one container's)."""
    best = None
    for c in request.gpu_containers:
        req = c.request
        if req is None or c.init or req.kind not in (RequestKind.WHOLE, RequestKind.SHARE):
            continue
        d = request_demand(req, request.allowed_models)
        if best is None or d.count * d.milli > best.count * best.milli:
            best = d
    return best


# ---- what is read of a pod besides its GPU request --------------------------------------------------
def _annotations(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = pod.get("metadata") if isinstance(pod, Mapping) else None
    ann = meta.get("annotations") if isinstance(meta, Mapping) else None
    return ann if isinstance(ann, Mapping) else {}


def requires_nvlink(pod: Mapping[str, Any]) -> bool:
    return str(_annotations(pod).get(A.REQUIRE_NVLINK, "")).lower() in ("true", "1", "yes")


def pod_policies(pod: Mapping[str, Any], node_default: str, gpu_default: str) -> tuple[str, str]:
    """The node- and GPU-level policies for a pod: its annotations, else the cluster defaults.
    Unknown names fall back to the defaults (the webhook refuses them at admission)."""
    ann = _annotations(pod)
    chosen = {"node": node_default, "gpu": gpu_default}
    for key, level in ((A.NODE_POLICY, "node"), (A.GPU_POLICY, "gpu")):
        value = ann.get(key)
        if isinstance(value, str) and value:
            try:
                get_policy(value)
            except KeyError:
                log.warning("pod %s: unknown %s policy %r ignored", (pod.get("metadata") or {}).get("name"),
                            level, value)
                continue
            chosen[level] = value
    return chosen["node"], chosen["gpu"]


def follows_its_node(pod: Mapping[str, Any]) -> bool:
    """A DaemonSet's pod or a static (mirror) pod: it runs where its node is, so it is not part of the
    workload the scheduler places (a DaemonSet's CPU on every node would otherwise crowd out the shapes
    that arrive for placement); its CPU and memory still count on its node."""
    meta = pod.get("metadata") if isinstance(pod, Mapping) else None
    meta = meta if isinstance(meta, Mapping) else {}
    if MIRROR_POD in _annotations(pod):
        return True
    return any(isinstance(o, Mapping) and o.get("kind") == "DaemonSet" and o.get("controller")
               for o in (meta.get("ownerReferences") or ()))


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
