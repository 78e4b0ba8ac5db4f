"""The pods the demo submits: one per request style of the seeds, plus a refused and a plain one.

Pure data. Each :class:`DemoPod` says what the demo expects of it (placed or refused) and in
which wave it goes: ``before`` the Xid, or ``after`` it (pinned to the faulty node with a
``nodeSelector``, so the check that no new pod lands on the unhealthy GPU means something).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

NAMESPACE = "demo"
IMAGE = "registry.k8s.io/pause:3.9"
HOSTNAME_LABEL = "kubernetes.io/hostname"
PRODUCT_LABEL = "nvidia.com/gpu.product"  # set by kubegpu node as GPU feature discovery does

Wave = Literal["before", "after"]


@dataclass(frozen=True, slots=True)
class DemoPod:
    name: str
    style: str  # the request style, as the demo prints it
    manifest: Mapping[str, Any]
    refused: bool = False  # the webhook must refuse it
    wave: Wave = "before"


def _pod(name: str, containers: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"containers": containers, **spec}}


def _c(name: str, limits: Mapping[str, Any] | None = None, requests: Mapping[str, Any] | None = None
       ) -> dict[str, Any]:
    resources: dict[str, Any] = {}
    if limits:
        resources["limits"] = dict(limits)
    if requests:
        resources["requests"] = dict(requests)
    return {"name": name, "image": IMAGE, "resources": resources}


def first_wave() -> list[DemoPod]:
    return [
        DemoPod("legacy-alpha", "alpha.kubernetes.io/nvidia-gpu: 1 + 1 (two containers, Kubernetes 1.6)",
                _pod("legacy-alpha", [_c("trainer", {"alpha.kubernetes.io/nvidia-gpu": 1}),
                                      _c("evaluator", {"alpha.kubernetes.io/nvidia-gpu": 1})])),
        DemoPod("cuda-single", "nvidia.com/gpu: 1 (device plugin)",
                _pod("cuda-single", [_c("cuda", {"nvidia.com/gpu": 1})], restartPolicy="Never")),
        DemoPod("nccl-pair", "nvidia.com/gpu: 2 (one NVLink pair)",
                _pod("nccl-pair", [_c("nccl", {"nvidia.com/gpu": 2})])),
        DemoPod("share-gpu-100", 'kubernetes.io/gpu: "100" (requests only)',
                _pod("share-gpu-100", [_c("main", requests={"kubernetes.io/gpu": "100"})])),
        DemoPod("share-core-ratio", "kubernetes.io/gpu-core 50 + gpu-memory-ratio 50",
                _pod("share-core-ratio", [_c("main", requests={"kubernetes.io/gpu-core": "50",
                                                               "kubernetes.io/gpu-memory-ratio": "50"})])),
        DemoPod("share-core-memory", "kubernetes.io/gpu-core 30 + gpu-memory 4Gi",
                _pod("share-core-memory", [_c("main", requests={"kubernetes.io/gpu-core": "30",
                                                                "kubernetes.io/gpu-memory": "4Gi"})])),
        DemoPod("a100-by-model", "koordinator.sh/gpu-core 25 + gpu-memory-ratio 25, nodeSelector on the GFD "
                "label nvidia.com/gpu.product",
                _pod("a100-by-model", [_c("main", {"koordinator.sh/gpu-core": "25",
                                                   "koordinator.sh/gpu-memory-ratio": "25"})],
                     nodeSelector={PRODUCT_LABEL: "NVIDIA-A100-SXM4-80GB"})),
        DemoPod("mig-slice", "nvidia.com/mig-1g.10gb: 1 (MIG, mixed strategy)",
                _pod("mig-slice", [_c("infer", {"nvidia.com/mig-1g.10gb": 1})])),
        DemoPod("replica", "nvidia.com/sharedgpu: 1 (time-slicing replica, gpu:sharedgpu:4)",
                _pod("replica", [_c("notebook", {"nvidia.com/sharedgpu": 1})])),
        DemoPod("core-only", "kubernetes.io/gpu-core 50 alone (refused: memory must be declared)",
                _pod("core-only", [_c("main", requests={"kubernetes.io/gpu-core": "50"})]), refused=True),
        DemoPod("plain", "no GPU, tolerates the GPU taint (gets NVIDIA_VISIBLE_DEVICES=void)",
                _pod("plain", [_c("exporter", {"cpu": "100m", "memory": "64Mi"})],
                     tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}])),
    ]


def second_wave(node: str, *, whole: bool) -> list[DemoPod]:
    """After the Xid: pods pinned to the faulty node (``nodeSelector`` on its hostname label), so
    the scheduler must place them beside the unhealthy GPU; ``whole`` adds a whole-GPU pod."""
    selector = {HOSTNAME_LABEL: node}
    pods = [
        DemoPod(f"after-xid-{i}", f"kubegpu.io/gpu-core 40 + gpu-memory 4Gi, nodeSelector {node}",
                _pod(f"after-xid-{i}", [_c("main", {"kubegpu.io/gpu-core": "40", "kubegpu.io/gpu-memory": "4Gi"})],
                     nodeSelector=selector), wave="after")
        for i in (1, 2)
    ]
    if whole:
        pods.append(DemoPod("after-xid-whole", f"nvidia.com/gpu: 1, nodeSelector {node}",
                            _pod("after-xid-whole", [_c("cuda", {"nvidia.com/gpu": 1})], nodeSelector=selector),
                            wave="after"))
    return pods
