"""Config + inventory -> the resources this node serves and their device IDs.

Pure functions, NVIDIA's rules (``internal/rm`` of k8s-device-plugin), in the plugin's own
types (:mod:`kubegpu.node.deviceplugin.plugin_model`):

- ``resources.gpus`` patterns (default ``* -> nvidia.com/gpu``) name whole GPUs by model;
- MIG strategy ``none``: every GPU whole, MIG mode ignored; ``single``: MIG devices served as
  ``nvidia.com/gpu`` and the node must be uniform; ``mixed``: ``nvidia.com/mig-<profile>`` per
  GPU-instance profile (``+`` becomes ``.``; compute-instance splits are not served by
  default), whole GPUs for the rest. The invalid cases fail with NVIDIA's messages;
- time-slicing / MPS replicas ``<uuid>::<k>``, under ``rename``, ``<name>.shared`` with
  ``renameByDefault``, or the same name; the ``devices`` selection (all, a count, indexes or
  UUIDs) is honoured, unselected devices stay whole under the base name; a rename with one
  replica is a plain rename (the sharing fork's ``mig-3g.20gb:gpu:1``); MPS refuses MIG and GPUs older
  than Volta (``node.mps.capability``);
- ``kubegpu.io/gpu.shared``: ``sharedSlots`` slots ``<uuid>::<k>`` per whole GPU.

Health is not decided here: the daemon's health state marks devices by their ``gpu_uuid``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping, Sequence

from kubegpu.inventory.mig import PROFILE_RE
from kubegpu.model import resources as R
from kubegpu.model.inventory import Gpu, MigDevice, NodeInventory
from kubegpu.node.config import Config, ReplicaDevices, ReplicatedResource, ResourcePattern
from kubegpu.node.deviceplugin.plugin_model import REPLICA_SEPARATOR, AdvertisedDevice, PluginSettings, ResourcePlan
from kubegpu.node.mps.capability import refusal as mps_refusal


class ResourceError(ValueError):
    """This config cannot be served on this node; the message says why (NVIDIA's wording for MIG)."""


def whole_device(g: Gpu) -> AdvertisedDevice:
    return AdvertisedDevice(id=g.uuid, uuid=g.uuid, index=str(g.index), gpu_uuid=g.uuid, minor=g.minor,
                            numa_node=g.numa_node, memory_bytes=g.memory_bytes)


def mig_device(g: Gpu, m: MigDevice) -> AdvertisedDevice:
    return AdvertisedDevice(id=m.uuid, uuid=m.uuid, index=f"{g.index}:{m.index}", gpu_uuid=g.uuid,
                            minor=g.minor, numa_node=g.numa_node, gi=m.gi, ci=m.ci,
                            memory_bytes=m.memory_bytes)


def mig_resource_name(profile: str) -> str:
    """``1g.10gb+me`` -> ``nvidia.com/mig-1g.10gb.me`` (``+`` is not allowed in resource names)."""
    return R.mig_resource(profile)


def _match(patterns: Sequence[ResourcePattern], value: str) -> str | None:
    for p in patterns:
        if fnmatch.fnmatchcase(value, p.pattern):
            return p.name
    return None


def base_resources(inv: NodeInventory, mig_strategy: str, gpu_patterns: Sequence[ResourcePattern] = (),
                   mig_patterns: Sequence[ResourcePattern] = ()) -> dict[str, list[AdvertisedDevice]]:
    """Resource name -> devices before sharing, under one MIG strategy."""
    gpu_patterns = tuple(gpu_patterns) or (ResourcePattern("*", R.NVIDIA_GPU),)
    out: dict[str, list[AdvertisedDevice]] = {}
    if mig_strategy not in ("none", "single", "mixed"):
        raise ResourceError(f"unknown MIG strategy {mig_strategy!r} (want none, single or mixed)")
    whole = [g for g in inv.gpus if mig_strategy == "none" or not g.mig_enabled]
    for g in whole:
        name = _match(gpu_patterns, g.model)
        if name is not None:
            out.setdefault(name, []).append(whole_device(g))
    if mig_strategy == "none":
        return out

    enabled = [g for g in inv.gpus if g.mig_enabled]
    for g in enabled:
        if not g.mig_devices:
            raise ResourceError("invalid MIG configuration: at least one device with migEnabled=true was not "
                                f"configured correctly: device {g.index} has no MIG devices configured")
    if mig_strategy == "single":
        profiles = {m.profile for g in enabled for m in g.mig_devices}
        if len(profiles) > 1:
            raise ResourceError("invalid MIG configuration: more than one MIG device type present on node "
                                f"({', '.join(sorted(profiles))})")
        if enabled and whole:
            raise ResourceError("all devices on the node must be configured with the same migEnabled value")
    for g in enabled:
        for m in g.mig_devices:
            name = _mig_name(m, mig_strategy, mig_patterns)
            if name is not None:
                out.setdefault(name, []).append(mig_device(g, m))
    return out


def _mig_name(m: MigDevice, strategy: str, patterns: Sequence[ResourcePattern]) -> str | None:
    if patterns:
        return _match(patterns, m.profile)
    if strategy == "single":
        return R.NVIDIA_GPU
    # mixed: NVIDIA's default patterns cover GPU-instance profiles only, so a compute-instance
    # split (1c.3g.40gb) is not served unless a pattern names it.
    parsed = PROFILE_RE.match(m.profile)
    if parsed is None or parsed["c"]:
        return None
    return mig_resource_name(m.profile)


def _selected(devices: Sequence[AdvertisedDevice], sel: ReplicaDevices, where: str) -> list[AdvertisedDevice]:
    if sel.all:
        return list(devices)
    if sel.count:
        if sel.count > len(devices):
            raise ResourceError(
                f"{where}: devices asks for {sel.count} devices but the node has {len(devices)}")
        return list(devices[: sel.count])
    chosen: list[AdvertisedDevice] = []
    for ref in sel.ids:
        match = [d for d in devices if ref in (d.uuid, d.index, d.gpu_uuid)]
        if not match:
            raise ResourceError(f"{where}: devices entry {ref!r} matches no device of this node")
        chosen += [d for d in match if d not in chosen]
    return chosen


def replicas_of(devices: Sequence[AdvertisedDevice], n: int) -> list[AdvertisedDevice]:
    """``n`` replica IDs ``<uuid>::<k>`` per device, device by device."""
    return [dataclasses.replace(d, id=f"{d.uuid}{REPLICA_SEPARATOR}{k}", replica=k)
            for d in devices for k in range(n)]


def expand(inv: NodeInventory, config: Config) -> list[ResourcePlan]:
    """Every resource this node serves under ``config``, in a stable order. Raises ResourceError."""
    base = base_resources(inv, config.flags.mig_strategy, config.resources.gpus, config.resources.migs)
    sharing = config.sharing
    strategy = sharing.strategy
    active = sharing.active
    plain: dict[str, list[AdvertisedDevice]] = {k: list(v) for k, v in base.items()}
    shared: dict[str, tuple[list[AdvertisedDevice], ReplicatedResource]] = {}
    for rr in active.resources:
        where = f"sharing.{'mps' if strategy == 'mps' else 'timeSlicing'} {rr.name}"
        if rr.name not in base:
            continue  # NVIDIA: a replicated resource this node does not have is skipped
        if strategy == "mps" and any(d.is_mig for d in base[rr.name]):
            raise ResourceError(f"{where}: sharing using MPS is not supported for MIG devices")
        chosen = _selected(base[rr.name], rr.devices, where)
        if strategy == "mps":
            for d in chosen:
                why = mps_refusal(inv.gpu(d.gpu_uuid))
                if why:
                    raise ResourceError(f"{where}: sharing using MPS is not supported on GPU {d.index}: {why}")
        name = active.served_name(rr)
        ids = {d.id for d in chosen}
        plain[rr.name] = [d for d in plain[rr.name] if d.id not in ids]
        if rr.replicas == 1:
            plain.setdefault(name, []).extend(chosen)  # a rename (or nothing), not sharing
            continue
        if name in shared or (name != rr.name and name in base):
            raise ResourceError(f"{where}: resource {name} would mix replicas with other devices")
        shared[name] = (replicas_of(chosen, rr.replicas), rr)

    plans: list[ResourcePlan] = []
    for name in _ordered(set(plain) | set(shared)):
        devices = list(plain.get(name, ()))
        if name in shared:
            reps, rr = shared[name]
            plans.append(ResourcePlan(name=name, devices=tuple(devices + reps),
                                      sharing=strategy,  # type: ignore[arg-type]
                                      replicas=rr.replicas,
                                      fail_requests_greater_than_one=active.fail_requests_greater_than_one))
        elif devices:
            plans.append(ResourcePlan(name=name, devices=tuple(devices)))
    slots = config.kubegpu.shared_slots
    if slots > 0:
        none = config.flags.mig_strategy == "none"
        whole = [whole_device(g) for g in inv.gpus if none or not g.mig_enabled]
        if whole:
            plans.append(ResourcePlan(name=R.GPU_SLOTS, devices=tuple(replicas_of(whole, slots)),
                                      sharing="slots", replicas=slots))
    return plans


def _ordered(names: set[str]) -> list[str]:
    """nvidia.com/gpu first, then MIG resources, then the rest, each alphabetically."""
    return sorted(names, key=lambda n: (n != R.NVIDIA_GPU, not n.startswith(R.NVIDIA_MIG_PREFIX), n))


def resource_counts(plans: Sequence[ResourcePlan]) -> dict[str, int]:
    """Resource name -> number of advertised devices (capacity before health)."""
    return {p.name: len(p.devices) for p in plans}


def plugin_settings(config: Config, **overrides: object) -> PluginSettings:
    """The plugin servers' settings from the config."""
    f = config.flags
    values: Mapping[str, object] = {
        "device_list_strategies": f.plugin.device_list_strategy,
        "device_id_strategy": f.plugin.device_id_strategy,
        "pass_device_specs": f.plugin.pass_device_specs,
        "driver_root": f.nvidia_driver_root,
        "dev_root": f.dev_root,
        "gdrcopy_enabled": f.gdrcopy_enabled,
        "gds_enabled": f.gds_enabled,
        "mofed_enabled": f.mofed_enabled,
        "cdi_dir": config.kubegpu.cdi_spec_dir,
        "cdi_annotation_prefix": f.plugin.cdi_annotation_prefix,
        "nvidia_ctk_path": f.plugin.nvidia_ctk_path,
        "container_driver_root": f.plugin.container_driver_root,
        "cdi_feature_flags": f.plugin.cdi_feature_flags,
        "mps_root": f.mps_root,
        "replica_policy": config.kubegpu.replica_choice,
        **overrides,
    }
    # Every setting reaches the servers: a name PluginSettings lacks is a bug here, not a value to drop.
    return PluginSettings(**values)  # type: ignore[arg-type]
