"""The device plugin's Allocate: the container's :class:`ContainerEdits` for a set of device IDs, and
their rendering as the kubelet's ``ContainerAllocateResponse``.

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

from kubegpu.node.container_edits import (
    VISIBLE_DEVICES,
    VOLUME_MOUNTS_HOST,
    VOLUME_MOUNTS_ROOT,
    ContainerEdits,
    MigMinors,
    SharePart,
    container_edits,
    unique,
)
from kubegpu.node.deviceplugin.cdi import annotation_key, qualified_name
from kubegpu.node.deviceplugin.plugin_model import (
    REPLICA_SEPARATOR,
    AdvertisedDevice,
    Enforcer,
    PluginSettings,
    ResourcePlan,
)
from kubegpu.node.deviceplugin.resolver import ResolvedAllocation
from kubegpu.node.mps.spec import Binding
from kubegpu.node.proto import deviceplugin_pb2 as pb

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


def runtime_devices(devices: Sequence[AdvertisedDevice], strategy: str) -> list[tuple[str, AdvertisedDevice]]:
    """(name the runtime gets, device) once per device: UUIDs or NVML indexes, replicas collapsed."""
    out: dict[str, AdvertisedDevice] = {}
    for d in devices:
        out.setdefault(d.index if strategy == "index" else d.uuid, d)
    return list(out.items())


def holder_of(resource: str, device_ids: Sequence[str]) -> str:
    """The name strict enforcement knows a container by. Built from what the kubelet gives ``Allocate`` and
    lists again in PodResources (a device ID is held by one container at a time), so the node can tell which
    holders still live (:meth:`kubegpu.node.daemon.NodeDaemon.reconcile_holders`) with or without the
    scheduler's record of the pod."""
    return f"{resource} {','.join(sorted(device_ids))}"


def _mps_binding(plan: ResourcePlan, settings: PluginSettings, gpus: Sequence[str],
                 shares: Sequence[SharePart], holder: str) -> Binding | None:
    """The MPS daemon that holds this container to its share, or None when nothing is to be enforced.

    MPS replicas are never served without their daemon (the H200 showed their limits are void without
    one); a fine-grained share is served through its daemon when enforcement is on. A container that gets
    its GPUs whole first claims them (strict: refused while shares hold one, each GPU's mode put back)."""
    enforcer = settings.enforcer
    try:
        if plan.sharing == "mps":
            if enforcer is None:
                raise AllocateError(f"'{plan.name}' is shared with MPS but no MPS control daemon runs "
                                    "on this node: its limits would be void")
            return enforcer.for_replicas(plan.name, gpus)
        if plan.sharing == "time-slicing" or enforcer is None:
            return None
        bound = enforcer.for_share(shares, gpus, holder) if shares else None
    except RuntimeError as exc:  # MpsError: the daemon is down, the GPU cannot be enforced, ...
        raise AllocateError(f"'{plan.name}': share cannot be enforced: {exc}") from exc
    if bound is None:
        _claim_whole(plan, enforcer, gpus, holder)
    return bound


def _claim_whole(plan: ResourcePlan, enforcer: Enforcer, gpus: Sequence[str], holder: str) -> None:
    claimed: list[str] = []
    try:
        for u in gpus:
            enforcer.claim_whole(u, holder)
            claimed.append(u)
    except RuntimeError as exc:  # MpsError: strict shares hold the GPU, or its mode cannot be put back
        for u in claimed:
            enforcer.release_whole(u, holder)
        raise AllocateError(f"'{plan.name}': the GPU cannot be given whole now: {exc}") from exc


def container_edits_for(plan: ResourcePlan, ids: Sequence[str], known: Mapping[str, AdvertisedDevice],
                        settings: PluginSettings, *, resolved: ResolvedAllocation | None = None,
                        by_uuid: Mapping[str, AdvertisedDevice] | None = None,
                        mig_minors: MigMinors | None = None) -> ContainerEdits:
    """What the container behind one request gets (``ids`` already checked by :func:`check_request`).

    With ``resolved`` (full mode) the GPUs are the recorded ones, whatever slots the kubelet
    picked; ``by_uuid`` maps a GPU/MIG UUID to one of its advertised devices for that."""
    if resolved is not None:
        if by_uuid is None:
            raise AllocateError("internal error: resolved allocation without a device table")
        missing = [u for u in resolved.uuids if u not in by_uuid]
        if missing:
            raise AllocateError(f"allocation recorded for {resolved.pod or 'the pod'} names GPUs this node "
                                f"does not have: {', '.join(missing)}")
        devices = [by_uuid[u] for u in resolved.uuids]
    else:
        devices = [known[i] for i in ids]
    gpus = unique(d.uuid for d in devices)
    # What the share is, when known: recorded by the scheduler, or implied by the replica count.
    shares: list[SharePart] = []
    if resolved is not None:
        shares = [(u, g.core, g.memory_bytes or by_uuid[u].memory_bytes)  # type: ignore[index]
                  for u, g in zip(resolved.uuids, resolved.gpus, strict=True)]
    elif plan.sharing in ("time-slicing", "mps") and plan.replicas > 1:
        first = {d.uuid: d for d in devices}
        shares = [(u, max(1, 100 // plan.replicas), first[u].memory_bytes // plan.replicas) for u in gpus]
    order = list(resolved.uuids) if resolved is not None else gpus
    return container_edits(runtime_devices(devices, settings.device_id_strategy), gpus, shares,
                           _mps_binding(plan, settings, order, shares, holder_of(plan.name, ids)),
                           minors=mig_minors)


def build_response(plan: ResourcePlan, edits: ContainerEdits,
                   settings: PluginSettings) -> pb.ContainerAllocateResponse:
    """``edits`` as the kubelet's answer, under the node's device-list strategies."""
    names = edits.names
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
        root = settings.dev_root
        resp.devices.extend(
            pb.DeviceSpec(container_path=p, host_path=os.path.join(root, p.lstrip("/")) if root not in ("", "/")
                          else p, permissions="rw") for p in edits.device_nodes())
    if settings.gdrcopy_enabled:
        envs["NVIDIA_GDRCOPY"] = "enabled"
    if settings.gds_enabled:
        envs["NVIDIA_GDS"] = "enabled"
    if settings.mofed_enabled:
        envs["NVIDIA_MOFED"] = "enabled"
    envs.update(edits.env())
    resp.mounts.extend(pb.Mount(container_path=c, host_path=h) for h, c in edits.mps_mounts())
    for k, v in settings.extra_env:
        envs.setdefault(k, v)
    for k, v in envs.items():
        resp.envs[k] = v
    return resp
