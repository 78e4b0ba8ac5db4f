"""The demo's end-state checks, as pure functions over what the cluster recorded and ran.

Each check returns a :class:`Check` (name, verdict, a sentence a person can read). Together they
say: every pod was admitted or refused as expected, placed where its
``kubegpu.io/device-allocated`` record says, each container's environment names exactly the
recorded GPUs (with the recorded share), the Xid GPU is unhealthy and nothing placed after the
Xid holds it, and no GPU is overcommitted.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kubegpu.model.allocation import AnnotationError, PodAllocation, decode
from kubegpu.model.annotations import DEVICE_ALLOCATED
from kubegpu.model.inventory import NodeInventory
from kubegpu.model.request import RequestKind, parse_pod
from kubegpu.node.handoff import DEVICE_ASSIGNED
from kubegpu.status.view import ClusterView

VISIBLE = "NVIDIA_VISIBLE_DEVICES"
CORE = "KUBEGPU_GPU_CORE_PERCENT"
MEMORY = "KUBEGPU_GPU_MEMORY_BYTES"
ACCOUNTED = frozenset({"nvidia.com/gpu", "kubegpu.io/gpu.shared"})  # the resources the extender accounts


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    ok: bool
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "detail": self.detail}


@dataclass(frozen=True, slots=True)
class Run:
    """One started container: where, what the device plugins gave it, and when (demo seconds)."""

    pod: str  # namespace/name
    container: str
    node: str
    env: Mapping[str, str]
    devices: Mapping[str, Sequence[str]]  # resource -> device IDs the kubelet allocated
    at: float = 0.0


@dataclass(frozen=True, slots=True)
class XidFault:
    node: str
    gpu_index: int
    uuid: str
    xid: int
    at: float  # demo seconds when injected
    unhealthy_after_s: float | None  # how long until the Device object said so; None: never seen


@dataclass(slots=True)
class EndState:
    expected_refused: set[str]  # namespace/name
    refusals: dict[str, str]  # namespace/name -> the webhook's message
    pods: dict[str, Mapping[str, Any]]  # namespace/name -> stored object, for every accepted pod
    runs: list[Run]
    inventories: dict[str, NodeInventory]
    view: ClusterView
    xid: XidFault | None = None
    after_xid: set[str] = field(default_factory=set)  # pods submitted after the Xid was seen
    kubelet_unhealthy: dict[str, set[str]] = field(default_factory=dict)  # node -> unhealthy device IDs
    roles_exited: list[str] = field(default_factory=list)
    expected_admitted: set[str] = field(default_factory=set)  # namespace/name
    admission_errors: dict[str, str] = field(default_factory=dict)  # the webhook could not be asked
    extender_view: ClusterView | None = None  # from the extender's debug API; None when unreadable


def _key(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', 'default')}/{meta.get('name', '?')}"


def record_of(pod: Mapping[str, Any]) -> PodAllocation | None:
    text = ((pod.get("metadata") or {}).get("annotations") or {}).get(DEVICE_ALLOCATED)
    if not text:
        return None
    try:
        return decode(text)
    except AnnotationError:
        return None


def _visible(env: Mapping[str, str]) -> set[str]:
    value = env.get(VISIBLE, "")
    return {v.strip() for v in value.split(",") if v.strip()} if value not in ("", "void", "none") else set()


def _gpu_of(device_id: str) -> str:
    """A replica or slot ID (``<uuid>::<k>``) -> the GPU or MIG UUID it stands for."""
    return device_id.split("::", 1)[0]


def check_admission(state: EndState) -> Check:
    wrong = []
    for key in sorted(state.expected_refused):
        if key not in state.refusals:
            wrong.append(f"{key} was admitted, the webhook should have refused it")
        elif not state.refusals[key]:
            wrong.append(f"{key} was refused without a reason")
    for key in sorted(state.refusals):
        if key not in state.expected_refused:
            wrong.append(f"{key} was refused: {state.refusals[key]}")
    for key in sorted(state.expected_refused & set(state.pods)):
        wrong.append(f"{key} was refused yet exists in the API server")
    for key in sorted(state.expected_admitted - set(state.pods)):
        wrong.append(f"{key} was never created" + (f": {state.admission_errors[key]}"
                                                   if key in state.admission_errors else ""))
    if wrong:
        return Check("admission", False, "; ".join(wrong))
    return Check("admission", True, f"{len(state.pods)} pods admitted, {len(state.refusals)} refused with a reason")


def check_placed(state: EndState) -> Check:
    wrong = [f"{k}: {(p.get('status') or {}).get('phase')} on {(p.get('spec') or {}).get('nodeName') or 'no node'}"
             for k, p in sorted(state.pods.items())
             if not (p.get("spec") or {}).get("nodeName") or (p.get("status") or {}).get("phase") != "Running"]
    if wrong:
        return Check("every pod placed and running", False, "; ".join(wrong))
    return Check("every pod placed and running", True, f"{len(state.pods)} pods Running on their nodes")


def check_records_and_env(state: EndState) -> Check:
    """Each GPU container: record on the pod's node, env naming exactly the recorded GPUs and share."""
    runs = {(r.pod, r.container): r for r in state.runs}
    wrong: list[str] = []
    checked = 0
    for key, pod in sorted(state.pods.items()):
        node = (pod.get("spec") or {}).get("nodeName")
        inv = state.inventories.get(node or "")
        if node is None or inv is None:
            continue
        parsed = parse_pod(pod)
        record = record_of(pod)
        uuids = {g.uuid for g in inv.gpus} | {m.uuid for g in inv.gpus for m in g.mig_devices}
        for creq in parsed.containers:
            run = runs.get((key, creq.name))
            where = f"{key}[{creq.name}]"
            if run is None:
                wrong.append(f"{where}: never started")
                continue
            req = creq.request
            if req is None:
                if run.env.get(VISIBLE) != "void":
                    wrong.append(f"{where}: asks for no GPU but sees {VISIBLE}={run.env.get(VISIBLE)!r}")
                checked += 1
                continue
            if req.kind is RequestKind.REPLICA:
                held = {_gpu_of(d) for ids in run.devices.values() for d in ids}
                if not held or _visible(run.env) != held or not held <= uuids:
                    wrong.append(f"{where}: replica devices {sorted(held)} vs {VISIBLE} {sorted(_visible(run.env))}")
                checked += 1
                continue
            alloc = record.for_container(creq.name) if record else None
            if alloc is None or not alloc.grants:
                wrong.append(f"{where}: no {DEVICE_ALLOCATED} record")
                continue
            recorded = {g.mig_uuid or g.uuid for g in alloc.grants}
            if not recorded <= uuids:
                wrong.append(f"{where}: recorded {sorted(recorded - uuids)} not on node {node}")
            if _visible(run.env) != recorded:
                wrong.append(f"{where}: {VISIBLE}={run.env.get(VISIBLE)!r}, recorded {sorted(recorded)}")
            for env_name, values in ((CORE, [g.core for g in alloc.grants]),
                                     (MEMORY, [g.memory_bytes for g in alloc.grants])):
                if env_name in run.env and not _same(run.env[env_name], values):
                    wrong.append(f"{where}: {env_name}={run.env[env_name]}, recorded {values}")
            checked += 1
    if wrong:
        return Check("placed where recorded", False, "; ".join(wrong))
    return Check("placed where recorded", True,
                 f"{checked} containers: env names exactly the recorded GPUs (and share), plain ones see void")


def _same(env_value: str, recorded: list[int]) -> bool:
    parts = [p.strip() for p in env_value.split(",")]
    try:
        got = [int(p) for p in parts]
    except ValueError:
        return False
    # Several values follow KUBEGPU_VISIBLE_GPUS order, which need not be the record's.
    return sorted(got) == sorted(recorded) if len(got) > 1 else all(v == got[0] for v in recorded)


def check_xid(state: EndState) -> list[Check]:
    if state.xid is None:
        return [Check("Xid GPU unhealthy", False, "no Xid was injected")]
    x = state.xid
    inv = state.inventories.get(x.node)
    gpu = next((g for g in inv.gpus if g.uuid == x.uuid), None) if inv else None
    out = []
    if gpu is None:
        out.append(Check("Xid GPU unhealthy", False, f"{x.node} GPU {x.gpu_index} is not in its Device object"))
    elif gpu.healthy:
        out.append(Check("Xid GPU unhealthy", False, f"{x.node} GPU {x.gpu_index} still Healthy after Xid {x.xid}"))
    else:
        seen = f" after {x.unhealthy_after_s:.2f} s" if x.unhealthy_after_s is not None else ""
        bad = {_gpu_of(d) for d in state.kubelet_unhealthy.get(x.node, set())}
        kubelet = "; the kubelet lists its devices Unhealthy" if x.uuid in bad else "; the kubelet was not told"
        out.append(Check("Xid GPU unhealthy", x.uuid in bad,
                         f"{x.node} GPU {x.gpu_index} ({x.uuid}) Unhealthy in its Device object{seen}{kubelet}"))
    landed = []
    for key, pod in state.pods.items():
        record = record_of(pod)
        if record and key in state.after_xid and any(g.uuid == x.uuid for g in record.grants()):
            landed.append(f"{key} recorded on it")
    for r in state.runs:
        if r.at >= x.at and (x.uuid in _visible(r.env)
                             or any(_gpu_of(d) == x.uuid for ids in r.devices.values() for d in ids)):
            landed.append(f"{r.pod}[{r.container}] started on it")
    placed_after = sum(1 for k in state.after_xid if (state.pods.get(k, {}).get("spec") or {}).get("nodeName"))
    if landed:
        out.append(Check("nothing new on the Xid GPU", False, "; ".join(landed)))
    else:
        out.append(Check("nothing new on the Xid GPU", True,
                         f"{placed_after} pods placed on {x.node} after the Xid, none on GPU {x.gpu_index}"))
    return out


def handoff_mismatches(pods: Mapping[str, Mapping[str, Any]], runs: Iterable[Run]) -> tuple[list[str], int]:
    """Containers whose acknowledgement (``kubegpu.io/device-assigned``) does not name exactly the device IDs
    the kubelet allocated (or is not written yet), and how many allocations were compared."""
    wrong: list[str] = []
    checked = 0
    for r in runs:
        pod = pods.get(r.pod)
        served = {res: ids for res, ids in r.devices.items() if res in ACCOUNTED}
        if pod is None or not served or record_of(pod) is None:
            continue
        raw = ((pod.get("metadata") or {}).get("annotations") or {}).get(DEVICE_ASSIGNED, "")
        try:
            acked = json.loads(raw)["containers"][r.container] if raw else None
        except (ValueError, KeyError, TypeError):
            acked = None
        for res, ids in served.items():
            if not isinstance(acked, Mapping) or acked.get("resource") != res or \
                    sorted(acked.get("devices") or []) != sorted(ids):
                wrong.append(f"{r.pod}[{r.container}]: kubelet allocated {res} {list(ids)}, acknowledged {acked}")
            checked += 1
    return wrong, checked


def check_handoff(state: EndState) -> Check:
    """The node daemon's acknowledgement (``kubegpu.io/device-assigned``) names, per container, exactly the
    device IDs the kubelet allocated: each Allocate was matched to its own pod's record."""
    wrong, checked = handoff_mismatches(state.pods, state.runs)
    if wrong:
        return Check("handoff acknowledged", False, "; ".join(wrong))
    return Check("handoff acknowledged", True,
                 f"{checked} Allocate calls matched to their own pod's record ({DEVICE_ASSIGNED})")


def check_overcommit(state: EndState) -> Check:
    """Records never exceed a GPU (compute ≤ 100 %, memory ≤ its size), nor does what containers were given."""
    wrong = [p for p in state.view.problems]
    for n in state.view.nodes:
        for g in n.gpus:
            if g.core_used > 100 or g.memory_used > g.memory_bytes:
                wrong.append(f"{n.name} GPU {g.index}: {g.core_used} % compute, {g.memory_used} of "
                             f"{g.memory_bytes} bytes recorded")
    # The runtime side: the compute percents handed out per GPU, whole GPUs, share slots and
    # time-slicing replicas alike (a replica is told its part too). MIG devices are isolated.
    given: dict[tuple[str, str], int] = {}
    for r in state.runs:
        if not r.devices or CORE not in r.env or any(res.startswith("nvidia.com/mig-") for res in r.devices):
            continue
        parts = [p.strip() for p in r.env[CORE].split(",")]
        order = [u.strip() for u in r.env.get("KUBEGPU_VISIBLE_GPUS", r.env.get(VISIBLE, "")).split(",")]
        for i, uuid in enumerate(u for u in order if u):
            try:
                pct = int(parts[i] if len(parts) > 1 else parts[0])
            except (ValueError, IndexError):
                continue
            given[(r.node, uuid)] = given.get((r.node, uuid), 0) + pct
    wrong += [f"{node} {uuid}: containers were given {pct} % compute" for (node, uuid), pct in sorted(given.items())
              if pct > 100]
    gpus = sum(len(n.gpus) for n in state.view.nodes)
    if wrong:
        return Check("no overcommit", False, "; ".join(wrong))
    return Check("no overcommit", True, f"{gpus} GPUs: compute ≤ 100 % and memory ≤ size, recorded and given")


def check_extender_agrees(state: EndState) -> Check:
    """The extender's accounting (its DeviceShare debug API) equals what the pods' records add up to."""
    if state.extender_view is None:
        return Check("extender agrees", False, "the extender's debug API could not be read")

    def usage(view: ClusterView) -> dict[tuple[str, int], tuple[int, int]]:
        return {(n.name, g.minor): (g.core_used, g.memory_used) for n in view.nodes for g in n.gpus
                if g.core_used or g.memory_used}

    ours, theirs = usage(state.view), usage(state.extender_view)
    wrong = [f"{node} GPU minor {minor}: records {ours.get((node, minor), (0, 0))}, extender "
             f"{theirs.get((node, minor), (0, 0))} (compute %, memory bytes)"
             for node, minor in sorted(set(ours) | set(theirs)) if ours.get((node, minor)) != theirs.get((node, minor))]
    if wrong:
        return Check("extender agrees", False, "; ".join(wrong))
    return Check("extender agrees", True, f"its debug API accounts the same {len(ours)} GPUs in use as the records")


def check_roles(state: EndState) -> Check:
    if state.roles_exited:
        return Check("roles alive", False, "exited: " + ", ".join(state.roles_exited))
    return Check("roles alive", True, "webhook, extender and every node daemon ran to the end")


def verify(state: EndState) -> list[Check]:
    return [check_admission(state), check_placed(state), check_records_and_env(state), check_handoff(state),
            *check_xid(state), check_overcommit(state), check_extender_agrees(state), check_roles(state)]


def replica_overlaps(runs: Iterable[Run]) -> list[str]:
    """GPUs that serve time-slicing replicas and fine-grained shares at once (worth a note: replicas
    are counted by the kubelet, shares by the extender, and neither sees the other)."""
    replica: set[tuple[str, str]] = set()
    share: set[tuple[str, str]] = set()
    for r in runs:
        for resource, ids in r.devices.items():
            for d in ids:
                if "::" in d:
                    (share if resource == "kubegpu.io/gpu.shared" else replica).add((r.node, _gpu_of(d)))
    return sorted(f"{node} {uuid}" for node, uuid in replica & share)
