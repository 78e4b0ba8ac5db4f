"""Every Kubernetes object kubegpu needs, rendered from one :class:`Values`.

Objects are built as plain dicts (no template language), so each role's
least-privilege RBAC sits next to the workload that needs it and the output
can be validated against the Kubernetes OpenAPI schemas offline.
"""

from __future__ import annotations

from importlib import resources as importlib_resources
from typing import Any

import msgspec
import yaml

from kubegpu.install import security
from kubegpu.install.network import network_policies
from kubegpu.install.values import (
    ReservationValues,
    Values,
    check_values,
    default_affinity,
    default_config_entry,
    gpu_resources,
    has_admission_policies,
    has_match_conditions,
    kube_scheduler_image,
    kube_version,
    node_fullname,
    reviews_updates,
    scheduler_config_version,
    target_namespace,
    webhook_failure_policy,
)
from kubegpu.model import resources as R
from kubegpu.node.runtime_env import env_entries as node_runtime_env

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


def _config_docs(v: Values) -> list[dict[str, Any] | None]:
    """Each ``config.map`` entry as a mapping; None for one that is not YAML of a mapping (opaque)."""
    docs: list[dict[str, Any] | None] = []
    for text in v.config.map.values():
        try:
            doc = yaml.safe_load(text) or {}
        except yaml.YAMLError:
            doc = None
        docs.append(doc if isinstance(doc, dict) else None)
    return docs


def mig_monitoring(v: Values) -> bool:
    """NVIDIA's chart rule (``allPossibleMigStrategiesAreNone``): MIG monitoring is set up unless every
    strategy the daemon could run with is ``none`` (the value, else each ``config.map`` entry's)."""
    if v.mig_strategy is not None:
        return v.mig_strategy != "none"
    for doc in _config_docs(v):
        if doc is None:
            return True  # cannot tell: as NVIDIA's chart does with an opaque ConfigMap
        flags = doc.get("flags")
        if isinstance(flags, dict) and flags.get("migStrategy", "none") != "none":
            return True
    return False


def node_security_context(v: Values) -> Obj:
    """As tight as the node daemon can run: root (the kubelet's device-plugin directory and the CDI
    directory are root's), no privilege escalation, a read-only root filesystem, the runtime's seccomp
    profile and no capabilities, except CAP_SYS_ADMIN where MIG devices must be monitored (NVML's MIG
    event and capability files need it, NVIDIA's chart adds it for the same reason) and privileged with
    ``compatWithCPUManager`` (device specs passed to the kubelet, as NVIDIA's chart)."""
    if v.compat_with_cpu_manager:
        return {"privileged": True}
    ctx: Obj = {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "seccompProfile": {"type": "RuntimeDefault"},
        "capabilities": {"drop": ["ALL"]},
    }
    if mig_monitoring(v) or strict_in_use(v):
        ctx["capabilities"]["add"] = ["SYS_ADMIN"]
    if mps_in_use(v):  # the MPS control daemon starts each server as its client's user (docs/sharing.md)
        ctx["capabilities"]["add"] = [*ctx["capabilities"].get("add", []), "SETUID", "SETGID"]
    return ctx


ENFORCING = ("mps", "per-shape", "strict")  # kubegpu.shareEnforcement values that run MPS daemons
MPS_ROOT = "/run/nvidia/mps"  # flags.mpsRoot's default; mounted at the same path so host paths are the daemon's


def mps_in_use(v: Values) -> bool:
    """Whether a config.map entry shares GPUs with MPS (sharing.mps) or enforces shares with it."""
    return any(doc is not None and ((doc.get("sharing") or {}).get("mps")
                                    or (doc.get("kubegpu") or {}).get("shareEnforcement") in ENFORCING)
               for doc in _config_docs(v))


def strict_in_use(v: Values) -> bool:
    """Whether a config.map entry selects strict share enforcement: the node daemon then sets GPU compute modes,
    which NVML allows only with CAP_SYS_ADMIN (as ``nvidia-smi -c``)."""
    return any(doc is not None and (doc.get("kubegpu") or {}).get("shareEnforcement") == "strict"
               for doc in _config_docs(v))


def node_objects(v: Values) -> list[Obj]:
    name = node_fullname(v)
    env: list[Obj] = [
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        # What NVIDIA's image and chart give the plugin, so the NVIDIA container runtime injects the
        # driver (NVML) into this container: every GPU visible, and the capabilities NVML needs.
        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
        {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"},
    ]
    if mig_monitoring(v):
        env.append({"name": "NVIDIA_MIG_MONITOR_DEVICES", "value": "all"})
    env += resources_env(v) + record_key_env(v) + node_runtime_env()
    for key, value in (
        ("MIG_STRATEGY", v.mig_strategy),
        ("FAIL_ON_INIT_ERROR", v.fail_on_init_error),
        ("DEVICE_LIST_STRATEGY", v.device_list_strategy),
        ("DEVICE_ID_STRATEGY", v.device_id_strategy),
        ("NVIDIA_DRIVER_ROOT", v.nvidia_driver_root),
        ("DEVICE_DISCOVERY_STRATEGY", v.device_discovery_strategy),
        ("NVIDIA_CDI_HOOK_PATH", v.cdi.nvidia_hook_path or None),
        ("CDI_FEATURE_FLAGS", _comma_list(v.cdi.feature_flags)),
        ("PASS_DEVICE_SPECS", True if v.compat_with_cpu_manager else None),
        ("GDS_ENABLED", v.gds_enabled),
        ("MOFED_ENABLED", v.mofed_enabled),
        ("GDRCOPY_ENABLED", v.gdrcopy_enabled),
    ):
        if value is not None:
            env.append({"name": key, "value": str(value).lower() if isinstance(value, bool) else str(value)})
    mounts = [
        {"name": "device-plugin", "mountPath": "/var/lib/kubelet/device-plugins"},
        {"name": "pod-resources", "mountPath": "/var/lib/kubelet/pod-resources", "readOnly": True},
        {"name": "cdi-root", "mountPath": "/var/run/cdi"},
        {"name": "driver-root", "mountPath": "/driver-root", "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},  # the root filesystem is read-only
        # MPS (node/mps): the daemons' pipe and log directories, and the /dev/shm they share with their
        # clients (NVIDIA's layout: <mps root>/shm on the host, /dev/shm in the daemon and in every client).
        {"name": "mps-root", "mountPath": MPS_ROOT},
        {"name": "mps-shm", "mountPath": "/dev/shm"},
    ]
    volumes = [
        {"name": "device-plugin", "hostPath": {"path": v.device_plugin_path}},
        {"name": "pod-resources", "hostPath": {"path": "/var/lib/kubelet/pod-resources"}},
        {"name": "cdi-root", "hostPath": {"path": v.cdi_root, "type": "DirectoryOrCreate"}},
        {"name": "driver-root", "hostPath": {"path": v.nvidia_driver_root}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
        {"name": "mps-root", "hostPath": {"path": MPS_ROOT, "type": "DirectoryOrCreate"}},
        {"name": "mps-shm", "hostPath": {"path": f"{MPS_ROOT}/shm", "type": "DirectoryOrCreate"}},
    ]
    objs: list[Obj] = _rbac(name, v, "node", security.rbac_rules("node"))
    args = ["node", "--device-plugin-dir", "/var/lib/kubelet/device-plugins",
            "--metrics-address", f":{v.metrics_port}"]
    if v.config.map or v.config.name:
        if v.config.map:
            objs.append(config_map(v))
        env.extend(config_env(v))
        mounts.append({"name": "config", "mountPath": "/config", "readOnly": True})
        volumes.append({"name": "config", "configMap": {"name": config_map_name(v)}})
    env = _with_env(env, v.device_plugin.containers.main.env)
    container = _container(
        v, "node", args, v.resources, env=env, volumeMounts=mounts,
        ports=[{"name": "metrics", "containerPort": v.metrics_port}],
        securityContext=v.security_context if v.security_context else node_security_context(v),
        **node_probes(),
    )
    pod_spec: Obj = {
        # Root (the image's default user is 65532): the kubelet's device-plugin directory and /var/run/cdi
        # are root's. At pod level, so a securityContext given in the values keeps it.
        "securityContext": {"runAsUser": 0, "runAsGroup": 0, **v.pod_security_context},
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
        # The runtime class of the NVIDIA container runtime where it is not the node's default.
        pod_spec["runtimeClassName"] = v.runtime_class_name
    if v.image_pull_secrets:
        pod_spec["imagePullSecrets"] = v.image_pull_secrets
    if v.device_plugin.enable_host_network:
        pod_spec["hostNetwork"] = True
        pod_spec["dnsPolicy"] = "ClusterFirstWithHostNet"  # still resolve Services (the API server's name)
    # NVIDIA's selectorLabelsOverride: the operator's labels beside kubegpu's, which the Service selects by.
    selector = {**v.selector_labels_override, **_selector("node")}
    # Prometheus' pod discovery convention; the values' podAnnotations win (NVIDIA's chart key).
    template_meta: Obj = {"labels": dict(selector),
                          "annotations": {**scrape_annotations(v.metrics_port), **v.pod_annotations}}
    objs.append({
        "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": _meta(name, v, "node"),
        "spec": {
            "selector": {"matchLabels": selector},
            "updateStrategy": v.update_strategy,
            "template": {"metadata": template_meta, "spec": pod_spec},
        },
    })
    objs.append(node_metrics_service(v, name))
    return objs


def _comma_list(flags: str | list[str] | None) -> str | None:
    if flags is None:
        return None
    return flags if isinstance(flags, str) else ",".join(flags)


def _with_env(env: list[Obj], extra: list[Obj]) -> list[Obj]:
    """``env`` with NVIDIA's ``devicePlugin.containers.main.env``: an entry replaces kubegpu's of its name (as
    the later duplicate wins in NVIDIA's chart), others are appended."""
    given = {e["name"]: e for e in extra}
    return [given.pop(e["name"], e) for e in env] + list(given.values())


def scrape_annotations(port: int) -> dict[str, str]:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}


def node_probes() -> Obj:
    """The node daemon's probes, on its metrics port (node/metrics.py serves both there).

    ``/readyz`` fails until NVML found the GPUs and every resource is registered with the kubelet: asked
    early and often, so a node shows ready seconds after it is. ``/healthz`` fails only when the lifecycle
    or the NVML event loop died; before ``start()`` returns (NVML init, the first discovery) the lifecycle
    loop does not exist yet, so liveness waits and tolerates two minutes of failures before restarting a
    daemon that may be serving Allocate calls."""
    return {
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "metrics"},
                           "initialDelaySeconds": 2, "periodSeconds": 5, "timeoutSeconds": 3,
                           "failureThreshold": 2},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "metrics"},
                          "initialDelaySeconds": 10, "periodSeconds": 20, "timeoutSeconds": 5,
                          "failureThreshold": 6},
    }


def node_metrics_service(v: Values, name: str) -> Obj:
    """A headless Service over the node pods, for Prometheus' endpoints discovery (ServiceMonitors select it by
    its labels). Not-ready pods stay listed: a node whose GPUs are not yet served is the one to look at."""
    return {"apiVersion": "v1", "kind": "Service",
            # No prometheus.io annotations here: the pods carry them, and a Prometheus that discovers both
            # pods and service endpoints by annotation would scrape every node twice.
            "metadata": _meta(f"{name}-metrics", v, "node"),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": _selector("node"),
                     "ports": [{"name": "metrics", "port": v.metrics_port, "targetPort": "metrics",
                                "protocol": "TCP"}]}}


def record_key_env(v: Values) -> list[Obj]:
    """The record-signing key for the extender and the node daemons (full mode), from the Secret. Required:
    without it a node could not tell the extender's records from forged ones, so the pods wait for the Secret
    (the kubelet says "secret ... not found") rather than run unsigned."""
    if v.mode != "full":
        return []
    return [{"name": "KUBEGPU_RECORD_KEY", "valueFrom": {"secretKeyRef": {
        "name": v.record_key_secret, "key": "key", "optional": False}}}]


def resources_env(v: Values) -> list[Obj]:
    """The renamed GPU resources the nodes serve, for every role that reads pods (model/resources.py)."""
    # The values' extra MIG profiles too: the webhook refuses MIG profiles it does not know (model/names.py).
    names = (*gpu_resources(v), *sorted({R.mig_resource(p) for p in v.mig_profiles}))
    return [{"name": R.GPU_RESOURCES_ENV, "value": ",".join(names)}] if names else []


def managed_resources(v: Values) -> list[Obj]:
    """The extender's managedResources: kubegpu's own, every MIG profile of the table (and the values'), every
    renamed resource. A pod asking for none of these never reaches the extender."""
    base = ["nvidia.com/gpu", "nvidia.com/gpu.shared", R.GPU_SLOTS, R.GPU_CORE, R.GPU_MEMORY, R.GPU_MEMORY_RATIO]
    out = [{"name": n, "ignoredByScheduler": False} for n in base]
    out.append({"name": R.GPU_PERCENT, "ignoredByScheduler": True})  # shorthand; the webhook expands it
    seen = {m["name"] for m in out}
    for n in (*R.mig_resources(v.mig_profiles), *gpu_resources(v)):
        if n not in seen:
            seen.add(n)
            out.append({"name": n, "ignoredByScheduler": False})
    return out


def config_map_name(v: Values) -> str:
    return v.config.name or f"{APP}-device-plugin-config"


def config_map(v: Values) -> Obj:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(config_map_name(v), v, "node"),
            "data": dict(v.config.map)}


def config_env(v: Values) -> list[Obj]:
    """Which ``config.map`` entry the daemon reads: the one its node's ``nvidia.com/device-plugin.config``
    label names (NVIDIA's per-node selection), else ``config.default`` (or the only entry)."""
    default = default_config_entry(v)
    env = [{"name": "CONFIG_DIR", "value": "/config"}]
    if default:
        env.append({"name": "CONFIG_FILE", "value": f"/config/{default}"})
    return env


def scheduler_config(v: Values) -> Obj:
    """The KubeSchedulerConfiguration: a second profile whose extender is kubegpu (base file, with the values).

    The profile makes kube-scheduler place GPU pods where ``kubegpu simulate`` places them
    (docs/scheduler.md, "What the profile must keep"): every node that passes kube-scheduler's filters
    reaches the extender (``percentageOfNodesToScore: 100``, at the top level, which every config API
    version has, and in the profile from 1.27, where the field exists there and would override a global
    value), and kube-scheduler's own score plugins are off, so the extender's prioritize alone orders the
    nodes. Its filters (resources, taints, affinity, topology spread) all stay.
    """
    sv = v.scheduler
    text = importlib_resources.files("kubegpu.install").joinpath("base", "scheduler", "scheduler-config.yaml")
    cfg = yaml.safe_load(text.read_text().replace(BASE_NAMESPACE, v.namespace))
    cfg["apiVersion"] = f"kubescheduler.config.k8s.io/{scheduler_config_version(v)}"
    cfg["leaderElection"]["resourceName"] = sv.scheduler_name
    # kube-scheduler's own identity (rbac.yaml): not the pod's, which is the extender's.
    cfg["clientConnection"] = {"kubeconfig": "/etc/kubegpu/kubeconfig"}
    cfg["percentageOfNodesToScore"] = ALL_NODES
    profile: Obj = {"schedulerName": sv.scheduler_name}
    if kube_version(v) >= PROFILE_PERCENTAGE_SINCE:
        profile["percentageOfNodesToScore"] = ALL_NODES
    profile["plugins"] = {"score": {"disabled": [{"name": "*"}]}}
    cfg["profiles"] = [profile]
    (ext,) = cfg["extenders"]
    ext["urlPrefix"] = f"http://127.0.0.1:{sv.port}/scheduler"
    ext["weight"], ext["httpTimeout"] = sv.weight, sv.http_timeout
    ext["managedResources"] = managed_resources(v)
    # kube-scheduler applies one httpTimeout to every verb of an extender, and a bind may wait in the extender
    # for its node's previous handoff of the same kind (docs/handoff.md, step 2): bind is a second entry on the
    # same URL with a longer timeout, so such a pod waits there instead of failing and backing off. Only one
    # extender may bind and a managed resource may be named once, so it names none: it binds every pod of the
    # profile (a pod without GPUs on a node without kubegpu GPUs gets a plain Binding).
    binder = {k: val for k, val in ext.items() if k not in _FILTER_ONLY}
    binder["httpTimeout"] = BIND_HTTP_TIMEOUT
    binder["managedResources"] = []
    del ext["bindVerb"]
    cfg["extenders"] = [ext, binder]
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
        if sv.runtime_class_name:
            pod["runtimeClassName"] = sv.runtime_class_name
        for c in pod["containers"]:
            if c["name"] == "kube-scheduler":
                c["image"] = kube_scheduler_image(v)
            elif c["name"] == "extender":
                c["args"] = ["scheduler", "--listen", f"127.0.0.1:{sv.port}", "--metrics-listen", "0.0.0.0:9401",
                             "--node-policy", sv.node_policy, "--gpu-policy", sv.gpu_policy,
                             f"--max-gpu-containers={v.max_gpu_containers}",
                             *(["--metrics-per-gpu"] if sv.metrics_per_gpu else []),
                             *reservation_args(sv.reservation)]
                if sv.resources:
                    c["resources"] = sv.resources
                c["env"] = c.get("env", []) + resources_env(v) + record_key_env(v)
    objs += [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": _meta("kubegpu-scheduler-extender", v, "scheduler", namespaced=False),
         "rules": security.rbac_rules("extender")},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": _meta("kubegpu-scheduler-extender", v, "scheduler", namespaced=False),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                     "name": "kubegpu-scheduler-extender"},
         "subjects": [{"kind": "ServiceAccount", "name": "kubegpu-scheduler-extender", "namespace": v.namespace}]},
    ]
    objs.append({"apiVersion": "v1", "kind": "ConfigMap",
                 "metadata": _meta("kubegpu-scheduler-config", v, "scheduler"),
                 "data": {"scheduler-config.yaml": yaml.safe_dump(scheduler_config(v), sort_keys=False),
                          "kubeconfig": yaml.safe_dump(kube_scheduler_kubeconfig(), sort_keys=False)}})
    return objs


def reservation_args(r: ReservationValues) -> list[str]:
    """The extender's reservation flags from ``scheduler.reservation`` (docs/scheduler.md, "Reservations for wide
    pods"): off, or the three settings."""
    if not r.enabled:
        return ["--no-reservations"]
    return [f"--reservation-min-gpus={r.min_gpus}", f"--reservation-wait={r.wait_seconds:g}",
            f"--reservation-max-share={r.max_share:g}"]


def kube_scheduler_kubeconfig() -> Obj:
    """kube-scheduler's credentials: the kubegpu-kube-scheduler token Secret mounted into its container."""
    root = "/var/run/secrets/kubegpu-kube-scheduler"
    return {
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "in-cluster", "cluster": {"server": "https://kubernetes.default.svc",
                                                        "certificate-authority": f"{root}/ca.crt"}}],
        "users": [{"name": "kubegpu-kube-scheduler", "user": {"tokenFile": f"{root}/token"}}],
        "contexts": [{"name": "default", "context": {"cluster": "in-cluster", "user": "kubegpu-kube-scheduler"}}],
        "current-context": "default",
    }


# kube-scheduler filters every node before the extender is called (its default stops at 50 - nodes/125 % of
# them, at least 100, and the node the simulator picks is then often not among them).
ALL_NODES = 100
# The bind extender's httpTimeout: above the extender's longest handoff wait (scheduler/bind.py
# DEFAULT_HANDOFF_WAIT_S), so its answer, a bind or the reason, always arrives before kube-scheduler gives up.
BIND_HTTP_TIMEOUT = "60s"
_FILTER_ONLY = frozenset({"filterVerb", "prioritizeVerb", "preemptVerb", "weight", "managedResources"})
# KubeSchedulerProfile.percentageOfNodesToScore exists from Kubernetes 1.27 (config API v1); before, only the
# global field does, and strict decoding refuses an unknown field.
PROFILE_PERCENTAGE_SINCE = (1, 27)

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
        pod = d.get("spec", {}).get("template", {}).get("spec", {})
        for c in pod.get("containers", []):
            if c["image"].startswith("ghcr.io/kubegpu/kubegpu:"):
                c["image"], c["imagePullPolicy"] = v.image.ref, v.image.pull_policy
                if v.image_pull_secrets:  # kubegpu's image, wherever it is pulled from
                    pod["imagePullSecrets"] = v.image_pull_secrets
    return docs


WEBHOOK_RENDERED_FLAGS = ("--record-writer", "--scheduler-name", "--max-gpu-containers")


def webhook_objects(v: Values) -> list[Obj]:
    w = v.webhook
    objs = _base("webhook", v)
    if not w.cert_manager:
        objs = [o for o in objs if not o["apiVersion"].startswith("cert-manager.io/")]
    for o in objs:
        if o["kind"] == "Deployment":
            o["spec"]["replicas"] = w.replicas
            if w.runtime_class_name:
                o["spec"]["template"]["spec"]["runtimeClassName"] = w.runtime_class_name
            if w.resources:
                o["spec"]["template"]["spec"]["containers"][0]["resources"] = w.resources
            extra = resources_env(v)
            c0 = o["spec"]["template"]["spec"]["containers"][0]
            if extra:
                c0["env"] = c0.get("env", []) + extra
            # The service accounts that write kubegpu's records, as this render names them (the same pair the
            # kubegpu-record-writers policy admits).
            c0["args"] = [a for a in c0["args"] if not a.startswith(WEBHOOK_RENDERED_FLAGS)] + [
                f"--record-writer=system:serviceaccount:{v.namespace}:{sa}"
                for sa in (node_fullname(v), security.EXTENDER_SA)] + [
                # GPU pods left to the default scheduler go to kubegpu's profile; the extender's cap.
                f"--scheduler-name={v.scheduler.scheduler_name}",
                f"--max-gpu-containers={v.max_gpu_containers}"]
        if o["kind"] not in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
            continue
        if not w.cert_manager:
            o["metadata"].pop("annotations", None)
        for hook in o["webhooks"]:
            hook["failurePolicy"] = webhook_failure_policy(v)
            hook["timeoutSeconds"] = w.timeout_seconds
            if not has_match_conditions(v):
                hook.pop("matchConditions", None)
            elif o["kind"] == "ValidatingWebhookConfiguration" and v.mode == "full" and has_admission_policies(v):
                hook["matchConditions"] = [*hook.get("matchConditions", []), _not_kubegpu_itself(v)]
            if o["kind"] == "ValidatingWebhookConfiguration" and not reviews_updates(v):
                hook["rules"] = _without_updates(hook["rules"])
            if w.ca_bundle:
                hook["clientConfig"]["caBundle"] = w.ca_bundle
            for expr in hook["namespaceSelector"]["matchExpressions"]:
                if expr["operator"] == "DoesNotExist":
                    expr["key"] = w.exclude_namespace_label
    return objs


def _not_kubegpu_itself(v: Values) -> Obj:
    """kubegpu's own accounts (the node daemon's acknowledgements, the extender's writes) are not sent to the
    validating webhook where the admission policy already governs what they may write: an outage of the
    webhook must not block the acknowledgements the accounting follows (docs/handoff.md)."""
    users = ", ".join(f"'system:serviceaccount:{v.namespace}:{sa}'" for sa in (node_fullname(v), security.EXTENDER_SA))
    return {"name": "not-kubegpu-itself", "expression": f"!(request.userInfo.username in [{users}])"}


def _without_updates(rules: list[Obj]) -> list[Obj]:
    """The validating rules less the pod and pod-status UPDATEs (kubectl debug's stays)."""
    out = []
    for rule in rules:
        if rule["resources"] == ["pods/status"]:
            continue
        if rule["resources"] == ["pods"]:
            rule = {**rule, "operations": [op for op in rule["operations"] if op != "UPDATE"]}
        out.append(rule)
    return out


def policy_objects(v: Values) -> list[Obj]:
    """The ValidatingAdmissionPolicies that narrow RBAC (``install/security.py``), where the release has them."""
    if not has_admission_policies(v):
        return []
    labels = {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": "policy",
              "app.kubernetes.io/managed-by": "kubegpu-manifests"}
    objs = security.node_restriction_policy(v.namespace, labels, node_fullname(v))
    if v.mode == "full":
        objs += security.record_writers_policy(v.namespace, labels, node_fullname(v))
        if v.scheduler.scheduler_name:
            objs += security.share_placement_policy(labels, v.scheduler.scheduler_name)
    return objs


def notes(v: Values) -> list[str]:
    """What the operator must know about this render (printed by ``kubegpu manifests`` on stderr), with the
    namespace and names the render uses."""
    v = resolved(v)
    out = []
    if v.gfd.enabled:
        out.append("gfd.enabled: no gpu-feature-discovery DaemonSet is rendered: `kubegpu node` publishes GPU "
                   "feature discovery's labels itself (remove a GFD you run beside it: both would write them)")
    if v.gfd.enabled and v.nfd.enabled is None:
        out.append("NVIDIA's chart would deploy node-feature-discovery with gfd.enabled; kubegpu does not: the node "
                   "DaemonSet's default affinity needs NFD's feature.node.kubernetes.io/pci-10de.present (install "
                   "NFD from its own chart) or the label nvidia.com/gpu.present=true on each GPU node")
    if v.device_plugin.enable_host_network:
        out.append(f"devicePlugin.enableHostNetwork: the node daemon binds its metrics port {v.metrics_port} "
                   "(metricsPort) on every GPU node's own network, where dcgm-exporter's default is 9400 too; "
                   "NetworkPolicies do not apply to it there")
    if v.mode == "full" and not has_match_conditions(v):
        out.append(f"Kubernetes {v.kube_version or 'release'} has no webhook matchConditions: the webhook is sent "
                   f"every pod outside the excluded namespaces, so its failurePolicy is "
                   f"{webhook_failure_policy(v)} (with Ignore, GPU pods are admitted unchecked while it is down)")
    if v.mode == "full":
        out.append(f"records are signed with the key in the Secret {v.namespace}/{v.record_key_secret}; create it "
                   f"once (kubectl -n {v.namespace} create secret generic {v.record_key_secret} "
                   "--from-literal=key=$(head -c 32 /dev/urandom | base64)); the extender and the node daemons "
                   "wait for it to start")
    if v.mode == "full" and not v.webhook.cert_manager:
        out.append(f"webhook.certManager: false: the Secret {v.namespace}/kubegpu-webhook-tls must hold a "
                   f"certificate for kubegpu-webhook.{v.namespace}.svc signed by webhook.caBundle's CA (kubegpu "
                   f"webhook-certs --namespace {v.namespace} makes both)")
    if v.mode == "full" and not reviews_updates(v):
        out.append("the webhook reviews pod creations only (webhook.reviewUpdates: false, the default without "
                   "matchConditions): record annotations written by a pod update are refused by the "
                   "kubegpu-record-writers policy (1.30+) and by the node daemons' signature check only")
    elif v.mode == "full" and not has_match_conditions(v):
        out.append("webhook.reviewUpdates without matchConditions: every pod update and status update in the "
                   "cluster is sent to the webhook")
    if not has_admission_policies(v):
        out.append("before Kubernetes 1.30 there are no ValidatingAdmissionPolicies: the node daemon's RBAC is not "
                   "narrowed to its own node, and the record annotations are guarded by the webhook alone")
    return out


def resolved(v: Values) -> Values:
    """``v`` as rendered: ``namespace`` is the namespace every object goes to (``namespaceOverride`` wins)."""
    return msgspec.structs.replace(v, namespace=target_namespace(v))


def render(v: Values) -> list[Obj]:
    """All objects for ``v.mode``, in an order ``kubectl apply`` can take."""
    check_values(v)
    v = resolved(v)
    objs: list[Obj] = [namespace(v), device_crd(), *node_objects(v)]
    if v.mode == "full":
        objs += scheduler_objects(v) + webhook_objects(v)
    return objs + policy_objects(v) + network_policies(v)


def to_yaml(objs: list[Obj]) -> str:
    header = ("# Rendered by `kubegpu manifests`; edit the values, not this file.\n"
              "# Prerequisites: the NVIDIA driver and the NVIDIA Container Toolkit on every GPU node (the NVIDIA\n"
              "# runtime as the default runtime, or a RuntimeClass named in runtimeClassName).\n")
    if any(o["apiVersion"].startswith("cert-manager.io/") for o in objs):
        header += ("# Full mode with certManager: true needs cert-manager installed first (its Issuer and Certificate\n"
                   "# are below); without it set webhook.certManager: false and webhook.caBundle.\n")
    return header + yaml.safe_dump_all(objs, sort_keys=False, default_flow_style=False)
