"""The extender's view of the cluster: GPU nodes, who holds what, and how pods are placed on them.

One object wires the parts, each in its own module:

- :mod:`.accounting` (:class:`Ledger`): held pods, rebuilt from live pods' annotations and requests;
- :mod:`.handoff` (:class:`HandoffQueue`): the bound pods each node is still being handed;
- :mod:`.mirror` (:class:`ArrayMirror`): every node's state as one row of a ``ClusterState``;
- :mod:`.scoring` (:class:`Scoring`): the learned target workload, its context and the policy objects;
- :mod:`.verbs` (:class:`Verbs`): filter, prioritize and bind's choice, through the placement core.

Pure logic, no I/O: the informers feed events in, the HTTP handlers read out.
Everything runs in one event loop, so a bind's check-and-hold is atomic.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kubegpu.model.inventory import NodeInventory
from kubegpu.placement import MILLI, NodeState
from kubegpu.placement.frag import node_frag
from kubegpu.placement.workload import LearnedWorkload
from kubegpu.scheduler.accounting import Ledger
from kubegpu.scheduler.handoff import HandoffQueue
from kubegpu.scheduler.mirror import ArrayMirror
from kubegpu.scheduler.nodes import NodeDaemons, NodeRecord
from kubegpu.scheduler.scoring import Scoring
from kubegpu.scheduler.summary import node_summary
from kubegpu.scheduler.verbs import FilterOutcome, Verbs

log = logging.getLogger(__name__)


class ClusterView(Verbs):
    """Nodes, their GPU states and the held allocations; the arrays behind filter and prioritize."""

    def __init__(self, *, assume_ttl_s: float = 120.0, exact_fit_enough: int = 100, clock: Any = time.monotonic,
                 learner: LearnedWorkload | None = None, handoff_wait: bool = True,
                 record_key: bytes | None = None) -> None:
        self.nodes: dict[str, NodeRecord] = {}
        self.mirror = ArrayMirror(self.nodes)
        self.scoring = Scoring(learner)
        self.handoffs = HandoffQueue(enabled=handoff_wait)
        self.ledger = Ledger(self.nodes, self.mirror, self.scoring.learner, self.handoffs,
                             assume_ttl_s=assume_ttl_s, clock=clock, record_key=record_key)
        self.exact_fit_enough = exact_fit_enough
        self.daemons = NodeDaemons()

    # ---- nodes -----------------------------------------------------------------------------------
    def _record(self, name: str) -> NodeRecord:
        rec = self.nodes.get(name)
        if rec is None:
            rec = self.nodes[name] = NodeRecord(name)
        return rec

    def set_node_labels(self, name: str, labels: Mapping[str, str] | None) -> None:
        rec = self._record(name)
        new = dict(labels or {})
        if new != rec.labels:
            rec.labels = new
            self.mirror.labels_changed()

    def set_node_daemon(self, name: str, annotations: Mapping[str, str], status: Mapping[str, Any] | None) -> None:
        """The Node's word on its kubegpu daemon (its annotation, its kubelet's device counts): filter refuses
        its GPUs and binds there wait while the daemon does not serve them."""
        self.handoffs.node_daemon(name, self.daemons.observe(name, annotations, status))

    def remove_node(self, name: str) -> None:
        """The Node object is gone: forget its labels (its GPUs go with its Device object)."""
        self.handoffs.node_progress(name, None)
        self.handoffs.node_daemon(name, None)
        self.daemons.forget(name)
        rec = self.nodes.get(name)
        if rec is not None:
            rec.labels = {}
            self.mirror.labels_changed()

    def set_inventory(self, name: str, inventory: NodeInventory | None, error: str = "") -> None:
        """A node's GPUs from its Device object (None when it is gone or unreadable)."""
        rec = self._record(name)
        rec.device_error = error
        if inventory == rec.inventory and rec.state is not None:
            return
        models = rec.models
        rec.inventory = inventory
        rec.state = None
        if inventory is not None:
            rec.state, problems = NodeState.rebuild(inventory, self.ledger.pods_on(name))
            for p in problems:
                self.ledger.conflicts += 1
                log.error("node %s: a recorded allocation does not fit its GPUs: %s", name, p)
        self.mirror.update(rec)
        if rec.state is not None:
            self.ledger.node_known(name)
        if rec.models != models:
            self.mirror.labels_changed()

    # ---- after the first lists ----------------------------------------------------------------
    def warm_up(self) -> None:
        """After the first full lists: the workload from every live pod now, the arrays and the context, and
        the tables the first filter and prioritize would otherwise build while kube-scheduler waits (the
        rows' names as JSON and as prioritize entries, the rows' model texts, the workload's fill tables).
        Each is kept by what it depends on, so building it early answers the same."""
        self.scoring.learner.rebuild()
        self.mirror.cluster  # noqa: B018
        ctx = self.scoring.context()
        self.name_table()
        self.host_table()
        self._models_present()
        if ctx.workload is not None and len(ctx.workload) > 0:
            ctx.fill_tables()

    # ---- views ---------------------------------------------------------------------------------
    def fragmentation(self) -> float:
        """Cluster fragmentation (milli-GPU of free compute the target workload cannot use)."""
        cluster = self.mirror.cluster
        if cluster.n_nodes == 0:
            return 0.0
        return float(node_frag(cluster, self.scoring.context().frag_terms(cluster, False)).sum())

    def summary(self, node: str) -> dict[str, Any] | None:
        """The seed's node device summary (``allocateSet``, ``deviceTotal``/``Free``/``Used`` and details)."""
        rec = self.nodes.get(node)
        if rec is None or rec.state is None or rec.inventory is None:
            return None
        held = self.ledger.held
        return node_summary(rec.state, {k: held[k].alloc for k in sorted(self.ledger.by_node.get(node, ()))})

    def gpu_totals(self) -> GpuTotals:
        """The GPUs placement may use (healthy, not MIG-enabled), by how much of their compute is allocated,
        and the allocated share of their compute and memory: from the arrays, so a scrape makes no Python pass
        over each GPU."""
        c = self.mirror.cluster
        ok = c.gpu_ok
        free = c.core_free[ok]
        if free.size == 0:
            return GpuTotals(0, 0, 0, 0.0, 0.0)
        idle, full = int((free >= MILLI).sum()), int((free <= 0).sum())
        mem_cap = int(c.gmem_cap[ok].sum())
        mem_used = 1 - int(c.gmem_free[ok].sum()) / mem_cap if mem_cap > 0 else 0.0
        return GpuTotals(idle, free.size - idle - full, full, 1 - int(free.sum()) / (free.size * MILLI), mem_used)

    def gpu_allocation(self) -> Iterable[tuple[str, int, float, float]]:
        """(node, minor, compute used 0..1, memory used 0..1) per healthy GPU."""
        for name, rec in self.nodes.items():
            if rec.state is None:
                continue
            for gpu in rec.state.gpus:
                if not gpu.placeable or gpu.memory_bytes <= 0:
                    continue
                yield (name, gpu.minor, 1 - rec.state.core_free(gpu.uuid) / 100,
                       1 - rec.state.memory_free(gpu.uuid) / gpu.memory_bytes)


@dataclass(frozen=True, slots=True)
class GpuTotals:
    """The cluster's GPUs placement may use: counts by compute allocated (none, some, all) and the allocated
    share of their compute and of their memory (0..1)."""

    free: int
    partial: int
    full: int
    compute_allocated: float
    memory_allocated: float


__all__ = ["ClusterView", "FilterOutcome", "GpuTotals", "NodeRecord"]
