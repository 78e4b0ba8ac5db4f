"""Who holds what: the extender's accounting of pods' GPUs, CPU and memory per node.

Accounting is rebuilt, never trusted from memory: it is the set of
``kubegpu.io/device-allocated`` annotations of live, bound pods (from the pod
watch), the CPU and memory requests of every live pod bound to a GPU node,
plus the allocations this extender assumed at bind time and has not yet seen
echoed by the watch. Each pod is held at most once (keyed by namespace/name
and checked by UID), so an echo, a relist or a restart never counts it twice.
Every hold and release also feeds the learned target workload (GPU pods and CPU-only pods, but not the
pods of DaemonSets or static pods, which follow their nodes).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kubegpu.model import annotations as A
from kubegpu.model import signing
from kubegpu.model.allocation import PodAllocation
from kubegpu.model.records import Shape, ambiguous, read_pod, request_shapes
from kubegpu.model.request import PodRequest
from kubegpu.model.versions import version_number as _rv
from kubegpu.placement import Demand, PlacementConflict
from kubegpu.placement.workload import LearnedWorkload
from kubegpu.scheduler.mirror import ArrayMirror
from kubegpu.scheduler.nodes import NodeRecord
from kubegpu.scheduler.parsed import parsed_pod as parse_pod  # once per pod version
from kubegpu.scheduler.requests import pod_demand, pod_resources

log = logging.getLogger(__name__)

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
HANDOFF_WAIT_ENV = "KUBEGPU_HANDOFF_WAIT"


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


@dataclass(frozen=True, slots=True)
class PodFacts:
    """What accounting reads from a pod besides its allocation."""

    cpu_milli: int = 0
    memory_bytes: int = 0
    shape: Demand | None = None

    @classmethod
    def of(cls, pod: Mapping[str, Any] | None) -> PodFacts:
        if pod is None:
            return cls()
        cpu, mem = pod_resources(pod)
        request = parse_pod(pod)
        shape = LearnedWorkload.shape_of(pod_demand(request, pod)) if request.ok and not follows_its_node(pod) else None
        return cls(cpu, mem, shape)


def follows_its_node(pod: Mapping[str, Any]) -> bool:
    """A DaemonSet's pod or a static (mirror) pod: it runs where its node is, so it is not part of the
    workload the scheduler places (a DaemonSet's CPU on every node would otherwise crowd out the shapes
    that arrive for placement); its CPU and memory still count on its node."""
    meta = pod.get("metadata") or {}
    if "kubernetes.io/config.mirror" in (meta.get("annotations") or {}):
        return True
    return any(isinstance(o, Mapping) and o.get("kind") == "DaemonSet" and o.get("controller")
               for o in (meta.get("ownerReferences") or ()))


class Ledger:
    """The held pods, per key and per node; applies each change to the node's state and its array row."""

    def __init__(self, nodes: dict[str, NodeRecord], mirror: ArrayMirror, learner: LearnedWorkload, *,
                 assume_ttl_s: float = 120.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.nodes = nodes
        self.mirror = mirror
        self.learner = learner
        self.held: dict[str, Held] = {}
        self.by_node: dict[str, set[str]] = {}
        self.assume_ttl_s = assume_ttl_s
        self._clock = clock
        self.conflicts = 0  # annotations that could not be held (double allocation seen in the cluster)
        self.corrupt = 0  # annotations that could not be read
        self.forged = 0  # records the extender did not sign (not accounted)
        self.record_key = signing.load_key()
        # Live records that exceed a GPU's capacity (pod -> why): held anyway, so the GPU is full.
        self.collisions: dict[str, str] = {}
        # node -> pod -> (resource, count, amounts) of its containers bound but not yet served by the node:
        # another pod asking the same (resource, count) there waits at bind, where binds are serialized
        # (docs/handoff.md).
        self.pending: dict[str, dict[str, frozenset[Shape]]] = {}
        # The same, indexed by what the kubelet's calls look like: (resource, count) -> node -> the first
        # pod (in the node's waiting order) with a container of that kind waiting there. Bind reads only
        # the nodes listed under the pod's own kinds, never every waiting pod (tens of thousands after a
        # restart). Written only by _set_pending and _drop_pending, with self.pending.
        self.pending_kinds: dict[tuple[str, int], dict[str, str]] = {}
        # Beside it: the reason filter gives on each such node (kind -> node -> text, built once per change),
        # and the nodes each pod waits on (to find the rare pod that would otherwise wait on itself).
        self._kind_reasons: dict[tuple[str, int], dict[str, str]] = {}
        self._waits_on: dict[str, set[str]] = {}
        # node -> the resourceVersion up to which its node daemon's view is complete (A.HANDOFF_SEEN), for nodes
        # that publish it; and node -> pod that ended while waiting there -> the version of its end. Such a pod
        # keeps its kind waiting (under a key of its own, _ended) until its node has seen the end: before that,
        # the node's view may still show it waiting and serve its record to the next pod's call.
        self.node_seen: dict[str, int] = {}
        self.ended: dict[str, dict[str, int]] = {}
        # node -> binds waiting in the extender for their turn there (prioritize sends a pod to the shortest queue)
        self.waiting_binds: dict[str, int] = {}
        # Off only where no kubegpu node serves the records (simulations, extender-only tests): there a
        # bound pod is never acknowledged and would hold its shape forever.
        self.handoff_wait = os.environ.get(HANDOFF_WAIT_ENV, "1") not in ("0", "false", "no")
        self._assumed: set[str] = set()  # keys of held entries not yet echoed by the watch
        # Pods without GPUs bound to a node whose Device object has not arrived yet (the informers list
        # concurrently): node -> key -> (uid, the pod's resource-only skeleton), held once it does.
        self.waiting: dict[str, dict[str, tuple[str, Mapping[str, Any]]]] = {}
        self.devices_listed = False  # once every Device object has been listed, nothing waits any more

    def pods_on(self, node: str) -> list[tuple[PodAllocation, int, int]]:
        """(allocation, CPU, memory) of the pods held on a node, in key order (to rebuild its state)."""
        return [(h.alloc.held(), h.cpu_milli, h.memory_bytes)
                for h in (self.held[k] for k in sorted(self.by_node.get(node, ())))]

    def hold(self, key: str, uid: str, node: str, alloc: PodAllocation, *, assumed: bool = False,
             pod: Mapping[str, Any] | None = None, facts: PodFacts | None = None, force: bool = False) -> None:
        """Account a pod's allocation (and, given the pod, its CPU and memory) on a node, replacing what
        was held for it. Raises PlacementConflict when it does not fit; then nothing changes. ``force``
        holds it anyway (a live record colliding with others: the GPU is then full, never silently
        over-filled). An assumed hold (a bind) makes the pod's GPU containers wait for the node's
        handoff until the watch shows them acknowledged. The GPUs held follow Kubernetes' init-container
        rule (:meth:`PodAllocation.held`)."""
        if assumed and pod is not None:
            self._set_pending(node, key, request_shapes(parse_pod(pod)))
            log.debug("pod %s bound to %s: waiting for the node's handoff", key, node)
        f = facts if facts is not None else PodFacts.of(pod)
        old = self.held.get(key)
        if (old is not None and old.uid == uid and old.node == node and old.alloc == alloc
                and (pod is None or (old.cpu_milli, old.memory_bytes, old.shape) == (f.cpu_milli, f.memory_bytes,
                                                                                      f.shape))):
            if not assumed:
                old.assumed_at = None
                old.binding = False
                self._assumed.discard(key)
            return
        if old is not None and pod is None and facts is None:
            f = PodFacts(old.cpu_milli, old.memory_bytes, old.shape)  # same pod, re-held without its spec
        rec = self.nodes.get(node)
        if old is not None:
            self.release(key)
        if rec is not None and rec.state is not None:
            try:
                rec.state.apply_allocation(alloc.held(), f.cpu_milli, f.memory_bytes, force=force)
            except PlacementConflict:
                if old is not None:  # put back what was there
                    self.hold(key, old.uid, old.node, old.alloc, assumed=old.assumed_at is not None,
                              facts=PodFacts(old.cpu_milli, old.memory_bytes, old.shape))
                raise
            self.mirror.sync(node)
        self.held[key] = Held(key, uid, node, alloc, self._clock() if assumed else None, binding=assumed,
                              cpu_milli=f.cpu_milli, memory_bytes=f.memory_bytes, shape=f.shape)
        self.by_node.setdefault(node, set()).add(key)
        if assumed:
            self._assumed.add(key)
        self.learner.add(f.shape)

    def release(self, key: str, uid: str | None = None) -> Held | None:
        h = self.held.get(key)
        if h is None or (uid is not None and h.uid != uid):
            return None
        del self.held[key]
        self._assumed.discard(key)
        self.collisions.pop(key, None)
        self._drop_pending(h.node, key)
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
        for key, (uid, pod) in sorted(self.waiting.pop(node, {}).items()):
            if self.tracks(node):
                try:
                    self.hold(key, uid, node, PodAllocation(()), pod=pod)
                except PlacementConflict as e:
                    self.conflicts += 1
                    log.error("pod %s on %s: its CPU or memory does not fit the node: %s", key, node, e)

    def tracks(self, node: str | None) -> bool:
        """Whether pods bound to ``node`` are accounted (it is a GPU node with a known state)."""
        rec = self.nodes.get(node or "")
        return rec is not None and rec.state is not None

    def observe_pod(self, pod: Mapping[str, Any], deleted: bool = False, version: str = "") -> None:
        """A pod from the watch (a dict shaped like a v1.Pod); ``version``: the resourceVersion of the change
        when it is not the pod's own (a deletion a relist found)."""
        meta = pod.get("metadata") or {}
        key = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
        uid = str(meta.get("uid") or "")
        phase = (pod.get("status") or {}).get("phase")
        if deleted or phase in TERMINAL_PHASES:
            self._unwait(key)
            if phase != "Succeeded" and ((held := self.held.get(key)) is None or not uid or held.uid == uid):
                # (a pod that succeeded ran: its kubelet calls were served)
                self._keep_waiting_until_seen(key, _rv(version or meta.get("resourceVersion")))
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
            self.waiting.setdefault(node, {})[key] = (uid, pod)
        if not node or (recorded is None and not self.tracks(node)):
            # Not bound yet (or no GPUs recorded): keep an in-flight assumption, drop anything else.
            if current is not None and current.assumed_at is None and current.uid == uid:
                self.release(key)
            return
        # A pod without GPUs on a GPU node: its CPU and memory count.
        alloc = recorded if recorded is not None else PodAllocation(())
        try:
            self.hold(key, uid, node, alloc, pod=pod)
            self.collisions.pop(key, None)
        except PlacementConflict as e:
            self.conflicts += 1
            self.collisions[key] = f"{node}: {e}"
            log.error("pod %s on %s: recorded GPUs exceed a GPU's capacity with other pods' (%s); held anyway: "
                      "that GPU is full for new placements", key, node, e)
            self.hold(key, uid, node, alloc, pod=pod, force=True)
        assert records is not None
        # Waiting ends with the acknowledgement, or once the kubelet runs the pod (its Allocate calls are done,
        # whoever writes the acknowledgement and whenever it lands): a running pod never holds its kind up.
        # A pod bound here without a record (another scheduler's) waits too: its calls look like a recorded
        # pod's of the same kind, and the node refuses both rather than guess.
        waiting = request_shapes(parse_pod(pod), records.acks) if phase != "Running" else frozenset()
        if waiting:
            self._set_pending(node, key, waiting)
        elif self._drop_pending(node, key):
            log.debug("pod %s on %s: served by the node; its shapes no longer wait", key, node)

    # ---- the handoff wait ------------------------------------------------------------------------
    def _keep_waiting_until_seen(self, key: str, version: int) -> None:
        """``key`` ended (deleted, or failed by its kubelet) at ``version`` while waiting: on each node that
        publishes how far its view has got and has not got that far, its kinds keep waiting until it has."""
        for node in list(self._waits_on.get(key, ())):
            shapes = self.pending.get(node, {}).get(key)
            seen = self.node_seen.get(node)
            if not shapes or seen is None or seen >= version:
                continue
            ended = key + _ENDED
            self._set_pending(node, ended, shapes)
            per = self.ended.setdefault(node, {})
            per[ended] = max(version, per.get(ended, -1))
            log.debug("pod %s ended at %d while waiting on %s, whose daemon has seen up to %d: its kinds wait "
                      "until it has seen that", key, version, node, seen)

    def node_progress(self, node: str, value: str | None) -> None:
        """``node``'s A.HANDOFF_SEEN (None: not published, or the node is gone): the pods that ended while
        waiting there, now seen ended by its daemon, stop holding their kinds."""
        seen = _rv(value) if value is not None else -1
        if seen < 0:
            self.node_seen.pop(node, None)  # a daemon that does not publish: nothing to wait for
        else:
            self.node_seen[node] = seen
        per = self.ended.get(node)
        if not per:
            return
        for ended in [k for k, version in per.items() if seen < 0 or version <= seen]:
            del per[ended]
            self._drop_pending(node, ended)
        if not per:
            del self.ended[node]

    def _set_pending(self, node: str, key: str, shapes: frozenset[Shape]) -> None:
        """``key`` on ``node`` waits for the node's handoff with these shapes (replacing what it waited with;
        an empty set keeps its place in the node's order and blocks nothing)."""
        per = self.pending.setdefault(node, {})
        old = per.get(key)
        if old == shapes:
            return
        per[key] = shapes
        self._waits_on.setdefault(key, set()).add(node)
        self._reindex(node, shapes if old is None else old | shapes)

    def _drop_pending(self, node: str, key: str) -> bool:
        """``key`` no longer waits on ``node`` (served, released or gone). Whether it was waiting."""
        per = self.pending.get(node)
        old = per.pop(key, None) if per is not None else None
        if old is None:
            return False
        if (nodes := self._waits_on.get(key)) is not None:
            nodes.discard(node)
            if not nodes:
                del self._waits_on[key]
        self._reindex(node, old)
        return True

    def _reindex(self, node: str, shapes: frozenset[Shape]) -> None:
        """Who waits first on ``node`` for each kind of ``shapes``, after a change of the node's waiting pods."""
        per = self.pending.get(node, {})
        for kind in {(res, count) for res, count, _ in shapes}:
            first = next((k for k, waiting in per.items() if any(w[:2] == kind for w in waiting)), None)
            nodes = self.pending_kinds.get(kind)
            if first is not None:
                if nodes is None:
                    nodes = self.pending_kinds[kind] = {}
                    self._kind_reasons[kind] = {}
                if nodes.get(node) != first:
                    nodes[node] = first
                    self._kind_reasons[kind][node] = _handoff_reason(first, kind[1], kind[0])
            elif nodes is not None:
                nodes.pop(node, None)
                self._kind_reasons[kind].pop(node, None)
                if not nodes:
                    del self.pending_kinds[kind], self._kind_reasons[kind]

    def handoff_blocked(self, pod: Mapping[str, Any], request: PodRequest) -> dict[str, str]:
        """Nodes where another pod is bound, not yet served by the node, and asks the same (resource,
        device count): the kubelet's calls carry no pod identity, so with two such pods waiting the
        node could steer one onto the other's record. One at a time per shape and node keeps every
        Allocate unambiguous (docs/handoff.md); bind checks it and holds in one step, so asynchronous
        binds cannot slip past it as they did past filter. Costs the waiting pods of the nodes indexed
        under the pod's own (resource, count) kinds, not every waiting pod."""
        if not self.pending_kinds or not self.handoff_wait:
            return {}
        shapes = request_shapes(request)
        kinds = {(res, count) for res, count, _ in shapes}
        lists = [(kind, nodes) for kind in kinds if (nodes := self.pending_kinds.get(kind))]
        if not lists:
            return {}
        meta = pod.get("metadata") or {}
        key = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
        out: dict[str, str] = {}
        if len(lists) == 1:
            # One kind waits anywhere (always so for a pod with one GPU container): the index names who
            # waits first on each node, and any waiting pod that matches the pod matches on that kind.
            (kind, firsts), = lists
            out = dict(self._kind_reasons[kind])
            for node in self._waits_on.get(key, ()):  # where the pod itself waits (a recreated name): skip it
                if firsts.get(node) == key:
                    del out[node]
                    if (reason := self._blocked_on(node, key, shapes)) is not None:
                        out[node] = reason
            return out
        for node in dict.fromkeys(n for _, nodes in lists for n in nodes):
            if (reason := self._blocked_on(node, key, shapes)) is not None:
                out[node] = reason
        return out

    def _blocked_on(self, node: str, key: str, shapes: frozenset[Shape]) -> str | None:
        """Why a pod ``key`` asking ``shapes`` waits on ``node``: the first other waiting pod there whose
        kubelet calls would look the same, or None."""
        for other, waiting in self.pending[node].items():
            same = ambiguous(waiting, shapes) if other != key else None
            if same is not None:
                res, count, _ = same
                return _handoff_reason(other, count, res)
        return None


_ENDED = " (ended)"  # the suffix of a pod's key under which it waits once ended (Ledger._keep_waiting_until_seen)


def _handoff_reason(other: str, count: int, resource: str) -> str:
    if other.endswith(_ENDED):
        return (f"pod {other[:-len(_ENDED)]} ended before its node's daemon served it, and the daemon has not "
                f"seen it end yet: until it has, a call for {count} {resource} there could be served that pod's "
                "record, so the next such pod waits")
    return (f"pod {other} is being handed to the kubelet with {count} {resource}; the kubelet's calls carry "
            "no pod, so one such pod at a time per node")
