"""The objects ``kubegpu manifests --dra`` adds: DeviceClasses, the DRA node DaemonSet, its RBAC and
the admission policy that keeps each node's driver to its own node's ResourceSlices.

- **DeviceClasses** (``resource.k8s.io/v1``): ``gpu.kubegpu.io`` (whole GPUs), ``mig.kubegpu.io``
  (any MIG device) and one per MIG profile (``mig-1g.10gb.kubegpu.io``, ...), ``shared-gpu.kubegpu.io``
  (consumable-capacity shares: ``capacity.requests: {compute: 30, memory: 8Gi}``, on the same GPUs
  that serve whole claims, see ``kubegpu.node.dra.slices``); with
  ``extended_resource`` also ``gpu-extended.kubegpu.io`` carrying ``extendedResourceName:
  nvidia.com/gpu``, so pods asking ``nvidia.com/gpu: 1`` are served by DRA (DRAExtendedResource).
- **DaemonSet** ``kubegpu-dra-node`` running ``kubegpu node --kubelet-plugin dra`` with the
  kubelet's ``plugins`` and ``plugins_registry`` directories and ``/var/run/cdi`` mounted. It runs on
  nodes labelled ``kubegpu.io/kubelet-plugin=dra``; the device-plugin DaemonSet is kept off them,
  so a node's GPUs are served one way only (``all_nodes`` drops the device-plugin DaemonSet).
- **RBAC**: read ResourceClaims, read/write ResourceSlices; a ValidatingAdmissionPolicy limits
  writes to slices whose ``spec.nodeName`` is the node the service account's token was issued
  for (``ServiceAccountTokenPodNodeInfo``, on by default since 1.32), as upstream recommends.
"""

from __future__ import annotations

from typing import Any, Final

from kubegpu.install.render import node_probes, scrape_annotations
from kubegpu.install.values import Values, default_affinity, node_fullname
from kubegpu.node.dra.names import DRIVER, MODE_LABEL, TYPE_GPU, TYPE_MIG, TYPE_SHARED
from kubegpu.node.runtime_env import env_entries as node_runtime_env

Obj = dict[str, Any]
APP: Final = "kubegpu"
NAME: Final = f"{APP}-dra-node"
# MIG profiles of the current data-centre GPUs (A100 40/80 GB, H100/H200, A30).
MIG_PROFILES: Final = ("1g.5gb", "1g.10gb", "1g.12gb", "1g.18gb", "1g.20gb", "1g.23gb", "1g.24gb", "2g.10gb",
                       "2g.20gb", "2g.24gb", "2g.35gb", "2g.45gb", "3g.20gb", "3g.40gb", "3g.47gb", "3g.71gb",
                       "4g.20gb", "4g.24gb", "4g.40gb", "4g.47gb", "4g.71gb", "7g.40gb", "7g.80gb", "7g.141gb")


def _labels(v: Values) -> Obj:
    return {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": "dra-node",
            "app.kubernetes.io/version": v.image.tag, "app.kubernetes.io/managed-by": "kubegpu-manifests"}


def _type_is(t: str) -> str:
    return f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "{t}"'


def shared_selector() -> str:
    """Shares: a ``gpu`` device that takes several allocations (``device.allowMultipleAllocations``, in
    the DRA CEL environment since 1.34), or the ``shared-gpu`` devices drivers before on-demand sharing
    published, so a rolling upgrade keeps serving share claims on both."""
    a = f'device.attributes["{DRIVER}"].type'
    return (f'device.driver == "{DRIVER}" && ({a} == "{TYPE_SHARED}" || '
            f'({a} == "{TYPE_GPU}" && device.allowMultipleAllocations == true))')


def device_class(name: str, expression: str, v: Values, **spec: Any) -> Obj:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
            "metadata": {"name": name, "labels": _labels(v)},
            "spec": {"selectors": [{"cel": {"expression": expression}}], **spec}}


def device_classes(v: Values, *, extended_resource: bool = False) -> list[Obj]:
    out = [device_class(DRIVER, _type_is(TYPE_GPU), v),
           device_class(f"mig.{DRIVER.split('.', 1)[1]}", _type_is(TYPE_MIG), v),
           device_class(f"shared-gpu.{DRIVER.split('.', 1)[1]}", shared_selector(), v)]
    for p in MIG_PROFILES:
        out.append(device_class(f"mig-{p}.{DRIVER.split('.', 1)[1]}",
                                _type_is(TYPE_MIG) + f' && device.attributes["{DRIVER}"].profile == "{p}"', v))
    if extended_resource:
        out.append(device_class(f"gpu-extended.{DRIVER.split('.', 1)[1]}", _type_is(TYPE_GPU), v,
                                extendedResourceName="nvidia.com/gpu"))
    return out


def rbac(v: Values) -> list[Obj]:
    # Exactly what node/dra calls (tests/install/test_install_rbac.py scans it): the claim it prepares,
    # and its own node's slices (narrowed to them by the ValidatingAdmissionPolicy below).
    rules = [
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},  # its Node's UID: the slices' owner
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"],
         "verbs": ["list", "watch", "create", "update", "delete"]},
    ]
    meta = {"name": NAME, "labels": _labels(v)}
    sa = f"system:serviceaccount:{v.namespace}:{NAME}"
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": f"{NAME}-own-slices", "labels": _labels(v)},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{"apiGroups": ["resource.k8s.io"], "apiVersions": ["*"],
                                                    "operations": ["CREATE", "UPDATE", "DELETE"],
                                                    "resources": ["resourceslices"]}]},
            "matchConditions": [{"name": "is-kubegpu-dra-node", "expression": f'request.userInfo.username == "{sa}"'}],
            "variables": [
                {"name": "userNodeName",
                 "expression": "request.userInfo.extra[?'authentication.kubernetes.io/node-name'][0].orValue('')"},
                {"name": "objectNodeName",
                 "expression": '(request.operation == "DELETE" ? oldObject : object).spec.?nodeName.orValue("")'},
            ],
            "validations": [
                {"expression": 'variables.userNodeName != ""', "reason": "Forbidden",
                 "message": "no node association found for the kubegpu DRA driver's token "
                            "(it must run in a pod, with ServiceAccountTokenPodNodeInfo enabled)"},
                {"expression": "variables.userNodeName == variables.objectNodeName", "reason": "Forbidden",
                 "messageExpression": "'the kubegpu DRA driver on node ' + variables.userNodeName + "
                                      "' may not modify ' + (variables.objectNodeName == '' ? "
                                      "'cluster-wide ResourceSlices' : 'ResourceSlices of node ' + "
                                      "variables.objectNodeName)"},
            ],
        },
    }
    binding = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
               "metadata": {"name": f"{NAME}-own-slices", "labels": _labels(v)},
               "spec": {"policyName": f"{NAME}-own-slices", "validationActions": ["Deny"]}}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": dict(meta, namespace=v.namespace)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": meta, "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": meta,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": NAME},
         "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": v.namespace}]},
        policy, binding,
    ]


def _affinity(v: Values, operator: str) -> Obj:
    """The chart's GPU-node affinity with one more requirement on the mode label, in every term."""
    aff = v.affinity if v.affinity is not None else default_affinity()
    aff = {**aff}
    na = dict(aff.get("nodeAffinity") or {})
    req = dict(na.get("requiredDuringSchedulingIgnoredDuringExecution") or {"nodeSelectorTerms": [{}]})
    expr = {"key": MODE_LABEL, "operator": operator, **({"values": ["dra"]} if operator != "Exists" else {})}
    req["nodeSelectorTerms"] = [dict(t, matchExpressions=[*t.get("matchExpressions", []), expr])
                                for t in req.get("nodeSelectorTerms") or [{}]]
    na["requiredDuringSchedulingIgnoredDuringExecution"] = req
    aff["nodeAffinity"] = na
    return aff


def daemonset(v: Values, *, all_nodes: bool = False, shared_gpus: str = "all") -> Obj:
    kubelet = "/var/lib/kubelet"
    mounts = [
        {"name": "plugins", "mountPath": f"{kubelet}/plugins"},
        {"name": "plugins-registry", "mountPath": f"{kubelet}/plugins_registry"},
        {"name": "cdi-root", "mountPath": "/var/run/cdi"},
        {"name": "driver-root", "mountPath": "/driver-root", "readOnly": True},
    ]
    volumes = [
        {"name": "plugins", "hostPath": {"path": f"{kubelet}/plugins", "type": "DirectoryOrCreate"}},
        {"name": "plugins-registry", "hostPath": {"path": f"{kubelet}/plugins_registry", "type": "DirectoryOrCreate"}},
        {"name": "cdi-root", "hostPath": {"path": v.cdi_root, "type": "DirectoryOrCreate"}},
        {"name": "driver-root", "hostPath": {"path": v.nvidia_driver_root}},
    ]
    env = [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
           {"name": "KUBEGPU_KUBELET_PLUGIN", "value": "dra"},
           {"name": "NVIDIA_DRIVER_ROOT", "value": v.nvidia_driver_root}, *node_runtime_env()]
    container = {
        "name": "dra-node", "image": v.image.ref, "imagePullPolicy": v.image.pull_policy, "command": ["kubegpu"],
        "args": ["node", "--kubelet-plugin", "dra", "--dra-plugins-dir", f"{kubelet}/plugins",
                 "--dra-registry-dir", f"{kubelet}/plugins_registry", "--cdi-spec-dir", "/var/run/cdi",
                 "--dra-shared-gpus", shared_gpus, "--metrics-address", f":{v.metrics_port}"],
        "env": env, "volumeMounts": mounts, "resources": v.resources,
        # The same endpoint and probes as the device-plugin node: a hung driver is restarted, and a node
        # whose driver is not registered with the kubelet shows not ready.
        "ports": [{"name": "metrics", "containerPort": v.metrics_port}], **node_probes(),
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}},
    }
    spec: Obj = {
        "serviceAccountName": NAME, "priorityClassName": v.priority_class_name, "tolerations": v.tolerations,
        "affinity": (v.affinity if v.affinity is not None else default_affinity()) if all_nodes
        else _affinity(v, "In"),
        "containers": [container], "volumes": volumes,
    }
    if v.node_selector:
        spec["nodeSelector"] = v.node_selector
    if v.runtime_class_name:
        spec["runtimeClassName"] = v.runtime_class_name
    sel = {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": "dra-node"}
    return {"apiVersion": "apps/v1", "kind": "DaemonSet",
            "metadata": {"name": NAME, "namespace": v.namespace, "labels": _labels(v)},
            "spec": {"selector": {"matchLabels": sel}, "updateStrategy": {"type": "RollingUpdate"},
                     "template": {"metadata": {"labels": sel, "annotations": scrape_annotations(v.metrics_port)},
                                  "spec": spec}}}


def apply_dra(objs: list[Obj], v: Values, *, extended_resource: bool = False, all_nodes: bool = False,
              shared_gpus: str = "all") -> list[Obj]:
    """``objs`` (the rendered install) with the DRA objects added and the device-plugin DaemonSet kept
    off DRA nodes (or dropped, with ``all_nodes``), and the values' ResourceClaimTemplates."""
    from kubegpu.install.dra.claim_templates import claim_templates
    from kubegpu.node.dra.slices import DraSettings

    DraSettings.parse_shared(shared_gpus)  # refuse a bad value here, not in every node's log
    out: list[Obj] = []
    for o in objs:
        if all_nodes and o.get("kind") == "Service" and o["metadata"]["name"] == f"{node_fullname(v)}-metrics":
            continue  # it would select no pod
        if extended_resource and o.get("kind") == "ConfigMap" and "scheduler-config.yaml" in (o.get("data") or {}):
            o = _whole_gpus_past_the_extender(o)
        if o.get("kind") == "DaemonSet" and o["metadata"]["name"] == node_fullname(v):
            if all_nodes:
                continue
            o = {**o, "spec": {**o["spec"], "template": {**o["spec"]["template"], "spec": {
                **o["spec"]["template"]["spec"], "affinity": _affinity(v, "NotIn")}}}}
        out.append(o)
    return out + device_classes(v, extended_resource=extended_resource) + rbac(v) + [
        daemonset(v, all_nodes=all_nodes, shared_gpus=shared_gpus)] + claim_webhook(out) + \
        claim_templates(v, _labels(v))


def _whole_gpus_past_the_extender(cm: Obj) -> Obj:
    """With ``nvidia.com/gpu`` served by DRA too, kubegpu-scheduler must not send those pods to the
    extender: it fails every node without a kubegpu ``Device`` object, which is every DRA node
    (recorded: ``ext-pod-full-mode-pending.yaml``, Pending with ``no GPUs known``). Taken out of the
    extender's ``managedResources``, a pod asking only ``nvidia.com/gpu`` is placed by kube-scheduler
    itself: on DRA nodes through the DeviceClass's ``extendedResourceName`` (DRAExtendedResource), on
    device-plugin nodes by the node's ``nvidia.com/gpu`` count as the default scheduler does. Pods
    asking any other kubegpu resource still go through the extender."""
    import yaml

    cfg = yaml.safe_load(cm["data"]["scheduler-config.yaml"])
    for ext in cfg.get("extenders") or []:
        ext["managedResources"] = [r for r in ext.get("managedResources") or [] if r.get("name") != "nvidia.com/gpu"]
    return {**cm, "data": {**cm["data"], "scheduler-config.yaml": yaml.safe_dump(cfg, sort_keys=False)}}


def claim_webhook(objs: list[Obj]) -> list[Obj]:
    """With the webhook installed (full mode): have it check new ResourceClaims and templates too
    (``kubegpu.node.dra.claims``). ``failurePolicy: Ignore``: the check spares users a claim that
    could never be allocated, and a webhook outage must not stop DRA."""
    pods = next((o for o in objs if o.get("kind") == "ValidatingWebhookConfiguration"
                 and o["metadata"]["name"] == f"{APP}-webhook"), None)
    if pods is None:
        return []
    hook = pods["webhooks"][0]
    return [{
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
        "metadata": {**pods["metadata"], "name": f"{APP}-dra-claims"},
        "webhooks": [{
            "name": "dra-claims.kubegpu.io", "admissionReviewVersions": ["v1"], "sideEffects": "None",
            "clientConfig": hook["clientConfig"], "failurePolicy": "Ignore", "timeoutSeconds": 5,
            **({"namespaceSelector": hook["namespaceSelector"]} if "namespaceSelector" in hook else {}),
            "rules": [{"apiGroups": ["resource.k8s.io"], "apiVersions": ["v1"], "operations": ["CREATE"],
                       "resources": ["resourceclaims", "resourceclaimtemplates"], "scope": "Namespaced"}],
        }],
    }]
