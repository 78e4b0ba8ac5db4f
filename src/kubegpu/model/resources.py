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

# Names under these prefixes belong to a GPU scheme kubegpu speaks; a name there that is
# neither canonical nor a known alias is a typo and is refused rather than ignored.
GPU_ALIAS_PREFIXES: Final = ("kubernetes.io/gpu", "koordinator.sh/gpu", "alpha.kubernetes.io/nvidia-gpu")
KUBEGPU_PREFIX: Final = "kubegpu.io/"
NVIDIA_PREFIX: Final = "nvidia.com/"

CANONICAL: Final = frozenset({NVIDIA_GPU, NVIDIA_GPU_SHARED, *SHARE_RESOURCES})


def canonical_name(name: str) -> str:
    """The canonical name of a resource (aliases resolved; others unchanged)."""
    return ALIASES.get(name, name)


def is_mig_resource(name: str) -> bool:
    if not name.startswith(NVIDIA_MIG_PREFIX):
        return False
    return MIG_PROFILE_RE.match(name[len(NVIDIA_MIG_PREFIX):]) is not None


def is_shared_mig_resource(name: str) -> bool:
    """``nvidia.com/mig-1g.10gb.shared``: time-sliced replicas of a MIG device (NVIDIA's renameByDefault)."""
    return name.endswith(".shared") and is_mig_resource(name[: -len(".shared")])


def mig_profile(name: str) -> str:
    """``nvidia.com/mig-1g.10gb`` -> ``1g.10gb``."""
    return name[len(NVIDIA_MIG_PREFIX):]


def is_nvidia_gpu_name(name: str) -> bool:
    """True for the ``nvidia.com/`` names that are GPUs: ``gpu``, MIG devices, and replica
    resources, including renamed ones such as ``nvidia.com/sharedgpu``.

    ``nvidia.com/`` also holds NVIDIA network-operator devices (``rdma_shared_device_a``,
    ``hostdev``, SR-IOV pools) that routinely sit beside ``nvidia.com/gpu`` in one container;
    they are not GPUs. A renamed replica resource is recognised when its name contains
    ``gpu``; other renamings (the seed's ``nvidia.com/small``) must be declared to the parser
    (``replica_resources``).
    """
    if not name.startswith(NVIDIA_PREFIX):
        return False
    rest = name[len(NVIDIA_PREFIX):]
    return rest.startswith("mig-") or "gpu" in rest.lower()


def is_gpu_resource(name: str, replica_resources: frozenset[str] = frozenset()) -> bool:
    """True for every name kubegpu owns or understands, canonical or alias, or one that
    sits in a GPU scheme's namespace (and is refused there when unknown)."""
    return (name in ALIASES or name in replica_resources or name.startswith(KUBEGPU_PREFIX)
            or name.startswith(GPU_ALIAS_PREFIXES) or is_nvidia_gpu_name(name))


def is_known_name(name: str, replica_resources: frozenset[str] = frozenset()) -> bool:
    """True for canonical names, aliases and device-plugin names the parser can turn into a request."""
    if name in ALIASES or name in CANONICAL or name in replica_resources:
        return True
    if name.startswith(KUBEGPU_PREFIX) or name.startswith(GPU_ALIAS_PREFIXES):
        return False
    return is_nvidia_gpu_name(name)
