"""Pure matching: which record an ``Allocate`` serves, where ``GetPreferredAllocation`` steers, and
which GPUs a container must not get. No I/O, no locks: the resolver calls these under its lock.

The rule (docs/handoff.md): the kubelet's device IDs name the GPUs (``<uuid>::<k>`` slots and
replicas, GPU or MIG UUIDs), so an ``Allocate`` is served **only** as a record that names exactly
the GPUs the kubelet chose. What the container gets is then by construction what the kubelet
holds; the only choice left is *which* of several identical waiting records it is, and that is
taken in the kubelet's admission order (creation time, the order this node saw the pods, name,
container position).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kubegpu.model import resources as R
from kubegpu.node.handoff.entries import Entry, PodView

ID_SHOWN = 80  # characters of a device ID echoed in a message


def uuid_of(device_id: str) -> str:
    """``GPU-…::3`` (a slot or replica) -> ``GPU-…``; a GPU or MIG UUID is itself."""
    return device_id.split("::", 1)[0]


def short(device_id: str) -> str:
    return device_id if len(device_id) <= ID_SHOWN else device_id[:ID_SHOWN] + "…"


def kubelet_gpus(ids: Sequence[str]) -> tuple[str, ...]:
    return tuple(uuid_of(i) for i in ids)


def pending(pods: Iterable[PodView], served: Mapping[tuple[str, str], object], resource: str,
            count: int) -> list[Entry]:
    """Records of ``resource`` with ``count`` devices not served yet, in the kubelet's admission order. A
    running pod's records are never pending: the kubelet admitted it, whoever served it (a previous process
    of this daemon whose acknowledgement never landed included)."""
    out = [e for p in pods if not p.forged and not p.running for e in p.entries
           if e.resource == resource and e.count == count and (e.uid, e.container) not in served
           and e.container not in p.acks]
    out.sort(key=lambda e: e.rank)
    return out


def fits(entry: Entry, gpus: Sequence[str]) -> bool:
    """The kubelet's GPUs are exactly the record's (or, for an app container served from its init
    containers' devices, a subset of those the kubelet picked among them)."""
    got = set(gpus)
    if len(got) != len(gpus) or len(gpus) != entry.count:
        return False  # two devices on one GPU: no record names a GPU twice
    want = set(entry.uuids)
    if got == want:
        return True
    return bool(entry.reuse) and want <= entry.reuse and got <= entry.reuse


def waiting_pods(entries: Iterable[Entry]) -> list[str]:
    """The distinct pods among waiting entries, in order. The extender lets one pod per (node, resource,
    count) wait (docs/handoff.md), so more than one means this node's view is stale or the records
    predate that rule: the kubelet's call cannot be attributed."""
    return list(dict.fromkeys(e.pod_key for e in entries))


def match(pods: Iterable[PodView], served: Mapping[tuple[str, str], object], resource: str,
          ids: Sequence[str]) -> Entry | None:
    gpus = kubelet_gpus(ids)
    for e in pending(pods, served, resource, len(ids)):
        if fits(e, gpus):
            return e
    return None


def steer(pods: Iterable[PodView], served: Mapping[tuple[str, str], object], resource: str,
          available: Sequence[str], must_include: Sequence[str], size: int) -> list[str] | None:
    """Device IDs for the first waiting record this request can be (its reused devices, if any,
    must be among the record's): the must-include IDs, then one available device per other GPU."""
    must_gpus = set(kubelet_gpus(must_include))
    for e in pending(pods, served, resource, size):
        if not must_gpus <= set(e.uuids) | e.reuse:
            continue
        chosen = list(dict.fromkeys(must_include))
        have = set(kubelet_gpus(chosen))
        for u in e.uuids:
            if u in have:
                continue
            pick = next((d for d in available if uuid_of(d) == u and d not in chosen), None)
            if pick is None:
                break
            chosen.append(pick)
            have.add(u)
        if len(chosen) == size:
            return chosen
    return None


def holders(pods: Iterable[PodView], exclude_uid: str = "") -> dict[str, list[tuple[str, int]]]:
    """GPU UUID -> [(pod, compute percent)] for what live pods hold (records, or acknowledgements of
    pods the extender did not place); MIG devices are keyed by their own UUID."""
    out: dict[str, list[tuple[str, int]]] = {}
    for p in pods:
        if p.uid == exclude_uid or p.held is None:
            continue
        for g in p.held.grants():
            out.setdefault(g.mig_uuid or g.uuid, []).append((p.key, g.core))
    return out


def whole_conflict(gpus: Sequence[str], taken: Mapping[str, list[tuple[str, int]]]) -> str:
    """Why whole GPUs cannot be given to a container the extender did not place ("" when they can)."""
    for u in gpus:
        for pod, core in taken.get(u, ()):
            what = "is given whole to" if core >= 100 else f"carries a {core} % share of"
            return f"GPU {short(u)} {what} {pod}"
    return ""


def share_conflict(gpus: Sequence[str], whole: Mapping[str, str]) -> str:
    """Why a share cannot go on GPUs the kubelet gave whole to a pod without a record."""
    for u in gpus:
        if u in whole:
            return f"GPU {short(u)} is held whole by {whole[u]}, which the extender did not place"
    return ""


def describe_pending(pods: Iterable[PodView], served: Mapping[tuple[str, str], object], resource: str,
                     count: int, limit: int = 3) -> str:
    waiting = pending(pods, served, resource, count)
    if not waiting:
        return f"no pod bound here has an unserved {resource} record of {count} device(s)"
    shown = "; ".join(f"{e.pod_key} {e.container} on {','.join(short(u) for u in e.uuids)}"
                      for e in waiting[:limit])
    more = f" and {len(waiting) - limit} more" if len(waiting) > limit else ""
    return f"waiting records: {shown}{more}"


SERVED_RESOURCES = (R.GPU_SLOTS, R.NVIDIA_GPU)


def is_handoff_resource(resource: str) -> bool:
    return resource in SERVED_RESOURCES or resource.startswith(R.NVIDIA_MIG_PREFIX)
