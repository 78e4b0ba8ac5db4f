"""The install values: one typed structure, keys mirroring NVIDIA's device-plugin chart where they overlap.

An operator who has a values file for ``nvidia-device-plugin`` can reuse its
``migStrategy``, ``deviceListStrategy``, ``config.map``, ``tolerations`` … here
unchanged. Unknown keys and bad values are errors that name the key.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Any, Final, Literal

import msgspec
import yaml

from kubegpu import __version__
from kubegpu.model import resources as R
from kubegpu.model.limits import DEFAULT_MAX_GPU_CONTAINERS


class ValuesError(ValueError):
    """A values file that cannot be used; the message names the key."""


class _Struct(msgspec.Struct, rename="camel", forbid_unknown_fields=True, omit_defaults=False):
    pass


class Image(_Struct):
    repository: str = "ghcr.io/kubegpu/kubegpu"
    tag: str = __version__
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"

    @property
    def ref(self) -> str:
        return f"{self.repository}:{self.tag}"


class DevicePluginConfig(_Struct):
    # name -> the content of an NVIDIA device-plugin config file (version: v1, flags, sharing).
    map: dict[str, str] = msgspec.field(default_factory=dict)
    # NVIDIA's chart: an existing ConfigMap to mount instead of creating one from `map`.
    name: str = ""
    # which entry a node reads when its `nvidia.com/device-plugin.config` label names none; "" = by
    # fallbackStrategies.
    default: str = ""
    # NVIDIA's chart: with no label and no default, "named" picks the entry called "default", "single"
    # the only entry; tried in order.
    fallback_strategies: list[Literal["named", "single"]] = msgspec.field(
        default_factory=lambda: ["named", "single"])


class GfdValues(_Struct):
    # NVIDIA's chart deploys GPU feature discovery; `kubegpu node` publishes the same labels itself, so
    # `enabled` only says whether they are published.
    enabled: bool = True


class NfdValues(_Struct):
    # NVIDIA's chart can deploy node-feature-discovery as a subchart; kubegpu does not (install NFD from
    # its own chart), so only `enabled: false` is accepted.
    enabled: bool = False


class CdiValues(_Struct):
    # NVIDIA's chart: the nvidia-cdi-hook (nvidia-ctk) path written into generated CDI specs.
    nvidia_hook_path: str = ""


class SchedulerValues(_Struct):
    # "" = registry.k8s.io/kube-scheduler at the cluster's release (kubeVersion).
    kube_scheduler_image: str = ""
    runtime_class_name: str | None = None
    scheduler_name: str = "kubegpu-scheduler"
    replicas: int = 1
    node_policy: str = "kubegpu"
    gpu_policy: str = "kubegpu"
    http_timeout: str = "10s"  # filter/prioritize answer in ms; bind makes an API call
    weight: int = 5
    port: int = 8888
    resources: dict[str, Any] = msgspec.field(default_factory=dict)


class WebhookValues(_Struct):
    replicas: int = 2
    # Fail: a GPU pod is never admitted unvalidated; the namespace exclusion keeps the
    # webhook's own namespace and kube-system admissible while it is down.
    # None = Fail where matchConditions keep plain pods away from the webhook (Kubernetes 1.28+), Ignore
    # before (the webhook would sit in front of every pod).
    failure_policy: Literal["Fail", "Ignore"] | None = None
    runtime_class_name: str | None = None
    timeout_seconds: int = 5
    # Namespaces carrying this label (any value) are not reviewed.
    exclude_namespace_label: str = "kubegpu.io/webhook-exclude"
    # cert-manager issues and rotates the serving certificate and injects the CA bundle;
    # without it, give the CA bundle (base64 PEM) and create the TLS secret yourself.
    cert_manager: bool = True
    # CEL matchConditions send only pods that concern GPUs; None = where the release has them (1.28+).
    match_conditions: bool | None = None
    # The validating webhook also reviews pod updates and status updates (refusing record annotations
    # written by anyone but kubegpu). None = where matchConditions send it only the updates that change a
    # record; without them it would be sent every pod update and status update in the cluster.
    review_updates: bool | None = None
    ca_bundle: str = ""
    resources: dict[str, Any] = msgspec.field(default_factory=dict)


class NetworkPolicyValues(_Struct):
    # Ingress NetworkPolicies for kubegpu's pods (install/network.py); off by default, see there why.
    enabled: bool = False
    # Who may scrape the metrics ports: pods in namespaces matching this (a LabelSelector; {} = every namespace),
    # and, if given, matching metricsPodSelector.
    metrics_namespace_selector: dict[str, Any] = msgspec.field(
        default_factory=lambda: {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}})
    metrics_pod_selector: dict[str, Any] = msgspec.field(default_factory=dict)
    # The API server's source addresses (CIDRs) for the webhook's port; [] = any source (a control plane off
    # the pod network, or behind SNAT, has no address a policy can name).
    api_server_cidrs: list[str] = msgspec.field(default_factory=list, name="apiServerCIDRs")


class Values(_Struct):
    mode: Literal["node-only", "full"] = "full"
    # The cluster's Kubernetes release, "1.24" .. NEWEST; "" = the newest.
    kube_version: str = ""
    namespace: str = "kubegpu-system"
    image: Image = msgspec.field(default_factory=Image)
    # NVIDIA chart keys for the node DaemonSet's pods.
    image_pull_secrets: list[dict[str, str]] = msgspec.field(default_factory=list)
    pod_annotations: dict[str, str] = msgspec.field(default_factory=dict)
    # The node container's securityContext, replacing kubegpu's (as NVIDIA's chart does).
    security_context: dict[str, Any] | None = None
    update_strategy: dict[str, Any] = msgspec.field(default_factory=lambda: {"type": "RollingUpdate"})
    fullname_override: str = ""  # the node role's object names (default kubegpu-node)
    namespace_override: str = ""  # wins over namespace, as in NVIDIA's chart
    device_discovery_strategy: str | None = None  # auto / nvml; tegra and vfio are refused
    gfd: GfdValues = msgspec.field(default_factory=GfdValues)
    nfd: NfdValues = msgspec.field(default_factory=NfdValues)
    cdi: CdiValues = msgspec.field(default_factory=CdiValues)
    # NVIDIA chart keys (same names, same meaning; None = the plugin's default).
    mig_strategy: Literal["none", "single", "mixed"] | None = None
    fail_on_init_error: bool | None = None
    device_list_strategy: str | None = None
    device_id_strategy: Literal["uuid", "index"] | None = msgspec.field(default=None, name="deviceIDStrategy")
    nvidia_driver_root: str = "/"
    compat_with_cpu_manager: bool | None = msgspec.field(default=None, name="compatWithCPUManager")
    runtime_class_name: str | None = None
    config: DevicePluginConfig = msgspec.field(default_factory=DevicePluginConfig)
    resources: dict[str, Any] = msgspec.field(default_factory=dict)
    node_selector: dict[str, str] = msgspec.field(default_factory=dict)
    tolerations: list[dict[str, Any]] = msgspec.field(
        default_factory=lambda: [
            {"key": "CriticalAddonsOnly", "operator": "Exists"},
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        ]
    )
    affinity: dict[str, Any] | None = None
    priority_class_name: str = "system-node-critical"
    device_plugin_path: str = "/var/lib/kubelet/device-plugins"
    cdi_root: str = "/var/run/cdi"
    metrics_port: int = 9400
    scheduler: SchedulerValues = msgspec.field(default_factory=SchedulerValues)
    webhook: WebhookValues = msgspec.field(default_factory=WebhookValues)
    network_policy: NetworkPolicyValues = msgspec.field(default_factory=NetworkPolicyValues)
    # Full mode: the Secret (key `key`, 16+ bytes) holding the HMAC key the extender signs records with and the
    # node daemons verify them with (model/signing.py). Not rendered (a key must not live in a values file or
    # in a re-rendered manifest): create it once, see `kubegpu manifests --help`. Until it exists, records are
    # unsigned and the node daemons say so.
    record_key_secret: str = "kubegpu-record-key"
    # Full mode: pods with more GPU containers are refused, by the webhook at admission and by the extender
    # (each GPU container needs its own exact fit per node); one key, so both say the same.
    max_gpu_containers: int = DEFAULT_MAX_GPU_CONTAINERS
    # MIG profiles beyond kubegpu's table (model/resources.py), e.g. "1g.30gb" for a GPU newer than it.
    mig_profiles: list[str] = msgspec.field(default_factory=list)
    # GPU resource names the nodes serve beyond those config.map declares (renames in ConfigMaps given by
    # config.name, --resource-config flags set elsewhere).
    gpu_resources: list[str] = msgspec.field(default_factory=list)


MIN_KUBE: Final = (1, 24)
NEWEST_KUBE: Final = (1, 37)


def kube_version(v: Values) -> tuple[int, int]:
    """The release the install is rendered for; raises ValuesError outside MIN_KUBE..NEWEST_KUBE."""
    raw = v.kube_version.strip().lstrip("v")
    if not raw:
        return NEWEST_KUBE
    m = re.fullmatch(r"(\d+)\.(\d+)(?:\.\d+)?", raw)
    span = f"{MIN_KUBE[0]}.{MIN_KUBE[1]} to {NEWEST_KUBE[0]}.{NEWEST_KUBE[1]}"
    if not m:
        raise ValuesError(f"kubeVersion: {v.kube_version!r} is not a Kubernetes release like 1.30 ({span})")
    ver = (int(m[1]), int(m[2]))
    if not MIN_KUBE <= ver <= NEWEST_KUBE:
        raise ValuesError(f"kubeVersion: {v.kube_version!r} is outside the supported releases {span}")
    return ver


def has_match_conditions(v: Values) -> bool:
    """Webhook matchConditions: beta and on by default from 1.28, GA in 1.30."""
    if v.webhook.match_conditions is not None:
        return v.webhook.match_conditions
    return kube_version(v) >= (1, 28)


def reviews_updates(v: Values) -> bool:
    """The validating webhook's UPDATE rules (pods, pods/status): by default only with matchConditions."""
    if v.webhook.review_updates is not None:
        return v.webhook.review_updates
    return has_match_conditions(v)


def has_admission_policies(v: Values) -> bool:
    """ValidatingAdmissionPolicy v1 and the node name in service-account tokens: 1.30+."""
    return kube_version(v) >= (1, 30)


def webhook_failure_policy(v: Values) -> str:
    if v.webhook.failure_policy is not None:
        return v.webhook.failure_policy
    return "Fail" if has_match_conditions(v) else "Ignore"


def scheduler_config_version(v: Values) -> str:
    """kubescheduler.config.k8s.io: v1 from 1.25; v1beta3 on 1.24 (v1beta2 is deprecated there)."""
    return "v1" if kube_version(v) >= (1, 25) else "v1beta3"


def kube_scheduler_image(v: Values) -> str:
    if v.scheduler.kube_scheduler_image:
        return v.scheduler.kube_scheduler_image
    major, minor = kube_version(v)
    return f"registry.k8s.io/kube-scheduler:v{major}.{minor}.0"


def target_namespace(v: Values) -> str:
    return v.namespace_override or v.namespace


def node_fullname(v: Values) -> str:
    from kubegpu.install.security import NODE_SA

    return v.fullname_override or NODE_SA


def default_config_entry(v: Values) -> str:
    """The config.map entry a node without the selection label reads ("" = none: defaults)."""
    c = v.config
    if c.default:
        return c.default
    for strategy in c.fallback_strategies:
        if strategy == "named" and "default" in c.map:
            return "default"
        if strategy == "single" and len(c.map) == 1:
            return next(iter(c.map))
    return ""


def gpu_resources(v: Values) -> tuple[str, ...]:
    """Renamed GPU resources the nodes serve: every config.map entry's replica renames, resource patterns and
    short forms, plus ``gpuResources``; the one list the webhook, the extender and the CLI are told."""
    from kubegpu.node.config import ConfigError, load_config

    names = set(v.gpu_resources)
    for entry, text in v.config.map.items():
        try:
            doc = yaml.safe_load(text) or {}
            cfg = load_config(file=doc)
        except (yaml.YAMLError, ConfigError) as exc:
            raise ValuesError(f"config.map.{entry}: {exc}") from None
        for section in (cfg.sharing.time_slicing, cfg.sharing.mps):
            names.update(section.served_name(r) for r in section.resources)
        names.update(p.name for p in (*cfg.resources.gpus, *cfg.resources.migs))
    return tuple(sorted(n for n in names if n))


def check_values(v: Values) -> None:
    """What the types cannot say: settings that would render and then fail on the cluster."""
    kube_version(v)
    c = v.config
    if c.map and c.name:
        raise ValuesError("config.name and config.map: give one (name mounts an existing ConfigMap, "
                          "map creates one)")
    if c.default and c.map and c.default not in c.map:
        raise ValuesError(f"config.default: {c.default!r} is not an entry of config.map "
                          f"({', '.join(sorted(c.map))}); every node would fail to start")
    if c.map and not default_config_entry(v):
        raise ValuesError(f"config.default: config.map has {len(c.map)} entries and none is chosen for nodes "
                          "without the nvidia.com/device-plugin.config label; set config.default "
                          "(or name an entry 'default')")
    if v.device_discovery_strategy not in (None, "auto", "nvml"):
        raise ValuesError(f"deviceDiscoveryStrategy: {v.device_discovery_strategy!r} is not supported: kubegpu "
                          "discovers GPUs through NVML only (auto or nvml); Tegra and VFIO passthrough GPUs "
                          "have no kubegpu backend")
    if not v.gfd.enabled:
        raise ValuesError("gfd.enabled: false is not supported: `kubegpu node` publishes GPU feature discovery's "
                          "labels itself (the extender and nodeSelectors rely on them)")
    if v.nfd.enabled:
        raise ValuesError("nfd.enabled: kubegpu does not deploy node-feature-discovery; install it from its own "
                          "chart and set nfd.enabled: false")
    if v.mode == "full" and not v.webhook.cert_manager and not v.webhook.ca_bundle:
        raise ValuesError("webhook.caBundle: without cert-manager (webhook.certManager: false) the API server "
                          "needs the CA that signed the webhook's certificate; run `kubegpu webhook-certs` and "
                          "set webhook.caBundle, or install cert-manager")
    for cidr in v.network_policy.api_server_cidrs:
        try:
            ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            raise ValuesError(f"networkPolicy.apiServerCIDRs: {cidr!r} is not a CIDR such as 10.0.0.0/24") from None
    if v.max_gpu_containers < 1:
        raise ValuesError(f"maxGpuContainers: {v.max_gpu_containers} would refuse every GPU pod; give 1 or more")
    if not 1 <= v.metrics_port <= 65535:
        raise ValuesError(f"metricsPort: {v.metrics_port} is not a TCP port (1-65535); the node daemon's probes "
                          "and Prometheus read it")
    for p in v.mig_profiles:
        if not R.MIG_PROFILE_RE.match(p):
            raise ValuesError(f"migProfiles: {p!r} is not a MIG profile name such as 1g.10gb or 1g.10gb+me")
    for n in v.gpu_resources:
        if "/" not in n:
            raise ValuesError(f"gpuResources: {n!r} is not a domain-qualified resource name (nvidia.com/small)")
    gpu_resources(v)  # every config.map entry must load as the node daemon would load it
    for i, s in enumerate(v.image_pull_secrets):
        if set(s) != {"name"} or not s.get("name"):
            raise ValuesError(f"imagePullSecrets[{i}]: expected {{name: <secret>}}")


def default_affinity() -> dict[str, Any]:
    """NVIDIA's chart: run on nodes that NFD or GFD found an NVIDIA GPU on."""
    terms = [
        ("feature.node.kubernetes.io/pci-10de.present", "true"),
        ("feature.node.kubernetes.io/cpu-model.vendor_id", "NVIDIA"),
        ("nvidia.com/gpu.present", "true"),
    ]
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": k, "operator": "In", "values": [v]}]} for k, v in terms
                ]
            }
        }
    }


def load_values(path: Path | None = None) -> Values:
    """Defaults, overridden by the YAML file at ``path`` (if any)."""
    if path is None:
        return Values()
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ValuesError(f"cannot read {path}: {exc.strerror}") from None
    except (yaml.YAMLError, RecursionError) as exc:  # RecursionError: nested too deeply
        raise ValuesError(f"{path} is not valid YAML: {str(exc)[:300]}") from None
    return values_from_dict(raw)


def values_from_dict(raw: object) -> Values:
    if not isinstance(raw, dict):
        raise ValuesError("the values file must be a mapping")
    try:
        v = msgspec.convert(raw, Values)
    except msgspec.ValidationError as exc:
        # msgspec says "... - at `$.scheduler.weight`": keep that path, it names the key.
        raise ValuesError(f"invalid values: {exc}") from None
    check_values(v)
    return v
