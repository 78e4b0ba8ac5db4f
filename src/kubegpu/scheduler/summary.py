"""The DeviceShare debug API's node summary, in the seed's shape (``seed-examples/node-device-summary.json``):
``allocateSet``, ``deviceTotal`` / ``deviceFree`` / ``deviceUsed`` and their per-minor details, plus one
kubegpu key, ``allocateSetByContainer`` (the same holdings per container, so ``kubegpu status --extender``
can name the containers; readers of the seed's shape ignore it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubegpu.model import resources as R
from kubegpu.model.allocation import PodAllocation
from kubegpu.model.quantity import format_bytes
from kubegpu.placement import NodeState


def node_summary(state: NodeState, held: Mapping[str, PodAllocation]) -> dict[str, Any]:
    """One node's summary; ``held`` maps ``namespace/name`` to each pod's allocation there."""
    detail: dict[str, dict[str, dict[str, str]]] = {"total": {}, "free": {}, "used": {}}
    sums = {k: [0, 0, 0] for k in detail}
    for gpu in state.gpus:
        usable = gpu.placeable
        cap = (100, gpu.memory_bytes) if gpu.healthy else (0, 0)
        free = (state.core_free(gpu.uuid), state.memory_free(gpu.uuid)) if usable else cap
        used = (cap[0] - free[0], cap[1] - free[1])
        for k, (core, mem) in (("total", cap), ("free", free), ("used", used)):
            ratio = _pct_of(mem, gpu.memory_bytes)
            detail[k][str(gpu.minor)] = _res(core, mem, ratio)
            sums[k][0] += core
            sums[k][1] += mem
            sums[k][2] += ratio
    allocate: dict[str, dict[str, dict[str, str]]] = {}
    by_container: dict[str, dict[str, dict[str, dict[str, str]]]] = {}
    for key, alloc in held.items():
        per: dict[str, dict[str, str]] = {}
        for g in alloc.grants():
            per[str(g.minor)] = _res(g.core, g.memory_bytes, g.memory_ratio)
        allocate[key] = per
        by_container[key] = {c.container: {str(g.minor): _res(g.core, g.memory_bytes, g.memory_ratio)
                                           for g in c.grants} for c in alloc.containers}
    return {
        **device_info(state, held),
        "allocateSet": {"gpu": allocate},
        "allocateSetByContainer": {"gpu": by_container},
        "deviceFree": _res(*sums["free"]),
        "deviceFreeDetail": {"gpu": detail["free"]},
        "deviceTotal": _res(*sums["total"]),
        "deviceTotalDetail": {"gpu": detail["total"]},
        "deviceUsed": _res(*sums["used"]),
        "deviceUsedDetail": {"gpu": detail["used"]},
    }


def device_info(state: NodeState, held: Mapping[str, PodAllocation]) -> dict[str, Any]:
    """kubegpu's ``deviceInfo``: what the extender knows of each GPU beyond the seed's numbers (model, health,
    MIG devices and their holders, replicated), so ``kubegpu status --extender`` shows what the API server
    view shows (kubegpu/status/sources.py reads it)."""
    mig_holders: dict[str, list[dict[str, str]]] = {}
    for key, alloc in held.items():
        for c in alloc.containers:
            for g in c.grants:
                if g.mig_uuid:
                    mig_holders.setdefault(g.mig_uuid, []).append({"pod": key, "container": c.container})
    info = {str(g.minor): {
        "uuid": g.uuid, "index": g.index, "model": g.model, "healthy": g.healthy, "memoryBytes": g.memory_bytes,
        "migEnabled": g.mig_enabled, "replicated": g.replicated,
        "mig": [{"uuid": m.uuid, "index": m.index, "profile": m.profile, "memoryBytes": m.memory_bytes,
                 "healthy": m.healthy, "slices": int(m.attributes.get("slices.gi", 0)),
                 "holders": mig_holders.get(m.uuid, [])} for m in g.mig_devices] if g.mig_enabled else [],
    } for g in state.gpus}
    return {"deviceInfo": {"gpu": info}}


def _res(core: int, mem: int, ratio: int) -> dict[str, str]:
    return {R.GPU_CORE: str(core), R.GPU_MEMORY: format_bytes(mem), R.GPU_MEMORY_RATIO: str(ratio)}


def _pct_of(part: int, whole: int) -> int:
    return 0 if whole <= 0 else round(100 * part / whole)
