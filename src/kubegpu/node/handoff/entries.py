"""A pod bound to this node, as the handoff sees it: one :class:`Entry` per GPU container record.

Pure: built from the pod object alone (and the record key). Which device-plugin resource a
container's record is served through, how many device IDs the kubelet will pass, which GPUs the
record names, and which GPUs the kubelet will *reuse* from the pod's init containers (it hands an
app container the devices its init containers had, before anything else; kubelet
``devicesToReuse``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kubegpu.model import resources as R
from kubegpu.model.allocation import DeviceGrant, PodAllocation
from kubegpu.model.records import Ack, device_resource, read_pod, request_shapes
from kubegpu.model.request import parse_pod

TERMINAL = frozenset({"Succeeded", "Failed"})


@dataclass(frozen=True, slots=True)
class Entry:
    """One container's record, waiting for (or served by) its Allocate."""

    rank: tuple[Any, ...]
    pod_key: str  # namespace/name
    uid: str
    container: str
    init: bool
    resource: str
    count: int
    grants: tuple[DeviceGrant, ...]
    reuse: frozenset[str] = frozenset()  # GPUs of this pod's init containers the kubelet reuses here

    @property
    def uuids(self) -> tuple[str, ...]:
        return tuple(g.mig_uuid or g.uuid for g in self.grants)

    def shares(self, gpus: tuple[str, ...] | None = None) -> tuple[DeviceGrant, ...]:
        """What to serve: the record's amounts, on ``gpus`` (the kubelet's, same count) if given."""
        by = {g.mig_uuid or g.uuid: g for g in self.grants}
        order = gpus if gpus is not None else self.uuids
        out = []
        for i, u in enumerate(order):
            g = by.get(u)
            if g is None:  # the kubelet's device in the record's place: the record's amounts on it
                g = replace(self.grants[min(i, len(self.grants) - 1)], uuid=u, mig_uuid=None, mig_profile=None)
            out.append(g)
        return tuple(out)


@dataclass(slots=True)
class PodView:
    key: str
    uid: str
    created: str
    seen: int
    entries: list[Entry]
    acks: dict[str, Ack] = field(default_factory=dict)
    held: PodAllocation | None = None  # what the pod holds on its GPUs (PodAllocation.held)
    forged: bool = False
    problems: tuple[str, ...] = ()
    whole_bypass: bool = False  # asks nvidia.com/gpu but has no record (not placed by the extender)
    unrecorded: frozenset[tuple[str, int]] = frozenset()  # (resource, count) asked without a record
    running: bool = False  # the kubelet runs it: its Allocate calls are done, its records wait for nothing
    # (container, kubelet resource, device count, init) of every container the kubelet will call the plugins
    # for, recorded or not: which calls this pod can still make (kubegpu.node.handoff.callers)
    asks: tuple[tuple[str, str, int, bool], ...] = ()


def pod_view(pod: Mapping[str, Any], seen: int, key: bytes | None,
             gpu_resources: frozenset[str] = frozenset()) -> PodView:
    meta = pod.get("metadata") or {}
    pkey = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
    uid = str(meta.get("uid") or "")
    created = str(meta.get("creationTimestamp") or "")
    recs = read_pod(pod, key)
    request = parse_pod(pod, replica_resources=gpu_resources)
    entries: list[Entry] = []
    reusable: dict[str, list[str]] = {}
    asks_whole = False
    asks: list[tuple[str, str, int, bool]] = []
    for position, c in enumerate(request.gpu_containers):
        req = c.request
        if req is None:
            continue
        resource = device_resource(req)
        if resource == R.NVIDIA_GPU:
            asks_whole = True
        if resource is not None:
            asks.append((c.name, resource, req.count, c.init))
        if resource is None or recs.record is None:
            continue
        rec = recs.record.for_container(c.name)
        if rec is None or not rec.grants:
            continue
        uuids = [g.mig_uuid or g.uuid for g in rec.grants]
        pool = reusable.setdefault(resource, [])
        reuse = frozenset(pool) if not c.init else frozenset()
        entries.append(Entry((created, seen, pkey, position), pkey, uid, c.name, c.init, resource,
                             req.count, rec.grants, reuse))
        if c.init:
            pool.extend(u for u in uuids if u not in pool)
        else:
            reusable[resource] = [u for u in pool if u not in uuids]
    allocation = recs.allocation()
    unrecorded = frozenset(s[:2] for s in request_shapes(request, recs.acks)) if recs.record is None else frozenset()
    return PodView(pkey, uid, created, seen, entries, dict(recs.acks),
                   allocation.held() if allocation is not None else None, recs.forged, recs.problems,
                   whole_bypass=asks_whole and recs.record is None, unrecorded=unrecorded,
                   running=(pod.get("status") or {}).get("phase") == "Running", asks=tuple(asks))


def is_live_here(pod: Mapping[str, Any], node: str) -> bool:
    phase = (pod.get("status") or {}).get("phase")
    return phase not in TERMINAL and (pod.get("spec") or {}).get("nodeName") == node
