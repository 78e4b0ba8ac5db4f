"""Who holds which GPU, how full and how fragmented the cluster is: one pure view for the CLI.

Built from what the API server records (each node's ``Device`` object and the
``kubegpu.io/device-allocated`` annotations of live pods), so ``kubegpu
status`` and ``kubectl gpu`` show exactly what the extender accounts. Time-slicing / MPS
replicas are counted by the kubelet, not the extender: they come from the Node's capacity and
GFD labels (how many replicas of which resource, how many per GPU) and from the pods that ask
for them; the GPUs offered only as replicas are not counted as whole free GPUs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from kubegpu.model.allocation import ContainerAllocation, PodAllocation
from kubegpu.model.inventory import NodeInventory
from kubegpu.node.dra.names import MODE_LABEL as DRA_NODE_LABEL

# Placement records a MIG device of <n> GPU-instance slices as n * 100 // 7 percent of its GPU: a whole
# percent, rounded down. Totals add the exact n / 7 instead (a 3g and a 1g are 0.571 GPU, not 42 % + 14 %).
_MIG_SLICES = 7
_MIG_G = re.compile(r"(?:\d+c\.)?(\d+)g\.")


def gpu_fraction(core: int, mig_profile: str | None) -> float:
    """The GPUs' worth of compute a grant of ``core`` percent holds; of a MIG device (``mig_profile``), its
    slices of the GPU's 7."""
    m = _MIG_G.match(mig_profile or "")
    if m is not None:
        slices = int(m.group(1))
        if core == min(100, slices * 100 // _MIG_SLICES):  # the whole device, as placement recorded it
            return min(1.0, slices / _MIG_SLICES)
    return core / 100


@dataclass(frozen=True, slots=True)
class Holder:
    pod: str  # namespace/name
    container: str
    core: int
    memory_bytes: int
    mig_uuid: str | None = None  # the MIG device held, for MIG grants
    gpu: float = 0.0  # GPUs' worth of compute held, unrounded (gpu_fraction)


@dataclass(frozen=True, slots=True)
class MigView:
    """One MIG device of a MIG-enabled GPU and who holds it."""

    uuid: str
    index: int
    profile: str
    memory_bytes: int
    healthy: bool
    slices: int  # GPU-instance slices it occupies (of 7 on A100/H100), 0 when unknown
    holders: tuple[Holder, ...] = ()


@dataclass(frozen=True, slots=True)
class ReplicaHolder:
    pod: str  # namespace/name
    container: str
    count: int


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """A time-slicing / MPS replica resource on a node: how many GPUs, replicas, and who holds them."""

    resource: str
    total: int  # replicas the node offers (its capacity)
    per_gpu: int  # replicas of each GPU (GFD's ``<resource>.replicas`` label), 0 when unknown
    holders: tuple[ReplicaHolder, ...] = ()

    @property
    def gpus(self) -> int:
        """GPUs (or MIG devices) behind the replicas; 0 when the replicas per GPU are unknown."""
        return self.total // self.per_gpu if self.per_gpu > 0 else 0

    @property
    def held(self) -> int:
        return sum(h.count for h in self.holders)

    @property
    def whole_gpus(self) -> bool:
        """Replicas of whole GPUs (not of MIG devices, whose resource names the profile)."""
        return "mig-" not in self.resource


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What the Node object says about GPU resources the kubelet counts (capacity, GFD labels)."""

    capacity: Mapping[str, int]
    labels: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class ReplicaRecord:
    """A live pod's container holding replicas of a time-slicing / MPS resource on a node."""

    namespace: str
    name: str
    node: str
    container: str
    resource: str
    count: int


@dataclass(frozen=True, slots=True)
class GpuView:
    node: str
    index: int
    minor: int
    uuid: str
    model: str
    healthy: bool
    memory_bytes: int
    core_used: int  # percent, may exceed 100 only if records are inconsistent (shown, never hidden)
    memory_used: int
    holders: tuple[Holder, ...] = ()
    mig: tuple[MigView, ...] = ()  # its MIG devices when MIG is enabled
    mig_enabled: bool = False
    replica_only: bool = False  # offered to the kubelet only as time-slicing / MPS replicas
    # On a DRA node a MIG GPU is published whole too (its parent device takes all the MIG counters):
    # idle it is a free whole GPU, in use its other MIG devices are free (status.dra, docs/dra.md).
    dra_mig: bool = False
    share_enforcement: str = ""  # how shares here are held to their limits: strict, mps, none, "unenforced: <why>"
    compute_mode: str = ""  # strict: the compute mode the node manages ("" = not managed)
    shape_lock: str = ""  # strict: the one share shape the GPU takes while its shares run
    escapable: bool | None = None  # whether a container could take more than its share (None = not reported)

    @property
    def gpu_used(self) -> float:
        """GPUs' worth of compute its holders hold, unrounded (core_used adds whole percents)."""
        return sum(h.gpu for h in self.holders)

    @property
    def gpu_free(self) -> float:
        """GPUs' worth of compute free on it: what ``core_free`` says in percent, unrounded."""
        return max(0.0, 1.0 - self.gpu_used) if self.core_free > 0 else 0.0

    @property
    def placeable(self) -> bool:
        """Can the extender give it (or part of it) to a whole-GPU or share request."""
        if self.dra_mig:
            return self.healthy and not self.holders
        return self.healthy and not self.mig_enabled and not self.replica_only

    @property
    def core_free(self) -> int:
        if self.dra_mig:
            return max(0, 100 - self.core_used) if self.healthy else 0
        return max(0, 100 - self.core_used) if self.placeable else 0

    @property
    def partial(self) -> bool:
        """In use but not full: its free part cannot serve a whole-GPU request."""
        return self.placeable and self.core_used < 100 and (self.core_used > 0 or self.memory_used > 0)

    @property
    def overcommitted(self) -> bool:
        return self.core_used > 100 or self.memory_used > self.memory_bytes


@dataclass(frozen=True, slots=True)
class NodeView:
    name: str
    gpus: tuple[GpuView, ...]
    replicas: tuple[ReplicaView, ...] = ()


@dataclass(frozen=True, slots=True)
class ClusterTotals:
    nodes: int
    gpus: int
    healthy_gpus: int
    allocated_gpu: float  # GPUs' worth of compute allocated
    free_gpu: float  # GPUs' worth of compute free on healthy GPUs
    stranded_gpu: float  # free compute on partially used GPUs (fragments)
    whole_free_gpus: int  # healthy GPUs nobody holds that a whole-GPU request can get (not MIG, not replicas)
    replica_gpus: int = 0  # GPUs offered only as time-slicing / MPS replicas
    replicas_total: int = 0
    replicas_held: int = 0
    replica_pods: int = 0
    mig_devices: int = 0
    mig_devices_free: int = 0

    @property
    def allocated_pct(self) -> float:
        return 100.0 * self.allocated_gpu / self.gpus if self.gpus else 0.0

    @property
    def stranded_pct(self) -> float:
        return 100.0 * self.stranded_gpu / self.gpus if self.gpus else 0.0


@dataclass(frozen=True, slots=True)
class ClusterView:
    nodes: tuple[NodeView, ...]
    totals: ClusterTotals
    problems: tuple[str, ...] = field(default=())

    def to_json(self) -> dict:
        return {
            "totals": {
                "nodes": self.totals.nodes, "gpus": self.totals.gpus, "healthy_gpus": self.totals.healthy_gpus,
                "allocated_gpu": round(self.totals.allocated_gpu, 3), "free_gpu": round(self.totals.free_gpu, 3),
                "stranded_gpu": round(self.totals.stranded_gpu, 3),
                "allocated_pct": round(self.totals.allocated_pct, 2),
                "stranded_pct": round(self.totals.stranded_pct, 2),
                "whole_free_gpus": self.totals.whole_free_gpus,
                "replica_gpus": self.totals.replica_gpus, "replicas_total": self.totals.replicas_total,
                "replicas_held": self.totals.replicas_held, "replica_pods": self.totals.replica_pods,
                "mig_devices": self.totals.mig_devices, "mig_devices_free": self.totals.mig_devices_free,
            },
            "nodes": [
                {"name": n.name, "gpus": [
                    {"index": g.index, "minor": g.minor, "uuid": g.uuid, "model": g.model, "healthy": g.healthy,
                     "memory_bytes": g.memory_bytes, "core_used": g.core_used, "memory_used": g.memory_used,
                     "mig_enabled": g.mig_enabled, "replica_only": g.replica_only,
                     "share_enforcement": g.share_enforcement, "compute_mode": g.compute_mode,
                     "share_shape_lock": g.shape_lock, "share_escapable": g.escapable,
                     "holders": [_holder_json(h) for h in g.holders],
                     "mig": [{"uuid": m.uuid, "index": m.index, "profile": m.profile,
                              "memory_bytes": m.memory_bytes, "healthy": m.healthy, "slices": m.slices,
                              "holders": [_holder_json(h) for h in m.holders]} for m in g.mig]}
                    for g in n.gpus],
                 "replicas": [{"resource": r.resource, "total": r.total, "per_gpu": r.per_gpu, "gpus": r.gpus,
                               "held": r.held,
                               "holders": [{"pod": h.pod, "container": h.container, "count": h.count}
                                           for h in r.holders]} for r in n.replicas]}
                for n in self.nodes
            ],
            "problems": list(self.problems),
        }


def _holder_json(h: Holder) -> dict:
    out: dict = {"pod": h.pod, "container": h.container, "core": h.core, "memory_bytes": h.memory_bytes}
    if h.mig_uuid is not None:
        out["mig_uuid"] = h.mig_uuid
    return out


def replica_resources(capacity: Mapping[str, int]) -> list[str]:
    """The Node's capacity names that are time-slicing / MPS replica resources (renamed ones included)."""
    from kubegpu.model.request import RequestKind, RequestRefused, parse_resources

    out = []
    for name in sorted(capacity):
        if not name.startswith("nvidia.com/"):
            continue
        try:
            req = parse_resources("c", {"limits": {name: "1"}}).request
        except RequestRefused:  # a capacity name the request rules refuse is no replica resource
            continue
        if req is not None and req.kind is RequestKind.REPLICA:
            out.append(name)
    return out


def _replica_label(labels: Mapping[str, str], resource: str) -> int:
    """Replicas per device from GFD's labels: ``nvidia.com/gpu.replicas`` for whole GPUs (renamed or not),
    ``nvidia.com/mig-<profile>.replicas`` for MIG devices."""
    base = resource.removesuffix(".shared")
    if "mig-" not in base:
        base = "nvidia.com/gpu"
    try:
        n = int(labels.get(f"{base}.replicas", "0"))
    except ValueError:
        return 0
    return n if n > 1 else 0


def _replica_views(info: NodeInfo | None, records: list[ReplicaRecord]) -> tuple[ReplicaView, ...]:
    names = set(replica_resources(info.capacity)) if info is not None else set()
    names |= {r.resource for r in records}
    out = []
    for name in sorted(names):
        holders = tuple(ReplicaHolder(f"{r.namespace}/{r.name}", r.container, r.count)
                        for r in records if r.resource == name)
        total = info.capacity.get(name, 0) if info is not None else 0
        per_gpu = _replica_label(info.labels, name) if info is not None else 0
        out.append(ReplicaView(name, total, per_gpu, holders))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class PodRecord:
    """A live pod bound to a node with its recorded allocation."""

    namespace: str
    name: str
    node: str
    allocation: PodAllocation


def build_view(
    inventories: Iterable[NodeInventory],
    pods: Iterable[PodRecord],
    *,
    node: str | None = None,
    model: str | None = None,
    namespace: str | None = None,
    node_info: Mapping[str, NodeInfo] | None = None,
    replica_pods: Iterable[ReplicaRecord] = (),
) -> ClusterView:
    """Join inventories and allocation records; filters narrow what is shown *and* totalled.

    A record pointing at a GPU the node does not have is reported in ``problems``,
    never dropped silently. ``node_info`` (each Node's capacity and labels) and ``replica_pods``
    add the time-slicing / MPS replicas the kubelet hands out.
    """
    by_node: dict[str, list[PodRecord]] = {}
    for p in pods:
        by_node.setdefault(p.node, []).append(p)
    replicas_by_node: dict[str, list[ReplicaRecord]] = {}
    for r in replica_pods:
        if namespace is None or r.namespace == namespace:
            replicas_by_node.setdefault(r.node, []).append(r)
    infos = node_info or {}
    problems: list[str] = []
    views: list[NodeView] = []
    whole_free = 0
    for inv in sorted(inventories, key=lambda i: i.name):
        if node is not None and inv.name != node:
            continue
        holders: dict[str, list[Holder]] = {g.uuid: [] for g in inv.gpus}
        # The device's profile, from the node (an extender's record names the MIG device, not its profile).
        mig_profiles = {m.uuid: m.profile for g in inv.gpus for m in g.mig_devices}
        by_minor: Mapping[int, str] = {g.minor: g.uuid for g in inv.gpus}
        for rec in by_node.get(inv.name, []):
            # Init containers count by Kubernetes' rule (model.allocation.PodAllocation.held): only what
            # they hold beyond the app containers shows, as one "(init)" holder per GPU.
            apps: dict[str, list[int]] = {}
            for c in rec.allocation.containers:
                for grant in c.grants if not c.init else ():
                    u = apps.setdefault(grant.mig_uuid or grant.uuid, [0, 0])
                    u[0], u[1] = u[0] + grant.core, u[1] + grant.memory_bytes
            extra = [ContainerAllocation("(init)", tuple(
                replace(h, core=max(0, h.core - apps.get(h.mig_uuid or h.uuid, [0, 0])[0]),
                        memory_bytes=max(0, h.memory_bytes - apps.get(h.mig_uuid or h.uuid, [0, 0])[1]))
                for h in rec.allocation.held().grants()))] if any(c.init for c in rec.allocation.containers) else []
            for c in [*(c for c in rec.allocation.containers if not c.init), *extra]:
                for grant in c.grants:
                    if c.container == "(init)" and grant.core == 0 and grant.memory_bytes == 0:
                        continue
                    uuid = grant.uuid if grant.uuid in holders else by_minor.get(grant.minor, "")
                    if uuid not in holders:
                        problems.append(f"{rec.namespace}/{rec.name}: GPU {grant.uuid or grant.minor} "
                                        f"is not on node {inv.name}")
                        continue
                    profile = mig_profiles.get(grant.mig_uuid or "", grant.mig_profile)
                    holders[uuid].append(Holder(f"{rec.namespace}/{rec.name}", c.container, grant.core,
                                                grant.memory_bytes, grant.mig_uuid,
                                                gpu_fraction(grant.core, profile)))
        replicas = _replica_views(infos.get(inv.name), replicas_by_node.get(inv.name, []))
        # GPUs behind whole-GPU replicas. The Node says how many, not which: when they are all of the
        # node's non-MIG GPUs (the usual config) each is marked; otherwise the count is taken off the
        # node's whole free GPUs below.
        replica_gpus = sum(r.gpus for r in replicas if r.whole_gpus)
        plain = [g for g in inv.gpus if not g.mig_enabled]
        mark_replicas = replica_gpus > 0 and replica_gpus == len(plain)
        gpus = []
        for g in inv.gpus:
            if model is not None and model.lower() not in g.model.lower():
                continue
            # Sorted, so both sources (records listed by the API server, the extender's map) print alike.
            hs = sorted(holders[g.uuid], key=lambda h: (h.pod, h.container, h.mig_uuid or ""))
            if namespace is not None and hs and not any(h.pod.startswith(f"{namespace}/") for h in hs):
                continue
            migs = tuple(MigView(m.uuid, m.index, m.profile, m.memory_bytes, m.healthy,
                                 int(m.attributes.get("slices.gi", 0)),
                                 tuple(h for h in hs if h.mig_uuid == m.uuid))
                         for m in sorted(g.mig_devices, key=lambda m: m.index)) if g.mig_enabled else ()
            gv = GpuView(inv.name, g.index, g.minor, g.uuid, g.model, g.healthy, g.memory_bytes,
                         sum(h.core for h in hs), sum(h.memory_bytes for h in hs), tuple(hs), migs,
                         g.mig_enabled, g.replicated or (mark_replicas and not g.mig_enabled),
                         g.mig_enabled and inv.labels.get(DRA_NODE_LABEL) == "dra",
                         g.share_enforcement + (f": {g.share_enforcement_reason}" if g.share_enforcement_reason
                                                and g.share_enforcement != "none" else ""),
                         g.compute_mode, g.share_shape_lock, g.share_escapable)
            if gv.overcommitted:
                problems.append(f"{inv.name} GPU {g.index}: overcommitted ({gv.core_used} % compute, "
                                f"{gv.memory_used} of {gv.memory_bytes} bytes)")
            gpus.append(gv)
        if gpus:
            views.append(NodeView(inv.name, tuple(gpus), replicas))
            # Replicated GPUs the Device object marks are already not placeable; take off only the rest.
            unmarked = max(0, replica_gpus - sum(1 for g in gpus if g.replica_only)) if not mark_replicas else 0
            whole_free += max(0, sum(1 for g in gpus if g.placeable and not g.holders) - unmarked)
    all_gpus = [g for n in views for g in n.gpus]
    all_replicas = [r for n in views for r in n.replicas]
    all_migs = [m for g in all_gpus for m in g.mig]
    totals = ClusterTotals(
        nodes=len(views),
        gpus=len(all_gpus),
        healthy_gpus=sum(g.healthy for g in all_gpus),
        allocated_gpu=sum(min(g.gpu_used, 1.0) for g in all_gpus),
        free_gpu=sum(g.gpu_free for g in all_gpus),
        stranded_gpu=sum(g.gpu_free for g in all_gpus if g.partial),
        whole_free_gpus=whole_free,
        replica_gpus=sum(r.gpus for r in all_replicas if r.whole_gpus),
        replicas_total=sum(r.total for r in all_replicas),
        replicas_held=sum(r.held for r in all_replicas),
        replica_pods=len({h.pod for r in all_replicas for h in r.holders}),
        mig_devices=len(all_migs),
        mig_devices_free=sum(1 for m in all_migs if m.healthy and not m.holders),
    )
    return ClusterView(tuple(views), totals, tuple(problems))
