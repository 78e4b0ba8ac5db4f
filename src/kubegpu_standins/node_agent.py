"""The pod side of a stand-in kubelet: registers its Node, reports device-plugin capacity, admits bound pods.

The device-manager half (gRPC to the plugins) is :class:`kubegpu_standins.kubelet.StandinKubelet`;
this half does what the kubelet does with the API server: it creates its ``Node``
(Ready, with CPU and memory), copies each registered resource's capacity and
allocatable into ``status`` as the device manager reports them, and admits the pods
bound to it: for each init container then app container, for each device-plugin
resource in its limits, one ``allocate`` (GetPreferredAllocation + Allocate). A failed
Allocate fails the pod with ``UnexpectedAdmissionError``, as the kubelet does; a
success sets the pod Running and keeps each container's environment for inspection (the
spec's ``env`` overridden by the plugins', as the runtime sees it). A batch is admitted in the
kubelet's order: creation time, then the order the pods were bound.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kubegpu.model.quantity import QuantityError, parse_int
from kubegpu_standins.kubelet import AllocationFailed, StandinKubelet

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ContainerRun:
    """What a container was started with."""

    pod: str  # namespace/name
    container: str
    envs: dict[str, str]  # from the device plugins' Allocate responses
    devices: dict[str, list[str]]  # resource -> device IDs allocated
    spec_envs: dict[str, str] = field(default_factory=dict)  # the container's own ``env`` values

    @property
    def environment(self) -> dict[str, str]:
        """What the process sees: the spec's values, overridden by the device plugins' (the runtime's order)."""
        return {**self.spec_envs, **self.envs}


@dataclass(slots=True)
class StandinNode:
    name: str
    client: Any  # a lightkube Client
    kubelet: StandinKubelet
    cpu: str = "64"
    memory: str = "512Gi"
    labels: dict[str, str] = field(default_factory=dict)
    runs: dict[tuple[str, str], ContainerRun] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)

    def register(self) -> None:
        """Create the Node object, Ready, as the kubelet does on start."""
        from lightkube.models.meta_v1 import ObjectMeta

        from kubegpu.kube.resources import Node

        labels = {"kubernetes.io/hostname": self.name, "kubernetes.io/os": "linux", **self.labels}
        node = Node(metadata=ObjectMeta(name=self.name, labels=labels))
        self.client.create(node)
        self._patch_status({
            "capacity": {"cpu": self.cpu, "memory": self.memory, "pods": "110"},
            "allocatable": {"cpu": self.cpu, "memory": self.memory, "pods": "110"},
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "kubelet is posting ready status"}],
        })

    def sync_device_status(self) -> None:
        """Copy the device manager's capacity/allocatable per resource into the Node status."""
        resources = list(self.kubelet.resources)
        if not resources:
            return
        self._patch_status({
            "capacity": {r: str(self.kubelet.capacity(r)) for r in resources},
            "allocatable": {r: str(self.kubelet.allocatable(r)) for r in resources},
        })

    def _patch_status(self, status: Mapping[str, Any]) -> None:
        from lightkube.types import PatchType

        from kubegpu.kube.resources import Node

        self.client.patch(Node.Status, self.name, {"status": dict(status)}, patch_type=PatchType.MERGE)

    def admit_pending(self) -> list[str]:
        """Admit every pod bound here and still Pending; returns the pods admitted or failed."""
        from kubegpu.kube.resources import Pod

        pending = [p.to_dict() for p in self.client.list(Pod, namespace="*", fields={"spec.nodeName": self.name})]
        pending = [p for p in pending if p.get("status", {}).get("phase") == "Pending"]
        # The kubelet admits a batch sorted by creation time; pods created in the same second come
        # in the order they were bound to it (the last write of a pending pod is its binding).
        pending.sort(key=lambda p: (p["metadata"].get("creationTimestamp", ""),
                                    _int(p["metadata"].get("resourceVersion"))))
        return [self.admit(p) for p in pending]

    def admit(self, pod: Mapping[str, Any]) -> str:
        meta = pod["metadata"]
        key = f"{meta.get('namespace', 'default')}/{meta['name']}"
        registered = set(self.kubelet.resources)
        spec = pod.get("spec") or {}
        runs = []
        self.kubelet.admitting(key)
        try:
            inits = spec.get("initContainers") or []
            for i, c in enumerate([*inits, *(spec.get("containers") or [])]):
                envs: dict[str, str] = {}
                devices: dict[str, list[str]] = {}
                for resource, qty in ((c.get("resources") or {}).get("limits") or {}).items():
                    if resource not in registered:
                        continue
                    try:
                        n = parse_int(qty)
                    except QuantityError:
                        raise AllocationFailed(f"{resource}: {qty!r} is not a whole number") from None
                    got = self.kubelet.allocate(resource, n, pod=key, container=c["name"], init=i < len(inits))
                    envs.update(got.response.envs)
                    devices[resource] = list(got.device_ids)
                spec_envs = {e["name"]: str(e.get("value", "")) for e in c.get("env") or []
                             if isinstance(e, Mapping) and isinstance(e.get("name"), str)}
                runs.append(ContainerRun(key, c["name"], envs, devices, spec_envs))
        except AllocationFailed as exc:
            self.failed[key] = str(exc)
            self._pod_status(meta, {"phase": "Failed", "reason": "UnexpectedAdmissionError",
                                    "message": f"Allocate failed due to {exc}, which is unexpected"})
            return key
        for run in runs:
            self.runs[(key, run.container)] = run
        self._pod_status(meta, {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]})
        return key

    def _pod_status(self, meta: Mapping[str, Any], status: Mapping[str, Any]) -> None:
        from lightkube.types import PatchType

        from kubegpu.kube.resources import Pod

        self.client.patch(Pod.Status, meta["name"], {"status": dict(status)},
                          namespace=meta.get("namespace", "default"), patch_type=PatchType.MERGE)


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0
