"""Build the kubelet's ``ContainerAllocateResponse`` for a set of device IDs.

Everything a container needs to see exactly its GPUs, under each device-list strategy
(contracts.md §4–§5): ``envvar`` (``NVIDIA_VISIBLE_DEVICES``), ``volume-mounts`` (``/dev/null``
mounts under ``/var/run/nvidia-container-devices``), ``cdi-annotations`` and ``cdi-cri``;
the ``uuid`` / ``index`` device-ID strategies; ``passDeviceSpecs``; the MPS variables when
MPS sharing or share enforcement is on (asked of the node's MPS side, never invented here);
and the plain ``KUBEGPU_*`` variables describing a share. Checks that need
no live state (unknown IDs, NVIDIA's ``failRequestsGreaterThanOne``) raise
:class:`AllocateError` with NVIDIA's wording; health checks are the server's.
"""

from __future__ import annotations

import os
import uuid as uuidlib
from collections.abc import Mapping, Sequence

from kubegpu.node.cdi import annotation_key, qualified_name
from kubegpu.node.container_env import (
    ENV_CORE,
    ENV_MEMORY,
    ENV_VISIBLE_GPUS,
    VISIBLE_DEVICES,
    VOLUME_MOUNTS_HOST,
    VOLUME_MOUNTS_ROOT,
)
from kubegpu.node.devspecs import CONTROL_DEVICES, MigMinors, mig_cap_paths
from kubegpu.node.mps.spec import Binding
from kubegpu.node.plugin_model import REPLICA_SEPARATOR, AdvertisedDevice, PluginSettings, ResourcePlan
from kubegpu.node.proto import deviceplugin_pb2 as pb
from kubegpu.node.resolver import ResolvedAllocation

CDI_PLUGIN_NAME = "kubegpu-device-plugin"


class AllocateError(ValueError):
    """The request cannot be honoured; the message goes back to the kubelet as is."""


ID_SHOWN = 80  # characters of a device ID an error message repeats (IDs come from the caller)


def shown(device_id: str) -> str:
    return device_id if len(device_id) <= ID_SHOWN else f"{device_id[:ID_SHOWN]}… ({len(device_id)} characters)"


def check_request(plan: ResourcePlan, ids: Sequence[str], known: Mapping[str, AdvertisedDevice]) -> None:
    """NVIDIA's request checks, with NVIDIA's messages."""
    if not ids:
        raise AllocateError(f"invalid allocation request for '{plan.name}': no device IDs")
    if plan.fail_requests_greater_than_one and len(ids) > 1 and any(REPLICA_SEPARATOR in i for i in ids):
        raise AllocateError(f"request for '{plan.name}: {len(ids)}' too large: "
                            "maximum request size for shared resources is 1")
    if len(ids) > len(known):
        raise AllocateError(f"invalid allocation request for '{plan.name}': {len(ids)} device IDs, "
                            f"the resource has {len(known)}")
    for i in ids:
        if i not in known:
            raise AllocateError(f"invalid allocation request for '{plan.name}': unknown device: {shown(i)}")
    if len(set(ids)) != len(ids):
        raise AllocateError(f"invalid allocation request for '{plan.name}': duplicate device IDs")


def _unique(items: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(items))


def runtime_devices(devices: Sequence[AdvertisedDevice], strategy: str) -> list[str]:
    """The names the runtime gets: UUIDs or NVML indexes, replicas collapsed to their device."""
    if strategy == "index":
        return _unique([d.index for d in devices])
    return _unique([d.uuid for d in devices])


def device_specs(devices: Sequence[AdvertisedDevice], driver_root: str,
                 minors: MigMinors) -> list[pb.DeviceSpec]:
    paths: list[str] = []
    for d in devices:
        paths.append(f"/dev/nvidia{d.minor}")
        if d.is_mig:
            assert d.gi is not None and d.ci is not None
            paths += mig_cap_paths(d.minor, d.gi, d.ci, minors)
    paths += list(CONTROL_DEVICES)
    out = []
    for p in _unique(paths):
        host = os.path.join(driver_root, p.lstrip("/")) if driver_root not in ("", "/") else p
        out.append(pb.DeviceSpec(container_path=p, host_path=host, permissions="rw"))
    return out


def _share_values(values: Sequence[int]) -> str:
    """One value when every GPU gets the same, else one per GPU in KUBEGPU_VISIBLE_GPUS order."""
    uniq = _unique([str(v) for v in values])
    return uniq[0] if len(uniq) == 1 else ",".join(str(v) for v in values)


def _mps_binding(plan: ResourcePlan, settings: PluginSettings, gpus: Sequence[str],
                 cores: Sequence[int] | None, mems: Sequence[int] | None) -> Binding | None:
    """The MPS daemon that holds this container to its share, or None when nothing is to be enforced.

    MPS replicas are never served without their daemon (the H200 showed their limits are void without
    one); a fine-grained share is served through its daemon when enforcement is on."""
    enforcer = settings.enforcer
    try:
        if plan.sharing == "mps":
            if enforcer is None:
                raise AllocateError(f"'{plan.name}' is shared with MPS but no MPS control daemon runs "
                                    "on this node: its limits would be void")
            return enforcer.for_replicas(plan.name, gpus)
        if plan.sharing != "time-slicing" and enforcer is not None and cores is not None and mems is not None:
            return enforcer.for_share(list(zip(gpus, cores, mems, strict=True)), gpus)
    except RuntimeError as exc:  # MpsError: the daemon is down, the GPU cannot be enforced, ...
        raise AllocateError(f"'{plan.name}': share cannot be enforced: {exc}") from exc
    return None


def build_response(plan: ResourcePlan, ids: Sequence[str], known: Mapping[str, AdvertisedDevice],
                   settings: PluginSettings, *, resolved: ResolvedAllocation | None = None,
                   by_uuid: Mapping[str, AdvertisedDevice] | None = None,
                   mig_minors: MigMinors | None = None) -> pb.ContainerAllocateResponse:
    """The response for one container request (``ids`` already checked by :func:`check_request`).

    With ``resolved`` (full mode) the GPUs are the recorded ones, whatever slots the kubelet
    picked; ``by_uuid`` maps a GPU/MIG UUID to one of its advertised devices for that."""
    if resolved is not None:
        if by_uuid is None:
            raise AllocateError("internal error: resolved allocation without a device table")
        missing = [g.uuid for g in resolved.gpus if g.uuid not in by_uuid]
        if missing:
            raise AllocateError(f"allocation recorded for {resolved.pod or 'the pod'} names GPUs this node "
                                f"does not have: {', '.join(missing)}")
        devices = [by_uuid[g.uuid] for g in resolved.gpus]
    else:
        devices = [known[i] for i in ids]
    names = runtime_devices(devices, settings.device_id_strategy)
    resp = pb.ContainerAllocateResponse()
    envs: dict[str, str] = {}
    strategies = settings.device_list_strategies

    if settings.cdi_enabled:
        cdi = [qualified_name(settings.cdi_vendor, settings.cdi_class, n) for n in names]
        if settings.gdrcopy_enabled:
            cdi.append(qualified_name(settings.cdi_vendor, "gdrcopy", "all"))
        if settings.gds_enabled:
            cdi.append(qualified_name(settings.cdi_vendor, "gds", "all"))
        if settings.mofed_enabled:
            cdi.append(qualified_name(settings.cdi_vendor, "mofed", "all"))
        if "cdi-annotations" in strategies:
            key = annotation_key(settings.cdi_annotation_prefix, CDI_PLUGIN_NAME, str(uuidlib.uuid4()))
            resp.annotations[key] = ",".join(cdi)
        if "cdi-cri" in strategies:
            resp.cdi_devices.extend(pb.CDIDevice(name=n) for n in cdi)
    if "envvar" in strategies:
        envs[VISIBLE_DEVICES] = ",".join(names)
    if "volume-mounts" in strategies:
        envs[VISIBLE_DEVICES] = VOLUME_MOUNTS_ROOT
        resp.mounts.extend(pb.Mount(host_path=VOLUME_MOUNTS_HOST, container_path=f"{VOLUME_MOUNTS_ROOT}/{n}")
                           for n in names)
    if settings.pass_device_specs:
        resp.devices.extend(device_specs(devices, settings.dev_root, mig_minors or {}))
    if settings.gdrcopy_enabled:
        envs["NVIDIA_GDRCOPY"] = "enabled"
    if settings.gds_enabled:
        envs["NVIDIA_GDS"] = "enabled"
    if settings.mofed_enabled:
        envs["NVIDIA_MOFED"] = "enabled"

    # What the share is, when known: recorded by the scheduler, or implied by the replica count.
    gpus = _unique([d.uuid for d in devices])
    envs[ENV_VISIBLE_GPUS] = ",".join(gpus)
    cores: list[int] | None = None
    mems: list[int] | None = None
    if resolved is not None:
        cores = [g.core_percent for g in resolved.gpus]
        mems = [g.memory_bytes or by_uuid[g.uuid].memory_bytes for g in resolved.gpus]  # type: ignore[index]
    elif plan.sharing in ("time-slicing", "mps") and plan.replicas > 1:
        first = {d.uuid: d for d in devices}
        cores = [max(1, 100 // plan.replicas) for _ in gpus]
        mems = [first[u].memory_bytes // plan.replicas for u in gpus]
    if cores is not None and mems is not None:
        envs[ENV_CORE] = _share_values(cores)
        envs[ENV_MEMORY] = _share_values(mems)

    share_gpus = [g.uuid for g in resolved.gpus] if resolved is not None else gpus
    binding = _mps_binding(plan, settings, share_gpus, cores, mems)
    if binding is not None:
        envs.update(binding.env)
        resp.mounts.extend(pb.Mount(container_path=c, host_path=h) for h, c in binding.mounts)
    for k, v in settings.extra_env:
        envs.setdefault(k, v)
    for k, v in envs.items():
        resp.envs[k] = v
    return resp
