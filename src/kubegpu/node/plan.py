"""Which resources this node serves and with which device IDs: inventory + config -> ResourcePlans.

NVIDIA's rules: MIG strategies ``none`` (MIG ignored, whole GPUs), ``single`` (every GPU
MIG-enabled with one profile, served as ``nvidia.com/gpu``) and ``mixed``
(``nvidia.com/mig-<profile>`` per profile, whole GPUs for the rest); time-slicing / MPS
replicas ``<uuid>::<k>`` with ``rename`` / ``renameByDefault`` (``<name>.shared``) and the
per-resource ``devices`` selection (``all``, a count, or GPU indexes / UUIDs), which
NVIDIA's plugin parses but ignores and kubegpu honours: unselected GPUs stay whole under the
base name. Plus kubegpu's own ``kubegpu.io/gpu.shared`` slots for fine-grained sharing.

This module takes the typed :class:`PlanConfig`; the daemon fills it from the node config.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from kubegpu.model import resources as R
from kubegpu.model.inventory import Gpu, NodeInventory
from kubegpu.node.plugin_model import REPLICA_SEPARATOR, AdvertisedDevice, ResourcePlan, Sharing

MigStrategy = Literal["none", "single", "mixed"]


class PlanError(ValueError):
    """The config cannot be served on this node (NVIDIA's MIG strategy errors and the like)."""


@dataclass(frozen=True, slots=True)
class ReplicatedResource:
    """One ``sharing.timeSlicing.resources`` / ``sharing.mps.resources`` entry."""

    name: str  # the resource it replicates: nvidia.com/gpu or nvidia.com/mig-<profile>
    replicas: int
    rename: str = ""
    devices: str | int | tuple[str, ...] = "all"  # "all", a count, or indexes / UUIDs


@dataclass(frozen=True, slots=True)
class PlanConfig:
    mig_strategy: MigStrategy = "none"
    sharing: Literal["none", "time-slicing", "mps"] = "none"
    replicated: tuple[ReplicatedResource, ...] = ()
    rename_by_default: bool = False
    fail_requests_greater_than_one: bool = False
    gpu_shared_slots: int = 0  # kubegpu.io/gpu.shared slots per GPU (0 = not served)
    extra: dict[str, object] = field(default_factory=dict)


def _whole(g: Gpu) -> AdvertisedDevice:
    return AdvertisedDevice(id=g.uuid, uuid=g.uuid, index=str(g.index), gpu_uuid=g.uuid, minor=g.minor,
                            numa_node=g.numa_node, memory_bytes=g.memory_bytes)


def _migs(g: Gpu) -> list[tuple[str, AdvertisedDevice]]:
    return [(m.profile, AdvertisedDevice(id=m.uuid, uuid=m.uuid, index=f"{g.index}:{m.index}",
                                         gpu_uuid=g.uuid, minor=g.minor, numa_node=g.numa_node,
                                         gi=m.gi, ci=m.ci, memory_bytes=m.memory_bytes))
            for m in g.mig_devices]


def base_resources(inv: NodeInventory, strategy: MigStrategy) -> dict[str, list[AdvertisedDevice]]:
    """Resource name -> devices before sharing, under one MIG strategy (NVIDIA's errors included)."""
    out: dict[str, list[AdvertisedDevice]] = {}
    if strategy == "none":
        if inv.gpus:
            out[R.NVIDIA_GPU] = [_whole(g) for g in inv.gpus]
        return out
    if strategy == "single":
        enabled = [g for g in inv.gpus if g.mig_enabled]
        if not enabled:
            if inv.gpus:
                out[R.NVIDIA_GPU] = [_whole(g) for g in inv.gpus]
            return out
        if len(enabled) != len(inv.gpus):
            raise PlanError("invalid MIG configuration for strategy 'single': all GPUs on the node must have "
                            "the same migEnabled value")
        migs = [x for g in enabled for x in _migs(g)]
        if any(not g.mig_devices for g in enabled):
            raise PlanError("invalid MIG configuration for strategy 'single': a MIG-enabled GPU has no MIG "
                            "devices configured")
        profiles = sorted({p for p, _ in migs})
        if len(profiles) > 1:
            raise PlanError("invalid MIG configuration for strategy 'single': more than one MIG device type "
                            f"present on node ({', '.join(profiles)})")
        out[R.NVIDIA_GPU] = [d for _, d in migs]
        return out
    if strategy == "mixed":
        whole = [_whole(g) for g in inv.gpus if not g.mig_enabled]
        if whole:
            out[R.NVIDIA_GPU] = whole
        for g in inv.gpus:
            if g.mig_enabled:
                for profile, d in _migs(g):
                    out.setdefault(R.NVIDIA_MIG_PREFIX + profile, []).append(d)
        return out
    raise PlanError(f"unknown MIG strategy {strategy!r} (want none, single or mixed)")


def _selected(devices: Sequence[AdvertisedDevice], sel: str | int | tuple[str, ...],
              resource: str) -> list[AdvertisedDevice]:
    if sel == "all":
        return list(devices)
    if isinstance(sel, int):
        if sel < 0:
            raise PlanError(f"sharing resource {resource}: devices count must be >= 0, got {sel}")
        return list(devices[:sel])
    if isinstance(sel, str):
        raise PlanError(f"sharing resource {resource}: devices must be 'all', a count or a list, got {sel!r}")
    chosen = []
    for ref in sel:
        match = [d for d in devices if ref in (d.uuid, d.index, d.gpu_uuid)]
        if not match:
            raise PlanError(f"sharing resource {resource}: devices entry {ref!r} matches no device "
                            f"of {resource}")
        chosen += [d for d in match if d not in chosen]
    return chosen


def _replicas(devices: Sequence[AdvertisedDevice], n: int) -> list[AdvertisedDevice]:
    return [AdvertisedDevice(id=f"{d.uuid}{REPLICA_SEPARATOR}{k}", uuid=d.uuid, index=d.index,
                             gpu_uuid=d.gpu_uuid, minor=d.minor, numa_node=d.numa_node, replica=k,
                             gi=d.gi, ci=d.ci, memory_bytes=d.memory_bytes)
            for d in devices for k in range(n)]


def build_plans(inv: NodeInventory, cfg: PlanConfig) -> list[ResourcePlan]:
    """Every resource this node serves, in a stable order."""
    base = base_resources(inv, cfg.mig_strategy)
    plans: dict[str, ResourcePlan] = {}
    plain: dict[str, list[AdvertisedDevice]] = {k: list(v) for k, v in base.items()}
    sharing: Sharing = cfg.sharing
    for rr in cfg.replicated:
        if rr.replicas < 1:
            raise PlanError(f"sharing resource {rr.name}: replicas must be >= 1, got {rr.replicas}")
        if rr.name not in base:
            continue  # NVIDIA skips replicas for a resource this node does not have
        if sharing == "mps" and any(d.is_mig for d in base[rr.name]):
            raise PlanError("sharing using MPS is not supported for MIG devices")
        chosen = _selected(base[rr.name], rr.devices, rr.name)
        name = rr.rename or (rr.name + ".shared" if cfg.rename_by_default else rr.name)
        ids = {d.id for d in chosen}
        plain[rr.name] = [d for d in plain[rr.name] if d.id not in ids]
        if rr.replicas == 1 and name == rr.name:
            plain[rr.name] += chosen  # one replica of itself is the device itself
            continue
        devs = _replicas(chosen, rr.replicas)
        if name in plans:
            raise PlanError(f"sharing: resource name {name} is produced twice")
        plans[name] = ResourcePlan(name=name, devices=tuple(devs), sharing=sharing, replicas=rr.replicas,
                                   fail_requests_greater_than_one=cfg.fail_requests_greater_than_one)
    out: list[ResourcePlan] = []
    for name, devs in plain.items():
        if not devs:
            continue
        if name in plans:
            # Unselected whole devices share the name with the replicas (no rename): one server.
            p = plans.pop(name)
            out.append(ResourcePlan(name=name, devices=tuple(devs) + p.devices, sharing=p.sharing,
                                    replicas=p.replicas,
                                    fail_requests_greater_than_one=p.fail_requests_greater_than_one))
        else:
            out.append(ResourcePlan(name=name, devices=tuple(devs)))
    out += plans.values()
    if cfg.gpu_shared_slots > 0:
        gpus = [g for g in inv.gpus if not g.mig_enabled]
        if gpus:
            out.append(ResourcePlan(name=R.GPU_SLOTS, devices=tuple(_replicas([_whole(g) for g in gpus],
                                                                               cfg.gpu_shared_slots)),
                                    sharing="slots", replicas=cfg.gpu_shared_slots))
    return out


def parse_resource_config(value: str) -> ReplicatedResource:
    """The sharing fork's short form ``gpu:sharedgpu:4``: replicate ``nvidia.com/gpu`` 4 times as
    ``nvidia.com/sharedgpu``."""
    parts = value.split(":")
    if len(parts) != 3:
        raise PlanError(f"--resource-config {value!r}: want <resource>:<new name>:<replicas>, "
                        "e.g. gpu:sharedgpu:4")
    src, dst, n = (p.strip() for p in parts)
    try:
        replicas = int(n)
    except ValueError:
        raise PlanError(f"--resource-config {value!r}: replicas {n!r} is not an integer") from None
    if replicas < 1 or replicas > 1024:
        raise PlanError(f"--resource-config {value!r}: replicas must be 1..1024")
    if not src or not dst:
        raise PlanError(f"--resource-config {value!r}: empty resource name")
    full = lambda s: s if "/" in s else f"nvidia.com/{s}"  # noqa: E731
    return ReplicatedResource(name=full(src), replicas=replicas, rename=full(dst))
