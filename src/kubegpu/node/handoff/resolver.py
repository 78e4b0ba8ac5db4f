"""The node side of the handoff: state, fresh-enough reads, acknowledgements, reports.

:class:`HandoffResolver` implements :class:`~kubegpu.node.deviceplugin.resolver.AllocationResolver`. It keeps
a view of the pods bound to this node (fed by a watch: the informer cache), and for every ``Allocate``:

1. matches the kubelet's device IDs to the one waiting record of that (resource, device count) naming
   exactly those GPUs (:mod:`kubegpu.node.handoff.matching`). The extender lets only one pod per (node,
   resource, count) wait (it checks at bind), so the cache decides alone when it shows exactly one such
   pod: no API round trip. When the cache shows none (its watch behind the kubelet's), the watch races a
   **consistent read** (a fresh LIST) and the first to show the record decides; when it shows several (a
   stale view), the LIST decides, and the call is refused if the records still cannot be told apart;
2. serves that record's amounts on the kubelet's GPUs, or refuses with a reason (the kubelet
   then fails the pod's admission with it) — never a silent divergence;
3. asks for the acknowledgement (what was served, which is what the kubelet holds) to be written after
   the answer, retried until it lands (:mod:`kubegpu.node.handoff.acks`).

Records count only when signed by the extender (:mod:`kubegpu.model.signing`) when a key is set.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from lightkube import Client
from lightkube.types import PatchType
from prometheus_client import CollectorRegistry, Counter

from kubegpu.kube.informer import EventType, WatchEvent
from kubegpu.kube.resources import Node
from kubegpu.kube.threaded import InformerThread
from kubegpu.kube.writes import emit_event
from kubegpu.model import annotations as A
from kubegpu.model import resources as R
from kubegpu.model import signing
from kubegpu.model.allocation import DeviceGrant
from kubegpu.model.inventory import NodeInventory
from kubegpu.model.records import Ack, encode_acks, request_shapes
from kubegpu.model.request import parse_pod
from kubegpu.model.versions import version_number as _rv
from kubegpu.node.deviceplugin.resolver import AllocationRefused, ResolvedAllocation
from kubegpu.node.handoff import matching as M
from kubegpu.node.handoff.acks import AckWriter
from kubegpu.node.handoff.callers import callers, held, lists, open_calls, open_kinds
from kubegpu.node.handoff.entries import Entry, PodView, is_live_here, pod_view
from kubegpu.node.handoff.pods import HandoffPod, tombstone
from kubegpu.node.handoff.verify import (
    POD_RESOURCES_SOCKET,
    Holding,
    Verifier,
    compare,
    group,
    list_pod_resources,
)

log = logging.getLogger(__name__)


_PROGRESS = "handoff-seen"  # the writer's key for A.HANDOFF_SEEN (no "/": never a pod's key)
GIVEN_KEPT = 4096  # records served, remembered until the kubelet shows who holds them (bounded)
ENDED_KEPT = 4096  # pods seen to end with a call open, remembered for the kubelet's late admission (bounded)
BYPASS_GRACE_S = 5.0  # a whole GPU served without a record counts as held until PodResources can show it


class HandoffMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.matched = Counter("kubegpu_handoff_matched_total", "Allocate calls served as the record naming "
                               "exactly the kubelet's GPUs", ["resource"], registry=r)
        self.refused = Counter("kubegpu_handoff_refused_total", "Allocate calls refused, by reason",
                               ["resource", "reason"], registry=r)
        self.unrecorded = Counter("kubegpu_handoff_unrecorded_total", "Allocate calls for whole GPUs or MIG "
                                  "devices of pods without a record, served as asked", ["resource"], registry=r)
        self.consistent_reads = Counter("kubegpu_handoff_consistent_reads_total",
                                        "Fresh LISTs made because the local view had no matching record",
                                        registry=r)
        self.mismatches = Counter("kubegpu_handoff_mismatches_total",
                                  "Containers found holding other GPUs than they were served (PodResources)",
                                  registry=r)
        self.swaps = Counter("kubegpu_handoff_reordered_total",
                             "Identical waiting records served in another order than the kubelet admitted "
                             "their pods (acknowledgements corrected; nothing served wrong)", registry=r)
        self.collisions = Counter("kubegpu_handoff_record_collisions_total",
                                  "Pods whose live records put a GPU above its compute", registry=r)
        self.forged = Counter("kubegpu_handoff_forged_records_total",
                              "Pods seen with a record the extender did not sign", registry=r)


class HandoffResolver:
    """The node side of the handoff. ``refresh`` lists this node's pods from the API server (a
    consistent read); a watch feeds :meth:`observe` between reads."""

    def __init__(self, node: str, *, client: Client | None = None, key: bytes | None = None,
                 refresh: Callable[[], Iterable[dict[str, Any]]] | None = None,
                 metrics: HandoffMetrics | None = None, inventory: NodeInventory | None = None,
                 gpu_resources: frozenset[str] = frozenset()) -> None:
        self.node = node
        self.client = client
        self.key = key
        self.gpu_resources = gpu_resources  # renamed GPU resources the deployment declared (parse_pod)
        self._refresh = refresh
        self.metrics = metrics or HandoffMetrics()
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # notified on every change of the view
        self._suspect: set[tuple[str, int]] = set()  # kinds refused since the last LIST (see _decide)
        self._suspect_all: set[str] = set()  # resources whose plugin re-registered since the last LIST
        self._registered: set[str] = set()
        # (resource, device IDs) -> (uid, container, what was served) for every record served, kept past its
        # pod's end until PodResources shows the devices on that container: who really holds them is what
        # verification compares with (a container served another pod's record, see verify.compare).
        self._given: dict[tuple[str, frozenset[str]], tuple[str, str, Ack]] = {}
        self._pods: dict[str, PodView] = {}
        self._served: dict[tuple[str, str], Ack] = {}  # (uid, container) -> what this process served
        # GPU -> (who, when) for GPUs given whole to pods without a record: served by this process (kept
        # until PodResources shows them or BYPASS_GRACE_S passes), or seen in PodResources.
        self._bypass: dict[str, tuple[str, float]] = {}
        self._seq = 0
        self._version: dict[str, int] = {}  # pod -> resourceVersion of the state held
        self._gone: dict[str, None] = {}  # UIDs of pods seen deleted or finished (insertion-ordered)
        # Pods seen to end before a call of theirs was served -> those calls (callers.open_kinds): the kubelet
        # takes a pod's addition before its deletion, so it may still admit one, and its call must not be taken
        # for the next pod of its kind (see _resolve). Dropped when a pod of that name is live here again.
        self._ended: dict[str, frozenset[tuple[str, str, int]]] = {}
        # The resourceVersion up to which this view is complete, as of the last GPU pod seen to end here (or the
        # last LIST that found one gone), and the one A.HANDOFF_SEEN carries on the Node (written by the acks'
        # writer): the extender binds the next pod of an ended waiting pod's kind only once it is published.
        self._seen = -1
        self._published = -1
        self._listed_at = -1  # the version of the last consistent read
        # When the latest consistent read that completed was started (monotonic), the reads in flight (their start
        # and completion), and the kind and start of the kubelet's last GetPreferredAllocation not yet followed by
        # its Allocate: a whole-GPU Allocate needs a read started after its container's calls began, and the one
        # its GetPreferredAllocation started (racing the watch) is such a read (see _read_since).
        self._read_from = float("-inf")
        self._reading: dict[int, tuple[float, threading.Event]] = {}
        self._last_gpa: tuple[str, int, float] | None = None
        self._gpus: dict[str, tuple[int, int]] = {}  # uuid -> (minor, memory bytes)
        self._mig_parent: dict[str, tuple[str, str]] = {}  # MIG uuid -> (parent GPU uuid, profile)
        self.pod_resources: Callable[[], list[Holding]] | None = None  # the kubelet's own word, when reachable
        self.reported: set[tuple[str, str]] = set()
        self.collided: set[tuple[str, str]] = set()  # (pod, GPU) collisions already reported
        self.forged_seen: set[str] = set()
        self.watch: InformerThread | None = None
        self.verifier: Verifier | None = None
        self.acks = AckWriter(self._write_ack, name=f"handoff-acks-{node}") if client is not None else None
        if inventory is not None:
            self.set_inventory(inventory)
        if key is None:
            log.warning("node %s: no record key (%s): records are served unsigned; anyone who can write "
                        "pod annotations can claim a GPU", node, signing.KEY_FILE_ENV)

    def set_inventory(self, inventory: NodeInventory) -> None:
        """The node's GPUs (minor and memory, to acknowledge pods the extender did not place)."""
        table: dict[str, tuple[int, int]] = {}
        parents: dict[str, tuple[str, str]] = {}
        for g in inventory.gpus:
            table[g.uuid] = (g.minor, g.memory_bytes)
            for m in g.mig_devices:
                table[m.uuid] = (g.minor, m.memory_bytes)
                parents[m.uuid] = (g.uuid, m.profile)
        self._gpus, self._mig_parent = table, parents

    def close(self) -> None:
        if self.acks is not None:
            self.acks.stop()
        if self.verifier is not None:
            self.verifier.stop()
        if self.watch is not None:
            self.watch.stop()

    # ---- feeding -------------------------------------------------------------------------------
    def observe(self, pod: dict[str, Any], deleted: bool = False, version: str = "", *, listing: bool = False) -> None:
        """One version of a pod (watch event or LIST item). Versions older than the one already held,
        and any version of a pod already seen deleted or finished, are ignored: a lagging watch must
        never bring back a pod, or an older state of it, that a fresher read has moved past.
        ``version``: the change's resourceVersion when it is not the pod's own (a deletion a relist found);
        ``listing``: an item of a consistent read."""
        meta = pod.get("metadata") or {}
        key = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
        uid = str(meta.get("uid") or "")
        rv = _rv(meta.get("resourceVersion"))
        with self._lock:
            ended = deleted or not is_live_here(pod, self.node)
            if ended and self._may_end_unserved(key, uid, pod):
                self._seen_up_to(_rv(version) if version else rv)
            if uid and uid in self._gone:
                return
            if ended:
                if uid and (deleted or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")):
                    self._bury(uid)
                cur = self._pods.get(key)
                if cur is None or cur.uid == uid or not uid:
                    self._end(key)
                return
            if key not in self._pods and rv <= self._listed_at and not listing:
                return  # older than a LIST that did not have it: gone since (a lagging watch never brings it back)
            current = self._pods.get(key)
            if current is not None and current.uid == uid and rv <= self._version.get(key, -1):
                # An older state than the one held (a lagging watch after a fresh LIST), or the same one again (a
                # LIST): nothing to read again, and the view keeps the acknowledgements written since.
                return
            if current is not None and current.uid == uid:
                seen = current.seen
            else:
                if current is not None:
                    self._forget(key)
                self._seq += 1
                seen = self._seq
            view = pod_view(pod, seen, self.key, self.gpu_resources)
            self._version[key] = rv
            if view.forged and key not in self.forged_seen:
                self.forged_seen.add(key)
                self.metrics.forged.inc()
                log.error("pod %s on %s: %s", key, self.node, "; ".join(view.problems))
            elif view.problems:
                log.warning("pod %s on %s: %s", key, self.node, "; ".join(view.problems))
            self._pods[key] = view
            self._ended.pop(key, None)
            self._changed.notify_all()

    def _bury(self, uid: str) -> None:
        self._gone[uid] = None
        while len(self._gone) > 20000:  # bounded: the oldest deletions cannot come back by now
            self._gone.pop(next(iter(self._gone)))

    def _end(self, key: str) -> None:
        """``key`` ended (deleted or finished): remember the calls it never made, then forget it."""
        cur = self._pods.get(key)
        if cur is not None and (kinds := open_kinds(cur, self._served)):
            self._ended[key] = kinds
            while len(self._ended) > ENDED_KEPT:
                self._ended.pop(next(iter(self._ended)))
        self._forget(key)

    def _forget(self, key: str) -> None:
        self._version.pop(key, None)
        old = self._pods.pop(key, None)
        if old is not None:
            for k in [k for k in self._served if k[0] == old.uid]:
                del self._served[k]
            for g in [g for g, (who, _t) in self._bypass.items() if who == key]:
                del self._bypass[g]

    def on_event(self, ev: WatchEvent) -> None:
        if ev.type is EventType.RELISTED:
            self.relisted(ev.version)
            return
        self.observe(ev.obj.to_dict(), deleted=ev.type is EventType.DELETED, version=ev.version)

    def relisted(self, version: str) -> None:
        """A relist at ``version`` rebuilt this view (its events all delivered before this). A GPU pod bound
        here and gone again while the watch was broken (expired, cut, or dead until the resync) was never seen
        here, yet the extender may hold its kind on this node until the Node says this view has got past its
        end (docs/handoff.md, step 2): the view is complete as of the relist, so that is published (a relist
        follows a broken watch only: a healthy one resumes from its version, so this costs no steady writes)."""
        with self._lock:
            self._seen_up_to(_rv(version))

    def _may_end_unserved(self, key: str, uid: str, pod: Mapping[str, Any] | None = None) -> bool:
        """Whether an ended pod is a GPU pod bound here that may not have been served (one that ran was): by
        its last state, or by this view's when that state is a tombstone (a deletion a relist found) or is not
        given (a LIST no longer has the pod). Whether this view had it or not: a LIST may have shown it ended
        first, or the watch only its end. A pod waits in the extender by the same rule (``request_shapes``)."""
        pod = pod or {}
        cur = self._pods.get(key)
        if cur is not None and uid and cur.uid != uid:
            cur = None  # another pod of that name
        if (pod.get("status") or {}).get("phase") in ("Running", "Succeeded") or (cur is not None and cur.running):
            return False
        if cur is not None and (cur.entries or cur.unrecorded):
            return True
        if (pod.get("spec") or {}).get("nodeName") != self.node:
            return False
        return bool(request_shapes(parse_pod(pod, replica_resources=self.gpu_resources)))

    def unserved(self) -> int:
        """Containers of pods bound here whose records wait to be served: what a stopping daemon serves before it
        closes its plugins (node/daemon.py)."""
        with self._lock:
            return sum(1 for p in self._pods.values() if not p.forged and not p.running for e in p.entries
                       if (e.uid, e.container) not in self._served and e.container not in p.acks)

    def _seen_up_to(self, version: int) -> None:
        """A GPU pod bound here ended at ``version`` and this view has everything up to it (the watch delivers
        in order; a LIST is complete at its own version): publish that on the Node (called under the lock).
        The extender keeps such a pod's kind waiting here until then, so that this view no longer shows it
        waiting when the next pod of its kind calls (docs/handoff.md)."""
        self._seen = max(self._seen, version)
        if self.acks is not None and self._seen > self._published:
            self.acks.ask(_PROGRESS)

    def _write_progress(self) -> bool:
        """One attempt at A.HANDOFF_SEEN (on the writer's thread); True when it is as wanted."""
        assert self.client is not None
        with self._lock:
            seen = self._seen
        if seen <= self._published:
            return True
        try:
            self.client.patch(Node, self.node, {"metadata": {"annotations": {A.HANDOFF_SEEN: str(seen)}}},
                              patch_type=PatchType.MERGE)
        except Exception as e:
            if getattr(getattr(e, "status", None), "code", None) == 404:
                return True  # the Node is gone: nobody binds here any more
            log.warning("node %s: cannot write %s yet (retried with back-off): %s", self.node, A.HANDOFF_SEEN, e)
            return False
        self._published = seen
        return True

    def consistent_read(self) -> bool:
        """Replace the local view with a fresh LIST (never under the lock: it is API I/O)."""
        if self._refresh is None:
            return False
        self.metrics.consistent_reads.inc()
        started, done = time.monotonic(), threading.Event()
        with self._lock:
            self._reading[id(done)] = (started, done)
        try:
            listed = self._refresh()
            pods = list(listed)
            snapshot = getattr(listed, "resource_version", None)
        except Exception as e:  # the API being down: decide from the local view (and refuse if unsure)
            log.warning("node %s: cannot list pods for the handoff: %s", self.node, e)
            return False
        finally:
            with self._lock:
                self._reading.pop(id(done), None)
                done.set()
        with self._lock:
            self._read_from = max(self._read_from, started)
            seen_before = self._seen
            present = set()
            for p in pods:
                meta = p.get("metadata") or {}
                present.add(f"{meta.get('namespace', '')}/{meta.get('name', '')}")
                self.observe(p, listing=True)
            # A pod the watch delivered while the LIST was on its way, newer than the LIST's snapshot, was bound
            # after it: it is not gone (the watch races the LIST, see _decide).
            cutoff = _rv(snapshot) if snapshot is not None else None
            ended = self._seen > seen_before  # a GPU pod the LIST shows ended
            for key in [k for k in self._pods if k not in present
                        and (cutoff is None or self._version.get(k, -1) <= cutoff)]:
                uid = self._pods[key].uid
                ended = ended or self._may_end_unserved(key, uid)
                if uid:
                    self._bury(uid)  # bound pods leave a node only by being deleted
                self._end(key)
            if cutoff is not None:
                self._listed_at = max(self._listed_at, cutoff)
                if ended or self._published < 0:  # the first LIST: the node publishes how far its view has got
                    self._seen_up_to(cutoff)
        return True

    def _read_since(self, since: float) -> bool:
        """Make sure a consistent read started at or after ``since`` (monotonic) has completed: one that did, or
        one in flight (waited for), else a new one. Whether there is one."""
        with self._lock:
            if self._read_from >= since:
                return True
            inflight = [ev for t, ev in self._reading.values() if t >= since]
        for ev in inflight:
            ev.wait()
        with self._lock:
            if self._read_from >= since:
                return True
        return self.consistent_read()  # none in flight, or those failed (the API down): one more decides

    # ---- AllocationResolver --------------------------------------------------------------------
    def _match(self, resource: str, ids: Sequence[str]) -> Entry | None:
        with self._lock:
            return M.match(self._pods.values(), self._served, resource, ids)

    def _kubelet_pods(self) -> list[Holding] | None:
        """The kubelet's PodResources ``List`` now (local, no API round trip), or None when it is unreachable.
        Read during a call, it lists the call's pod (kubegpu.node.handoff.callers)."""
        if self.pod_resources is None:
            return None
        try:
            return self.pod_resources()
        except Exception:  # the kubelet's socket unreachable: the view alone decides
            return None

    def _only_caller(self, pod_key: str, rows: list[Holding] | None, resource: str, count: int) -> bool:
        """Whether the kubelet's list, read during this call, shows that the call can only be ``pod_key``'s: the
        view knows every pod the kubelet lists, and of those only ``pod_key`` may still call with this kind. The
        kubelet lists the pod it is admitting, so then no pod this view has not seen (another scheduler's,
        bound after the record) can be the caller, and no consistent read is needed to rule one out."""
        if rows is None:
            return False
        with self._lock:
            found = callers(self._pods, self._served, rows, resource, count)
        return not found.unknown and found.possible == (pod_key,)

    def _ended_caller(self, entry: Entry, rows: list[Holding] | None, resource: str, count: int) -> str | None:
        """The pod this call is for when it is not the record's: the kubelet's list, read during the call, does
        not name the record's pod but names one this view saw end with a call of this kind open. The kubelet
        lists the pod it is admitting, and takes a pod's addition before its deletion, so it may admit a pod
        already deleted; serving it the next pod's record would give it that pod's share and refuse the pod
        itself (seen with a slow kubelet). Such a pod gets one refusal, its first call fails it."""
        if rows is None:
            return None
        with self._lock:
            if lists(rows, entry.pod_key):
                return None
            found = callers(self._pods, self._served, rows, resource, count, self._ended)
            if not found.ended:
                return None
            self._ended.pop(found.ended[0], None)
            return found.ended[0]

    def _other_callers(self, entry: Entry, rows: list[Holding] | None, resource: str, count: int) -> list[str]:
        """Pods other than the record's that this call of (``resource``, ``count``) may be for: an Allocate of
        that shape may be theirs. With the kubelet's list, read during the call, and the record's pod in it: the
        listed pods the view knows that may still make such a call (listed pods no read showed are gone from
        the API server). Otherwise (a kubelet that does not list the pod being admitted, or none reachable):
        every pod bound here asking that shape without a record whose containers the kubelet holds no such
        devices for. A pod listed without devices is not done: it may be the one being admitted (the kubelet
        lists it before its first call), or one whose admission failed, which this view drops once it sees the
        pod Failed."""
        with self._lock:
            if rows is not None and lists(rows, entry.pod_key):
                found = callers(self._pods, self._served, rows, resource, count)
                return [k for k in found.possible if k != entry.pod_key]
            done = held(rows or (), resource)
            return [p.key for p in self._pods.values() if p.key != entry.pod_key
                    and (resource, count) in p.unrecorded and open_calls(p, done, self._served, resource, count)]

    def _decide(self, resource: str, n: int, gpus: tuple[str, ...] | None,
                rows: list[Holding] | None) -> tuple[list[Entry], bool]:
        """The waiting entries of this call's kind (resource, device count), from the freshest view needed:
        the cache when it shows exactly one pod waiting with a record naming the kubelet's GPUs (the
        extender lets one pod per kind wait, so that is the call's pod: no API round trip). When the cache
        shows none yet (this node's watch behind the kubelet's), the watch races a consistent read (a fresh
        LIST): whichever shows the record first decides, so the wait is the shorter of the watch's lag and
        one round trip. When it shows several (a stale view), the LIST decides. ``gpus``: the kubelet's
        choice (Allocate), or None (GetPreferredAllocation: the one waiting pod is enough); ``rows``: the
        kubelet's PodResources read for this call. Returns the entries and whether they come from a LIST just
        made."""

        # (pod, container) the kubelet already holds such devices for (its own word, local): their calls are
        # done, so their records wait for nothing, whatever this node's view says (a pod served by an earlier
        # process of this daemon whose acknowledgement was lost, or whose Running phase the watch has not
        # delivered yet).
        taken = held(rows or (), resource)

        def waiting() -> list[Entry]:
            return [e for e in M.pending(self._pods.values(), self._served, resource, n)
                    if (e.pod_key, e.container) not in taken]

        def settled() -> list[Entry] | None:
            w = waiting()
            if len(M.waiting_pods(w)) == 1 and (gpus is None or any(M.fits(e, gpus) for e in w)):
                return w
            return None

        with self._lock:
            # After a refusal of this kind, the pod it failed may still show as waiting here while the
            # extender, which saw it fail, has bound the next pod of the kind: the next call reads the API.
            suspect = (resource, n) in self._suspect or resource in self._suspect_all
            found = None if suspect else settled()
            stale = suspect or len(M.waiting_pods(waiting())) > 1
        if found is not None:
            return found, False
        if suspect:
            listed = self.consistent_read()
            with self._lock:
                if listed:
                    self._suspect.discard((resource, n))
                    self._suspect_all.discard(resource)
                return waiting(), listed
        if stale or not self._expects_records(resource) or self._refresh is None:
            listed = self.consistent_read()
            with self._lock:
                return waiting(), listed
        done = threading.Event()

        def read() -> None:
            try:
                self.consistent_read()
            finally:
                with self._lock:
                    done.set()
                    self._changed.notify_all()

        threading.Thread(target=read, name=f"handoff-list-{self.node}", daemon=True).start()
        with self._lock:
            while (found := settled()) is None and not done.is_set() and len(M.waiting_pods(waiting())) <= 1:
                self._changed.wait(1.0)
        if found is not None:
            return found, False
        done.wait()
        with self._lock:
            return waiting(), True

    def kubelet_registered(self, resource: str) -> None:
        """The plugin of ``resource`` registered with a (maybe restarted) kubelet, which fails the pods it
        admitted before that without any call here: the next call of the resource reads the API server."""
        with self._lock:
            if resource in self._registered:
                self._suspect_all.add(resource)
            self._registered.add(resource)  # the first registration: this process's first LIST is fresher

    def _expects_records(self, resource: str) -> bool:
        """Whether a call of ``resource`` may be a recorded pod's not in the cache yet: shares always are;
        whole GPUs and MIG devices only where the extender places pods (some pod here has a record)."""
        return resource == R.GPU_SLOTS or any(p.entries for p in self._pods.values())

    def resolve(self, resource: str, device_ids: Sequence[str]) -> ResolvedAllocation | None:
        if not M.is_handoff_resource(resource):
            return None
        try:
            return self._resolve(resource, tuple(device_ids))
        except AllocationRefused:
            with self._lock:
                self._suspect.add((resource, len(device_ids)))
            raise

    def _resolve(self, resource: str, ids: tuple[str, ...]) -> ResolvedAllocation | None:
        gpus = M.kubelet_gpus(ids)
        with self._lock:
            # The kubelet calls GetPreferredAllocation then Allocate for one container and resource, one
            # container at a time: a GetPreferredAllocation of this kind just before is this container's.
            gpa, self._last_gpa = self._last_gpa, None
        since = gpa[2] if gpa is not None and gpa[:2] == (resource, len(ids)) else time.monotonic()
        rows = self._kubelet_pods()  # read during the call: it lists the call's pod (kubegpu.node.handoff.callers)
        waiting, listed = self._decide(resource, len(ids), gpus, rows)
        pods = M.waiting_pods(waiting)
        if (not listed and resource != R.GPU_SLOTS and pods
                and not (len(pods) == 1 and self._only_caller(pods[0], rows, resource, len(ids)))
                and self._read_since(since)):
            # Whole GPUs and MIG devices are also asked by pods another scheduler bound here, with no record.
            # The kubelet admits such a pod once it sees it bound, but this node's watch may be behind the
            # kubelet's, and serving the waiting record to that pod's call would give it another pod's GPUs
            # (seen in the stress test with a 2 s watch lag). The kubelet's own list, read during the call,
            # names the pod it is admitting: when this view knows every pod listed and only the record's pod can
            # still call with this kind, that is the caller. Otherwise (a listed pod this view has not seen, or
            # no list) a consistent read started after the container's first call shows every pod bound before
            # it, so the ambiguity check below sees that pod: one LIST per such container start (the one its
            # GetPreferredAllocation raced the watch with, when it did).
            waiting, listed = self._decide(resource, len(ids), gpus, rows)
        pods = M.waiting_pods(waiting)
        if len(pods) > 1:
            # Two pods wait with this kind even by the API server's word (records from before the extender
            # enforced the rule at bind, or a stale view the LIST could not settle): the call does not say
            # which pod it is, and serving one pod's record to the other is what this protocol forbids.
            self.metrics.refused.labels(resource, "ambiguous-records").inc()
            raise AllocationRefused(
                f"kubegpu: {resource} x{len(ids)} is waited for by several pods bound to {self.node} "
                f"({', '.join(pods[:3])}{' …' if len(pods) > 3 else ''}); the kubelet's call does not say "
                "which pod it is, so it is refused rather than serve one pod's record to another (the "
                "controller recreates the pod)")
        entry = next((e for e in waiting if M.fits(e, gpus)), None)
        if entry is not None and (ended := self._ended_caller(entry, rows, resource, len(ids))):
            self.metrics.refused.labels(resource, "ended-pod").inc()
            raise AllocationRefused(
                f"kubegpu: {resource} x{len(ids)} is asked while the kubelet admits {ended}, which ended (deleted "
                f"or finished) before it ran, and does not list {entry.pod_key} yet, whose record this node "
                f"holds: the call is {ended}'s, refused; {entry.pod_key}'s record waits for its own call")
        if entry is not None and (others := self._other_callers(entry, rows, resource, len(ids))):
            # The call may be the other pod's: serving the record to it would be a silent divergence.
            self.metrics.refused.labels(resource, "ambiguous").inc()
            raise AllocationRefused(
                f"kubegpu: {resource} x{len(ids)} is asked both by {entry.pod_key} (recorded) and by "
                f"{', '.join(others[:3])}, bound here without a kubegpu record; the kubelet's call does not "
                "say which pod it is, so it is refused rather than risk serving one pod's record to the other")
        with self._lock:
            if entry is not None and (entry.uid, entry.container) in self._served:
                entry = M.match(self._pods.values(), self._served, resource, ids)  # taken meanwhile
            if entry is None:
                self._unrecorded(resource, ids, gpus)  # serves as asked (None) or refuses
                return None
            if resource == R.GPU_SLOTS and (why := M.share_conflict(gpus, self._whole_bypass(rows))):
                self.metrics.refused.labels(resource, "gpu-held-whole").inc()
                raise AllocationRefused(f"kubegpu: share for {entry.pod_key} container {entry.container} "
                                        f"refused: {why}")
            ack = Ack(resource, ids, tuple(self._grant(entry, u) for u in gpus))
            self._served[(entry.uid, entry.container)] = ack
            self._given[(resource, frozenset(ids))] = (entry.uid, entry.container, ack)
            while len(self._given) > GIVEN_KEPT:
                self._given.pop(next(iter(self._given)))
        self.metrics.matched.labels(resource).inc()
        self._acknowledge(entry.pod_key)  # after the answer, on the writer's thread, until it lands
        if self.verifier is not None:
            self.verifier.poke()
        return ResolvedAllocation(entry.shares(gpus), pod=entry.pod_key, container=entry.container)

    def _whole_bypass(self, rows: list[Holding] | None) -> dict[str, str]:
        """GPUs held whole by pods the extender did not place (called under the lock): those this
        process served, those acknowledged on such pods, and what the kubelet lists (``rows``, read during
        this call: the kubelet admits one pod at a time, so no other pod's devices are added meanwhile; None
        when its socket is unreachable, and the other two sources stand)."""
        out = {g: who for g, (who, _t) in self._bypass.items()}
        for p in self._pods.values():
            if p.whole_bypass and p.held is not None:
                out.update({g.uuid: p.key for g in p.held.grants()})
        for ns, name, _c, resource, ids in rows or ():
            view = self._pods.get(f"{ns}/{name}")
            if resource == R.NVIDIA_GPU and (view is None or view.whole_bypass):
                out.update({M.uuid_of(i): f"{ns}/{name}" for i in ids})
        return out

    def _grant(self, entry: Entry, gpu: str) -> DeviceGrant:
        for g in entry.grants:
            if (g.mig_uuid or g.uuid) == gpu:
                return g
        g = entry.grants[0]  # another GPU of the same kind than the record's (reuse, or a correction)
        minor, _ = self._gpus.get(gpu, (g.minor, 0))
        if gpu in self._mig_parent:
            parent, profile = self._mig_parent[gpu]
            return DeviceGrant(minor, parent, g.core, g.memory_bytes, g.memory_ratio, gpu, profile)
        return DeviceGrant(minor, gpu, g.core, g.memory_bytes, g.memory_ratio)

    def _unrecorded(self, resource: str, ids: tuple[str, ...], gpus: tuple[str, ...]) -> None:
        """No record names these GPUs (called under the lock): serve a pod the extender did not
        place when the GPUs are free of records, else refuse with the reason."""
        shown = ",".join(M.short(i) for i in ids[:8])
        if resource == R.GPU_SLOTS:
            self.metrics.refused.labels(resource, "no-record").inc()
            raise AllocationRefused(
                f"kubegpu: the kubelet chose {resource} {shown} (GPU {','.join(M.short(g) for g in gpus[:8])}); "
                f"no pod bound to {self.node} has a signed, unserved record naming exactly these GPUs "
                f"({M.describe_pending(self._pods.values(), self._served, resource, len(ids))})")
        waiting = M.pending(self._pods.values(), self._served, resource, len(ids))
        if waiting:
            self.metrics.refused.labels(resource, "not-the-recorded-gpus").inc()
            raise AllocationRefused(
                f"kubegpu: the kubelet chose {resource} {shown}, which no waiting record names "
                f"({M.describe_pending(self._pods.values(), self._served, resource, len(ids))}); "
                "refused rather than run a pod on GPUs its record does not name")
        taken = M.holders(self._pods.values())
        why = M.whole_conflict(gpus, taken) or M.share_conflict(gpus, {g: w for g, (w, _t) in self._bypass.items()})
        if why:
            self.metrics.refused.labels(resource, "gpu-in-use").inc()
            raise AllocationRefused(f"kubegpu: {resource} {shown} cannot be given to a pod without a kubegpu "
                                    f"record: {why}")
        for g in gpus:
            self._bypass[g] = ("a pod known only from the kubelet's Allocate call", time.monotonic())
        self.metrics.unrecorded.labels(resource).inc()
        if self.verifier is not None:
            self.verifier.poke()  # acknowledge it soon, so the extender places no share there
        return None

    def preferred(self, resource: str, available: Sequence[str], must_include: Sequence[str],
                  size: int) -> Sequence[str] | None:
        if not M.is_handoff_resource(resource):
            return None
        with self._lock:
            self._last_gpa = (resource, size, time.monotonic())
        # Steer from the cache when it names the one waiting pod of this kind (else the same bounded wait and
        # LIST as Allocate's, so the Allocate that follows answers from the cache). Several pods waiting:
        # no preference (the kubelet picks; Allocate refuses what it cannot attribute).
        waiting, _ = self._decide(resource, size, None, self._kubelet_pods())
        if len(M.waiting_pods(waiting)) > 1:
            return None
        with self._lock:
            hint = M.steer(self._pods.values(), self._served, resource, available, must_include, size)
        if hint is not None or resource == R.GPU_SLOTS:
            return hint
        with self._lock:  # a pod without a record: steer away from GPUs records or others hold
            taken = M.holders(self._pods.values())
            busy = set(taken) | set(self._bypass)
        chosen = list(dict.fromkeys(must_include))
        for d in available:
            if len(chosen) >= size:
                break
            if d not in chosen and M.uuid_of(d) not in busy:
                chosen.append(d)
        return chosen if len(chosen) == size else None

    # ---- acknowledgement -----------------------------------------------------------------------
    def _acknowledge(self, pod_key: str) -> None:
        """Have the pod's acknowledgement written (what ``_served`` holds for it, over what it carries)."""
        if self.acks is not None:
            self.acks.ask(pod_key)

    def _write_ack(self, pod_key: str) -> bool:
        """One attempt (on the writer's thread). True when nothing is left to write: written, already as
        wanted, or the pod gone; False to be retried after back-off (API server or webhook down)."""
        assert self.client is not None
        if pod_key == _PROGRESS:
            return self._write_progress()
        ns, name = pod_key.split("/", 1)
        # The writer never runs two writes of one pod at once (acks.AckWriter), so a later acknowledgement
        # never lands before an earlier one; writes of different pods run side by side.
        with self._lock:
            view = self._pods.get(pod_key)
            if view is None:
                return True
            acks = dict(view.acks)
            acks.update({c: a for (uid, c), a in self._served.items() if uid == view.uid})
            uid = view.uid
            if acks == view.acks:
                return True
        value = encode_acks(acks)
        ann = {A.DEVICE_ASSIGNED: value}
        if self.key is not None:
            ann[signing.ACK_SIGNATURE] = signing.sign(self.key, uid, self.node, value, kind="ack")
        try:
            # The UID as a precondition: never acknowledge a recreated pod of the same name.
            self.client.patch(HandoffPod, name, {"metadata": {"annotations": ann, "uid": uid}}, namespace=ns,
                              patch_type=PatchType.MERGE)
        except Exception as e:
            status = getattr(getattr(e, "status", None), "code", None)
            if status in (404, 409):
                return True  # gone, or recreated under the same name: nothing of ours to acknowledge
            log.warning("pod %s: cannot write %s yet (retried with back-off): %s", pod_key,
                        A.DEVICE_ASSIGNED, e)
            return False
        with self._lock:
            if (v := self._pods.get(pod_key)) is not None and v.uid == uid:
                v.acks = acks
        return True

    # ---- verification --------------------------------------------------------------------------
    def verify(self, holdings: Iterable[Holding]) -> list[str]:
        """Compare PodResources (grouped per container) with what was served; report and correct."""
        grouped = group(holdings)
        with self._lock:
            pods, served, given = dict(self._pods), dict(self._served), dict(self._given)
        divergent, bypass, unacked = compare(pods, served, grouped, given)
        with self._lock:  # served to the container that holds them: nothing left to tell apart
            for (_pod, container), per in grouped.items():
                for resource, ids in per.items():
                    told = self._given.get((resource, frozenset(ids)))
                    if told is not None and told[1] == container and pods.get(_pod) is not None \
                            and pods[_pod].uid == told[0]:
                        del self._given[(resource, frozenset(ids))]
        out: list[str] = []
        for d in divergent:
            out.append(f"{d.pod_key}: {d.message}")
            if (d.pod_key, d.container) in self.reported:
                continue
            self.reported.add((d.pod_key, d.container))
            if d.swap:
                self.metrics.swaps.inc()
                log.info("handoff on %s: pod %s: %s (identical records taken in another order; "
                         "acknowledgement corrected)", self.node, d.pod_key, d.message)
                self._event(d.pod_key, d.uid, "GpuHandoffReordered",
                            d.message + ", with its own amounts; the acknowledgement now names the kubelet's "
                            "GPUs", type_="Normal")
            else:
                self.metrics.mismatches.inc()
                log.error("handoff divergence on %s: pod %s: %s", self.node, d.pod_key, d.message)
                self._event(d.pod_key, d.uid, "GpuHandoffMismatch",
                            d.message + "; the accounting now follows the kubelet")
            if d.served_as is not None:
                # What the container was told is the other record's: acknowledge that, so the accounting
                # holds the amounts really given, and that record is no longer served.
                with self._lock:
                    told = self._given.pop((d.resource, frozenset(d.kubelet_ids)), None)
                    self._served.pop(d.served_as, None)
                    if told is not None:
                        self._served[(d.uid, d.container)] = told[2]
                if told is not None:
                    self._acknowledge(d.pod_key)
                continue
            self._acknowledge_held(pods.get(d.pod_key), d.pod_key, d.uid, d.container, d.resource, d.kubelet_ids)
        for h in unacked:  # the kubelet holds exactly the record, and no acknowledgement says so yet
            self._acknowledge_held(pods.get(h.pod_key), h.pod_key, h.uid, h.container, h.resource, h.kubelet_ids)
        self._report_collisions(pods)
        now = time.monotonic()
        held_now = {g for b in bypass for g in M.kubelet_gpus(b.kubelet_ids)}
        with self._lock:  # what the kubelet no longer lists, and this process did not serve just now, is free
            for g in [g for g, (_w, t) in self._bypass.items() if g not in held_now and now - t > BYPASS_GRACE_S]:
                del self._bypass[g]
        for b in bypass:
            gpus = M.kubelet_gpus(b.kubelet_ids)
            with self._lock:
                for g in gpus:
                    self._bypass[g] = (b.pod_key, now)
                p = self._pods.get(b.pod_key)
                known = p is not None and b.container in p.acks
            if not known and all(g in self._gpus for g in gpus):
                grants = tuple(DeviceGrant(self._gpus[g][0], g, 100, self._gpus[g][1], 100) for g in gpus)
                with self._lock:
                    self._served[(b.uid, b.container)] = Ack(b.resource, b.kubelet_ids, grants)
                self._acknowledge(b.pod_key)
        return out

    def _acknowledge_held(self, p: PodView | None, pod_key: str, uid: str, container: str, resource: str,
                          ids: tuple[str, ...]) -> None:
        """Record and acknowledge the container's own record on the GPUs the kubelet holds for it (what
        PodResources shows is what the accounting must follow)."""
        entry = next((e for e in p.entries if e.container == container), None) if p else None
        if entry is None:
            return
        grants = tuple(self._grant(entry, u) for u in M.kubelet_gpus(ids))
        with self._lock:
            self._served[(uid, container)] = Ack(resource, ids, grants)
        self._acknowledge(pod_key)

    def _report_collisions(self, pods: Mapping[str, PodView]) -> None:
        """Live records that put more than a GPU's compute on it: a Warning Event on each pod involved
        (once) and a metric. The extender holds them all, so the GPU is full for new placements."""
        for gpu, holders in M.holders(pods.values()).items():
            total = sum(core for _, core in holders)
            if total <= 100:
                continue
            for key, _core in holders:
                if (key, gpu) in self.collided:
                    continue
                self.collided.add((key, gpu))
                self.metrics.collisions.inc()
                view = pods.get(key)
                self._event(key, view.uid if view else "", "GpuRecordCollision",
                            f"GPU {M.short(gpu)} carries {total} % compute by the records of "
                            f"{', '.join(sorted(k for k, _ in holders))}; it is full for new placements")

    def _event(self, pod_key: str, uid: str, reason: str, message: str, type_: str = "Warning") -> None:
        if self.client is None:
            return
        ns, name = pod_key.split("/", 1)
        try:
            emit_event(self.client, namespace=ns, kind="Pod", name=name, uid=uid or None, reason=reason,
                       message=message[:1000], type_=type_, component="kubegpu-node")
        except Exception as e:
            log.warning("pod %s: cannot emit the %s Event: %s", pod_key, reason, e)


WatchHandler = Callable[[WatchEvent], None]


class Listed(list[dict[str, Any]]):
    """A LIST's items and the resourceVersion of its snapshot."""

    resource_version: str | None = None


def make_resolver(client: Client, node: str, *, pod_resources_socket: str = POD_RESOURCES_SOCKET,
                  verify_interval_s: float = 30.0, registry: CollectorRegistry | None = None,
                  key: bytes | None = None, inventory: NodeInventory | None = None,
                  watch_feed: Callable[[WatchHandler], WatchHandler] | None = None,
                  gpu_resources: frozenset[str] = frozenset()) -> HandoffResolver:
    """The resolver the node daemon plugs into its device plugins: a watch of this node's pods feeds it,
    a fresh LIST backs every decision the watch cannot make, PodResources verifies it. ``key`` is the record
    key the node's entry read (:func:`kubegpu.model.signing.load_key`; None: records are unsigned) and
    ``gpu_resources`` the renamed GPU resources it declared. ``watch_feed`` wraps
    the handler the pod watch feeds (a stand-in cluster delays it, as a watch that lags the kubelet's)."""

    def refresh() -> Iterable[dict[str, Any]]:
        listing = client.list(HandoffPod, namespace="*", fields={"spec.nodeName": node})
        out = Listed(p.to_dict() for p in listing)
        try:
            out.resource_version = str(listing.resourceVersion)
        except Exception:  # no list resourceVersion: every pod absent from the LIST is taken as gone
            out.resource_version = None
        return out

    resolver = HandoffResolver(node, client=client, refresh=refresh, metrics=HandoffMetrics(registry),
                               key=key, inventory=inventory, gpu_resources=gpu_resources)
    feed = watch_feed(resolver.on_event) if watch_feed is not None else resolver.on_event
    # The pods' handoff fields only, and a tombstone of each in the watch's cache (kubegpu.node.handoff.pods).
    resolver.watch = InformerThread(client, HandoffPod, feed, fields={"spec.nodeName": node},
                                    name=f"handoff-{node}", keep=tombstone, announce_relists=True).start()
    resolver.watch.wait_synced(10)
    time.sleep(0)  # let the synced events land
    resolver.consistent_read()  # complete as of its version, which the Node then carries (A.HANDOFF_SEEN)
    resolver.verifier = Verifier(resolver, pod_resources_socket, verify_interval_s).start()
    resolver.pod_resources = lambda: list_pod_resources(pod_resources_socket, timeout_s=1.0)
    return resolver
