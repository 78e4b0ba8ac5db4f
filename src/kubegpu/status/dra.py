"""DRA nodes and claims in ``kubegpu status``: ResourceSlices -> inventories, allocated claims -> pod records.

A node served by kubegpu's DRA driver publishes no ``Device`` object; its ResourceSlices
(driver ``gpu.kubegpu.io``) describe its GPUs instead, and the allocations are in ResourceClaims.
This turns both into the view's own types, so DRA allocations appear beside device-plugin ones:

- each ``gpu`` / ``shared-gpu`` device is a GPU (uuid, index, minor, product, memory, NUMA, how its shares
  are enforced; a taint makes it unhealthy); MIG devices are attached to their parent;
- each allocated claim is a record for every pod in ``reservedFor``: a whole GPU is 100 % of it, a
  MIG device its GPU-instance slices of 7 (a 1g.10gb is 14 %, as the device-plugin path counts it),
  a share its ``consumedCapacity`` (compute percent, memory bytes). MIG devices carry their
  position on the parent and their slices (the ``compute-slices`` they consume), for the MIG layout.

A cluster without ``resource.k8s.io/v1`` (before 1.34) simply contributes nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from kubegpu.model.allocation import ContainerAllocation, DeviceGrant, PodAllocation
from kubegpu.model.inventory import Gpu, MigDevice, NodeInventory
from kubegpu.model.quantity import QuantityError, parse_int
from kubegpu.node.dra.names import DRIVER, MODE_LABEL, TYPE_GPU, TYPE_MIG, TYPE_SHARED
from kubegpu.status.view import PodRecord

_Obj = Mapping[str, Any]


def _attr(dev: _Obj, name: str) -> Any:
    v = (dev.get("attributes") or {}).get(name) or {}
    return next((v[k] for k in ("string", "int", "version", "bool") if k in v), None)


def _qty(value: Any, default: int = 0) -> int:
    try:
        return parse_int(value)
    except (QuantityError, ValueError, TypeError):
        return default


def _mig_slices(dev: _Obj) -> int:
    """The GPU-instance slices a MIG device takes: its ``compute-slices`` counter, else its profile's ``<n>g``."""
    for cc in dev.get("consumesCounters") or []:
        v = ((cc.get("counters") or {}).get("compute-slices") or {}).get("value")
        if v is not None:
            return _qty(v)
    m = re.match(r"(?:\d+c\.)?(\d+)g\.", str(_attr(dev, "profile") or ""))
    return int(m.group(1)) if m else 0


def inventories(slices: Iterable[_Obj]) -> tuple[list[NodeInventory], dict[tuple[str, str], tuple[str, _Obj]]]:
    """(inventories, (pool, device) -> (node, device)) from the newest generation of each of our pools."""
    newest: dict[str, int] = {}
    ours = [s for s in slices
            if (s.get("spec") or {}).get("driver") == DRIVER and (s.get("spec") or {}).get("nodeName")]
    for s in ours:
        pool = s["spec"]["pool"]
        newest[pool["name"]] = max(newest.get(pool["name"], 0), int(pool.get("generation", 0)))
    gpus: dict[str, dict[str, Gpu]] = {}
    migs: dict[str, list[tuple[str, MigDevice]]] = {}
    where: dict[tuple[str, str], tuple[str, _Obj]] = {}
    for s in ours:
        spec = s["spec"]
        if int(spec["pool"].get("generation", 0)) != newest[spec["pool"]["name"]]:
            continue
        node = spec["nodeName"]
        for d in spec.get("devices") or []:
            where[(spec["pool"]["name"], d["name"])] = (node, d)
            t = _attr(d, "type")
            uuid = str(_attr(d, "uuid") or d["name"])
            healthy = not any(x.get("effect") in ("NoSchedule", "NoExecute") for x in d.get("taints") or [])
            mem = _qty(((d.get("capacity") or {}).get("memory") or {}).get("value"))
            if t in (TYPE_GPU, TYPE_SHARED):
                idx = int(_attr(d, "index") or 0)
                gpus.setdefault(node, {})[uuid] = Gpu(
                    uuid=uuid, index=idx, minor=int(_attr(d, "minor") if _attr(d, "minor") is not None else idx),
                    model=str(_attr(d, "productName") or ""), memory_bytes=mem, healthy=healthy,
                    numa_node=_attr(d, "numaNode"), pci_bus_id=str(_attr(d, "pciBusID") or ""),
                    # How a shared GPU's shares are enforced, as its device attributes say (node/dra/slices.py).
                    share_enforcement=str(_attr(d, "shareEnforcement") or ""),
                    compute_mode=str(_attr(d, "computeMode") or ""),
                    share_shape_lock=str(_attr(d, "shareShapeLock") or ""),
                    share_escapable=_attr(d, "shareEscapable"))
            elif t == TYPE_MIG:
                parent = str(_attr(d, "parentUUID") or "")
                n_slices = _mig_slices(d)
                migs.setdefault(node, []).append((parent, MigDevice(
                    uuid=uuid, profile=str(_attr(d, "profile") or ""), parent_uuid=parent,
                    gi=int(_attr(d, "gi") or 0), ci=int(_attr(d, "ci") or 0), memory_bytes=mem, healthy=healthy,
                    attributes={"slices.gi": n_slices} if n_slices else {})))
    out = []
    for node, by_uuid in sorted(gpus.items()):
        for parent, m in sorted(migs.get(node, []), key=lambda pm: (pm[1].gi, pm[1].ci)):
            g = by_uuid.get(parent)
            if g is not None:  # index: the position on the parent, as NVML numbers them
                m = replace(m, index=len(g.mig_devices))
                by_uuid[parent] = replace(g, mig_enabled=True, mig_devices=(*g.mig_devices, m))
        out.append(NodeInventory(node, tuple(sorted(by_uuid.values(), key=lambda g: g.index)),
                                 labels={MODE_LABEL: "dra"}))
    return out, where


def records(claims: Iterable[_Obj], where: Mapping[tuple[str, str], tuple[str, _Obj]],
            inv: Iterable[NodeInventory]) -> list[PodRecord]:
    """One record per (claim, reserving pod): the claim's devices as grants of a container named after the claim."""
    gpu_by_uuid = {g.uuid: g for n in inv for g in n.gpus}
    mig_parent = {m.uuid: (g, m) for n in inv for g in n.gpus for m in g.mig_devices}
    out: list[PodRecord] = []
    for c in claims:
        st = c.get("status") or {}
        results = [r for r in (((st.get("allocation") or {}).get("devices") or {}).get("results") or [])
                   if r.get("driver") == DRIVER]
        if not results:
            continue
        grants: list[DeviceGrant] = []
        node = ""
        for r in results:
            node, dev = where.get((r.get("pool", ""), r.get("device", "")), ("", {}))
            uuid = str(_attr(dev, "uuid") or "") if dev else ""
            if uuid in mig_parent:
                g, m = mig_parent[uuid]
                core = min(100, int(m.attributes.get("slices.gi", 7)) * 100 // 7)  # placement's MIG rule
                ratio = max(1, round(100 * m.memory_bytes / g.memory_bytes)) if g.memory_bytes else 100
                grants.append(DeviceGrant(g.minor, g.uuid, core, m.memory_bytes, ratio, m.uuid, m.profile))
            elif uuid in gpu_by_uuid:
                g = gpu_by_uuid[uuid]
                used = r.get("consumedCapacity") or {}
                core = _qty(used.get("compute"), 100) if used else 100
                mem = _qty(used.get("memory"), g.memory_bytes) if used else g.memory_bytes
                ratio = max(1, round(100 * mem / g.memory_bytes)) if g.memory_bytes else 100
                grants.append(DeviceGrant(g.minor, g.uuid, core, mem, ratio))
        if not grants or not node:
            continue
        alloc = PodAllocation((ContainerAllocation(f"claim:{c['metadata']['name']}", tuple(grants)),))
        ns = c["metadata"].get("namespace", "")
        for ref in st.get("reservedFor") or []:
            if ref.get("resource", "pods") == "pods":
                out.append(PodRecord(ns, ref.get("name", ""), node, alloc))
    return out


def from_client(client: Any, problems: list[str]) -> tuple[list[NodeInventory], list[PodRecord]]:
    """DRA inventories and records through a lightkube client; nothing when the API has no resource.k8s.io/v1."""
    from lightkube.core.exceptions import ApiError

    from kubegpu.node.dra.kube import ResourceClaim, ResourceSlice

    try:
        slices = [x.to_dict() for x in client.list(ResourceSlice)]
        if not any((x.get("spec") or {}).get("driver") == DRIVER for x in slices):
            return [], []
        claims = [x.to_dict() for x in client.list(ResourceClaim, namespace="*")]
    except ApiError as exc:
        if exc.status.code not in (403, 404):
            problems.append(f"DRA objects could not be read: {exc.status.message or exc}")
        return [], []
    inv, where = inventories(slices)
    return inv, records(claims, where, inv)
