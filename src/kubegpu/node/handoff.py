"""Matching the kubelet's identity-less ``Allocate`` calls to the pod whose recorded GPUs they serve.

The scheduler extender writes each pod's chosen GPUs in ``kubegpu.io/device-allocated``
before binding it. The kubelet then calls the device plugin with device IDs only. This
module implements :class:`~kubegpu.node.resolver.AllocationResolver` with the protocol of
``docs/handoff.md``:

1. **Candidates**: containers of live pods bound to this node whose recorded allocation
   covers this resource (``kubegpu.io/gpu.shared`` for shares, ``nvidia.com/gpu`` for whole
   GPUs) with as many devices as the call carries, not yet served.
2. **Order**: the kubelet admits pods in the order its watch delivers them, each batch sorted
   by creation time, and a pod's containers in spec order (init containers first). This node
   watches the same pods through the same API server, so the rank (creation time, order the
   pod was seen bound, name; then container order) is the kubelet's admission order.
3. **Per-node serialisation**: one lock over choose-and-mark, so two concurrent calls never
   take the same candidate.
4. **Steering**: ``GetPreferredAllocation`` answers with the slots of the first candidate's
   recorded GPUs, so the kubelet's own device accounting follows the scheduler's choice.
5. **Acknowledgement**: the served container, its resource and the device IDs are written
   on the pod (``kubegpu.io/device-assigned``); after a restart the served set is rebuilt
   from these, so no container is served twice.
6. **Verification**: the kubelet's PodResources API says which pod really holds which
   device IDs. A container holding IDs that were served as another pod's allocation is a
   mismatch: reported as a Warning Event on the pod and counted in
   ``kubegpu_handoff_mismatches_total``, never silently.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from lightkube import Client
from lightkube.types import PatchType
from prometheus_client import CollectorRegistry, Counter

from kubegpu.kube.informer import EventType, WatchEvent
from kubegpu.kube.resources import Pod
from kubegpu.kube.threaded import InformerThread
from kubegpu.kube.writes import emit_event
from kubegpu.model import annotations as A
from kubegpu.model import resources as R
from kubegpu.model.allocation import AnnotationError, DeviceGrant, decode
from kubegpu.model.request import RequestKind, parse_pod
from kubegpu.node.resolver import AllocationRefused, GpuShare, ResolvedAllocation

log = logging.getLogger(__name__)

DEVICE_ASSIGNED = A.DEVICE_ASSIGNED
POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
HANDOFF_RESOURCES = (R.GPU_SLOTS, R.NVIDIA_GPU)
TERMINAL = frozenset({"Succeeded", "Failed"})


def uuid_of(device_id: str) -> str:
    """``GPU-…::3`` (a replica or slot) -> ``GPU-…``."""
    return device_id.split("::", 1)[0]


@dataclass(frozen=True, slots=True)
class Candidate:
    """One container's recorded GPUs, waiting for its Allocate."""

    rank: tuple[Any, ...]
    pod_key: str  # namespace/name
    uid: str
    container: str
    resource: str
    count: int
    grants: tuple[DeviceGrant, ...]

    @property
    def uuids(self) -> tuple[str, ...]:
        return tuple(g.mig_uuid or g.uuid for g in self.grants)


@dataclass(slots=True)
class _PodEntry:
    key: str
    uid: str
    created: str
    seen: int
    candidates: list[Candidate]
    acked: dict[str, dict[str, Any]] = field(default_factory=dict)  # container -> {"resource", "devices"}


def pod_candidates(pod: dict[str, Any], seen: int) -> tuple[_PodEntry | None, str]:
    """The handoff entries of a pod bound here, or (None, why) when it has none."""
    meta = pod.get("metadata") or {}
    key = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
    ann = meta.get("annotations") or {}
    value = ann.get(A.DEVICE_ALLOCATED)
    if not value:
        return None, "no recorded allocation"
    try:
        alloc = decode(value)
    except AnnotationError as e:
        return None, f"unreadable {A.DEVICE_ALLOCATED}: {e}"
    request = parse_pod(pod)
    created = str(meta.get("creationTimestamp") or "")
    rank_base = (created, seen, key)
    out: list[Candidate] = []
    for position, c in enumerate(request.gpu_containers):
        req = c.request
        assert req is not None
        if req.kind is RequestKind.WHOLE:
            resource = R.NVIDIA_GPU
        elif req.kind is RequestKind.SHARE:
            resource = R.GPU_SLOTS
        else:
            continue  # MIG and replica resources are served from their device IDs
        rec = alloc.for_container(c.name)
        if rec is None or not rec.grants:
            continue
        out.append(Candidate((*rank_base, 0 if c.init else 1, position), key, str(meta.get("uid") or ""), c.name,
                             resource, len(rec.grants), rec.grants))
    acked: dict[str, dict[str, Any]] = {}
    raw_ack = ann.get(DEVICE_ASSIGNED)
    if raw_ack:
        try:
            parsed = json.loads(raw_ack)
            if isinstance(parsed, dict) and isinstance(parsed.get("containers"), dict):
                acked = {str(k): v for k, v in parsed["containers"].items() if isinstance(v, dict)}
        except (ValueError, RecursionError):  # RecursionError: "[" * 100000
            log.warning("pod %s: unreadable %s annotation ignored", key, DEVICE_ASSIGNED)
    return _PodEntry(key, str(meta.get("uid") or ""), created, seen, out, acked), ""


class HandoffMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.matched = Counter("kubegpu_handoff_matched_total", "Allocate calls matched to a recorded allocation",
                               ["resource"], registry=self.registry)
        self.unmatched = Counter("kubegpu_handoff_unmatched_total",
                                 "Allocate calls with no recorded allocation to serve", ["resource"],
                                 registry=self.registry)
        self.mismatches = Counter("kubegpu_handoff_mismatches_total",
                                  "Containers found holding devices served as another pod's allocation",
                                  registry=self.registry)


class HandoffResolver:
    """The node side of the handoff. ``pods`` is fed by a watch of this node's pods (see
    :func:`make_resolver`); ``refresh`` lists them directly when an Allocate finds no candidate."""

    def __init__(self, node: str, *, client: Client | None = None, wait_s: float = 3.0,
                 refresh: Callable[[], Iterable[dict[str, Any]]] | None = None,
                 metrics: HandoffMetrics | None = None) -> None:
        self.node = node
        self.client = client
        self.wait_s = wait_s
        self._refresh = refresh
        self.metrics = metrics or HandoffMetrics()
        self._lock = threading.Condition()
        self._ack_lock = threading.Lock()
        self._pods: dict[str, _PodEntry] = {}
        self._served: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {}  # (uid, container) -> (res, ids)
        self._seq = 0
        self.reported: set[tuple[str, str]] = set()  # (pod key, container) mismatches already reported
        self.watch: InformerThread | None = None
        self.verifier: Verifier | None = None

    def close(self) -> None:
        if self.verifier is not None:
            self.verifier.stop()
        if self.watch is not None:
            self.watch.stop()

    # ---- feeding -------------------------------------------------------------------------------
    def observe(self, pod: dict[str, Any], deleted: bool = False) -> None:
        meta = pod.get("metadata") or {}
        key = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
        phase = (pod.get("status") or {}).get("phase")
        with self._lock:
            if deleted or phase in TERMINAL or (pod.get("spec") or {}).get("nodeName") != self.node:
                old = self._pods.pop(key, None)
                if old is not None:
                    for k in [k for k in self._served if k[0] == old.uid]:
                        del self._served[k]
                return
            current = self._pods.get(key)
            uid = str(meta.get("uid") or "")
            if current is not None and current.uid == uid:
                seen = current.seen
            else:
                self._seq += 1
                seen = self._seq
            entry, why = pod_candidates(pod, seen)
            if entry is None:
                if why.startswith("unreadable"):
                    log.error("pod %s on %s: %s", key, self.node, why)
                self._pods.pop(key, None)
                return
            self._pods[key] = entry
            for container, ack in entry.acked.items():
                devices = tuple(str(d) for d in ack.get("devices") or ())
                self._served[(entry.uid, container)] = (str(ack.get("resource", "")), devices)
            self._lock.notify_all()

    def on_event(self, ev: WatchEvent) -> None:
        self.observe(ev.obj.to_dict(), deleted=ev.type is EventType.DELETED)

    # ---- AllocationResolver --------------------------------------------------------------------
    def _pending(self, resource: str, count: int) -> list[Candidate]:
        out = [c for p in self._pods.values() for c in p.candidates
               if c.resource == resource and c.count == count and (c.uid, c.container) not in self._served]
        out.sort(key=lambda c: c.rank)
        return out

    def _next(self, resource: str, count: int) -> Candidate | None:
        """The first pending candidate, waiting briefly for the watch (the kubelet may have seen the
        pod bound before this node's watch did), then listing directly."""
        deadline = time.monotonic() + self.wait_s
        refreshed = False
        while True:
            pending = self._pending(resource, count)
            if pending:
                return pending[0]
            left = deadline - time.monotonic()
            if left <= 0:
                if refreshed or self._refresh is None:
                    return None
                refreshed = True
                self._lock.release()  # never hold the lock across API I/O
                try:
                    pods = list(self._refresh())
                except Exception as e:  # the API being down must not fail admission by itself
                    log.warning("node %s: cannot list pods for the handoff: %s", self.node, e)
                    pods = []
                finally:
                    self._lock.acquire()
                for p in pods:
                    self.observe(p)  # the condition's lock is re-entrant
                continue
            self._lock.wait(min(left, 0.1))

    def resolve(self, resource: str, device_ids: Sequence[str]) -> ResolvedAllocation | None:
        if resource not in HANDOFF_RESOURCES:
            return None
        ids = tuple(device_ids)
        with self._lock:
            cand = self._next(resource, len(ids))
            if cand is None:
                self.metrics.unmatched.labels(resource).inc()
                if resource == R.GPU_SLOTS:
                    # A share slot without a recorded share cannot be limited: refuse rather than hand out
                    # a GPU with no bound on compute or memory.
                    raise AllocationRefused(
                        f"no pod bound to {self.node} has a recorded {resource} allocation of {len(ids)} "
                        f"device(s) waiting (was it scheduled by the kubegpu extender?)")
                return None  # a whole-GPU pod the extender did not place: serve the IDs as they are
            self._served[(cand.uid, cand.container)] = (resource, ids)
        self.metrics.matched.labels(resource).inc()
        if {uuid_of(i) for i in ids} != set(cand.uuids):
            log.info("node %s: kubelet chose %s for %s/%s; serving its recorded GPUs %s", self.node,
                     ",".join(ids), cand.pod_key, cand.container, ",".join(cand.uuids))
        self._acknowledge(cand)
        return ResolvedAllocation(
            tuple(GpuShare(g.mig_uuid or g.uuid, g.minor, g.core, g.memory_bytes) for g in cand.grants),
            pod=cand.pod_key, container=cand.container)

    def preferred(self, resource: str, available: Sequence[str], must_include: Sequence[str],
                  size: int) -> Sequence[str] | None:
        if resource not in HANDOFF_RESOURCES:
            return None
        deadline = time.monotonic() + (min(self.wait_s, 0.5) if resource == R.GPU_SLOTS else 0.0)
        with self._lock:
            # A share pod always has a record: give this node's watch a moment to catch up with the
            # kubelet's. Whole GPUs may belong to pods the extender never saw: do not delay those.
            while not (pending := self._pending(resource, size)) and time.monotonic() < deadline:
                self._lock.wait(0.05)
        if not pending:
            return None
        want = list(pending[0].uuids)
        chosen = list(must_include)
        for uuid in want:  # one device per recorded GPU, in the recorded order
            for d in available:
                if uuid_of(d) == uuid and d not in chosen:
                    chosen.append(d)
                    break
        return chosen[:size] if len(chosen) >= size else None

    # ---- acknowledgement -----------------------------------------------------------------------
    def _acknowledge(self, cand: Candidate) -> None:
        if self.client is None:
            return
        ns, name = cand.pod_key.split("/", 1)
        # One writer at a time, so a later acknowledgement never lands before an earlier one.
        with self._ack_lock:
            with self._lock:
                # Everything served to this pod so far: the in-memory set is the truth (the watch may
                # still show an older version of the pod, without the previous acknowledgements).
                acked = {c: {"resource": r, "devices": list(d)}
                         for (uid, c), (r, d) in self._served.items() if uid == cand.uid}
            value = json.dumps({"containers": acked}, separators=(",", ":"), sort_keys=True)
            try:
                self.client.patch(Pod, name, {"metadata": {"annotations": {DEVICE_ASSIGNED: value}}},
                                  namespace=ns, patch_type=PatchType.MERGE)
            except Exception as e:  # the served set is already updated in memory; the ack is best effort
                log.warning("pod %s: cannot write %s: %s", cand.pod_key, DEVICE_ASSIGNED, e)

    # ---- verification --------------------------------------------------------------------------
    def verify(self, holdings: Iterable[tuple[str, str, str, str, Sequence[str]]]) -> list[str]:
        """Compare what the kubelet says each container holds (namespace, pod, container, resource,
        device IDs; from PodResources ``List``) with what was served to whom. Returns the problems
        found (each reported once as an Event and counted)."""
        with self._lock:
            served_to: dict[tuple[str, frozenset[str]], tuple[str, str]] = {}
            uid_key = {p.uid: p.key for p in self._pods.values()}
            for (uid, container), (resource, served_ids) in self._served.items():
                served_to[(resource, frozenset(served_ids))] = (uid_key.get(uid, uid), container)
            by_key = dict(self._pods)
        problems: list[tuple[str, str, str]] = []
        for ns, pod, container, resource, ids in holdings:
            if resource not in HANDOFF_RESOURCES or not ids:
                continue
            key = f"{ns}/{pod}"
            owner = served_to.get((resource, frozenset(ids)))
            if owner is None:
                entry = by_key.get(key)
                if entry is None or not any(c.container == container for c in entry.candidates):
                    continue  # not a pod the extender placed
                msg = (f"container {container} holds {resource} devices {','.join(ids)} that were never served "
                       "as its recorded allocation")
            elif owner != (key, container):
                msg = (f"container {container} holds {resource} devices {','.join(ids)}, which were served as "
                       f"the recorded allocation of {owner[0]} container {owner[1]}")
            else:
                continue
            problems.append((key, container, msg))
        out = []
        for key, container, msg in problems:
            out.append(f"{key}: {msg}")
            if (key, container) in self.reported:
                continue
            self.reported.add((key, container))
            self.metrics.mismatches.inc()
            log.error("handoff mismatch on %s: pod %s: %s", self.node, key, msg)
            if self.client is not None:
                ns, name = key.split("/", 1)
                entry = by_key.get(key)
                try:
                    emit_event(self.client, namespace=ns, kind="Pod", name=name, uid=entry.uid if entry else None,
                               reason="GpuHandoffMismatch", message=msg, type_="Warning",
                               component="kubegpu-node")
                except Exception as e:
                    log.warning("pod %s: cannot emit the mismatch Event: %s", key, e)
        return out


def list_pod_resources(socket_path: str = POD_RESOURCES_SOCKET, timeout_s: float = 5.0
                       ) -> list[tuple[str, str, str, str, list[str]]]:
    """(namespace, pod, container, resource, device IDs) for every device the kubelet has allocated."""
    from kubegpu.node.proto import podresources_pb2 as prpb
    from kubegpu.node.proto import podresources_pb2_grpc as prgrpc

    with grpc.insecure_channel(f"unix://{socket_path}") as channel:
        resp = prgrpc.PodResourcesListerStub(channel).List(prpb.ListPodResourcesRequest(), timeout=timeout_s)
    out = []
    for p in resp.pod_resources:
        for c in p.containers:
            for d in c.devices:
                out.append((p.namespace, p.name, c.name, d.resource_name, list(d.device_ids)))
    return out


class Verifier:
    """Checks the handoff against PodResources every ``interval_s`` (a daemon thread, stoppable)."""

    def __init__(self, resolver: HandoffResolver, socket_path: str = POD_RESOURCES_SOCKET,
                 interval_s: float = 30.0) -> None:
        self.resolver, self.socket_path, self.interval_s = resolver, socket_path, interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> list[str]:
        try:
            holdings = list_pod_resources(self.socket_path)
        except grpc.RpcError as e:
            log.debug("PodResources unavailable at %s: %s", self.socket_path, e)
            return []
        return self.resolver.verify(holdings)

    def start(self) -> Verifier:
        def loop() -> None:
            while not self._stop.wait(self.interval_s):
                self.check()

        self._thread = threading.Thread(target=loop, name="handoff-verifier", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()


def make_resolver(client: Client, node: str, *, pod_resources_socket: str = POD_RESOURCES_SOCKET,
                  verify_interval_s: float = 30.0, registry: CollectorRegistry | None = None) -> HandoffResolver:
    """The resolver the node daemon plugs into its device plugins: a watch of this node's pods feeds it,
    a direct list backs it up, PodResources verifies it. Its counters go to ``registry`` (the daemon's
    metrics registry) when given; otherwise to ``resolver.metrics.registry``, which a caller can
    register as a collector elsewhere."""

    def refresh() -> Iterable[dict[str, Any]]:
        return [p.to_dict() for p in client.list(Pod, namespace="*", fields={"spec.nodeName": node})]

    resolver = HandoffResolver(node, client=client, refresh=refresh, metrics=HandoffMetrics(registry))
    resolver.watch = InformerThread(client, Pod, resolver.on_event, fields={"spec.nodeName": node},
                                    name=f"handoff-{node}").start()
    resolver.watch.wait_synced(10)
    resolver.verifier = Verifier(resolver, pod_resources_socket, verify_interval_s).start()
    return resolver
