"""A trace replayed through the real extender the way kube-scheduler calls it with a given profile.

:class:`~kubegpu_standins.trace_scheduler.TraceScheduler` sends the extender every node that has the CPU and
memory, and takes its top score: the extender's own answer. :class:`ProductionScheduler` puts
kube-scheduler's rules in between (:mod:`kubegpu_standins.kube_scheduler_model`): its in-tree resource
filter over the nodes' allocatable (CPU, memory, pods, and the GPU resources the node daemon advertises),
the search window of ``percentageOfNodesToScore`` with the rotating start, the feasible nodes in no
particular order, one node chosen without scoring, the score plugins and the extender weight, ties at
random. Nodes are as the recording's: allocatable CPU and memory from the trace, ``nvidia.com/gpu: n``,
``kubegpu.io/gpu-core: 100n``, ``kubegpu.io/gpu-memory-ratio: 100n``, ``pods: 1000``, no taints, one zone.

The handoff wait stays on, as deployed. The node's acknowledgement is modelled as the kubelet produces it
(docs/handoff.md): the pod is admitted after its binding and the node daemon writes the signed
``kubegpu.io/device-assigned`` with the GPUs it served, which are the record's. ``ack_lag`` is how many
later pods kube-scheduler places before that acknowledgement is seen (0: the kubelet is faster than the
arrivals; each acknowledgement is waited for until the extender has taken it in, so nothing depends on
timing). A pod that no node takes only because nodes wait for acknowledgements is tried again once they
have come (kube-scheduler requeues it on the pod update that carries them); otherwise it is turned away and
deleted, as the simulator drops it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import httpx
import numpy as np

from kubegpu.model import annotations as A
from kubegpu.model import resources as R
from kubegpu.model import signing
from kubegpu.model.allocation import PodAllocation, decode
from kubegpu.model.records import Ack, encode_acks
from kubegpu.sim.trace import TraceNodes, TracePod
from kubegpu_standins.apiserver import ApiServer
from kubegpu_standins.kube_scheduler_model import (
    DEFAULT_CPU_REQUEST,
    DEFAULT_MEMORY_REQUEST,
    NodeSearch,
    ProfileModel,
    balanced_allocation,
    least_allocated,
    select_host,
    total_scores,
)
from kubegpu_standins.trace_scheduler import NAMESPACE, ReplayOutcome, post_verb, trace_pod

MAX_PODS = 1000
HANDOFF_REASON = "is being handed to the kubelet"  # the extender's filter reason (scheduler/accounting.py)
ACK_WAIT_S = 30.0


def served_acks(record: PodAllocation, slot: str) -> dict[str, Ack]:
    """What a node daemon acknowledges for a pod it served exactly on its record's GPUs: whole GPUs by UUID,
    a share as the kubelet's slot ``<uuid>::<slot>``, per container."""
    acks: dict[str, Ack] = {}
    for c in record.containers:
        whole = all(g.core >= 100 for g in c.grants)
        resource = R.NVIDIA_GPU if whole else R.GPU_SLOTS
        devices = tuple(g.uuid if whole else f"{g.uuid}::{slot}" for g in c.grants)
        acks[c.container] = Ack(resource, devices, tuple(c.grants))
    return acks


class ProductionScheduler:
    """Plays kube-scheduler with ``model`` for a trace against the extender at ``url``; ``ext`` is the
    running :class:`~kubegpu.scheduler.service.ServiceThread` (to see when an acknowledgement is taken in)."""

    def __init__(self, api: ApiServer, url: str, ext: Any, nodes: TraceNodes, model: ProfileModel, *,
                 seed: int = 0, ack_lag: int = 0) -> None:
        self.api, self.url, self.ext, self.model = api, url.rstrip("/"), ext, model
        self.names = list(nodes.names)
        self.index = {n: j for j, n in enumerate(self.names)}
        n = len(self.names)
        gpus = np.asarray(nodes.gpus, np.int64)
        self.alloc = {"cpu": np.asarray(nodes.cpu_milli, np.int64), "memory": np.asarray(nodes.memory_bytes, np.int64),
                      R.NVIDIA_GPU: gpus, R.GPU_CORE: 100 * gpus, R.GPU_MEMORY_RATIO: 100 * gpus}
        self.requested = {r: np.zeros(n, np.int64) for r in self.alloc}
        self.nonzero = {"cpu": np.zeros(n, np.int64), "memory": np.zeros(n, np.int64)}
        self.pods = np.zeros(n, np.int64)
        self.search = NodeSearch(n)
        self.rng = np.random.default_rng(seed)
        self.ack_lag = ack_lag
        self.unacked: deque[tuple[str, str]] = deque()  # (pod name, node), in bind order
        self.http = httpx.Client(timeout=30.0)
        service = ext.service
        self.handoffs = service.view.handoffs
        self.record_key = service.view.ledger.record_key
        ext.call(lambda: setattr(service.view.handoffs, "enabled", True))
        self.turned_away = 0
        self.retried = 0  # pods tried again after waiting for acknowledgements

    def _post(self, verb: str, body: Any, out: ReplayOutcome) -> Any:
        return post_verb(self.http, self.url, verb, body, out)

    @staticmethod
    def _asks(tp: TracePod) -> dict[str, int]:
        """The pod's requests as kube-scheduler counts them (trace_pod's limits; requests default to them)."""
        d = tp.demand
        out = {"cpu": d.cpu_milli, "memory": d.memory_bytes}
        if d.count and d.exclusive:
            out[R.NVIDIA_GPU] = d.count
        elif d.count:
            out[R.GPU_CORE] = d.milli // 10
            out[R.GPU_MEMORY_RATIO] = 1
        return out

    def run(self, pods: Sequence[TracePod], order: Sequence[int]) -> ReplayOutcome:
        out = ReplayOutcome()
        start = time.perf_counter()
        for k, i in enumerate(order):
            out.placements.append(self._one(f"p{k:05d}", pods[i], out))
            while len(self.unacked) > self.ack_lag:
                self._acknowledge(*self.unacked.popleft())
        while self.unacked:
            self._acknowledge(*self.unacked.popleft())
        out.seconds = time.perf_counter() - start
        return out

    def _one(self, name: str, tp: TracePod, out: ReplayOutcome) -> tuple[str, tuple[int, ...]] | None:
        pod = self.api.put_object(trace_pod(name, tp))
        cached = {key: v for key, v in pod.items() if key not in ("kind", "apiVersion")}
        asks = self._asks(tp)
        node, held_back = self._choose(cached, asks, out)
        while node is None and held_back and self.unacked:
            # Unschedulable only because nodes wait for acknowledgements: kube-scheduler requeues the pod on
            # the next pod update (the acknowledgement) and tries again. The acknowledgements come.
            self.retried += 1
            while self.unacked:
                self._acknowledge(*self.unacked.popleft())
            node, held_back = self._choose(cached, asks, out)
        if node is None:
            self.api.store.delete(self.api.kind("pods"), NAMESPACE, name)
            self.turned_away += tp.demand.count > 0
            return None
        meta = pod["metadata"]
        result = self._post("bind", {"PodName": name, "PodNamespace": NAMESPACE, "PodUID": meta["uid"],
                                     "Node": node}, out)
        if result.get("Error"):
            raise RuntimeError(f"bind error for {name} on {node}: {result['Error']}")
        stored = self.api.get_object("pods", name, NAMESPACE)
        value = (stored["metadata"].get("annotations") or {}).get(A.DEVICE_ALLOCATED)
        minors = tuple(sorted(g.minor for g in decode(value).grants())) if value else ()
        j = self.index[node]
        for r, q in asks.items():
            self.requested[r][j] += q
        self.nonzero["cpu"][j] += asks["cpu"] or DEFAULT_CPU_REQUEST
        self.nonzero["memory"][j] += asks["memory"] or DEFAULT_MEMORY_REQUEST
        self.pods[j] += 1
        if value:
            self.unacked.append((name, node))
        return node, minors

    def _choose(self, cached: dict[str, Any], asks: dict[str, int], out: ReplayOutcome) -> tuple[str | None, bool]:
        """One scheduling cycle: (the node chosen or None, whether some node failed only for the handoff)."""
        passes = self.pods < MAX_PODS
        for r, q in asks.items():
            if q:
                passes &= self.requested[r] + q <= self.alloc[r]
        found = self.search.feasible(passes, self.model.nodes_to_find(len(self.names)))
        found = found[self.rng.permutation(len(found))]  # the parallel search fills its array in no order
        names = [self.names[j] for j in found]
        interested = self.model.interested([r for r, q in asks.items() if q and r not in ("cpu", "memory")])
        held_back = False
        if interested and names:
            passed = self._post("filter", {"Pod": cached, "Nodes": None, "NodeNames": names}, out)
            if passed.get("Error"):
                raise RuntimeError(f"filter error: {passed['Error']}")
            names = list(passed.get("NodeNames") or [])
            held_back = any(HANDOFF_REASON in why for why in (passed.get("FailedNodes") or {}).values())
        if not names:
            return None, held_back
        node = names[0]
        if len(names) > 1:
            rows = np.array([self.index[n] for n in names])
            ext_scores = None
            if interested and self.model.extender_prioritizes:
                got = {h["Host"]: int(h["Score"]) for h in
                       self._post("prioritize", {"Pod": cached, "Nodes": None, "NodeNames": names}, out)}
                ext_scores = np.array([got.get(n, 0) for n in names], np.int64)
            node = names[select_host(total_scores(self.model, self._plugin_scores(rows, asks), ext_scores),
                                     self.rng)]
        return node, held_back

    def _plugin_scores(self, rows: np.ndarray, asks: dict[str, int]) -> dict[str, np.ndarray]:
        """The modelled score plugins' scores of ``rows`` with the pod on them (only those the profile runs)."""
        out: dict[str, np.ndarray] = {}
        cap = [self.alloc["cpu"][rows], self.alloc["memory"][rows]]
        if "NodeResourcesFit" in self.model.score_weights:
            nz = [self.nonzero["cpu"][rows] + (asks["cpu"] or DEFAULT_CPU_REQUEST),
                  self.nonzero["memory"][rows] + (asks["memory"] or DEFAULT_MEMORY_REQUEST)]
            out["NodeResourcesFit"] = least_allocated(nz, cap)
        if "NodeResourcesBalancedAllocation" in self.model.score_weights:
            req = [self.requested["cpu"][rows] + asks["cpu"], self.requested["memory"][rows] + asks["memory"]]
            out["NodeResourcesBalancedAllocation"] = balanced_allocation(req, cap)
        return out

    def _acknowledge(self, name: str, node: str) -> None:
        """The node daemon's acknowledgement of a pod it served (the record's GPUs, as the kubelet got them),
        then wait until the extender's watch has taken it in."""
        stored = self.api.get_object("pods", name, NAMESPACE)
        meta = stored["metadata"]
        record = decode((meta.get("annotations") or {})[A.DEVICE_ALLOCATED])
        value = encode_acks(served_acks(record, "0"))
        ann = {A.DEVICE_ASSIGNED: value}
        if self.record_key is not None:
            ann[signing.ACK_SIGNATURE] = signing.sign(self.record_key, meta["uid"], node, value, kind="ack")

        def patch(obj: dict[str, Any]) -> dict[str, Any]:
            obj["metadata"].setdefault("annotations", {}).update(ann)
            return obj

        self.api.store.update(self.api.kind("pods"), NAMESPACE, name, patch)
        key = f"{NAMESPACE}/{name}"
        deadline = time.monotonic() + ACK_WAIT_S
        while self.ext.call(lambda: key in self.handoffs.pending.get(node, {})):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the extender did not take in the acknowledgement of {key} on {node}")
            time.sleep(0.001)
