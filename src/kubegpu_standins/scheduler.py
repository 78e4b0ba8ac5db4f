"""A stand-in kube-scheduler: the in-tree resource fit, then the HTTP extender calls, as v1.24 makes them.

Only what the extender sees is reproduced (``fixtures/kube-scheduler-v1.24``): a pod
is sent to the extender only when it names a managed resource; the node list is what
survived the in-tree ``NodeResourcesFit`` (allocatable minus what bound pods request,
skipping ``ignoredByScheduler`` resources); the bodies are compact JSON with
capitalised keys in the order ``Pod``, ``Nodes``, ``NodeNames``; prioritize is called
only when more than one node survived and its score counts ×10×weight; bind goes to
the extender, and pods without managed resources are bound by the default binder.
The in-tree NodeAffinity filter runs too (``nodeSelector`` and required node affinity), so
pods pinned by label (the seeds' GPU-model selectors, a hostname) reach only those nodes.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from kubegpu.model.quantity import QuantityError, parse

log = logging.getLogger(__name__)

Obj = dict[str, Any]
HEADERS = {"Content-Type": "application/json", "User-Agent": "Go-http-client/1.1", "Accept-Encoding": "gzip"}


@dataclass(slots=True)
class ScheduleResult:
    pod: str  # namespace/name
    node: str | None
    message: str = ""


@dataclass(slots=True)
class StandinScheduler:
    """Schedules pending pods through an extender at ``url`` (the ``urlPrefix``)."""

    client: Any  # a lightkube Client
    url: str
    managed: set[str]
    ignored: set[str] = field(default_factory=set)
    weight: int = 1
    node_cache_capable: bool = True
    scheduler_name: str | None = None
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=5.0))

    def _pods(self) -> list[Obj]:
        from kubegpu.kube.resources import Pod

        return [p.to_dict() for p in self.client.list(Pod, namespace="*")]

    def _nodes(self) -> list[Obj]:
        from kubegpu.kube.resources import Node

        return [n.to_dict() for n in self.client.list(Node)]

    def interested(self, pod: Mapping[str, Any]) -> bool:
        for c in _containers(pod):
            res = c.get("resources") or {}
            if any(name in self.managed for part in ("requests", "limits") for name in (res.get(part) or {})):
                return True
        return False

    def schedule_pending(self) -> list[ScheduleResult]:
        """One pass over the pending pods, in creation order; returns what happened to each."""
        pods = self._pods()
        pending = [p for p in pods if not p["spec"].get("nodeName") and p.get("status", {}).get("phase") == "Pending"
                   and (self.scheduler_name is None or p["spec"].get("schedulerName") == self.scheduler_name)]
        pending.sort(key=lambda p: (p["metadata"].get("creationTimestamp", ""), p["metadata"]["name"]))
        results = []
        for pod in pending:
            try:
                results.append(self.schedule(pod, pods))
            except (RuntimeError, ValueError, httpx.HTTPError) as exc:
                # The real scheduler requeues the pod with the error; one broken answer stops nothing.
                meta = pod["metadata"]
                results.append(ScheduleResult(f"{meta.get('namespace', 'default')}/{meta['name']}", None,
                                              f"scheduling error: {exc}"))
            if results[-1].node:
                pod["spec"]["nodeName"] = results[-1].node  # its requests now count on that node
        return results

    def schedule(self, pod: Obj, all_pods: Iterable[Mapping[str, Any]]) -> ScheduleResult:
        key = f"{pod['metadata'].get('namespace', 'default')}/{pod['metadata']['name']}"
        nodes = [n for n in self._nodes() if _ready(n)]
        feasible, reasons = [], {}
        for n in nodes:
            why = node_affinity_mismatch(pod, n) or self._in_tree_fit(pod, n, all_pods)
            if why:
                reasons[n["metadata"]["name"]] = why
            else:
                feasible.append(n)
        if not feasible:
            return ScheduleResult(key, None, _summary(len(nodes), reasons))
        if not self.interested(pod):
            node = feasible[0]["metadata"]["name"]
            self._default_bind(pod, node)
            return ScheduleResult(key, node, "bound by the default binder")
        args: dict[str, Any] = {"Pod": _cached(pod), "Nodes": None, "NodeNames": None}
        if self.node_cache_capable:
            args["NodeNames"] = [n["metadata"]["name"] for n in feasible]
        else:
            args["Nodes"] = {"metadata": {}, "items": [_cached(n) for n in feasible]}
        body = self._post("filter", args)
        if body.get("Error"):
            return ScheduleResult(key, None, f"extender filter error: {body['Error']}")
        if self.node_cache_capable:
            names = body.get("NodeNames") or []
        else:
            names = [n["metadata"]["name"] for n in ((body.get("Nodes") or {}).get("items") or [])]
        failed = {**(body.get("FailedNodes") or {}), **(body.get("FailedAndUnresolvableNodes") or {})}
        if not names:
            return ScheduleResult(key, None, _summary(len(nodes), {**reasons, **failed}))
        if len(names) > 1:
            scores = {h["Host"]: int(h["Score"]) * self.weight * 10 for h in self._post("prioritize", args_for(
                args, names, feasible, self.node_cache_capable))}
            names = sorted(names, key=lambda n: (-scores.get(n, 0), n))
        node = names[0]
        meta = pod["metadata"]
        result = self._post("bind", {"PodName": meta["name"], "PodNamespace": meta.get("namespace", "default"),
                                     "PodUID": meta.get("uid", ""), "Node": node})
        if result.get("Error"):
            return ScheduleResult(key, None, f"extender bind error: {result['Error']}")
        return ScheduleResult(key, node)

    def _post(self, verb: str, body: Any) -> Any:
        data = json.dumps(body, separators=(",", ":"))
        resp = self.http.post(f"{self.url.rstrip('/')}/{verb}", content=data, headers=HEADERS)
        if resp.status_code != 200:
            raise RuntimeError(f"extender {verb} answered HTTP {resp.status_code}: {resp.text[:200]}")
        return resp.json()

    def _default_bind(self, pod: Obj, node: str) -> None:
        from kubegpu.kube.writes import bind_pod

        meta = pod["metadata"]
        bind_pod(self.client, meta.get("namespace", "default"), meta["name"], meta.get("uid"), node)

    def _in_tree_fit(self, pod: Mapping[str, Any], node: Mapping[str, Any], all_pods: Iterable[Mapping[str, Any]]
                     ) -> str:
        """NodeResourcesFit for extended resources: '' when it fits, else the scheduler's reason."""
        name = node["metadata"]["name"]
        allocatable = (node.get("status") or {}).get("allocatable") or {}
        want = _requests(pod)
        used: dict[str, float] = {}
        for p in all_pods:
            if p["spec"].get("nodeName") == name and p.get("status", {}).get("phase") not in ("Succeeded", "Failed"):
                for r, q in _requests(p).items():
                    used[r] = used.get(r, 0) + q
        for r, q in want.items():
            if r in self.ignored or "/" not in r:
                continue
            try:
                have = float(parse(allocatable.get(r, "0")))
            except QuantityError:
                have = 0.0
            if used.get(r, 0) + q > have:
                return f"Insufficient {r}"
        return ""


def node_affinity_mismatch(pod: Mapping[str, Any], node: Mapping[str, Any]) -> str:
    """The in-tree NodeAffinity filter: ``nodeSelector`` and required node affinity
    (``matchExpressions`` on labels: In, NotIn, Exists, DoesNotExist, Gt, Lt); '' when the node matches."""
    reason = "node(s) didn't match Pod's node affinity/selector"
    labels = (node.get("metadata") or {}).get("labels") or {}
    spec = pod.get("spec") or {}
    for k, v in (spec.get("nodeSelector") or {}).items():
        if labels.get(k) != v:
            return reason
    required = (((spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    terms = required.get("nodeSelectorTerms") or []
    # Terms are ORed, expressions inside a term ANDed; a term with no expressions matches nothing.
    if terms and not any(_term_matches(t, labels) for t in terms):
        return reason
    return ""


def _term_matches(term: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    exprs = term.get("matchExpressions") or []
    if not exprs:
        return False
    for e in exprs:
        key, op, values = e.get("key", ""), e.get("operator", ""), list(e.get("values") or [])
        have = labels.get(key)
        if op == "In":
            ok = have is not None and have in values
        elif op == "NotIn":
            ok = have is None or have not in values
        elif op == "Exists":
            ok = have is not None
        elif op == "DoesNotExist":
            ok = have is None
        elif op in ("Gt", "Lt") and len(values) == 1:
            try:
                a, b = int(have or ""), int(values[0])
            except ValueError:
                return False
            ok = a > b if op == "Gt" else a < b
        else:
            return False
        if not ok:
            return False
    return True


def args_for(args: Obj, names: list[str], feasible: list[Obj], node_cache_capable: bool) -> Obj:
    """The prioritize body: the filter body narrowed to the nodes the extender kept."""
    if node_cache_capable:
        return {**args, "NodeNames": names}
    keep = set(names)
    return {**args, "Nodes": {"metadata": {}, "items": [_cached(n) for n in feasible
                                                        if n["metadata"]["name"] in keep]}}


def _containers(pod: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    spec = pod.get("spec") or {}
    return [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]


def _requests(pod: Mapping[str, Any]) -> dict[str, float]:
    """Effective requests: max over init containers, sum over app containers (the scheduler's rule)."""
    spec = pod.get("spec") or {}
    total: dict[str, float] = {}
    for c in spec.get("containers") or []:
        for r, q in _container_requests(c).items():
            total[r] = total.get(r, 0) + q
    for c in spec.get("initContainers") or []:
        for r, q in _container_requests(c).items():
            total[r] = max(total.get(r, 0), q)
    return total


def _container_requests(c: Mapping[str, Any]) -> dict[str, float]:
    res = c.get("resources") or {}
    merged = {**(res.get("limits") or {}), **(res.get("requests") or {})}
    out = {}
    for r, q in merged.items():
        try:
            out[r] = float(parse(q))
        except QuantityError:
            continue
    return out


def _cached(obj: Mapping[str, Any]) -> Obj:
    """The scheduler's cached copy: no kind/apiVersion, as in the recorded bodies."""
    return {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}


def _ready(node: Mapping[str, Any]) -> bool:
    if (node.get("spec") or {}).get("unschedulable"):
        return False
    conds = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def _summary(total: int, reasons: Mapping[str, str]) -> str:
    counts: dict[str, int] = {}
    for r in reasons.values():
        counts[r] = counts.get(r, 0) + 1
    return f"0/{total} nodes are available: " + ", ".join(f"{n} {r}" for r, n in sorted(counts.items())) + "."


# ---- kube-scheduler's scheduling queue and asynchronous binding (v1.36) ----------------------------------

INITIAL_BACKOFF_S = 1.0  # podInitialBackoffSeconds
MAX_BACKOFF_S = 10.0  # podMaxBackoffSeconds
UNSCHEDULABLE_FLUSH_S = 300.0  # podMaxInUnschedulablePodsDuration


@dataclass(slots=True)
class QueuedPod:
    key: str
    uid: str
    order: int
    attempts: int = 0
    last_attempt: float = 0.0
    where: str = "active"  # active, backoff, unschedulable, binding
    events_at_pop: int = 0  # the queue's event count when this attempt began (-1: the pod itself changed since)


@dataclass
class SchedulingQueue:
    """kube-scheduler v1.36's queue as far as an extender sees it (``pkg/scheduler/backend/queue``):

    - a pod is tried from the active queue in arrival order; the scheduling cycle (filter, prioritize,
      assume) is serial, and the binding cycle runs asynchronously (a goroutine per pod), so the next pod is
      filtered before the previous pod's bind reaches the extender (recorded: same-shape binds 33–130 ms
      apart, ``kubegpu-on-v1.36/turn3.md``);
    - a bind that fails (the extender's bind answer carries an error) sends the pod to the back-off queue: it
      is tried again once its back-off has passed, ``INITIAL_BACKOFF_S`` doubling per attempt up to
      ``MAX_BACKOFF_S``;
    - a pod every node refused (the extender's filter included) goes to the unschedulable pool with the
      rejector ``Extender``. Extenders have no queueing hints, so kube-scheduler registers them for every
      event (``schedule_one.go``: "This Pod will be requeued from unschedulable pod pool to activeQ/backoffQ
      by any kind of cluster events", kubernetes#122019): any change of an assigned pod or a node, or an
      update of the pod itself, moves it to the back-off queue if its back-off has not passed, else to the
      active queue. With no event at all it waits for the flush after ``UNSCHEDULABLE_FLUSH_S``;
    - an event that arrives while a pod is being scheduled is not lost: kube-scheduler records the events of
      each in-flight pod (``inFlightEvents``) and replays them when the attempt fails
      (``determineSchedulingHintForInFlightPod``); with the extender among the rejectors, any such event
      sends the pod to the back-off queue (or the active queue once its back-off has passed), not the
      unschedulable pool;
    - a scheduling cycle that fails with an error (an extender unreachable, or its filter answer carrying
      ``Error``: ``extender.go`` returns it as an error, not as Unschedulable) sends the pod to the back-off
      queue, as a failed bind does.

    Not modelled: ``SchedulerPopFromBackoffQ`` (1.33+ beta, which pops backing-off pods when the active queue
    is empty and would only make the stand-in faster), priorities, preemption, gated pods.
    Pure bookkeeping with an injected clock; the driver calls the extender."""

    clock: Any = time.monotonic
    initial_backoff_s: float = INITIAL_BACKOFF_S
    max_backoff_s: float = MAX_BACKOFF_S
    flush_s: float = UNSCHEDULABLE_FLUSH_S
    pods: dict[str, QueuedPod] = field(default_factory=dict)
    _seq: int = 0
    attempts: int = 0
    unschedulable_count: int = 0
    bind_failures: int = 0
    flushed: int = 0
    cycle_errors: int = 0
    requeued_by_event: int = 0
    events: int = 0  # cluster events so far: what an in-flight attempt compares with

    def backoff_s(self, attempts: int) -> float:
        if attempts <= 0:
            return 0.0
        return min(self.max_backoff_s, self.initial_backoff_s * 2 ** (attempts - 1))

    def add(self, key: str, uid: str) -> None:
        """A pending pod (created, or seen again): queued once per UID."""
        cur = self.pods.get(key)
        if cur is not None and cur.uid == uid:
            return
        self._seq += 1
        self.pods[key] = QueuedPod(key, uid, self._seq)

    def forget(self, key: str) -> None:
        self.pods.pop(key, None)

    def _backing_off(self, p: QueuedPod, now: float) -> bool:
        return now < p.last_attempt + self.backoff_s(p.attempts)

    def pop(self) -> QueuedPod | None:
        """The next pod to schedule (it moves to ``binding`` until the driver says what became of it)."""
        now = self.clock()
        best: QueuedPod | None = None
        for p in self.pods.values():
            if p.where == "backoff" and not self._backing_off(p, now):
                p.where = "active"
            elif p.where == "unschedulable" and now - p.last_attempt >= self.flush_s:
                p.where = "active"
                self.flushed += 1
            if p.where == "active" and (best is None or p.order < best.order):
                best = p
        if best is not None:
            best.where = "binding"
            best.attempts += 1
            best.last_attempt = now
            best.events_at_pop = self.events
            self.attempts += 1
        return best

    def unschedulable(self, key: str) -> None:
        """Every node refused it (the extender's filter among them): the unschedulable pool, unless an event
        arrived while it was being scheduled (its in-flight events), which requeues it at once."""
        if (p := self.pods.get(key)) is not None:
            self.unschedulable_count += 1
            if p.events_at_pop != self.events:
                self._requeue(p, self.clock())
            else:
                p.where = "unschedulable"

    def errored(self, key: str) -> None:
        """The scheduling cycle failed with an error (an extender unreachable or answering Error), not
        Unschedulable: kube-scheduler sends such a pod to the back-off queue, not the unschedulable pool."""
        if (p := self.pods.get(key)) is not None:
            p.where = "backoff"
            self.cycle_errors += 1

    def bind_failed(self, key: str) -> None:
        """The binding cycle failed (the extender's bind error, the API): back-off queue."""
        if (p := self.pods.get(key)) is not None:
            p.where = "backoff"
            self.bind_failures += 1

    def _requeue(self, p: QueuedPod, now: float) -> None:
        p.where = "backoff" if self._backing_off(p, now) else "active"
        p.order = self._seq = self._seq + 1  # re-enters the queue: behind the pods already there
        self.requeued_by_event += 1

    def cluster_event(self) -> None:
        """An assigned pod or a node was added, changed or deleted: every pod the extender left
        unschedulable is worth another try."""
        now = self.clock()
        self.events += 1
        for p in self.pods.values():
            if p.where == "unschedulable":
                self._requeue(p, now)

    def pod_updated(self, key: str) -> None:
        """The unscheduled pod itself was updated."""
        p = self.pods.get(key)
        if p is not None and p.where == "unschedulable":
            self._requeue(p, self.clock())
        elif p is not None and p.where == "binding":
            p.events_at_pop = -1  # in flight: an event of its own, replayed if this attempt fails
