"""The bind commit protocol: how one Binding is chosen, held and written, with its conflict retries.

Bind is the extender's one commit point. It works from the API server's pod, never from what an earlier
``/filter`` body said about that UID: first the watch's copy of the pending pod, bound only at the version
copied (the Binding's precondition; :mod:`kubegpu.scheduler.pending`), else a GET. It waits for the node's
handoff turn (:mod:`kubegpu.scheduler.handoff`), chooses the GPUs and holds them before its next ``await``,
so concurrent binds can never be handed the same capacity, posts one Binding that carries the
``kubegpu.io/device-allocated`` annotation (the API server applies both in one write), and releases the hold
if that fails. Binds of one pod are serialized; binds of different pods interleave only at awaits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import httpx2
from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError

from kubegpu.kube.slim import SlimPod
from kubegpu.kube.writes import abind_pod, is_conflict, is_not_found, retry_async
from kubegpu.model import annotations as A
from kubegpu.model.allocation import AnnotationError, PodAllocation, decode, encode
from kubegpu.model.signing import record_annotations
from kubegpu.placement import PlacementConflict
from kubegpu.scheduler import wire
from kubegpu.scheduler.inflight import InFlight
from kubegpu.scheduler.metrics import ExtenderMetrics
from kubegpu.scheduler.pending import PendingPods
from kubegpu.scheduler.plan import PlanCache, PodPlan
from kubegpu.scheduler.state import ClusterView

log = logging.getLogger(__name__)

# Below the rendered bind extender's httpTimeout (60 s, install/render.py BIND_HTTP_TIMEOUT): a pod that only waits
# for its node's previous handoff of its kind waits here, with no Warning and no back-off, behind a queue of that
# kind many handoffs deep even on a slow link.
DEFAULT_HANDOFF_WAIT_S = 50.0
# Reads of the pod one bind may make: the watch's copy, the API server's pod, and once more when the pod
# changed between that read and the Binding (its resourceVersion is the Binding's precondition).
BIND_READS = 3
# How far back a bind that finds its node full looks for what took the room since the pod was filtered: kube-scheduler
# binds asynchronously, so a pod's bind follows its filter by one scheduling cycle and the binds queued before it.
RECENT_S = 10.0
RECENT_KEPT = 16  # binds remembered per node for that reason


class KeyLocks:
    """One lock per key while anyone holds or waits for it (binds of one pod run one at a time)."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def held(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(key) or (asyncio.Lock(), 0)
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users > 1:
                self._locks[key] = (lock, users - 1)
            else:
                del self._locks[key]

    def __len__(self) -> int:
        return len(self._locks)


class Binder:
    """Binds pods to the nodes kube-scheduler chose: the view it chooses GPUs on, the API client it writes
    with, the watch of pending pods it reads first (None: a GET at every bind) and how long a bind waits for
    its node's handoff turn."""

    def __init__(self, view: ClusterView, client: AsyncClient | None, plans: PlanCache, metrics: ExtenderMetrics,
                 *, pending: PendingPods | None = None, handoff_wait_s: float = DEFAULT_HANDOFF_WAIT_S,
                 ready: asyncio.Event | None = None, inflight: InFlight | None = None) -> None:
        self.view = view
        self.ledger = view.ledger
        self.handoffs = view.handoffs
        self.client = client
        self.plans = plans
        self.metrics = metrics
        self.pending = pending
        # How long a bind waits for its node to finish handing a pod of the same kind to the kubelet before it
        # fails (kube-scheduler then retries after its back-off): below the bind extender's httpTimeout (the
        # manifests render 60 s), so the answer always arrives before kube-scheduler gives up on it.
        self.handoff_wait_s = handoff_wait_s
        # Set once the first lists are in: before that a pod waiting on a node is invisible to the queue.
        self.ready = ready
        self.locks = KeyLocks()
        # The pods filters count before the accounting does (scheduler/inflight.py): a bind names its node there
        # as soon as it knows the pod's plan, and ends its flight once it holds the GPUs or gives up.
        self.inflight = inflight if inflight is not None else InFlight(view, wait_s=0.0)
        # Per node, the latest binds through here (loop time, pod, what it took): when a bind finds no room on a
        # node its filter passed, they say what changed in between.
        self.recent: dict[str, deque[tuple[float, str, str]]] = {}

    async def bind(self, args: wire.ExtenderBindingArgs) -> str:
        """Bind the pod ``args`` names to ``args.Node``: '' or why it failed."""
        key = f"{args.PodNamespace}/{args.PodName}"
        async with self.locks.held(key):
            filtered_at = self.inflight.filtered_at(key)
            try:
                error = await self._bind(args, key, filtered_at)
            finally:
                self.inflight.done(key)
        if error:
            log.warning("bind %s to %s failed: %s", key, args.Node, error)
        return error

    async def _bind(self, args: wire.ExtenderBindingArgs, key: str, filtered_at: float | None) -> str:
        if self.client is None:
            return "kubegpu bind: no API client configured"
        ns, name, node = args.PodNamespace, args.PodName, args.Node
        held = self.ledger.held.get(key)
        if held is not None and not held.binding and (not args.PodUID or held.uid == args.PodUID):
            if held.node == node:
                return ""  # a retry of a bind that went through (ours, or one the watch has shown)
            self.metrics.bind_failures.labels("already-bound").inc()
            return f"kubegpu bind: pod {key} is already bound to {held.node}"
        deadline = asyncio.get_running_loop().time() + self.handoff_wait_s  # one wait per bind, whatever it reads
        # Always the API server's pod: what an earlier /filter body said about this UID is not evidence. First
        # the watch's copy of the pending pod, which binds only at the version copied (the Binding's
        # precondition) and never refuses on its own word (scheduler/pending.py); then a GET.
        pod = self.pending.get(key, args.PodUID) if self.pending is not None else None
        if pod is not None:
            outcome = await self._bind_pod(args, key, pod, deadline, filtered_at, confirmed=False)
            if isinstance(outcome, str):
                return outcome
            pod = outcome.pod
        for _ in range(BIND_READS - 1):
            if pod is None:
                try:
                    current = await retry_async(lambda: self.client.get(SlimPod, name, namespace=ns))  # type: ignore[union-attr]
                except ApiError as e:
                    self.metrics.bind_failures.labels("pod-lookup").inc()
                    return f"kubegpu bind: cannot read pod {key}: {e.status.message}"
                except (OSError, httpx2.HTTPError) as e:
                    self.metrics.bind_failures.labels("api-unreachable").inc()
                    return f"kubegpu bind: API server unreachable: {e}"
                pod = current.to_dict()
            outcome = await self._bind_pod(args, key, pod, deadline, filtered_at, confirmed=True)
            if isinstance(outcome, str):
                return outcome
            pod = outcome.pod
        self.metrics.bind_failures.labels("api-error").inc()
        return f"kubegpu bind: pod {key} kept changing while it was being bound; retried after back-off"

    async def _bind_pod(self, args: wire.ExtenderBindingArgs, key: str, pod: dict[str, Any], deadline: float,
                        filtered_at: float | None, *, confirmed: bool) -> str | _Reread:
        """Bind ``pod`` (the API server's, as a GET or the watch showed it) to ``args.Node``: '' or the reason
        it failed, or :class:`_Reread` to start over from the API server's pod. Unconfirmed (the watch's
        copy), every refusal that depends on the pod is a reread, so that only the API server's current pod
        is ever refused; so is a Binding the API server refuses as a conflict (the pod changed since the copy,
        was recreated, or was bound since) or as not found (deleted since). ``filtered_at``: when this extender's
        filter last passed the pod (loop time; None: not seen), what a refusal compares the node's changes with."""
        ns, name, node = args.PodNamespace, args.PodName, args.Node
        meta = pod.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        version = str(meta.get("resourceVersion") or "")
        if args.PodUID and uid != args.PodUID:
            if not confirmed:
                return _Reread()
            self.metrics.bind_failures.labels("uid-changed").inc()
            return f"kubegpu bind: pod {key} is now UID {uid}, not {args.PodUID} (recreated)"
        bound_to = (pod.get("spec") or {}).get("nodeName")
        if bound_to:
            if not confirmed:
                return _Reread()
            recorded = _recorded(pod)
            if bound_to == node and recorded is not None:  # bound by an earlier attempt of ours
                self._hold_quietly(key, uid, node, recorded)
                return ""
            if bound_to == node and recorded is None and not self.ledger.tracks(node):
                return ""  # a plain Binding of ours that went through (a node without kubegpu GPUs)
            self.metrics.bind_failures.labels("already-bound").inc()
            return f"kubegpu bind: pod {key} is already bound to {bound_to}"
        plan = self.plans.plan(pod)
        if not plan.request.wants_gpu and not self.ledger.tracks(node):
            return await self._bind_plain(key, pod, node, confirmed=confirmed)
        if why := plan.too_many:
            if not confirmed:
                return _Reread()
            self.metrics.bind_failures.labels("refused").inc()
            return f"kubegpu bind: {why}"
        # From here until it holds, filters count the pod on this node (it may wait for its turn a long while).
        self.inflight.binding(plan, node)
        if why := await self._turn(plan, node, deadline):
            if not confirmed:  # the API server's pod waits for what is left of the same deadline (none)
                return _Reread()
            self.metrics.bind_failures.labels("handoff-wait").inc()
            return f"kubegpu bind: {why}"
        # Choose and hold before the first await below: no other bind can take the same capacity, and no
        # other pod of this kind can start waiting on the node between the check above and this hold.
        current = self.ledger.held.get(key)  # read again: the watch may have moved while this bind waited
        if current is not None:
            if current.uid == uid:  # the watch has shown this pod bound since: the API server's pod answers
                return _Reread()
            self.ledger.release(key)  # an earlier pod of this name, deleted (its event still to come)
        alloc, why = self.view.choose(plan, node)
        if alloc is None:
            if not confirmed:
                return _Reread()
            self.metrics.bind_failures.labels("no-fit").inc()
            return f"kubegpu bind: {why}; {self._changed_since_filter(node, key, filtered_at)}"
        try:
            self.ledger.hold(key, uid, node, alloc, assumed=True, plan=plan)
        except PlacementConflict as e:  # cannot happen right after choose; refuse rather than over-commit
            self.metrics.bind_failures.labels("no-fit").inc()
            return f"kubegpu bind: {e}"
        self.inflight.done(key)  # the accounting counts it now
        value = encode(alloc)
        record = record_annotations(value, uid, node, self.ledger.record_key)  # signed for the node (h11)
        try:
            # One write: the API server copies the Binding's annotations onto the pod as it sets
            # spec.nodeName, so a pod is never on a node without its record; the UID and the version the GPUs
            # were chosen for are its preconditions.
            try:
                await retry_async(lambda: abind_pod(self.client, ns, name, uid, node,  # type: ignore[arg-type]
                                                    record, resource_version=version))
            except ApiError as e:
                if not is_conflict(e):
                    if not confirmed and is_not_found(e):  # gone since the copy: answered as after a GET
                        self.ledger.release_assumed(key, uid, node)
                        return _Reread()
                    raise
                ours, fresh = await self._bound_to(ns, name, node, value)
                if not ours:
                    # Refused for the pod as the API server has it now (as after a GET) when that is the pod just
                    # bound with. Otherwise bind again from what it has: after the watch's copy, always (a GET if
                    # the pod is gone); after the API server's own pod, when that pod changed while unbound.
                    now = _version(fresh) if fresh is not None else None
                    if now != (uid, version, "") and (not confirmed or (now is not None and now[0] == uid
                                                                        and not now[2])):
                        self.ledger.release_assumed(key, uid, node)
                        return _Reread(fresh)
                    raise
        except ApiError as e:
            self.ledger.release_assumed(key, uid, node)
            self.metrics.bind_failures.labels("api-error").inc()
            return f"kubegpu bind: API error {e.status.code}: {e.status.message}"
        except Exception as e:
            self.ledger.release_assumed(key, uid, node)
            self.metrics.bind_failures.labels("api-unreachable").inc()
            return f"kubegpu bind: {type(e).__name__}: {e}"
        self.ledger.mark_bound(key)
        self.metrics.placed.inc()
        self._remember(node, key, alloc)
        return ""

    def _remember(self, node: str, key: str, alloc: PodAllocation) -> None:
        now = asyncio.get_running_loop().time()
        taken = ", ".join(f"GPU {g.minor} {'whole' if g.core >= 100 else f'{g.core} %'}" for g in alloc.held().grants())
        per = self.recent.get(node)
        if per is None:
            per = self.recent[node] = deque(maxlen=RECENT_KEPT)
        per.append((now, key, taken or "CPU and memory"))
        for n in [n for n, q in self.recent.items() if q and now - q[-1][0] > RECENT_S]:
            del self.recent[n]  # bounded by the nodes bound to lately

    def _changed_since_filter(self, node: str, key: str, filtered_at: float | None) -> str:
        """What took the room on ``node`` since this extender's filter passed it for ``key`` (``filtered_at``, loop
        time; None when it did not filter the pod: then the last RECENT_S seconds): the binds through here since,
        which its filter did not count (a bind that came later than the filter waits for), else a change the
        extender did not make (a pod the watch showed bound there, the node's GPUs)."""
        now = asyncio.get_running_loop().time()
        since = now - RECENT_S if filtered_at is None else filtered_at
        seen = (f"its filter passed the node {now - filtered_at:.1f} s ago" if filtered_at is not None else
                "this extender did not filter the pod (restarted since, or another instance did)")
        recent = [(t, k, taken) for t, k, taken in self.recent.get(node, ()) if t >= since and k != key]
        if recent:
            shown = "; ".join(f"{k} ({taken}, {now - t:.1f} s ago)" for t, k, taken in reversed(recent[-4:]))
            more = f" and {len(recent) - 4} more" if len(recent) > 4 else ""
            return (f"{seen}; the room its filter saw was taken since by pods bound there: {shown}{more} (their binds "
                    "came after its filter; retried after back-off)")
        return (f"{seen}; no pod was bound there through this extender since: the room went to a pod the watch "
                "showed bound there, or with the node's GPUs (health, Device object); retried after back-off")

    async def _bind_plain(self, key: str, pod: dict[str, Any], node: str, *, confirmed: bool) -> str | _Reread:
        """A pod without GPUs on a node without kubegpu GPUs: nothing to choose or account, a plain Binding
        (kube-scheduler sends every pod of its profile to the one extender that binds, install/render.py)."""
        meta = pod.get("metadata") or {}
        ns, name = str(meta.get("namespace") or ""), str(meta.get("name") or "")
        uid, version = str(meta.get("uid") or ""), str(meta.get("resourceVersion") or "")
        try:
            await retry_async(lambda: abind_pod(self.client, ns, name, uid, node,  # type: ignore[arg-type]
                                                None, resource_version=version))
        except ApiError as e:
            if not confirmed and (is_conflict(e) or is_not_found(e)):
                return _Reread()  # the watch's copy was behind: answered from the API server's pod
            self.metrics.bind_failures.labels("api-error").inc()
            return f"kubegpu bind: API error {e.status.code}: {e.status.message}"
        except Exception as e:
            self.metrics.bind_failures.labels("api-unreachable").inc()
            return f"kubegpu bind: {type(e).__name__}: {e}"
        log.debug("pod %s (no GPUs) bound to %s", key, node)
        return ""

    async def _turn(self, plan: PodPlan, node: str, deadline: float) -> str:
        """Wait until no other pod of this pod's kinds waits on ``node`` for its handoff: the
        one-waiting-record rule, enforced here where binds are serialized (kube-scheduler binds
        asynchronously: the next pod is filtered before the previous bind arrives). '' once it is this pod's
        turn; the reason when it is not by ``deadline`` (on the loop's clock). The caller holds right after,
        with no await in between, so two binds of a kind can never both pass."""
        if not plan.request.wants_gpu:
            return ""
        loop = asyncio.get_running_loop()
        if self.ready is not None and not self.ready.is_set():
            # Who waits is rebuilt from the pods (records, acknowledgements, phases): before the first LIST is
            # in (a restart), a pod waiting on the node is invisible and the rule would be guessed.
            try:
                await asyncio.wait_for(self.ready.wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                return "the extender is still listing the cluster's pods (after a start); retried after back-off"
        why = await self.handoffs.turn(node, plan.key, plan.shapes, deadline)
        if why is None:
            return ""
        return f"{why}; not its turn within {self.handoff_wait_s:g} s, retried after back-off"

    async def _bound_to(self, ns: str, name: str, node: str, value: str) -> tuple[bool, dict[str, Any] | None]:
        """After a 409 on the Binding: is the pod bound to ``node`` with our record (a retry that raced)? And
        the pod as the API server has it now (None when it is gone)."""
        try:
            current = await self.client.get(SlimPod, name, namespace=ns)  # type: ignore[union-attr]
        except ApiError as e:
            if getattr(e.status, "code", None) == 404:
                return False, None
            raise
        pod = current.to_dict()
        spec, meta = pod.get("spec") or {}, pod.get("metadata") or {}
        return (spec.get("nodeName") == node and (meta.get("annotations") or {}).get(A.DEVICE_ALLOCATED) == value,
                pod)

    def _hold_quietly(self, key: str, uid: str, node: str, alloc: PodAllocation) -> None:
        try:
            self.ledger.hold(key, uid, node, alloc)
        except PlacementConflict as e:
            log.error("pod %s: recorded GPUs collide with another pod's: %s", key, e)




class _Reread:
    """Bind starts over from the API server's pod: ``pod`` when the conflict's GET just read it, else a GET."""

    __slots__ = ("pod",)

    def __init__(self, pod: dict[str, Any] | None = None) -> None:
        self.pod = pod


def _version(pod: dict[str, Any]) -> tuple[str, str, str]:
    """(UID, resourceVersion, node bound to or '') of a pod."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    return str(meta.get("uid") or ""), str(meta.get("resourceVersion") or ""), str(spec.get("nodeName") or "")


def _recorded(pod: dict[str, Any]) -> PodAllocation | None:
    value = ((pod.get("metadata") or {}).get("annotations") or {}).get(A.DEVICE_ALLOCATED)
    if not value:
        return None
    try:
        return decode(value)
    except AnnotationError:
        return None
