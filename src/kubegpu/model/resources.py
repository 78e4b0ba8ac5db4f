"""Resource names of the kubegpu resource protocol and the aliases it accepts.

One table, so the webhook, the extender, the simulator and ``kubegpu check``
never disagree on what a name means.
"""

from __future__ import annotations

import re
from typing import Final

# Canonical names (ARCHITECTURE.md, "Resource protocol").
NVIDIA_GPU: Final = "nvidia.com/gpu"
NVIDIA_MIG_PREFIX: Final = "nvidia.com/mig-"
NVIDIA_GPU_SHARED: Final = "nvidia.com/gpu.shared"
GPU_CORE: Final = "kubegpu.io/gpu-core"
GPU_MEMORY: Final = "kubegpu.io/gpu-memory"
GPU_MEMORY_RATIO: Final = "kubegpu.io/gpu-memory-ratio"
GPU_PERCENT: Final = "kubegpu.io/gpu"
GPU_SLOTS: Final = "kubegpu.io/gpu.shared"

# The fine-grained share resources, in the order they are printed.
SHARE_RESOURCES: Final = (GPU_CORE, GPU_MEMORY, GPU_MEMORY_RATIO, GPU_PERCENT, GPU_SLOTS)
# Per-GPU resources of a Device entry and of the allocation annotation.
DEVICE_RESOURCES: Final = (GPU_CORE, GPU_MEMORY, GPU_MEMORY_RATIO)

# Alias -> canonical name. The webhook rewrites these; every reader understands them.
ALIASES: Final[dict[str, str]] = {
    "alpha.kubernetes.io/nvidia-gpu": NVIDIA_GPU,
    "kubernetes.io/gpu": GPU_PERCENT,
    "kubernetes.io/gpu-core": GPU_CORE,
    "kubernetes.io/gpu-memory": GPU_MEMORY,
    "kubernetes.io/gpu-memory-ratio": GPU_MEMORY_RATIO,
    "koordinator.sh/gpu": GPU_PERCENT,
    "koordinator.sh/gpu-core": GPU_CORE,
    "koordinator.sh/gpu-memory": GPU_MEMORY,
    "koordinator.sh/gpu-memory-ratio": GPU_MEMORY_RATIO,
    "koordinator.sh/gpu.shared": GPU_SLOTS,
}

# MIG resource names: nvidia.com/mig-<g>g.<m>gb, optionally with a compute-slice prefix
# (<c>c.<g>g.<m>gb) and +me / -me / +gfx style suffixes, as NVIDIA's naming produces them.
MIG_PROFILE_RE: Final = re.compile(r"^(?:(\d+)c\.)?(\d+)g\.(\d+)gb(?:[+-][a-z]+)*$")

GPU_DOMAINS: Final = ("nvidia.com/", "kubegpu.io/", "kubernetes.io/gpu", "koordinator.sh/gpu",
                      "alpha.kubernetes.io/nvidia-gpu")


def canonical_name(name: str) -> str:
    """The canonical name of a resource (aliases resolved; others unchanged)."""
    return ALIASES.get(name, name)


def is_mig_resource(name: str) -> bool:
    return name.startswith(NVIDIA_MIG_PREFIX) and MIG_PROFILE_RE.match(name[len(NVIDIA_MIG_PREFIX):]) is not None


def mig_profile(name: str) -> str:
    """``nvidia.com/mig-1g.10gb`` -> ``1g.10gb``."""
    return name[len(NVIDIA_MIG_PREFIX):]


def is_gpu_resource(name: str) -> bool:
    """True for every name kubegpu owns or understands, canonical or alias.

    Renamed replica resources (``nvidia.com/sharedgpu``) count: everything under
    ``nvidia.com/`` is a GPU resource.
    """
    return name in ALIASES or name.startswith(GPU_DOMAINS)
