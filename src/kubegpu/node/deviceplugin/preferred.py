"""GetPreferredAllocation: which of the kubelet's candidate devices to take.

Whole GPUs go to the placement core's NVLink-aware choice (``choose_gpu_set``). Replicas
and slots are spread (``distributed``: least-shared GPU first, the seed fork's default) or
piled up (``packed``: most-shared GPU that still has room first); a container's replicas
land on distinct GPUs while distinct GPUs remain. Must-include IDs always come first.
The answer is advisory; the kubelet intersects it with its candidates.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from kubegpu.model.inventory import Gpu
from kubegpu.node.deviceplugin.allocate import shown
from kubegpu.node.deviceplugin.plugin_model import AdvertisedDevice


class PreferenceError(ValueError):
    """A request that cannot be answered at all (unknown IDs, sizes that make no sense)."""


def check(available: Sequence[str], must_include: Sequence[str], size: int,
          known: Mapping[str, AdvertisedDevice]) -> None:
    if size < 0:
        raise PreferenceError(f"allocation size {size} is negative")
    if size > len(known):
        raise PreferenceError(f"allocation size {size} exceeds the {len(known)} devices of this resource")
    if len(available) > len(known) or len(must_include) > len(known):
        raise PreferenceError(f"{len(available)} available and {len(must_include)} must-include device IDs, "
                              f"the resource has {len(known)}")
    unknown = [i for i in [*available, *must_include] if i not in known]
    if unknown:
        raise PreferenceError(f"unknown device IDs: {', '.join(shown(i) for i in sorted(set(unknown))[:5])}")
    if len(set(must_include)) > size:
        raise PreferenceError(f"{len(set(must_include))} must-include devices exceed allocation size {size}")


def whole_gpus(gpus: Sequence[Gpu], available: Sequence[str], must_include: Sequence[str], size: int,
               known: Mapping[str, AdvertisedDevice]) -> list[str]:
    """Topology-aware choice of whole GPUs (or MIG devices, by lowest index) among ``available``."""
    avail = list(dict.fromkeys([*must_include, *available]))
    size = min(size, len(avail))
    if size <= 0:
        return []
    if any(known[i].is_mig for i in avail):
        must = list(dict.fromkeys(must_include))
        rest = sorted((i for i in avail if i not in must), key=lambda i: _index_key(known[i].index))
        return (must + rest)[:size]
    from kubegpu.placement.topology import choose_gpu_set

    # Advertised whole-GPU IDs are GPU UUIDs; the inventory may hold more GPUs than advertised.
    node = [g for g in gpus if g.uuid in known]
    return list(choose_gpu_set(node, avail, list(dict.fromkeys(must_include)), size))


def _index_key(index: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in index.split(":"))
    except ValueError:
        return (1 << 30,)


def replica_totals(all_devices: Sequence[AdvertisedDevice]) -> dict[str, int]:
    """GPU/MIG UUID -> how many replicas (or slots) it has; computed once per served resource."""
    return dict(Counter(d.uuid for d in all_devices))


def replicas(all_devices: Sequence[AdvertisedDevice], available: Sequence[str], must_include: Sequence[str],
             size: int, known: Mapping[str, AdvertisedDevice], policy: str = "distributed",
             distinct: bool = True, totals: Mapping[str, int] | None = None) -> list[str]:
    """Replica / slot IDs: ``distributed`` (least-shared GPU first) or ``packed`` (most-shared first).

    "Shared" is how many of a GPU's replicas are not among the candidates (in use elsewhere).
    With ``distinct`` one container's IDs go to different GPUs while different GPUs remain."""
    if totals is None:
        totals = replica_totals(all_devices)
    chosen = list(dict.fromkeys(must_include))
    must = set(chosen)
    free: dict[str, list[tuple[int, str]]] = {}
    candidates_of: Counter[str] = Counter()
    for i in available:
        d = known[i]
        candidates_of[d.uuid] += 1
        if i not in must:
            free.setdefault(d.uuid, []).append((d.replica or 0, i))
    for i in must:
        if i not in available:
            candidates_of[known[i].uuid] += 1
    in_use = {u: totals.get(u, 0) - candidates_of[u] for u in free}
    order = {u: _index_key(known[ids[0][1]].index) for u, ids in free.items()}
    for ids in free.values():
        ids.sort(reverse=True)  # lowest replica number last: pop() takes it
    taken = Counter(known[i].uuid for i in chosen)
    sign = -1 if policy == "packed" else 1
    while len(chosen) < size and free:

        def rank(u: str) -> tuple[int, int, tuple[int, ...]]:
            # Distinct GPUs for one container first (if asked), then the policy, then the lowest index.
            spread = taken[u] if distinct else 0
            return (spread, sign * (in_use[u] + taken[u]), order[u])

        best = min(free, key=rank)
        chosen.append(free[best].pop()[1])
        taken[best] += 1
        if not free[best]:
            del free[best]
    return chosen
