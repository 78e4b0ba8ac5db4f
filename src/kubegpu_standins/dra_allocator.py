"""A small DRA allocator and claim controller, doing what kube-scheduler and kube-controller-manager do
(v1.36, as recorded in fixtures ``dra-v1.36``) against the stand-in API server's objects.

Allocation (:meth:`Allocator.allocate`), per request of a claim (``exactly`` or the first
``firstAvailable`` subrequest that fits):

- candidates are the devices of complete pools (every slice of the newest generation present),
  in pool / slice / device order (recorded: gpu-0, gpu-1, ... in order);
- the DeviceClass's and the request's CEL selectors must hold (cel-python; unqualified
  attribute names are in the driver's domain; a selector that errors does not match);
- a device with a ``NoSchedule`` / ``NoExecute`` taint is skipped unless the request tolerates
  it; the tolerations are copied into the result;
- a device is given once (``capacity.requests`` then only filter: each named capacity must be at
  least the request), unless it has ``allowMultipleAllocations``: then each capacity
  ``requests`` entry (or the request policy's default) is checked against ``validRange`` /
  ``validValues``, rounded up to the step, and must fit beside what other claims consume;
  the result carries ``consumedCapacity`` and a fresh ``shareID``;
- shared counters (partitionable devices) must cover every device's ``consumesCounters``;
- all devices of a claim come from one node; the allocation gets that node's ``nodeSelector``.

A claim that cannot be allocated keeps an empty status, and :attr:`Allocator.last_failure` holds
the scheduler's message (``0/1 nodes are available: 1 cannot allocate all claims. ...``).
:class:`ClaimController` creates claims from templates (``<pod>-<claim>-<5 chars>``, owned by the
pod, the ``delete-protection`` finalizer), reserves and releases them, and deallocates a claim
nobody reserves.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import ROUND_CEILING, Decimal
from typing import Any, Final

import celpy

from kubegpu.model.quantity import QuantityError, format_bytes, parse
from kubegpu_standins.apiserver import ApiServer, ApiStatusError

UNSCHEDULABLE: Final = ("0/1 nodes are available: 1 cannot allocate all claims. still not schedulable, "
                        "preemption: 0/1 nodes are available: 1 Preemption is not helpful for scheduling.")
CLAIM_ANNOTATION: Final = "resource.kubernetes.io/pod-claim-name"
EXTENDED_ANNOTATION: Final = "resource.kubernetes.io/extended-resource-claim"
FINALIZER: Final = "resource.kubernetes.io/delete-protection"
GROUP: Final = "resource.k8s.io"


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _q(v: Any) -> Decimal:
    try:
        return parse(v)
    except (QuantityError, ValueError, TypeError):
        return Decimal(0)


def _fmt(name: str, value: Decimal, like: Any) -> str:
    """A consumed quantity in the form the server stores (``20Gi``, ``30``)."""
    if value == value.to_integral_value():
        n = int(value)
        s = str(like)
        if any(s.endswith(x) for x in ("Ki", "Mi", "Gi", "Ti")) or name == "memory":
            return format_bytes(n)
        return str(n)
    return str(value)


_ENV = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}
_CEL_LOCK = threading.Lock()


def cel_matches(expression: str, device: Mapping[str, Any]) -> bool:
    with _CEL_LOCK:
        prog = _PROGRAMS.get(expression)
        if prog is None:
            prog = _ENV.program(_ENV.compile(expression))
            _PROGRAMS[expression] = prog
    try:
        return bool(prog.evaluate({"device": celpy.json_to_cel(dict(device))}))
    except Exception:
        return False


@dataclass
class Candidate:
    driver: str
    pool: str
    node: str
    device: dict[str, Any]

    @property
    def key(self) -> tuple[str, str, str]:
        return self.driver, self.pool, self.device["name"]

    def cel_view(self) -> dict[str, Any]:
        attrs: dict[str, dict[str, Any]] = {}
        for name, v in (self.device.get("attributes") or {}).items():
            domain, sep, ident = name.rpartition("/")
            dom = domain if sep else self.driver
            val = next((v[k] for k in ("int", "bool", "string", "version") if k in v), None)
            attrs.setdefault(dom, {})[ident] = val
        caps: dict[str, dict[str, Any]] = {}
        for name, c in (self.device.get("capacity") or {}).items():
            domain, sep, ident = name.rpartition("/")
            caps.setdefault(domain if sep else self.driver, {})[ident] = int(_q(c.get("value")))
        return {"driver": self.driver, "attributes": attrs, "capacity": caps,
                "allowMultipleAllocations": bool(self.device.get("allowMultipleAllocations"))}


def tolerates(tolerations: list[dict[str, Any]], taint: Mapping[str, Any]) -> bool:
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        op = t.get("operator", "Equal")
        if op == "Exists" and (not t.get("key") or t["key"] == taint.get("key")):
            return True
        if op == "Equal" and t.get("key") == taint.get("key") and t.get("value", "") == taint.get("value", ""):
            return True
    return False


@dataclass
class _Usage:
    exclusive: set[tuple[str, str, str]] = field(default_factory=set)
    consumed: dict[tuple[str, str, str], dict[str, Decimal]] = field(default_factory=dict)
    counters: dict[tuple[str, str, str], dict[str, Decimal]] = field(default_factory=dict)  # set -> used


class Allocator:
    """Allocates ResourceClaims stored in ``api`` (what kube-scheduler's DRA plugin does)."""

    def __init__(self, api: ApiServer) -> None:
        self.api = api
        self.last_failure = ""
        self._lock = threading.Lock()

    def _kind(self, plural: str) -> Any:
        return self.api.kind(plural, GROUP)

    # ----- inventory ---------------------------------------------------------------------------

    def _slices(self) -> list[dict[str, Any]]:
        slices = self.api.objects("resourceslices", GROUP)
        pools: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for s in slices:
            sp = s["spec"]
            pools.setdefault((sp["driver"], sp["pool"]["name"]), []).append(s)
        out: list[dict[str, Any]] = []
        for (_d, _p), items in sorted(pools.items()):
            gen = max(int(i["spec"]["pool"].get("generation", 0)) for i in items)
            newest = [i for i in items if int(i["spec"]["pool"].get("generation", 0)) == gen]
            if len(newest) < int(newest[0]["spec"]["pool"].get("resourceSliceCount", 1)):
                continue  # incomplete pool: not used, as upstream
            out += sorted(newest, key=lambda x: x["metadata"]["name"])
        return out

    def _usage(self, skip_uid: str) -> _Usage:
        use = _Usage()
        for c in self.api.objects("resourceclaims", GROUP):
            if c["metadata"]["uid"] == skip_uid:
                continue
            for r in (((c.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []:
                key = (r["driver"], r["pool"], r["device"])
                if r.get("shareID") or r.get("consumedCapacity"):
                    slot = use.consumed.setdefault(key, {})
                    for n, v in (r.get("consumedCapacity") or {}).items():
                        slot[n] = slot.get(n, Decimal(0)) + _q(v)
                else:
                    use.exclusive.add(key)
        return use

    # ----- allocation --------------------------------------------------------------------------

    def allocate(self, namespace: str, name: str, *, pod: Mapping[str, Any] | None = None) -> bool:
        """Allocate the claim (if not yet) and reserve it for ``pod``; False + last_failure when it cannot."""
        with self._lock:
            claim = self.api.get_object("resourceclaims", name, namespace, GROUP)
            if not (claim.get("status") or {}).get("allocation"):
                alloc = self._compute(claim)
                if alloc is None:
                    self.last_failure = UNSCHEDULABLE
                    return False
                claim.setdefault("status", {})["allocation"] = alloc
            if pod is not None:
                ref = {"name": pod["metadata"]["name"], "resource": "pods", "uid": pod["metadata"]["uid"]}
                rf = claim["status"].setdefault("reservedFor", [])
                if all(r.get("uid") != ref["uid"] for r in rf):
                    rf.append(ref)
            status = claim["status"]
            self.api.store.update(self._kind("resourceclaims"), namespace, name,
                                  lambda o: dict(o, status=status), "status")
            return True

    def _compute(self, claim: Mapping[str, Any]) -> dict[str, Any] | None:
        slices = self._slices()
        use = self._usage(claim["metadata"]["uid"])
        counter_sets: dict[tuple[str, str, str], dict[str, Decimal]] = {}
        cands: list[Candidate] = []
        for s in slices:
            sp = s["spec"]
            for cs in sp.get("sharedCounters") or []:
                counter_sets[(sp["driver"], sp["pool"]["name"], cs["name"])] = {
                    n: _q(c.get("value")) for n, c in (cs.get("counters") or {}).items()}
            for d in sp.get("devices") or []:
                cands.append(Candidate(sp["driver"], sp["pool"]["name"], sp.get("nodeName", ""), d))
        # Counters already consumed by allocated devices.
        by_key = {c.key: c for c in cands}
        for key in list(use.exclusive) + list(use.consumed):
            c = by_key.get(key)
            if c is not None:
                self._consume(use, c, counter_sets, commit=True)
        results: list[dict[str, Any]] = []
        node: list[str] = []
        for req in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []:
            subs = [(req["name"], req["exactly"])] if "exactly" in req else [
                (f"{req['name']}/{s['name']}", s) for s in req.get("firstAvailable") or []]
            for rname, sub in subs:
                got = self._request(rname, sub, cands, use, counter_sets, node)
                if got is not None:
                    results += got
                    break
            else:
                return None
        if not node:
            return None
        return {"allocationTimestamp": _now(), "devices": {"results": results},
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": [node[0]]}]}]}}

    def _consume(self, use: _Usage, c: Candidate, sets: dict[tuple[str, str, str], dict[str, Decimal]],
                 commit: bool) -> bool:
        needs = []
        for cc in c.device.get("consumesCounters") or []:
            key = (c.driver, c.pool, cc["counterSet"])
            if key not in sets:
                return False  # a counter set that exists nowhere: only found out now
            for n, v in (cc.get("counters") or {}).items():
                needs.append((key, n, _q(v.get("value"))))
        for key, n, v in needs:
            used = use.counters.get(key, {}).get(n, Decimal(0))
            if used + v > sets[key].get(n, Decimal(0)):
                return False
        if commit:
            for key, n, v in needs:
                slot = use.counters.setdefault(key, {})
                slot[n] = slot.get(n, Decimal(0)) + v
        return True

    @staticmethod
    def _capacity_filter(c: Candidate, sub: Mapping[str, Any]) -> bool:
        """On a device given whole, ``capacity.requests`` only filters: each named capacity must exist and
        be at least the request (upstream: as a CEL ``capacity.compareTo(request) >= 0``)."""
        caps = c.device.get("capacity") or {}
        for name, want in ((sub.get("capacity") or {}).get("requests") or {}).items():
            if name not in caps or _q(caps[name].get("value")) < _q(want):
                return False
        return True

    def _capacity(self, c: Candidate, sub: Mapping[str, Any], use: _Usage) -> dict[str, Decimal] | None:
        requested = (sub.get("capacity") or {}).get("requests") or {}
        out: dict[str, Decimal] = {}
        for name, cap in (c.device.get("capacity") or {}).items():
            total = _q(cap.get("value"))
            policy = cap.get("requestPolicy") or {}
            if name in requested:
                want = _q(requested[name])
            elif "default" in policy:
                want = _q(policy["default"])
            else:
                want = total  # no policy: the whole capacity
            rng = policy.get("validRange")
            if rng:
                lo = _q(rng.get("min"))
                want = max(want, lo)
                step = _q(rng.get("step")) if rng.get("step") else None
                if step:
                    want = lo + ((want - lo) / step).to_integral_value(ROUND_CEILING) * step
                if rng.get("max") is not None and want > _q(rng["max"]):
                    return None
            values = policy.get("validValues")
            if values:
                fits = [_q(v) for v in values if _q(v) >= want]
                if not fits:
                    return None
                want = min(fits)
            if use.consumed.get(c.key, {}).get(name, Decimal(0)) + want > total:
                return None
            out[name] = want
        for name in requested:
            if name not in (c.device.get("capacity") or {}):
                return None
        return out

    def _request(self, rname: str, sub: Mapping[str, Any], cands: list[Candidate], use: _Usage,
                 sets: dict[tuple[str, str, str], dict[str, Decimal]], node: list[str]) -> list[dict[str, Any]] | None:
        try:
            cls = self.api.get_object("deviceclasses", sub.get("deviceClassName", ""), "", GROUP)
        except ApiStatusError:
            return None
        exprs = [s["cel"]["expression"] for s in (cls.get("spec") or {}).get("selectors") or []]
        exprs += [s["cel"]["expression"] for s in sub.get("selectors") or []]
        tolerations = list(sub.get("tolerations") or [])
        mode = sub.get("allocationMode", "ExactCount")
        count = int(sub.get("count", 1))
        picked: list[dict[str, Any]] = []
        for c in cands:
            if node and c.node != node[0]:
                continue
            taints = [t for t in c.device.get("taints") or [] if t.get("effect") in ("NoSchedule", "NoExecute")]
            if any(not tolerates(tolerations, t) for t in taints):
                continue
            view = c.cel_view()
            if not all(cel_matches(e, view) for e in exprs):
                continue
            multi = bool(c.device.get("allowMultipleAllocations"))
            if not multi and c.key in use.exclusive:
                continue
            if not multi and not self._capacity_filter(c, sub):
                continue
            consumed = self._capacity(c, sub, use) if multi else None
            if multi and consumed is None:
                continue
            if (not multi or c.key not in use.consumed) and not self._consume(use, c, sets, commit=False):
                continue
            if not multi or c.key not in use.consumed:
                self._consume(use, c, sets, commit=True)
            res: dict[str, Any] = {"device": c.device["name"], "driver": c.driver, "pool": c.pool, "request": rname}
            if multi:
                assert consumed is not None
                slot = use.consumed.setdefault(c.key, {})
                for n, v in consumed.items():
                    slot[n] = slot.get(n, Decimal(0)) + v
                caps = c.device.get("capacity") or {}
                res["consumedCapacity"] = {n: _fmt(n, v, caps[n].get("value")) for n, v in consumed.items()}
                res["shareID"] = str(uuid.uuid4())
            else:
                use.exclusive.add(c.key)
            if tolerations:
                res["tolerations"] = tolerations
            if not node:
                node.append(c.node)
            picked.append(res)
            if mode == "ExactCount" and len(picked) == count:
                return picked
        if mode == "All" and picked:
            return picked
        return None

    # ----- release -----------------------------------------------------------------------------

    def release(self, namespace: str, name: str, pod_uid: str) -> None:
        """Drop ``pod_uid`` from ``reservedFor``; with nobody left, deallocate (the claim controller's job)."""
        with self._lock:
            try:
                claim = self.api.get_object("resourceclaims", name, namespace, GROUP)
            except ApiStatusError:
                return
            status = dict(claim.get("status") or {})
            rf = [r for r in status.get("reservedFor") or [] if r.get("uid") != pod_uid]
            if rf:
                status["reservedFor"] = rf
            else:
                status.pop("reservedFor", None)
                status.pop("allocation", None)
            self.api.store.update(self._kind("resourceclaims"), namespace, name,
                                  lambda o: dict(o, status=status), "status")


class ClaimController:
    """The resourceclaim controller: claims from templates and for extended resources, owned by their pod."""

    def __init__(self, api: ApiServer) -> None:
        self.api = api

    def claims_for(self, pod: dict[str, Any]) -> list[tuple[str, str]]:
        """(pod claim name, ResourceClaim name) for every claim of the pod, creating template claims."""
        meta = pod["metadata"]
        ns = meta.get("namespace", "default")
        statuses = {s["name"]: s.get("resourceClaimName") for s in (pod.get("status") or {}).get(
            "resourceClaimStatuses") or []}
        out: list[tuple[str, str]] = []
        changed = False
        for pc in (pod.get("spec") or {}).get("resourceClaims") or []:
            if pc.get("resourceClaimName"):
                out.append((pc["name"], pc["resourceClaimName"]))
                continue
            if statuses.get(pc["name"]):
                out.append((pc["name"], statuses[pc["name"]]))
                continue
            tpl = self.api.get_object("resourceclaimtemplates", pc["resourceClaimTemplateName"], ns, GROUP)
            body = {"apiVersion": f"{GROUP}/v1", "kind": "ResourceClaim",
                    "metadata": {"generateName": f"{meta['name']}-{pc['name']}-", "namespace": ns,
                                 "annotations": {CLAIM_ANNOTATION: pc["name"]}, "finalizers": [FINALIZER],
                                 "ownerReferences": [{"apiVersion": "v1", "controller": True, "kind": "Pod",
                                                      "name": meta["name"], "uid": meta["uid"]}]},
                    "spec": (tpl.get("spec") or {}).get("spec") or {}}
            made = self.api.store.create(self.api.kind("resourceclaims", GROUP), ns, body)
            statuses[pc["name"]] = made["metadata"]["name"]
            out.append((pc["name"], made["metadata"]["name"]))
            changed = True
        out += self._extended(pod, ns)
        if changed:
            st = [{"name": k, "resourceClaimName": v} for k, v in statuses.items()]
            self.api.store.update(self.api.kind("pods"), ns, meta["name"],
                                  lambda o: dict(o, status=dict(o.get("status") or {}, resourceClaimStatuses=st)),
                                  "status")
        return out

    def _extended(self, pod: dict[str, Any], ns: str) -> list[tuple[str, str]]:
        """``nvidia.com/gpu: N`` served by a DeviceClass with that extendedResourceName (DRAExtendedResource)."""
        classes = {c["spec"]["extendedResourceName"]: c["metadata"]["name"]
                   for c in self.api.objects("deviceclasses", GROUP) if (c.get("spec") or {}).get(
                       "extendedResourceName")}
        if not classes:
            return []
        existing = (pod.get("status") or {}).get("extendedResourceClaimStatus")
        if existing:
            return [("", existing["resourceClaimName"])]
        requests, mappings = [], []
        for i, ctr in enumerate((pod.get("spec") or {}).get("containers") or []):
            for res, qty in ((ctr.get("resources") or {}).get("limits") or {}).items():
                if res in classes:
                    rname = f"container-{i}-request-0"
                    requests.append({"exactly": {"allocationMode": "ExactCount", "count": int(_q(qty)),
                                                 "deviceClassName": classes[res]}, "name": rname})
                    mappings.append({"containerName": ctr["name"], "requestName": rname, "resourceName": res})
        if not requests:
            return []
        meta = pod["metadata"]
        body = {"apiVersion": f"{GROUP}/v1", "kind": "ResourceClaim",
                "metadata": {"generateName": f"{meta['name']}-extended-resources-", "namespace": ns,
                             "annotations": {EXTENDED_ANNOTATION: "true"}, "finalizers": [FINALIZER],
                             "ownerReferences": [{"apiVersion": "v1", "controller": True, "kind": "Pod",
                                                  "name": meta["name"], "uid": meta["uid"]}]},
                "spec": {"devices": {"requests": requests}}}
        made = self.api.store.create(self.api.kind("resourceclaims", GROUP), ns, body)
        st = {"resourceClaimName": made["metadata"]["name"], "requestMappings": mappings}
        self.api.store.update(self.api.kind("pods"), ns, meta["name"],
                              lambda o: dict(o, status=dict(o.get("status") or {}, extendedResourceClaimStatus=st)),
                              "status")
        return [("", made["metadata"]["name"])]

    def schedule(self, allocator: Allocator, pod: dict[str, Any]) -> bool:
        """Allocate and reserve every claim of ``pod``; False (claims untouched beyond those done) when one fails."""
        ns = pod["metadata"].get("namespace", "default")
        pod = self.api.get_object("pods", pod["metadata"]["name"], ns)
        claims = self.claims_for(pod)
        return all(allocator.allocate(ns, cname, pod=pod) for _, cname in claims)

    def pod_gone(self, allocator: Allocator, pod: dict[str, Any]) -> None:
        """After the pod is gone: release its claims; delete those it owned (generated ones)."""
        ns = pod["metadata"].get("namespace", "default")
        for c in self.api.objects("resourceclaims", GROUP, ns):
            if any(r.get("uid") == pod["metadata"]["uid"] for r in (c.get("status") or {}).get("reservedFor") or []):
                allocator.release(ns, c["metadata"]["name"], pod["metadata"]["uid"])
            owners = c["metadata"].get("ownerReferences") or []
            if any(o.get("uid") == pod["metadata"]["uid"] for o in owners):
                with contextlib.suppress(ApiStatusError):
                    self.api.store.delete(self.api.kind("resourceclaims", GROUP), ns, c["metadata"]["name"])
