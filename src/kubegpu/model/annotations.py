"""Annotation and label keys that cross process boundaries (ARCHITECTURE.md, "Who writes what")."""

from typing import Final

# Written by the scheduler extender before the Binding; read by the node daemon and the CLI.
DEVICE_ALLOCATED: Final = "kubegpu.io/device-allocated"
# Allowed GPU models for a pod, separated by "|" or "," (the trace's gpu_spec form).
GPU_MODEL: Final = "kubegpu.io/gpu-model"
# Written by the node daemon when it has served a container (the handoff's acknowledgement).
DEVICE_ASSIGNED: Final = "kubegpu.io/device-assigned"
# On the Node, written by its node daemon: the resourceVersion up to which its view of the node's pods is
# complete, published when it learns that a GPU pod bound there ended unserved (and at start). The extender
# binds the next pod of such a pod's kind there only once this reaches the end (docs/handoff.md).
HANDOFF_SEEN: Final = "kubegpu.io/handoff-seen-version"
# "true": the GPUs of each multi-GPU container must be pairwise NVLink-connected.
REQUIRE_NVLINK: Final = "kubegpu.io/require-nvlink"
# Per-pod overrides of the placement policies.
NODE_POLICY: Final = "kubegpu.io/node-policy"
GPU_POLICY: Final = "kubegpu.io/gpu-policy"

# Node labels (GPU feature discovery keys) that name the GPU model.
GPU_PRODUCT_LABEL: Final = "nvidia.com/gpu.product"
LEGACY_GPU_NAME_LABEL: Final = "alpha.kubernetes.io/nvidia-gpu-name"


def split_models(value: str) -> frozenset[str]:
    """``"V100M16|V100M32"`` or ``"A100, H100"`` -> the set of model names."""
    return frozenset(m.strip() for m in value.replace(",", "|").split("|") if m.strip())
