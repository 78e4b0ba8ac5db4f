"""The names both kubelet paths put in a container's runtime edits: the NVIDIA runtime's variable and
volume-mount device list, and kubegpu's own variables (contracts.md).

A module of its own so the DRA driver (:mod:`kubegpu.node.dra.prepare`) takes them without importing
the device plugins' Allocate (:mod:`kubegpu.node.allocate`) and its protobuf messages (issue 23: the
DRA daemon's memory).
"""

from __future__ import annotations

from typing import Final

VOLUME_MOUNTS_ROOT: Final = "/var/run/nvidia-container-devices"
VOLUME_MOUNTS_HOST: Final = "/dev/null"
VISIBLE_DEVICES: Final = "NVIDIA_VISIBLE_DEVICES"

ENV_VISIBLE_GPUS: Final = "KUBEGPU_VISIBLE_GPUS"
ENV_CORE: Final = "KUBEGPU_GPU_CORE_PERCENT"
ENV_MEMORY: Final = "KUBEGPU_GPU_MEMORY_BYTES"
