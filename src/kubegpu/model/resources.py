"""Resource names of the kubegpu resource protocol and the aliases it accepts.

One table, so the webhook, the extender, the simulator and ``kubegpu check``
never disagree on what a name means.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
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
# (<c>c.<g>g.<m>gb) and +me / -me / +gfx / +me.all suffixes, as NVIDIA's naming produces them ("+" becomes
# "." in a resource name, where "+" is not allowed).
MIG_PROFILE_RE: Final = re.compile(r"^(?:(\d+)c\.)?(\d+)g\.(\d+)gb(?:[+.-][a-z]+(?:\.all)?)*$")

# Every MIG profile of the current data-centre GPUs (NVIDIA's MIG user guide, supported-profiles tables), by
# GPU. One table drives what the extender manages and what the webhook and the CLI treat as GPUs; the values'
# `migProfiles` extends it for a GPU newer than this list.
MIG_PROFILE_TABLE: Final[dict[str, tuple[str, ...]]] = {
    "A100 40GB": ("1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"),
    "A100 80GB": ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    "A30 24GB": ("1g.6gb", "1g.6gb+me", "2g.12gb", "2g.12gb+me", "4g.24gb"),
    "H100 80GB": ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    "H100 NVL 94GB": ("1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb"),
    "GH200 96GB": ("1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"),
    "H200 141GB": ("1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
    "GH200 144GB": ("1g.18gb", "1g.18gb+me", "1g.36gb", "2g.36gb", "3g.72gb", "4g.72gb", "7g.144gb"),
    "B200 180GB": ("1g.23gb", "1g.23gb+me", "1g.23gb-me", "1g.23gb+me.all", "1g.45gb", "2g.45gb",
                   "2g.45gb-me", "2g.45gb+me.all", "3g.90gb", "4g.90gb", "7g.180gb"),
    "GB200 186GB": ("1g.23gb", "1g.23gb+me", "1g.23gb-me", "1g.23gb+me.all", "1g.47gb", "2g.47gb",
                    "2g.47gb-me", "2g.47gb+me.all", "3g.93gb", "4g.93gb", "7g.186gb"),
}


def mig_resource(profile: str) -> str:
    """``1g.10gb+me`` -> ``nvidia.com/mig-1g.10gb.me`` (the name the node serves the profile under)."""
    return NVIDIA_MIG_PREFIX + profile.replace("+", ".")


def mig_resources(extra_profiles: Iterable[str] = ()) -> tuple[str, ...]:
    """Every MIG resource name of the table plus ``extra_profiles``, sorted, without duplicates."""
    profiles = {p for ps in MIG_PROFILE_TABLE.values() for p in ps} | set(extra_profiles)
    return tuple(sorted({mig_resource(p) for p in profiles}))


# Renamed GPU resources a deployment serves (time-slicing/MPS renames, `--resource-config` short forms) that
# no naming rule can recognise, e.g. the sharing fork's nvidia.com/small. `kubegpu manifests` derives them
# from the values and sets this variable in every role's container; a CLI may set it too. Each role reads it
# at its entry and passes the names down (``replica_resources``), so the parser stays a pure function.
GPU_RESOURCES_ENV: Final = "KUBEGPU_GPU_RESOURCES"
# The node daemon also writes the names it serves on its Node, so readers of Nodes (kubegpu status) need not
# be told: `kubegpu.io/gpu-resources: nvidia.com/gpu,nvidia.com/small`.
SERVED_RESOURCES_ANNOTATION: Final = "kubegpu.io/gpu-resources"


def served_resources(nodes: Iterable[object]) -> frozenset[str]:
    """Every resource name the nodes say their kubegpu node daemon serves (Node dicts)."""
    out: set[str] = set()
    for node in nodes:
        meta = node.get("metadata") if isinstance(node, dict) else None
        ann = meta.get("annotations") if isinstance(meta, dict) else None
        value = ann.get(SERVED_RESOURCES_ANNOTATION) if isinstance(ann, dict) else None
        if isinstance(value, str):
            out.update(n.strip() for n in value.split(",") if "/" in n)
    return frozenset(out)


def declared_gpu_resources(environ: Mapping[str, str]) -> frozenset[str]:
    """The renamed GPU resources a role's environment declares (``KUBEGPU_GPU_RESOURCES``, comma separated);
    the role's entry passes its own environment."""
    return parse_declared(environ.get(GPU_RESOURCES_ENV, ""))


@functools.lru_cache(maxsize=8)
def parse_declared(value: str) -> frozenset[str]:
    """``KUBEGPU_GPU_RESOURCES``'s value (comma separated names) as a set; each role reads it at its entry."""
    return frozenset(n.strip() for n in value.split(",") if n.strip())

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


def is_nvidia_gpu_name(name: str, declared: frozenset[str] = frozenset()) -> bool:
    """True for the ``nvidia.com/`` names that are GPUs: ``gpu``, MIG devices, and replica
    resources, including renamed ones such as ``nvidia.com/sharedgpu``.

    ``nvidia.com/`` also holds NVIDIA network-operator devices (``rdma_shared_device_a``,
    ``hostdev``, SR-IOV pools) that routinely sit beside ``nvidia.com/gpu`` in one container;
    they are not GPUs. A renamed replica resource is recognised when its name contains
    ``gpu`` or when it is in ``declared`` (the deployment's values, which each role's entry reads from
    ``KUBEGPU_GPU_RESOURCES``: :func:`declared_gpu_resources`), as the seed's ``nvidia.com/small`` must be.
    """
    if name in declared:
        return True
    if not name.startswith(NVIDIA_PREFIX):
        return False
    rest = name[len(NVIDIA_PREFIX):]
    return rest.startswith("mig-") or "gpu" in rest.lower()


def is_gpu_resource(name: str, replica_resources: frozenset[str] = frozenset()) -> bool:
    """True for every name kubegpu owns or understands, canonical or alias, or one that
    sits in a GPU scheme's namespace (and is refused there when unknown)."""
    return (name in ALIASES or name in replica_resources
            or name.startswith(KUBEGPU_PREFIX)
            or name.startswith(GPU_ALIAS_PREFIXES) or is_nvidia_gpu_name(name, replica_resources))


def is_known_name(name: str, replica_resources: frozenset[str] = frozenset()) -> bool:
    """True for canonical names, aliases and device-plugin names the parser can turn into a request."""
    if name in ALIASES or name in CANONICAL or name in replica_resources:
        return True
    if name.startswith(KUBEGPU_PREFIX) or name.startswith(GPU_ALIAS_PREFIXES):
        return False
    return is_nvidia_gpu_name(name, replica_resources)
