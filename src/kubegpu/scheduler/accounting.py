"""Who holds what: the extender's accounting of pods' GPUs, CPU and memory per node.

Accounting is rebuilt, never trusted from memory: it is the set of
``kubegpu.io/device-allocated`` annotations of live, bound pods (from the pod
watch), the CPU and memory requests of every live pod bound to a GPU node,
plus the allocations this extender assumed at bind time and has not yet seen
echoed by the watch. Each pod is held at most once (keyed by namespace/name
and checked by UID), so an echo, a relist or a restart never counts it twice.
Every hold and release also feeds the learned target workload (GPU pods and CPU-only pods, but not the
pods of DaemonSets or static pods, which follow their nodes), and tells the handoff queue
(:mod:`.handoff`) which bound pods wait for their node to serve them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kubegpu.model import annotations as A
from kubegpu.model.allocation import PodAllocation
from kubegpu.model.records import read_pod, request_shapes
from kubegpu.model.versions import version_number as _rv
from kubegpu.placement import Demand, PlacementConflict
from kubegpu.placement.workload import LearnedWorkload
from kubegpu.scheduler.handoff import HandoffQueue
from kubegpu.scheduler.mirror import ArrayMirror
from kubegpu.scheduler.nodes import NodeRecord
from kubegpu.scheduler.plan import PodPlan

log = logging.getLogger(__name__)

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


@dataclass(slots=True)
class Held:
    """One pod's allocation as this extender accounts it."""

    key: str  # namespace/name
    uid: str
    node: str
    alloc: PodAllocation
    assumed_at: float | None = None  # set while only this extender knows (bind not yet echoed)
    binding: bool = False  # a bind is in flight: never expire it
    cpu_milli: int = 0
    memory_bytes: int = 0
    shape: Demand | None = None  # what the learned workload counts for it (None: not learned)


_Usage = tuple[int, int, Demand | None]  # CPU millicores, memory bytes, the learned shape of a held pod


class Ledger:
    """The held pods, per key and per node; applies each change to the node's state and its array row."""

    def __init__(self, nodes: dict[str, NodeRecord], mirror: ArrayMirror, learner: LearnedWorkload,
                 handoffs: HandoffQueue, *, assume_ttl_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic, record_key: bytes | None = None) -> None:
        self.nodes = nodes
        self.mirror = mirror
        self.learner = learner
        self.handoffs = handoffs
        self.held: dict[str, Held] = {}
        self.by_node: dict[str, set[str]] = {}
        self.assume_ttl_s = assume_ttl_s
        self._clock = clock
        self.conflicts = 0  # annotations that could not be held (double allocation seen in the cluster)
        self.corrupt = 0  # annotations that could not be read
        self.forged = 0  # records the extender did not sign (not accounted)
        self.record_key = record_key  # records must carry its signature (None: unsigned records count)
        # Live records that exceed a GPU's capacity (pod -> why): held anyway, so the GPU is full.
        self.collisions: dict[str, str] = {}
        self._assumed: set[str] = set()  # keys of held entries not yet echoed by the watch
        # Pods without GPUs bound to a node whose Device object has not arrived yet (the informers list
        # concurrently): node -> key -> (uid, the pod's plan), held once it does.
        self.waiting: dict[str, dict[str, tuple[str, PodPlan]]] = {}
        self.devices_listed = False  # once every Device object has been listed, nothing waits any more

    def pods_on(self, node: str) -> list[tuple[PodAllocation, int, int]]:
        """(allocation, CPU, memory) of the pods held on a node, in key order (to rebuild its state)."""
        return [(h.alloc.held(), h.cpu_milli, h.memory_bytes)
                for h in (self.held[k] for k in sorted(self.by_node.get(node, ())))]

    def hold(self, key: str, uid: str, node: str, alloc: PodAllocation, *, assumed: bool = False,
             plan: PodPlan | None = None, force: bool = False) -> None:
        """Account a pod's allocation (and, given its plan, its CPU and memory) on a node, replacing what
        was held for it (without a plan, what was held for it counts as before). Raises PlacementConflict
        when it does not fit; then nothing changes. ``force`` holds it anyway (a live record colliding with
        others: the GPU is then full, never silently over-filled). An assumed hold (a bind) makes the pod's
        GPU containers wait in the handoff queue until the watch shows them acknowledged. The GPUs held
        follow Kubernetes' init-container rule (:meth:`PodAllocation.held`)."""
        if assumed and plan is not None:
            self.handoffs.wait(node, key, plan.shapes)
            log.debug("pod %s bound to %s: waiting for the node's handoff", key, node)
        old = self.held.get(key)
        usage: _Usage = (0, 0, None)
        if plan is not None:
            usage = (plan.demand.cpu_milli, plan.demand.memory_bytes, plan.learned)
        elif old is not None:
            usage = (old.cpu_milli, old.memory_bytes, old.shape)
        if (old is not None and old.uid == uid and old.node == node and old.alloc == alloc
                and (old.cpu_milli, old.memory_bytes, old.shape) == usage):
            if not assumed:
                old.assumed_at = None
                old.binding = False
                self._assumed.discard(key)
            return
        self._apply(key, uid, node, alloc, assumed, usage, force)

    def _apply(self, key: str, uid: str, node: str, alloc: PodAllocation, assumed: bool, usage: _Usage,
               force: bool) -> None:
        old = self.held.get(key)
        rec = self.nodes.get(node)
        if old is not None:
            self.release(key)
        cpu, mem, shape = usage
        if rec is not None and rec.state is not None:
            try:
                rec.state.apply_allocation(alloc.held(), cpu, mem, force=force)
            except PlacementConflict:
                if old is not None:  # put back what was there
                    self._apply(key, old.uid, old.node, old.alloc, old.assumed_at is not None,
                                (old.cpu_milli, old.memory_bytes, old.shape), False)
                raise
            self.mirror.sync(node)
        self.held[key] = Held(key, uid, node, alloc, self._clock() if assumed else None, binding=assumed,
                              cpu_milli=cpu, memory_bytes=mem, shape=shape)
        self.by_node.setdefault(node, set()).add(key)
        if assumed:
            self._assumed.add(key)
        self.learner.add(shape)

    def release(self, key: str, uid: str | None = None) -> Held | None:
        h = self.held.get(key)
        if h is None or (uid is not None and h.uid != uid):
            return None
        del self.held[key]
        self._assumed.discard(key)
        self.collisions.pop(key, None)
        self.handoffs.served(h.node, key)
        self.by_node.get(h.node, set()).discard(key)
        rec = self.nodes.get(h.node)
        if rec is not None and rec.state is not None:
            rec.state.release_allocation(h.alloc.held(), h.cpu_milli, h.memory_bytes)
            self.mirror.sync(h.node)
        self.learner.remove(h.shape)
        return h

    def release_assumed(self, key: str, uid: str, node: str) -> Held | None:
        """Drop what a bind that failed held for ``key`` on ``node``: only while it is still that bind's
        assumption. Once the watch has shown the pod bound (there, by a write that did go through, or on
        another node by someone else), the hold is the pod's own and stays."""
        h = self.held.get(key)
        if h is None or h.uid != uid or h.node != node or h.assumed_at is None:
            return None
        return self.release(key, uid)

    @property
    def assumed_count(self) -> int:
        return len(self._assumed)

    def mark_bound(self, key: str) -> None:
        """The bind of an assumed pod went through: wait up to the TTL for the watch to echo it."""
        h = self.held.get(key)
        if h is not None and h.assumed_at is not None:
            h.binding = False
            h.assumed_at = self._clock()

    def expire_assumed(self) -> list[str]:
        """Drop assumptions whose bind finished but never showed in the watch within the TTL."""
        now = self._clock()
        ttl = self.assume_ttl_s
        gone = [k for k in self._assumed
                if (h := self.held[k]).assumed_at is not None and not h.binding and now - h.assumed_at > ttl]
        for k in gone:
            log.warning("pod %s: assumed allocation expired (bind never seen in the watch); released", k)
            self.release(k)
        return gone

    def _unwait(self, key: str) -> None:
        for node in [n for n, pods in self.waiting.items() if key in pods]:
            del self.waiting[node][key]
            if not self.waiting[node]:
                del self.waiting[node]

    def devices_are_listed(self) -> None:
        """Every Device object has been listed: nodes still without one are not GPU nodes; forget their pods."""
        self.devices_listed = True
        self.waiting.clear()

    def node_known(self, node: str) -> None:
        """A node's state now exists: hold the pods without GPUs that were bound to it before."""
        for key, (uid, plan) in sorted(self.waiting.pop(node, {}).items()):
            if self.tracks(node):
                try:
                    self.hold(key, uid, node, PodAllocation(()), plan=plan)
                except PlacementConflict as e:
                    self.conflicts += 1
                    log.error("pod %s on %s: its CPU or memory does not fit the node: %s", key, node, e)

    def tracks(self, node: str | None) -> bool:
        """Whether pods bound to ``node`` are accounted (it is a GPU node with a known state)."""
        rec = self.nodes.get(node or "")
        return rec is not None and rec.state is not None

    def observe_pod(self, pod: Mapping[str, Any], plan: PodPlan, deleted: bool = False, version: str = "") -> None:
        """A pod from the watch (a dict shaped like a v1.Pod) and its plan; ``version``: the resourceVersion of
        the change when it is not the pod's own (a deletion a relist found)."""
        meta = pod.get("metadata") or {}
        key = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
        uid = str(meta.get("uid") or "")
        phase = (pod.get("status") or {}).get("phase")
        if deleted or phase in TERMINAL_PHASES:
            self._unwait(key)
            if phase != "Succeeded" and ((held := self.held.get(key)) is None or not uid or held.uid == uid):
                # (a pod that succeeded ran: its kubelet calls were served)
                self.handoffs.keep_waiting_until_seen(key, _rv(version or meta.get("resourceVersion")))
            self.release(key, uid or None)
            return
        node = (pod.get("spec") or {}).get("nodeName") or ""
        # The signed record, moved to the GPUs the node acknowledged; or the acknowledged GPUs of a pod
        # the extender did not place (model.records: one home for these rules).
        records = read_pod(pod, self.record_key) if node else None
        recorded = records.allocation() if records is not None else None
        current = self.held.get(key)
        if records is not None and records.problems and (current is None or current.uid != uid):
            if records.forged:
                self.forged += 1
            elif records.record is None and A.DEVICE_ALLOCATED in (meta.get("annotations") or {}):
                self.corrupt += 1
            log.error("pod %s: %s; not accounted", key, "; ".join(records.problems))
        self._unwait(key)
        if node and recorded is None and not self.tracks(node) and not self.devices_listed:
            # Maybe a GPU node whose Device object is still to come: hold the pod's CPU and memory then.
            self.waiting.setdefault(node, {})[key] = (uid, plan)
        if not node or (recorded is None and not self.tracks(node)):
            # Not bound yet (or no GPUs recorded): keep an in-flight assumption, drop anything else.
            if current is not None and current.assumed_at is None and current.uid == uid:
                self.release(key)
            return
        # A pod without GPUs on a GPU node: its CPU and memory count.
        alloc = recorded if recorded is not None else PodAllocation(())
        try:
            self.hold(key, uid, node, alloc, plan=plan)
            self.collisions.pop(key, None)
        except PlacementConflict as e:
            self.conflicts += 1
            self.collisions[key] = f"{node}: {e}"
            log.error("pod %s on %s: recorded GPUs exceed a GPU's capacity with other pods' (%s); held anyway: "
                      "that GPU is full for new placements", key, node, e)
            self.hold(key, uid, node, alloc, plan=plan, force=True)
        assert records is not None
        # Waiting ends with the acknowledgement, or once the kubelet runs the pod (its Allocate calls are done,
        # whoever writes the acknowledgement and whenever it lands): a running pod never holds its kind up.
        # A pod bound here without a record (another scheduler's) waits too: its calls look like a recorded
        # pod's of the same kind, and the node refuses both rather than guess.
        waiting = request_shapes(plan.request, records.acks) if phase != "Running" else frozenset()
        if waiting:
            self.handoffs.wait(node, key, waiting)
        elif self.handoffs.served(node, key):
            log.debug("pod %s on %s: served by the node; its shapes no longer wait", key, node)
