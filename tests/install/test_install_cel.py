"""Every CEL expression the install renders, evaluated the way the API server does.

In the API server a field an admission request omits (``subResource`` on a plain create, ``annotations``
on a pod without any, ``key`` on a toleration that matches every taint) is an *error* when read, and
``error || false`` is an error too; with ``failurePolicy: Fail`` that error refuses the request. cel-python
has the same semantics, so each expression is evaluated against requests that omit, one at a time, every
optional field of the request and of the object: an error must never come out, only a boolean (or, for a
``messageExpression``, a string).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import celpy
import pytest

from kubegpu.install.render import render
from kubegpu.install.values import Values, values_from_dict

Obj = dict[str, Any]

# Fields the API server always sets on what it hands to CEL; every other key may be absent.
REQUIRED_REQUEST = {"uid", "kind", "resource", "operation", "userInfo", "userInfo.username",
                    *(f"{k}.{f}" for k in ("kind", "requestKind") for f in ("group", "version", "kind")),
                    *(f"{r}.{f}" for r in ("resource", "requestResource") for f in ("group", "version", "resource"))}
REQUIRED_OBJECT = {"apiVersion", "kind", "metadata", "spec", "spec.containers", "spec.containers[].name",
                   "spec.initContainers[].name", "spec.ephemeralContainers[].name",
                   "spec.containers[].env[].name", "spec.initContainers[].env[].name",
                   "spec.containers[].volumeMounts[].name", "spec.containers[].volumeMounts[].mountPath",
                   "spec.initContainers[].volumeMounts[].name", "spec.initContainers[].volumeMounts[].mountPath",
                   "metadata.name"}
REQUIRED_CLUSTER_OBJECT = {"apiVersion", "kind", "metadata", "metadata.name"}


def _container(name: str) -> Obj:
    return {
        "name": name, "image": "cuda:12",
        "resources": {"limits": {"nvidia.com/gpu": "1"}, "requests": {"nvidia.com/gpu": "1"}},
        "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}],
        "volumeMounts": [{"name": "d", "mountPath": "/var/run/nvidia-container-devices/all"}],
    }


FULL_POD: Obj = {
    "apiVersion": "v1", "kind": "Pod",
    "metadata": {"name": "p", "namespace": "team-a", "uid": "u-1",
                 "labels": {"app": "x"},
                 "annotations": {"cdi.k8s.io/x": "y", "kubegpu.io/device-allocated": "{}",
                                 "kubegpu.io/device-assigned": "{}", "kubegpu.io/device-allocated-signature": "a",
                                 "kubegpu.io/device-assigned-signature": "b",
                                 "scheduler.alpha.kubernetes.io/affinity": "{}"}},
    "spec": {"nodeName": "node-a", "schedulerName": "default-scheduler", "serviceAccountName": "default",
             "containers": [_container("main")], "initContainers": [_container("init")],
             "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
    "status": {"phase": "Pending"},
}
FULL_NODE: Obj = {
    "apiVersion": "v1", "kind": "Node",
    "metadata": {"name": "node-a", "uid": "n-1", "labels": {"nvidia.com/gpu.present": "true"},
                 "annotations": {"a": "b"}},
    "spec": {"taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}], "unschedulable": False},
    "status": {"capacity": {"kubegpu.io/gpu-core": "100"}, "allocatable": {"kubegpu.io/gpu-core": "100"}},
}
FULL_DEVICE: Obj = {
    "apiVersion": "kubegpu.io/v1alpha1", "kind": "Device",
    "metadata": {"name": "node-a", "uid": "d-1", "labels": {"a": "b"}},
    "spec": {"devices": [{"id": "GPU-1", "minor": 0, "type": "gpu"}]},
}
OBJECTS: dict[str, tuple[Obj, set[str]]] = {
    "pods": (FULL_POD, REQUIRED_OBJECT),
    "nodes": (FULL_NODE, REQUIRED_CLUSTER_OBJECT),
    "devices": (FULL_DEVICE, REQUIRED_CLUSTER_OBJECT),
}


def _request(resource: str, sub: str, operation: str, obj: Obj | None, old: Obj | None) -> Obj:
    group = "kubegpu.io" if resource == "devices" else ""
    gvr = {"group": group, "version": "v1alpha1" if group else "v1", "resource": resource}
    gvk = {"group": group, "version": gvr["version"], "kind": OBJECTS[resource][0]["kind"]}
    req: Obj = {
        "uid": "r-1", "kind": gvk, "resource": gvr, "subResource": sub,
        "requestKind": gvk, "requestResource": gvr, "requestSubResource": sub,
        "name": "node-a" if resource in ("nodes", "devices") else "p",
        "namespace": "" if resource in ("nodes", "devices") else "team-a",
        "operation": operation,
        "userInfo": {"username": "system:serviceaccount:kubegpu-system:kubegpu-node", "uid": "sa-1",
                     "groups": ["system:serviceaccounts"],
                     "extra": {"authentication.kubernetes.io/node-name": ["node-a"],
                               "authentication.kubernetes.io/pod-name": ["kubegpu-node-x"]}},
        "dryRun": False, "options": {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1"},
    }
    if obj is not None:
        req["object"] = obj
    if old is not None:
        req["oldObject"] = old
    return req


def _objects(obj: Obj | None, old: Obj | None) -> Obj:
    out: Obj = {}
    if obj is not None:
        out["object"] = obj
    if old is not None:
        out["oldObject"] = old
    return out


def _paths(value: Any, prefix: str = "") -> Iterator[tuple[str, list[Any]]]:
    """Every key path in ``value`` (list items written ``[]``), with the keys leading to it."""
    if isinstance(value, dict):
        for k, v in value.items():
            path = f"{prefix}.{k}" if prefix else k
            yield path, [k]
            for sub, keys in _paths(v, path):
                yield sub, [k, *keys]
    elif isinstance(value, list):
        for i, v in enumerate(value):
            for sub, keys in _paths(v, f"{prefix}[]"):
                yield sub, [i, *keys]


def _without(value: Obj, keys: list[Any]) -> Obj:
    out = copy.deepcopy(value)
    cur: Any = out
    for k in keys[:-1]:
        cur = cur[k]
    del cur[keys[-1]]
    return out


def _optional(path: str, required: set[str]) -> bool:
    return path not in required


def _omissions(value: Obj, required: set[str]) -> Iterator[tuple[str, Obj]]:
    """``value`` itself, then ``value`` without each optional key in turn, then with every optional key gone."""
    yield "(nothing)", value
    for path, keys in _paths(value):
        if _optional(path, required):
            yield path, _without(value, keys)
    yield "(every optional field)", _minimal(value, required)


def _minimal(value: Any, required: set[str], prefix: str = "") -> Any:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            path = f"{prefix}.{k}" if prefix else k
            if not _optional(path, required):
                out[k] = _minimal(v, required, path)
        return out
    if isinstance(value, list):
        return [_minimal(v, required, f"{prefix}[]") for v in value]
    return value


def _rule_targets(rules: list[Obj]) -> Iterator[tuple[str, str, str]]:
    for rule in rules:
        for res in rule.get("resources", []):
            resource, _, sub = res.partition("/")
            for op in rule.get("operations", []):
                for o in ([op] if op != "*" else ["CREATE", "UPDATE", "DELETE"]):
                    yield resource, sub, o


def _expressions(objs: list[Obj]) -> Iterator[tuple[str, list[tuple[str, str, str]], list[tuple[str, str]],
                                                   list[tuple[str, str, str]]]]:
    """(where, variables, expressions (where, text, expected type), targets) for every CEL user in ``objs``."""
    for o in objs:
        kind, name = o["kind"], o["metadata"]["name"]
        if kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
            for hook in o["webhooks"]:
                exprs = [(f"{kind}/{hook['name']}/{c['name']}", c["expression"], "bool")
                         for c in hook.get("matchConditions", [])]
                if exprs:
                    yield f"{kind}/{name}", [], exprs, list(_rule_targets(hook["rules"]))
        elif kind == "ValidatingAdmissionPolicy":
            spec = o["spec"]
            variables = [(v["name"], v["expression"], "any") for v in spec.get("variables", [])]
            exprs = [(f"{name}/match/{c['name']}", c["expression"], "bool") for c in spec.get("matchConditions", [])]
            for i, val in enumerate(spec.get("validations", [])):
                exprs.append((f"{name}/validation[{i}]", val["expression"], "bool"))
                if "messageExpression" in val:
                    exprs.append((f"{name}/validation[{i}]/message", val["messageExpression"], "string"))
            for a in spec.get("auditAnnotations", []):
                exprs.append((f"{name}/audit/{a['key']}", a["valueExpression"], "any"))
            yield f"{kind}/{name}", variables, exprs, list(
                _rule_targets(spec["matchConstraints"]["resourceRules"]))


def _cases(objs: list[Obj]) -> list[tuple[str, list[tuple[str, str, str]], list[tuple[str, str, str]],
                                          tuple[str, str, str]]]:
    return [(where, variables, exprs, target) for where, variables, exprs, targets in _expressions(objs)
            for target in targets]


RENDERS: dict[str, Values] = {
    "default": Values(),
    "kube-1.28": values_from_dict({"kubeVersion": "1.28"}),  # matchConditions, no policies
    "kube-1.30": values_from_dict({"kubeVersion": "1.30"}),  # the first release with both
    "node-only-renamed": values_from_dict({"mode": "node-only", "fullnameOverride": "gpu-plugin"}),
}
ENV = celpy.Environment()
PROGRAMS: dict[str, Any] = {}


def _evaluate(text: str, activation: dict[str, Any]) -> Any:
    if text not in PROGRAMS:
        PROGRAMS[text] = ENV.program(ENV.compile(text))
    return PROGRAMS[text].evaluate(activation)


def _check(where: str, variables: list[tuple[str, str, str]], exprs: list[tuple[str, str, str]],
           request: Obj, omitted: str) -> None:
    activation: dict[str, Any] = {
        "request": celpy.json_to_cel({k: v for k, v in request.items() if k not in ("object", "oldObject")}),
        "object": celpy.json_to_cel(request.get("object")),
        "oldObject": celpy.json_to_cel(request.get("oldObject")),
        "params": None,
    }
    bound: dict[str, Any] = {}
    for name, text, _ in variables:
        try:
            bound[name] = _evaluate(text, {**activation, "variables": celpy.celtypes.MapType(bound)})
        except celpy.CELEvalError as exc:
            pytest.fail(f"{where}: variable {name} errors when the request omits {omitted}: {exc}")
        if isinstance(bound[name], celpy.CELEvalError):
            pytest.fail(f"{where}: variable {name} errors when the request omits {omitted}: {bound[name]}")
    activation["variables"] = celpy.celtypes.MapType(bound)
    for label, text, expected in exprs:
        try:
            result = _evaluate(text, activation)
        except celpy.CELEvalError as exc:
            pytest.fail(f"{label}: errors when the request omits {omitted}: {exc}")
        assert not isinstance(result, celpy.CELEvalError), f"{label}: {result} when the request omits {omitted}"
        if expected == "bool":
            assert isinstance(result, bool | celpy.celtypes.BoolType), f"{label}: {result!r} is not a bool"
        elif expected == "string":
            assert isinstance(result, str), f"{label}: {result!r} is not a string"


def _unique_cases() -> list[tuple[str, list[tuple[str, str, str]], list[tuple[str, str, str]],
                                  tuple[str, str, str]]]:
    """Every (expressions, target) the renders produce, once: renders that differ only in names share CEL."""
    seen: set[tuple[object, ...]] = set()
    out = []
    for name in sorted(RENDERS):
        cases = _cases(render(RENDERS[name]))
        assert cases, f"{name}: no CEL expression rendered"
        for where, variables, exprs, target in cases:
            key = (tuple(v[1] for v in variables), tuple(e[1] for e in exprs), target)
            if key not in seen:
                seen.add(key)
                out.append((f"{name}: {where}", variables, exprs, target))
    return out


CASES = _unique_cases()


def test_every_render_has_cel_to_check() -> None:
    assert len(CASES) >= 10  # two webhooks' targets, the two policies' resources and operations


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0].split(': ')[1].split('/')[-1]}-{'/'.join(c[3])}" for c in CASES])
def test_every_rendered_cel_expression_survives_every_omitted_optional_field(case: tuple) -> None:
    checked = 0
    for where, variables, exprs, (resource, sub, operation) in [case]:
        full, required = OBJECTS[resource]
        if operation == "CREATE":
            pairs = [(o, None, f"object.{p}") for p, o in _omissions(full, required)]
        elif operation == "DELETE":
            pairs = [(None, o, f"oldObject.{p}") for p, o in _omissions(full, required)]
        else:
            pairs = [(o, full, f"object.{p}") for p, o in _omissions(full, required)]
            pairs += [(full, o, f"oldObject.{p}") for p, o in _omissions(full, required)]
        # Each object omission with a full and with a minimal request; each request omission with the
        # full object and with the minimal one (an error hides behind `|| true` on a full object).
        full_request = _request(resource, sub, operation, None, None)
        minimal_request = _minimal(full_request, REQUIRED_REQUEST)
        for i, (obj, old, omitted) in enumerate(pairs):
            # The minimal request with every object omission (an error hides behind `|| true` less there);
            # the full request with the full and the minimal object.
            requests = [minimal_request, full_request] if i in (0, len(pairs) - 1) else [minimal_request]
            for req in requests:
                _check(where, variables, exprs, {**req, **_objects(obj, old)}, omitted)
                checked += 1
        for obj, old, _ in (pairs[0], pairs[-1]):
            for path, req in _omissions(full_request, REQUIRED_REQUEST):
                _check(where, variables, exprs, {**req, **_objects(obj, old)}, f"request.{path}")
                checked += 1
    assert checked > 40


def test_the_v1_36_refusal_is_caught() -> None:
    """The expression recorded refusing every plain pod on v1.36 fails this check (the check can fail)."""
    unguarded = "request.subResource == 'ephemeralcontainers' || object.spec.containers.exists(c, c.name == 'x')"
    request = _request("pods", "", "CREATE", FULL_POD, None)
    del request["subResource"]
    with pytest.raises(pytest.fail.Exception, match="subResource"):
        _check("unguarded", [], [("unguarded", unguarded, "bool")], request, "request.subResource")


# --- what the webhook configurations send -------------------------------------------------------------------
# The API server sends a request when a rule matches and every matchCondition is true (they are ANDed). The
# conditions must never hide a request the webhook would act on (patch or refuse), and should keep away the
# requests it only waves through (plain pods, status updates that leave kubegpu's records alone).

def _plain_pod(**spec: Any) -> Obj:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "team-a"},
            "spec": {"containers": [{"name": "app", "image": "busybox"}], **spec}}


def _gpu_pod(records: dict[str, str]) -> Obj:
    pod = _plain_pod(nodeName="node-a", containers=[_container("main")])
    pod["metadata"]["annotations"] = dict(records)
    return pod


ALICE = "alice"
NODE_SA = "system:serviceaccount:kubegpu-system:kubegpu-node"
RECORDS = {"kubegpu.io/device-allocated": '{"main":["GPU-1"]}', "kubegpu.io/device-assigned": "true"}


def _admission(resource: str, sub: str, operation: str, user: str, obj: Obj, old: Obj | None) -> Obj:
    req = _request("pods", sub, operation, obj, old)
    req["subResource"] = req["requestSubResource"] = sub
    if not sub:  # the API server omits them on the main resource
        del req["subResource"], req["requestSubResource"]
    req["userInfo"] = {"username": user, "groups": ["system:authenticated"]}
    return req


def _sent(objs: list[Obj], kind: str, req: Obj) -> bool:
    (conf,) = [o for o in objs if o["kind"] == kind]
    (hook,) = conf["webhooks"]
    target = ("pods", req.get("subResource", ""), req["operation"])
    if target not in set(_rule_targets(hook["rules"])):
        return False
    activation = {"request": celpy.json_to_cel({k: v for k, v in req.items() if k not in ("object", "oldObject")}),
                  "object": celpy.json_to_cel(req.get("object")), "oldObject": celpy.json_to_cel(req.get("oldObject"))}
    results = [_evaluate(c["expression"], activation) for c in hook.get("matchConditions", [])]
    assert not [r for r in results if isinstance(r, celpy.CELEvalError)], results
    return all(bool(r) for r in results)


def _verdict(req: Obj, *, mutate: bool) -> str:
    from kubegpu.webhook.app import WebhookSettings, decide

    body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": req}).encode()
    return decide(body, WebhookSettings(own_namespace="kubegpu-system", scheduler_name="kubegpu-scheduler"),
                  mutate=mutate).verdict


# (name, request, sent to the mutating webhook, sent to the validating one)
SCOPE_CASES: list[tuple[str, Obj, bool, bool]] = [
    ("plain pod", _admission("pods", "", "CREATE", ALICE, _plain_pod(), None), False, False),
    ("plain pod created onto a node", _admission("pods", "", "CREATE", ALICE, _plain_pod(nodeName="node-a"), None),
     True, True),
    ("plain pod with a forged record",
     _admission("pods", "", "CREATE", ALICE,
                {**_plain_pod(), "metadata": {"name": "p", "annotations": {"kubegpu.io/device-allocated": "{}"}}},
                None), False, True),
    ("update setting a record", _admission("pods", "", "UPDATE", ALICE, _gpu_pod(RECORDS), _gpu_pod({})),
     False, True),
    ("update changing a record",
     _admission("pods", "", "UPDATE", ALICE, _gpu_pod({**RECORDS, "kubegpu.io/device-assigned": "false"}),
                _gpu_pod(RECORDS)), False, True),
    ("status update removing a record",
     _admission("pods", "status", "UPDATE", ALICE, _gpu_pod({"kubegpu.io/device-assigned": "true"}),
                _gpu_pod(RECORDS)), False, True),
    ("status update leaving the records", _admission("pods", "status", "UPDATE", "system:node:node-a",
                                                     _gpu_pod(RECORDS), _gpu_pod(RECORDS)), False, False),
    ("status update of a plain pod on a node",
     _admission("pods", "status", "UPDATE", "system:node:node-a", _plain_pod(nodeName="node-a"),
                _plain_pod(nodeName="node-a")), False, False),
    ("label update of a GPU pod", _admission("pods", "", "UPDATE", ALICE, _gpu_pod(RECORDS), _gpu_pod(RECORDS)),
     False, False),
    ("the node daemon acknowledging",
     _admission("pods", "", "UPDATE", NODE_SA, _gpu_pod(RECORDS),
                _gpu_pod({"kubegpu.io/device-allocated": RECORDS["kubegpu.io/device-allocated"]})), False, True),
]


@pytest.mark.parametrize("release", ["default", "kube-1.28"])
@pytest.mark.parametrize("case", SCOPE_CASES, ids=[c[0] for c in SCOPE_CASES])
def test_match_conditions_send_what_the_webhook_acts_on(case: tuple[str, Obj, bool, bool], release: str) -> None:
    name, req, to_mutating, to_validating = case
    objs = render(RENDERS[release])
    if name == "the node daemon acknowledging" and any(o["kind"] == "ValidatingAdmissionPolicy" for o in objs):
        to_validating = False  # the admission policy governs kubegpu's own writes: a webhook outage never blocks them
    assert _sent(objs, "MutatingWebhookConfiguration", req) == to_mutating, name
    assert _sent(objs, "ValidatingWebhookConfiguration", req) == to_validating, name
    # Nothing the webhook would patch is kept from the mutating one, nothing it refuses from the validating one
    # (which has the last word; the mutating one need not see a refusal too).
    if _verdict(req, mutate=True) == "patched":
        assert to_mutating, name
    if _verdict(req, mutate=False) == "denied":
        assert to_validating, name


def test_the_scope_cases_exercise_refusals_and_patches() -> None:
    """The property above could hold vacuously: the webhook does refuse and patch some of these requests."""
    verdicts = {c[0]: (_verdict(c[1], mutate=True), _verdict(c[1], mutate=False)) for c in SCOPE_CASES}
    assert verdicts["plain pod created onto a node"][0] == "patched"
    assert verdicts["plain pod with a forged record"][1] == "denied"
    assert verdicts["status update removing a record"][1] == "denied"
    assert verdicts["the node daemon acknowledging"][1] == "allowed"
    assert verdicts["plain pod"] == ("allowed", "allowed")


def test_updates_are_reviewed_only_where_match_conditions_narrow_them() -> None:
    def update_targets(v: Values) -> set[tuple[str, str, str]]:
        (conf,) = [o for o in render(v) if o["kind"] == "ValidatingWebhookConfiguration"]
        return {t for t in _rule_targets(conf["webhooks"][0]["rules"]) if t[2] == "UPDATE"}

    assert update_targets(Values()) == {("pods", "", "UPDATE"), ("pods", "status", "UPDATE"),
                                        ("pods", "ephemeralcontainers", "UPDATE")}
    assert update_targets(values_from_dict({"kubeVersion": "1.27"})) == {("pods", "ephemeralcontainers", "UPDATE")}
    assert ("pods", "status", "UPDATE") in update_targets(
        values_from_dict({"kubeVersion": "1.27", "webhook": {"reviewUpdates": True}}))
    assert update_targets(values_from_dict({"webhook": {"reviewUpdates": False}})) == {
        ("pods", "ephemeralcontainers", "UPDATE")}
    # The operator is told which case they are in.
    from kubegpu.install.render import notes

    assert any("reviewUpdates: false" in n for n in notes(values_from_dict({"kubeVersion": "1.27"})))
    assert any("every pod update and status update" in n for n in notes(
        values_from_dict({"kubeVersion": "1.27", "webhook": {"reviewUpdates": True}})))
    assert not any("reviewUpdates" in n for n in notes(Values()))
