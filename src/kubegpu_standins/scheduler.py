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
