"""A GPU node as the extender knows it, and the questions asked of one node: which GPU models it offers
to a pod's allowed list, whether a choice of GPUs is fully NVLink-connected, and whether its node daemon
serves its GPUs now (:class:`NodeDaemons`)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from kubegpu.model import annotations as A
from kubegpu.model import node_daemon as ND
from kubegpu.model.allocation import DeviceGrant
from kubegpu.model.inventory import NodeInventory
from kubegpu.model.request import PodRequest
from kubegpu.model.resources import SERVED_RESOURCES_ANNOTATION
from kubegpu.placement import NodeState


@dataclass(slots=True)
class NodeRecord:
    name: str
    inventory: NodeInventory | None = None
    state: NodeState | None = None
    labels: dict[str, str] = field(default_factory=dict)
    device_error: str = ""

    @property
    def models(self) -> frozenset[str]:
        """GPU model names of the node: its GPUs' and its product labels' (GFD's dashed form)."""
        found = {g.model for g in self.inventory.gpus} if self.inventory else set()
        for labels in (self.labels, self.inventory.labels if self.inventory else {}):
            for key in (A.GPU_PRODUCT_LABEL, A.LEGACY_GPU_NAME_LABEL):
                if labels.get(key):
                    found.add(labels[key])
        return frozenset(found)

    def allowed_gpu_models(self, allowed: frozenset[str] | None) -> frozenset[str] | None:
        """The node's GPU model names a pod's allowed list admits (None = no constraint).

        Names compare without case, spaces and dashes alike (``NVIDIA A100-SXM4-80GB`` is GFD's
        ``NVIDIA-A100-SXM4-80GB``), a short name matches whole words of a long one (``A100``), and the
        trace's ``V100M16`` is a V100 with 16 GB.
        When only a node label matches, every GPU of the node is admitted."""
        if allowed is None or self.inventory is None:
            return allowed
        wanted = [_norm(a) for a in allowed]
        gpu_models = {g.model for g in self.inventory.gpus}
        direct = frozenset(m for m in gpu_models if any(_model_match(w, _norm(m)) for w in wanted))
        if direct:
            return direct
        if any(_model_match(w, _norm(m)) for m in self.models for w in wanted):
            return frozenset(gpu_models)
        return frozenset()


def _norm(name: str) -> str:
    return "-".join(name.lower().replace("_", "-").split()).replace("--", "-")


_TRACE_NAME = re.compile(r"([a-z]+\d+)m(\d+)")  # the Alibaba trace's gpu_spec form: V100M16 = V100, 16 GB


def _model_match(wanted: str, model: str) -> bool:
    if wanted == model or f"-{wanted}-" in f"-{model}-":
        return True
    trace = _TRACE_NAME.fullmatch(wanted)
    return trace is not None and f"-{trace[1]}-" in f"-{model}-" and f"-{trace[2]}gb" in f"-{model}"


def for_node(request: PodRequest, rec: NodeRecord) -> PodRequest:
    """The request with its allowed models spelled as this node's GPUs name them (placement compares
    names exactly)."""
    if request.allowed_models is None:
        return request
    return replace(request, allowed_models=rec.allowed_gpu_models(request.allowed_models))


class _Granted(Protocol):
    """A container's GPUs: a chosen one (placement) or an allocated one (model)."""

    @property
    def grants(self) -> tuple[DeviceGrant, ...]: ...


NOT_LINKED = "no free set of GPUs is fully NVLink-connected for this pod"


def all_linked(rec: NodeRecord, containers: Iterable[_Granted]) -> bool:
    """Every pair of whole GPUs each container got is joined by NVLink (single-GPU containers trivially are)."""
    assert rec.inventory is not None
    by_uuid = {g.uuid: g for g in rec.inventory.gpus}
    for c in containers:
        uuids = [g.uuid for g in c.grants if g.mig_uuid is None]
        if not all(by_uuid[a].links.get(b, 0) > 0 for i, a in enumerate(uuids) for b in uuids[i + 1:]):
            return False
    return True


class NodeDaemons:
    """Which nodes' kubegpu daemons do not serve their GPUs now, with the reason a pod is told, from the Node
    watch (:mod:`kubegpu.model.node_daemon`): one that said it is stopping, until its next daemon says it
    serves; one whose kubelet reports none of its plugin resources healthy (a daemon that died saying nothing),
    until the kubelet reports them again or a newer daemon says it serves. A node that says nothing (an older
    daemon, a DRA-only node) serves."""

    def __init__(self) -> None:
        # node -> the daemon (boot) that was the node's when its kubelet was seen with no healthy device of
        # ours: the node is down while that daemon is still the last to have spoken.
        self._lost_under: dict[str, str] = {}

    def observe(self, node: str, annotations: Mapping[str, str], status: Mapping[str, Any] | None) -> str | None:
        """Why nothing may be placed on ``node``'s GPUs now (None: its daemon serves them)."""
        state = ND.decode(annotations.get(ND.NODE_DAEMON))
        boot = state.boot if state is not None else ""
        served = [r for r in (annotations.get(SERVED_RESOURCES_ANNOTATION) or "").split(",") if r]
        lost = ND.kubelet_lost_devices(status, served)
        # Kept whatever the daemon says, so that the next daemon's "serving" outranks a kubelet status older
        # than it (the kubelet posts its devices only every nodeStatusUpdateFrequency).
        under = self._lost_under.setdefault(node, boot) if lost else self._lost_under.pop(node, None)
        if state is not None and state.state == ND.STOPPING:
            return (f"kubegpu node daemon on {node} is restarting (stopping since {_clock(state.since)}); "
                    "nothing is placed on its GPUs until the next one serves them")
        if not lost or under != boot:
            return None  # healthy, or a daemon started since the kubelet lost them has said it serves
        return (f"the kubelet on {node} reports no healthy {', '.join(lost)} (its kubegpu node daemon is not "
                "serving them); nothing is placed on its GPUs until it is")

    def forget(self, node: str) -> None:
        self._lost_under.pop(node, None)


def _clock(since: float) -> str:
    return time.strftime("%H:%M:%SZ", time.gmtime(since)) if since > 0 else "an unknown time"
