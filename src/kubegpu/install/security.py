"""Least privilege, line by line: each role's RBAC and the ValidatingAdmissionPolicies that narrow it.

RBAC cannot say "only your own node": a ``patch nodes`` grant reaches every Node. So each role gets
exactly the verbs its code calls (:data:`ROLE_RULES`, checked against the code by
``tests/install/test_install_rbac.py``), and two ValidatingAdmissionPolicies (Kubernetes 1.30+) narrow
the writes further:

- ``kubegpu-node-restriction``: the node daemon's service account may change only the Node it runs on
  (labels under NVIDIA's and kubegpu's prefixes, ``kubegpu.io/`` annotations, and status), the Device
  object named after that node, and the ``kubegpu.io/device-assigned`` annotation of pods bound to that
  node. "The node it runs on" comes from the service-account token: a token bound to a pod carries the pod's node in the
  ``authentication.kubernetes.io/node-name`` extra (Kubernetes 1.30+, on by default from 1.32, feature
  ``ServiceAccountTokenPodNodeInfo``); a token without it is refused (fail closed).
- ``kubegpu-record-writers``: only the extender may write ``kubegpu.io/device-allocated`` (through the
  Binding) and only the node daemon ``kubegpu.io/device-assigned``; anyone else's create or update that
  sets or changes them is refused. The webhook refuses the same, but a cluster may run it with
  ``failurePolicy: Ignore``; the policy holds while the webhook is down.
- ``kubegpu-share-placement`` (full mode): a pod asking a GPU share is created only for kubegpu's scheduler to
  place (no ``spec.nodeName``, ``spec.schedulerName`` kubegpu's): a node serves a share only as the record
  that scheduler writes at bind. The webhook refuses the same and sets the scheduler name when it is left
  out; with the webhook down (``failurePolicy: Ignore``) the policy refuses what it would have steered.
"""

from __future__ import annotations

from typing import Any, Final

from kubegpu.model import resources as R

Obj = dict[str, Any]

NODE_NAME_EXTRA: Final = "authentication.kubernetes.io/node-name"
# The service accounts that write kubegpu's records (the node's is renamed by fullnameOverride); the webhook's
# default record writers are these (webhook/app.py).
EXTENDER_SA: Final = "kubegpu-scheduler-extender"
NODE_SA: Final = "kubegpu-node"
DEVICE_ALLOCATED: Final = "kubegpu.io/device-allocated"
DEVICE_ASSIGNED: Final = "kubegpu.io/device-assigned"
# Their HMACs (model/signing.py), written with them by the same writer.
ALLOCATED_KEYS: Final = (DEVICE_ALLOCATED, "kubegpu.io/device-allocated-signature")
ASSIGNED_KEYS: Final = (DEVICE_ASSIGNED, "kubegpu.io/device-assigned-signature")
# What a container asks when it asks a GPU share, as the API server has it after the webhook (which translates
# the other forms to these).
SHARE_KEYS: Final = (R.GPU_SLOTS, *R.DEVICE_RESOURCES)
# Label prefixes the node daemon publishes (GPU feature discovery's keys, kubegpu's, the legacy model label).
NODE_LABEL_PREFIXES: Final = ("nvidia.com/", "kubegpu.io/", "alpha.kubernetes.io/nvidia-gpu")

# role -> [(apiGroup, resource, verbs, why)]: every verb a role's code calls, and nothing else.
ROLE_RULES: Final[dict[str, list[tuple[str, str, tuple[str, ...], str]]]] = {
    "node": [
        ("", "nodes", ("get", "patch"), "read its Node, publish the GPU labels (node.publish.kube)"),
        ("", "nodes/status", ("patch",), "publish the share capacity (capacity.py)"),
        ("", "pods", ("list", "watch", "patch"),
         "watch the pods bound to its node, acknowledge the record (handoff)"),
        ("", "events", ("create",), "report a handoff mismatch on the pod (handoff)"),
        ("kubegpu.io", "devices", ("get", "create", "update"), "publish its Device object (node.publish.kube)"),
    ],
    "extender": [
        ("", "pods", ("get", "list", "watch"), "pod informer; bind re-reads the pod (scheduler/app.py)"),
        ("", "pods/binding", ("create",), "the Binding that carries the allocation record"),
        ("", "nodes", ("list", "watch"), "node informer"),
        ("kubegpu.io", "devices", ("list", "watch"), "Device informer"),
    ],
}


def rbac_rules(role: str) -> list[Obj]:
    """The ClusterRole rules of ``role`` (one rule per resource, verbs as listed)."""
    return [{"apiGroups": [group], "resources": [resource], "verbs": list(verbs)}
            for group, resource, verbs, _why in ROLE_RULES[role]]


def _sa(namespace: str, name: str) -> str:
    return f"system:serviceaccount:{namespace}:{name}"


def _vap(name: str, labels: dict[str, str], spec: Obj) -> list[Obj]:
    return [
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
         "metadata": {"name": name, "labels": labels}, "spec": spec},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
         "metadata": {"name": name, "labels": labels},
         "spec": {"policyName": name, "validationActions": ["Deny"]}},
    ]


def _annotations(var: str) -> str:
    return f"has({var}.metadata.annotations) ? {var}.metadata.annotations : {{}}"


def _labels(var: str) -> str:
    return f"has({var}.metadata.labels) ? {var}.metadata.labels : {{}}"


def _only_changed(new: str, old: str, allowed: str) -> str:
    """CEL: map ``new`` differs from map ``old`` only in keys for which ``allowed`` (on ``k``) holds."""
    return (f"{new}.all(k, ({allowed}) || (k in {old} && {old}[k] == {new}[k])) && "
            f"{old}.all(k, ({allowed}) || k in {new})")


def node_restriction_policy(namespace: str, labels: dict[str, str], node_sa: str = NODE_SA) -> list[Obj]:
    user = _sa(namespace, node_sa)
    label_ok = " || ".join(f"k.startsWith('{p}')" for p in NODE_LABEL_PREFIXES)
    spec: Obj = {
        "failurePolicy": "Fail",
        "matchConstraints": {"resourceRules": [
            {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE", "DELETE"],
             "resources": ["nodes", "nodes/status", "pods"]},
            {"apiGroups": ["kubegpu.io"], "apiVersions": ["*"], "operations": ["CREATE", "UPDATE", "DELETE"],
             "resources": ["devices"]},
        ]},
        "matchConditions": [{"name": "kubegpu-node-only", "expression": f"request.userInfo.username == '{user}'"}],
        "variables": [
            {"name": "nodeName", "expression":
                f"has(request.userInfo.extra) && '{NODE_NAME_EXTRA}' in request.userInfo.extra && "
                f"size(request.userInfo.extra['{NODE_NAME_EXTRA}']) == 1 ? "
                f"request.userInfo.extra['{NODE_NAME_EXTRA}'][0] : ''"},
            {"name": "target", "expression": "request.operation == 'DELETE' ? oldObject : object"},
        ],
        "validations": [
            {"expression": "variables.nodeName != ''",
             "message": f"the kubegpu-node token carries no node name ({NODE_NAME_EXTRA}): "
                        "Kubernetes 1.30+ with ServiceAccountTokenPodNodeInfo is required",
             "reason": "Forbidden"},
            {"expression": "request.resource.resource != 'nodes' || "
                           "(request.operation == 'UPDATE' && variables.target.metadata.name == variables.nodeName)",
             "messageExpression": "'kubegpu-node on ' + variables.nodeName + ' may update only its own Node'",
             "reason": "Forbidden"},
            {"expression": "request.resource.resource != 'nodes' || "
                           "(has(request.subResource) && request.subResource == 'status') || ("
                           "(has(object.spec) ? object.spec : {}) == (has(oldObject.spec) ? oldObject.spec : {}) && "
                           + _only_changed(f"({_annotations('object')})", f"({_annotations('oldObject')})",
                                           "k.startsWith('kubegpu.io/')")
                           + " && "
                           + _only_changed(f"({_labels('object')})", f"({_labels('oldObject')})", label_ok) + ")",
             "message": "kubegpu-node may change only its Node's labels under "
                        + ", ".join(NODE_LABEL_PREFIXES) + ", its kubegpu.io/ annotations and its status",
             "reason": "Forbidden"},
            {"expression": "request.resource.resource != 'devices' || "
                           "variables.target.metadata.name == variables.nodeName",
             "messageExpression": "'kubegpu-node on ' + variables.nodeName + ' may write only the Device object '"
                                  " + variables.nodeName",
             "reason": "Forbidden"},
            {"expression": "request.resource.resource != 'pods' || (request.operation == 'UPDATE' && "
                           "has(oldObject.spec.nodeName) && oldObject.spec.nodeName == variables.nodeName && "
                           "object.spec == oldObject.spec && "
                           + _only_changed(f"({_annotations('object')})", f"({_annotations('oldObject')})",
                                           " || ".join(f"k == '{k}'" for k in ASSIGNED_KEYS)) + ")",
             "messageExpression": "'kubegpu-node on ' + variables.nodeName + ' may change only the "
                                  f"{DEVICE_ASSIGNED} annotation (and its signature) of pods bound to its node'",
             "reason": "Forbidden"},
        ],
    }
    return _vap("kubegpu-node-restriction", labels, spec)


def record_writers_policy(namespace: str, labels: dict[str, str], node_sa: str = NODE_SA) -> list[Obj]:
    extender, node = _sa(namespace, EXTENDER_SA), _sa(namespace, node_sa)

    def unchanged(key: str) -> str:
        new = f"({_annotations('object')})"
        old = f"(request.operation == 'CREATE' ? {{}} : ({_annotations('oldObject')}))"
        return (f"(!('{key}' in {new}) && !('{key}' in {old})) || "
                f"('{key}' in {new} && '{key}' in {old} && {new}['{key}'] == {old}['{key}'])")

    spec: Obj = {
        "failurePolicy": "Fail",
        "matchConstraints": {"resourceRules": [
            {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
             "resources": ["pods", "pods/binding"]},
        ]},
        # Only requests where a record is present before or after are evaluated at all.
        "matchConditions": [
            {"name": "carries-a-record", "expression":
                f"[{_annotations('object')}, request.operation == 'CREATE' ? {{}} : ({_annotations('oldObject')})]"
                ".exists(a, " + " || ".join(f"'{k}' in a" for k in (*ALLOCATED_KEYS, *ASSIGNED_KEYS)) + ")"},
        ],
        "validations": [
            *({"expression": f"request.userInfo.username == '{extender}' || {unchanged(k)}",
               "message": f"only kubegpu's scheduler extender may write the {k} annotation",
               "reason": "Forbidden"} for k in ALLOCATED_KEYS),
            *({"expression": f"request.userInfo.username == '{node}' || {unchanged(k)}",
               "message": f"only kubegpu's node daemon may write the {k} annotation",
               "reason": "Forbidden"} for k in ASSIGNED_KEYS),
        ],
    }
    return _vap("kubegpu-record-writers", labels, spec)


def share_placement_policy(labels: dict[str, str], scheduler: str) -> list[Obj]:
    keys = "[" + ", ".join(f"'{k}'" for k in SHARE_KEYS) + "]"

    def asks(field: str) -> str:
        return (f"(has(object.spec.{field}) ? object.spec.{field} : []).exists(c, has(c.resources) && ("
                f"(has(c.resources.limits) && {keys}.exists(k, k in c.resources.limits)) || "
                f"(has(c.resources.requests) && {keys}.exists(k, k in c.resources.requests))))")

    why = f"GPU shares are served only to pods {scheduler} places (a node serves a share only as the record it " \
          "writes at bind)"
    spec: Obj = {
        "failurePolicy": "Fail",
        "matchConstraints": {"resourceRules": [
            {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]},
        ]},
        "matchConditions": [{"name": "asks-a-gpu-share", "expression": f"{asks('containers')} || "
                                                                       f"{asks('initContainers')}"}],
        "validations": [
            {"expression": "!has(object.spec.nodeName) || object.spec.nodeName == ''",
             "message": f"{why}: leave spec.nodeName out and pin the pod with a nodeSelector or node affinity",
             "reason": "Forbidden"},
            {"expression": f"has(object.spec.schedulerName) && object.spec.schedulerName == '{scheduler}'",
             "message": f"{why}: spec.schedulerName must be {scheduler} (kubegpu's webhook sets it when it is "
                        "left out, except in the namespaces it skips and while it is down)",
             "reason": "Forbidden"},
        ],
    }
    return _vap("kubegpu-share-placement", labels, spec)
