"""Who holds which GPU, how full and how fragmented the cluster is: one pure view for the CLI.

Built from what the API server records (each node's ``Device`` object and the
``kubegpu.io/device-allocated`` annotations of live pods), so ``kubegpu
status`` and ``kubectl gpu`` show exactly what the extender accounts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from kubegpu.model.allocation import ContainerAllocation, PodAllocation
from kubegpu.model.inventory import NodeInventory


@dataclass(frozen=True, slots=True)
class Holder:
    pod: str  # namespace/name
    container: str
    core: int
    memory_bytes: int


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

    @property
    def core_free(self) -> int:
        return max(0, 100 - self.core_used) if self.healthy else 0

    @property
    def partial(self) -> bool:
        """In use but not full: its free part cannot serve a whole-GPU request."""
        return self.healthy and self.core_used < 100 and (self.core_used > 0 or self.memory_used > 0)

    @property
    def overcommitted(self) -> bool:
        return self.core_used > 100 or self.memory_used > self.memory_bytes


@dataclass(frozen=True, slots=True)
class NodeView:
    name: str
    gpus: tuple[GpuView, ...]


@dataclass(frozen=True, slots=True)
class ClusterTotals:
    nodes: int
    gpus: int
    healthy_gpus: int
    allocated_gpu: float  # GPUs' worth of compute allocated
    free_gpu: float  # GPUs' worth of compute free on healthy GPUs
    stranded_gpu: float  # free compute on partially used GPUs (fragments)
    whole_free_gpus: int  # healthy GPUs nobody holds

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
                "allocated_gpu": round(self.totals.allocated_gpu, 2), "free_gpu": round(self.totals.free_gpu, 2),
                "stranded_gpu": round(self.totals.stranded_gpu, 2),
                "allocated_pct": round(self.totals.allocated_pct, 2),
                "stranded_pct": round(self.totals.stranded_pct, 2),
                "whole_free_gpus": self.totals.whole_free_gpus,
            },
            "nodes": [
                {"name": n.name, "gpus": [
                    {"index": g.index, "minor": g.minor, "uuid": g.uuid, "model": g.model, "healthy": g.healthy,
                     "memory_bytes": g.memory_bytes, "core_used": g.core_used, "memory_used": g.memory_used,
                     "holders": [{"pod": h.pod, "container": h.container, "core": h.core,
                                  "memory_bytes": h.memory_bytes} for h in g.holders]}
                    for g in n.gpus]}
                for n in self.nodes
            ],
            "problems": list(self.problems),
        }


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
) -> ClusterView:
    """Join inventories and allocation records; filters narrow what is shown *and* totalled.

    A record pointing at a GPU the node does not have is reported in ``problems``,
    never dropped silently.
    """
    by_node: dict[str, list[PodRecord]] = {}
    for p in pods:
        by_node.setdefault(p.node, []).append(p)
    problems: list[str] = []
    views: list[NodeView] = []
    for inv in sorted(inventories, key=lambda i: i.name):
        if node is not None and inv.name != node:
            continue
        holders: dict[str, list[Holder]] = {g.uuid: [] for g in inv.gpus}
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
                    holders[uuid].append(Holder(f"{rec.namespace}/{rec.name}", c.container, grant.core,
                                                grant.memory_bytes))
        gpus = []
        for g in inv.gpus:
            if model is not None and model.lower() not in g.model.lower():
                continue
            hs = holders[g.uuid]
            if namespace is not None and hs and not any(h.pod.startswith(f"{namespace}/") for h in hs):
                continue
            gv = GpuView(inv.name, g.index, g.minor, g.uuid, g.model, g.healthy, g.memory_bytes,
                         sum(h.core for h in hs), sum(h.memory_bytes for h in hs), tuple(hs))
            if gv.overcommitted:
                problems.append(f"{inv.name} GPU {g.index}: overcommitted ({gv.core_used} % compute, "
                                f"{gv.memory_used} of {gv.memory_bytes} bytes)")
            gpus.append(gv)
        if gpus:
            views.append(NodeView(inv.name, tuple(gpus)))
    all_gpus = [g for n in views for g in n.gpus]
    totals = ClusterTotals(
        nodes=len(views),
        gpus=len(all_gpus),
        healthy_gpus=sum(g.healthy for g in all_gpus),
        allocated_gpu=sum(min(g.core_used, 100) for g in all_gpus) / 100,
        free_gpu=sum(g.core_free for g in all_gpus) / 100,
        stranded_gpu=sum(g.core_free for g in all_gpus if g.partial) / 100,
        whole_free_gpus=sum(1 for g in all_gpus if g.healthy and not g.holders),
    )
    return ClusterView(tuple(views), totals, tuple(problems))
