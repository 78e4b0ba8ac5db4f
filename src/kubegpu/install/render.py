"""Every Kubernetes object kubegpu needs, rendered from one :class:`Values`.

Objects are built as plain dicts (no template language), so each role's
least-privilege RBAC sits next to the workload that needs it and the output
can be validated against the Kubernetes OpenAPI schemas offline.
"""

from __future__ import annotations

from importlib import resources as importlib_resources
from typing import Any

import yaml

from kubegpu.install.values import Values, default_affinity

Obj = dict[str, Any]

APP = "kubegpu"


def _meta(name: str, v: Values, component: str, *, namespaced: bool = True, **extra: Any) -> Obj:
    meta: Obj = {
        "name": name,
        "labels": {
            "app.kubernetes.io/name": APP,
            "app.kubernetes.io/component": component,
            "app.kubernetes.io/version": v.image.tag,
            "app.kubernetes.io/managed-by": "kubegpu-manifests",
        },
    }
    if namespaced:
        meta["namespace"] = v.namespace
    meta.update(extra)
    return meta


def _selector(component: str) -> Obj:
    return {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": component}


def _rbac(name: str, v: Values, component: str, rules: list[Obj]) -> list[Obj]:
    """ServiceAccount + ClusterRole + ClusterRoleBinding for one role."""
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(name, v, component)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": _meta(name, v, component, namespaced=False), "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": _meta(name, v, component, namespaced=False),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": v.namespace}]},
    ]


def _container(v: Values, name: str, args: list[str], resources: Obj, **extra: Any) -> Obj:
    c: Obj = {
        "name": name,
        "image": v.image.ref,
        "imagePullPolicy": v.image.pull_policy,
        "command": ["kubegpu"],
        "args": args,
        "resources": resources,
    }
    c.update(extra)
    return c


def namespace(v: Values) -> Obj:
    return {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": v.namespace, "labels": {v.webhook.exclude_namespace_label: "true"}}}


def device_crd() -> Obj:
    text = importlib_resources.files("kubegpu.install").joinpath("crd-device.yaml").read_text()
    return yaml.safe_load(text)


def node_objects(v: Values) -> list[Obj]:
    name = f"{APP}-node"
    rules = [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch", "patch"]},
        {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]},
        # The handoff reads the scheduler's record on pods bound to this node and acknowledges it.
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "patch"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
        {"apiGroups": ["kubegpu.io"], "resources": ["devices"],
         "verbs": ["get", "list", "watch", "create", "update", "patch"]},
    ]
    env: list[Obj] = [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    for key, value in (
        ("MIG_STRATEGY", v.mig_strategy),
        ("FAIL_ON_INIT_ERROR", v.fail_on_init_error),
        ("DEVICE_LIST_STRATEGY", v.device_list_strategy),
        ("DEVICE_ID_STRATEGY", v.device_id_strategy),
        ("NVIDIA_DRIVER_ROOT", v.nvidia_driver_root),
        ("PASS_DEVICE_SPECS", True if v.compat_with_cpu_manager else None),
    ):
        if value is not None:
            env.append({"name": key, "value": str(value).lower() if isinstance(value, bool) else str(value)})
    mounts = [
        {"name": "device-plugin", "mountPath": "/var/lib/kubelet/device-plugins"},
        {"name": "pod-resources", "mountPath": "/var/lib/kubelet/pod-resources", "readOnly": True},
        {"name": "cdi-root", "mountPath": "/var/run/cdi"},
        {"name": "driver-root", "mountPath": "/driver-root", "readOnly": True},
    ]
    volumes = [
        {"name": "device-plugin", "hostPath": {"path": v.device_plugin_path}},
        {"name": "pod-resources", "hostPath": {"path": "/var/lib/kubelet/pod-resources"}},
        {"name": "cdi-root", "hostPath": {"path": v.cdi_root, "type": "DirectoryOrCreate"}},
        {"name": "driver-root", "hostPath": {"path": v.nvidia_driver_root}},
    ]
    objs: list[Obj] = _rbac(name, v, "node", rules)
    args = ["node", "--device-plugin-dir", "/var/lib/kubelet/device-plugins",
            "--metrics-address", f":{v.metrics_port}"]
    if v.config.map:
        default = v.config.default or sorted(v.config.map)[0]
        env.append({"name": "CONFIG_FILE", "value": f"/config/{default}"})
        mounts.append({"name": "config", "mountPath": "/config", "readOnly": True})
        volumes.append({"name": "config", "configMap": {"name": f"{APP}-device-plugin-config"}})
        objs.append({"apiVersion": "v1", "kind": "ConfigMap",
                     "metadata": _meta(f"{APP}-device-plugin-config", v, "node"), "data": dict(v.config.map)})
    container = _container(
        v, "node", args, v.resources, env=env, volumeMounts=mounts,
        ports=[{"name": "metrics", "containerPort": v.metrics_port}],
        # compatWithCPUManager (NVIDIA's chart): privileged so device specs can be passed.
        securityContext=({"privileged": True} if v.compat_with_cpu_manager else
                         {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}),
    )
    pod_spec: Obj = {
        "serviceAccountName": name,
        "priorityClassName": v.priority_class_name,
        "tolerations": v.tolerations,
        "affinity": v.affinity if v.affinity is not None else default_affinity(),
        "containers": [container],
        "volumes": volumes,
    }
    if v.node_selector:
        pod_spec["nodeSelector"] = v.node_selector
    if v.runtime_class_name:
        pod_spec["runtimeClassName"] = v.runtime_class_name
    objs.append({
        "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": _meta(name, v, "node"),
        "spec": {
            "selector": {"matchLabels": _selector("node")},
            "updateStrategy": {"type": "RollingUpdate"},
            "template": {"metadata": {"labels": _selector("node")}, "spec": pod_spec},
        },
    })
    return objs


def scheduler_config(v: Values) -> Obj:
    """The KubeSchedulerConfiguration: a second profile whose extender is kubegpu (base file, with the values)."""
    sv = v.scheduler
    text = importlib_resources.files("kubegpu.install").joinpath("base", "scheduler", "scheduler-config.yaml")
    cfg = yaml.safe_load(text.read_text().replace(BASE_NAMESPACE, v.namespace))
    cfg["leaderElection"]["resourceName"] = sv.scheduler_name
    cfg["profiles"] = [{"schedulerName": sv.scheduler_name}]
    (ext,) = cfg["extenders"]
    ext["urlPrefix"] = f"http://127.0.0.1:{sv.port}/scheduler"
    ext["weight"], ext["httpTimeout"] = sv.weight, sv.http_timeout
    return cfg


def scheduler_objects(v: Values) -> list[Obj]:
    sv = v.scheduler
    objs = _base("scheduler", v)
    for o in objs:
        if o["kind"] == "Role" and o["metadata"]["name"] == "kubegpu-scheduler-leader-election":
            for rule in o["rules"]:
                if "resourceNames" in rule:
                    rule["resourceNames"] = [sv.scheduler_name]
        if o["kind"] != "Deployment":
            continue
        o["spec"]["replicas"] = sv.replicas
        pod = o["spec"]["template"]["spec"]
        for c in pod["containers"]:
            if c["name"] == "kube-scheduler":
                c["image"] = sv.kube_scheduler_image
            elif c["name"] == "extender":
                c["args"] = ["scheduler", "--listen", f"127.0.0.1:{sv.port}", "--metrics-listen", "0.0.0.0:9401",
                             "--node-policy", sv.node_policy, "--gpu-policy", sv.gpu_policy]
                if sv.resources:
                    c["resources"] = sv.resources
    objs.append({"apiVersion": "v1", "kind": "ConfigMap",
                 "metadata": _meta("kubegpu-scheduler-config", v, "scheduler"),
                 "data": {"scheduler-config.yaml": yaml.safe_dump(scheduler_config(v), sort_keys=False)}})
    return objs


BASE_NAMESPACE = "kubegpu-system"
BASE_FILES = {
    "webhook": ("rbac.yaml", "certificate.yaml", "deployment.yaml", "mutating.yaml", "validating.yaml"),
    "scheduler": ("rbac.yaml", "deployment.yaml"),
}


def _base(role: str, v: Values) -> list[Obj]:
    """A role's reviewed base manifests (packaged YAML whose comments explain each choice), in
    ``v.namespace`` and with ``v.image``."""
    root = importlib_resources.files("kubegpu.install").joinpath("base", role)
    docs: list[Obj] = []
    for name in BASE_FILES[role]:
        text = root.joinpath(name).read_text().replace(BASE_NAMESPACE, v.namespace)
        docs += [d for d in yaml.safe_load_all(text) if d]
    for d in docs:
        for c in d.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            if c["image"].startswith("ghcr.io/kubegpu/kubegpu:"):
                c["image"], c["imagePullPolicy"] = v.image.ref, v.image.pull_policy
    return docs


def webhook_objects(v: Values) -> list[Obj]:
    w = v.webhook
    objs = _base("webhook", v)
    if not w.cert_manager:
        objs = [o for o in objs if not o["apiVersion"].startswith("cert-manager.io/")]
    for o in objs:
        if o["kind"] == "Deployment":
            o["spec"]["replicas"] = w.replicas
            if w.resources:
                o["spec"]["template"]["spec"]["containers"][0]["resources"] = w.resources
        if o["kind"] not in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
            continue
        if not w.cert_manager:
            o["metadata"].pop("annotations", None)
        for hook in o["webhooks"]:
            hook["failurePolicy"] = w.failure_policy
            hook["timeoutSeconds"] = w.timeout_seconds
            if not w.match_conditions:
                hook.pop("matchConditions", None)
            if w.ca_bundle:
                hook["clientConfig"]["caBundle"] = w.ca_bundle
            for expr in hook["namespaceSelector"]["matchExpressions"]:
                if expr["operator"] == "DoesNotExist":
                    expr["key"] = w.exclude_namespace_label
    return objs


def render(v: Values) -> list[Obj]:
    """All objects for ``v.mode``, in an order ``kubectl apply`` can take."""
    objs: list[Obj] = [namespace(v), device_crd(), *node_objects(v)]
    if v.mode == "full":
        objs += scheduler_objects(v) + webhook_objects(v)
    return objs


def to_yaml(objs: list[Obj]) -> str:
    header = "# Rendered by `kubegpu manifests`; edit the values, not this file.\n"
    return header + yaml.safe_dump_all(objs, sort_keys=False, default_flow_style=False)
