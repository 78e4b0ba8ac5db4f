"""The install values: one typed structure, keys mirroring NVIDIA's device-plugin chart where they overlap.

An operator who has a values file for ``nvidia-device-plugin`` can reuse it here unchanged: the keys kubegpu
honours are fields below under the chart's names, and ``nvidia_chart.py`` says what happens to the others.
Every unknown key, bad value and setting kubegpu cannot honour is reported at once, in one error that names
the file and each key with what to do.
"""

from __future__ import annotations

import ipaddress
import re
import typing
from pathlib import Path
from typing import Any, Final, Literal

import msgspec
import yaml

from kubegpu import __version__
from kubegpu.install.nvidia_chart import KUBEGPU_REPOSITORY, field_type, prepare
from kubegpu.model import resources as R
from kubegpu.model.limits import DEFAULT_MAX_GPU_CONTAINERS


class ValuesError(ValueError):
    """A values file that cannot be used: every problem found, each naming its key and what to do."""

    def __init__(self, problems: str | list[str], source: str = "") -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        where = f"{source}: " if source else ""
        if len(self.problems) == 1:
            text = where + self.problems[0]
        else:
            text = (f"{where}{len(self.problems)} settings to change (nothing was rendered):"
                    + "".join(f"\n  - {p}" for p in self.problems))
        super().__init__(text)


class _Struct(msgspec.Struct, rename="camel", forbid_unknown_fields=True, omit_defaults=False):
    pass


class Image(_Struct):
    """kubegpu's image (every role runs it). NVIDIA's ``image:`` block is not this: see nvidia_chart.py."""

    repository: str = KUBEGPU_REPOSITORY
    tag: str = __version__  # "" = this release's, as a chart's appVersion
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"

    @property
    def ref(self) -> str:
        return f"{self.repository}:{self.tag or __version__}"


# A container image tag (the OCI distribution spec's grammar).
_TAG_RE: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")


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
    # NVIDIA's chart deploys GPU feature discovery when true (default false); `kubegpu node` publishes the
    # same labels itself either way (the extender and nodeSelectors rely on them), so no GFD DaemonSet is
    # rendered and true only earns a note. Its other keys: nvidia_chart.py.
    enabled: bool = False


class NfdValues(_Struct):
    # NVIDIA's chart can deploy node-feature-discovery as a subchart; kubegpu does not (install NFD from
    # its own chart), so true is refused. None = not set (NVIDIA's chart then follows gfd.enabled).
    enabled: bool | None = None


class CdiValues(_Struct):
    # NVIDIA's chart: the nvidia-cdi-hook (nvidia-ctk) path written into generated CDI specs.
    nvidia_hook_path: str = ""
    # NVIDIA's chart: CDI feature flags for spec generation, a comma-separated string (a list is taken too).
    feature_flags: str | list[str] | None = None


class MainContainerValues(_Struct):
    # Extra environment of the node container; an entry replaces kubegpu's of the same name.
    env: list[dict[str, Any]] = msgspec.field(default_factory=list)


class DevicePluginContainers(_Struct):
    main: MainContainerValues = msgspec.field(default_factory=MainContainerValues)


class DevicePluginValues(_Struct):
    # NVIDIA's chart: whether the device-plugin DaemonSet is deployed. It is kubegpu's node DaemonSet, so
    # false is refused.
    enabled: bool = True
    enable_host_network: bool = False
    containers: DevicePluginContainers = msgspec.field(default_factory=DevicePluginContainers)


class ReservationValues(_Struct):
    # GPUs held for a pod of minGpus+ whole GPUs once it has waited waitSeconds, at most maxShare of the
    # cluster's GPUs (docs/scheduler.md, "Reservations for wide pods"); enabled: false turns them off.
    enabled: bool = True
    min_gpus: int = 4
    wait_seconds: float = 60.0
    max_share: float = 0.25


class SchedulerValues(_Struct):
    # "" = registry.k8s.io/kube-scheduler at the cluster's release (kubeVersion).
    kube_scheduler_image: str = ""
    runtime_class_name: str | None = None
    scheduler_name: str = "kubegpu-scheduler"
    replicas: int = 1
    node_policy: str = "kubegpu"
    gpu_policy: str = "kubegpu"
    http_timeout: str = "10s"  # filter/prioritize answer in ms; bind makes an API call
    # Two series per GPU on the extender's /metrics (kubegpu scheduler --metrics-per-gpu): small clusters only.
    metrics_per_gpu: bool = False
    weight: int = 5
    port: int = 8888
    resources: dict[str, Any] = msgspec.field(default_factory=dict)
    reservation: ReservationValues = msgspec.field(default_factory=ReservationValues)


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


class ClaimTemplateValues(_Struct):
    """A ResourceClaimTemplate ``manifests --dra`` renders in each of ``namespaces`` (install/dra/claim_templates.py):
    ``gpus`` whole GPUs, or one share of ``compute`` percent and ``memory`` (a quantity such as 20Gi)."""

    name: str
    namespaces: list[str]
    gpus: int | None = None
    compute: int | str | None = None
    memory: int | str | None = None


class DraValues(_Struct):
    # The share sizes and GPU counts pods on DRA nodes ask for, as ResourceClaimTemplates (docs/dra.md).
    claim_templates: list[ClaimTemplateValues] = msgspec.field(default_factory=list)


class Values(_Struct):
    mode: Literal["node-only", "full"] = "full"
    # The cluster's Kubernetes release, "1.24" .. NEWEST; "" = the newest.
    kube_version: str = ""
    namespace: str = "kubegpu-system"
    image: Image = msgspec.field(default_factory=Image)
    # kubegpu's image without doubt (wins over image): for a values file whose image block is NVIDIA's.
    kubegpu_image: Image | None = None
    # NVIDIA chart keys for the node DaemonSet's pods.
    image_pull_secrets: list[dict[str, str]] = msgspec.field(default_factory=list)
    pod_annotations: dict[str, str] = msgspec.field(default_factory=dict)
    # The node container's securityContext, replacing kubegpu's (as NVIDIA's chart does); {} (NVIDIA's
    # default) = kubegpu's.
    security_context: dict[str, Any] | None = None
    # The node pod's securityContext, over kubegpu's (root: the kubelet's directories are root's).
    pod_security_context: dict[str, Any] = msgspec.field(default_factory=dict)
    update_strategy: dict[str, Any] = msgspec.field(default_factory=lambda: {"type": "RollingUpdate"})
    fullname_override: str = ""  # the node role's object names (default kubegpu-node)
    # The node role's object names when fullnameOverride is not given (kubegpu has no release name to prefix).
    name_override: str = ""
    namespace_override: str = ""  # wins over namespace, as in NVIDIA's chart
    # NVIDIA's chart refuses the default namespace unless this is true; kubegpu too (and always in full mode).
    allow_default_namespace: bool = False
    # Labels added to the node DaemonSet's selector and pods (beside kubegpu's own).
    selector_labels_override: dict[str, str] = msgspec.field(default_factory=dict)
    device_plugin: DevicePluginValues = msgspec.field(default_factory=DevicePluginValues)
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
    gds_enabled: bool | None = None
    mofed_enabled: bool | None = None
    gdrcopy_enabled: bool | None = None
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
    dra: DraValues = msgspec.field(default_factory=DraValues)


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

    return v.fullname_override or v.name_override or NODE_SA


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
    bad: list[str] = []  # every entry that does not load, not the first only
    for entry, text in v.config.map.items():
        try:
            doc = yaml.safe_load(text) or {}
            cfg = load_config(file=doc)
        except (yaml.YAMLError, ConfigError) as exc:
            bad.append(f"config.map.{entry}: {exc}")
            continue
        for section in (cfg.sharing.time_slicing, cfg.sharing.mps):
            names.update(section.served_name(r) for r in section.resources)
        names.update(p.name for p in (*cfg.resources.gpus, *cfg.resources.migs))
    if bad:
        raise ValuesError(bad)
    return tuple(sorted(n for n in names if n))


DRA_MIN_KUBE: Final = (1, 34)  # resource.k8s.io/v1, the only DRA API kubegpu's driver and install speak


def check_values(v: Values) -> None:
    """Raise one ValuesError listing every problem of :func:`problems`."""
    found = problems(v)
    if found:
        raise ValuesError(found)


def problems(v: Values) -> list[str]:
    """What the types cannot say: settings that would render and then fail on the cluster, each naming its key
    and what to do (all of them, so an operator fixes a file in one round)."""
    out: list[str] = []
    try:
        kube_version(v)
    except ValuesError as exc:
        out += exc.problems
    c = v.config
    if c.map and c.name:
        out.append("config.name and config.map: give one (name mounts an existing ConfigMap, map creates one)")
    if c.default and c.map and c.default not in c.map:
        out.append(f"config.default: {c.default!r} is not an entry of config.map ({', '.join(sorted(c.map))}); "
                   "every node would fail to start")
    elif c.map and not default_config_entry(v):
        out.append(f"config.default: config.map has {len(c.map)} entries and none is chosen for nodes without "
                   "the nvidia.com/device-plugin.config label; set config.default (or name an entry 'default')")
    if v.device_discovery_strategy not in (None, "auto", "nvml"):
        out.append(f"deviceDiscoveryStrategy: {v.device_discovery_strategy!r} is not supported: kubegpu discovers "
                   "GPUs through NVML only; Tegra and VFIO passthrough GPUs have no kubegpu backend: give auto or "
                   "nvml, and keep NVIDIA's device plugin on those nodes")
    if v.nfd.enabled:
        out.append("nfd.enabled: kubegpu does not deploy node-feature-discovery; install it from its own chart "
                   "and set nfd.enabled: false (or remove it)")
    if not v.device_plugin.enabled:
        out.append("devicePlugin.enabled: false cannot be honoured: kubegpu's node DaemonSet is the device plugin "
                   "(GPU feature discovery's labels come from it too); remove it")
    for i, e in enumerate(v.device_plugin.containers.main.env):
        name = e.get("name")
        if not isinstance(name, str) or not name:
            out.append(f"devicePlugin.containers.main.env[{i}]: expected {{name: ..., value: ...}}")
        elif name == "NODE_NAME" or name.startswith("KUBEGPU_"):
            out.append(f"devicePlugin.containers.main.env[{i}]: {name} is set by kubegpu (the node name, the "
                       "record key, the served resources); remove it")
    r = v.scheduler.reservation
    if r.min_gpus < 1:
        out.append(f"scheduler.reservation.minGpus: {r.min_gpus} must be 1 or more (4: pods of 4+ whole GPUs)")
    if not r.wait_seconds >= 0:
        out.append(f"scheduler.reservation.waitSeconds: {r.wait_seconds} must be 0 or more")
    if not 0 <= r.max_share <= 1:
        out.append(f"scheduler.reservation.maxShare: {r.max_share} must be a fraction of the GPUs, from 0 to 1")
    ns = target_namespace(v)
    if ns == "default" and v.mode == "full":
        out.append("namespace: kubegpu's full install cannot live in 'default': the webhook never reviews its own "
                   "namespace, so GPU pods there would be admitted unchecked; set namespace (or "
                   "namespaceOverride) to a namespace of its own")
    elif ns == "default" and not v.allow_default_namespace:
        out.append("namespace: 'default' is refused, as NVIDIA's chart refuses it; set namespace (or "
                   "namespaceOverride), or allowDefaultNamespace: true")
    for key, image in (("image", v.image), ("kubegpuImage", v.kubegpu_image)):
        if image is not None and image.tag and not _TAG_RE.fullmatch(image.tag):
            out.append(f"{key}.tag: {image.tag!r} is not an image tag (letters, digits, '_', '.', '-'; 128 at most)")
    if v.mode == "full" and not v.webhook.cert_manager and not v.webhook.ca_bundle:
        out.append("webhook.caBundle: without cert-manager (webhook.certManager: false) the API server needs the CA "
                   "that signed the webhook's certificate; run `kubegpu webhook-certs` and set webhook.caBundle, "
                   "or install cert-manager")
    for cidr in v.network_policy.api_server_cidrs:
        try:
            ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            out.append(f"networkPolicy.apiServerCIDRs: {cidr!r} is not a CIDR such as 10.0.0.0/24")
    if v.max_gpu_containers < 1:
        out.append(f"maxGpuContainers: {v.max_gpu_containers} would refuse every GPU pod; give 1 or more")
    if not 1 <= v.metrics_port <= 65535:
        out.append(f"metricsPort: {v.metrics_port} is not a TCP port (1-65535); the node daemon's probes and "
                   "Prometheus read it")
    for p in v.mig_profiles:
        if not R.MIG_PROFILE_RE.match(p):
            out.append(f"migProfiles: {p!r} is not a MIG profile name such as 1g.10gb or 1g.10gb+me")
    for n in v.gpu_resources:
        if "/" not in n:
            out.append(f"gpuResources: {n!r} is not a domain-qualified resource name (nvidia.com/small)")
    try:
        gpu_resources(v)  # every config.map entry must load as the node daemon would load it
    except ValuesError as exc:
        out += exc.problems
    for i, s in enumerate(v.image_pull_secrets):
        if set(s) != {"name"} or not s.get("name"):
            out.append(f"imagePullSecrets[{i}]: expected {{name: <secret>}}")
    from kubegpu.install.dra.claim_templates import claim_template_problems  # it renders from these values

    out += claim_template_problems(v)
    return out


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
    return read_values(path)[0]


def read_values(path: Path | None = None) -> tuple[Values, list[str]]:
    """:func:`load_values` with the notes the operator must read (what of NVIDIA's chart is not used); every
    problem of the file in one ValuesError that names it."""
    if path is None:
        return Values(), []
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ValuesError(f"cannot read {path}: {exc.strerror}") from None
    except (yaml.YAMLError, RecursionError) as exc:  # RecursionError: nested too deeply
        raise ValuesError(f"{path} is not valid YAML: {str(exc)[:300]}") from None
    try:
        return parse_values(raw)
    except ValuesError as exc:
        raise ValuesError(exc.problems, source=str(path)) from None


def values_from_dict(raw: object) -> Values:
    return parse_values(raw)[0]


def parse_values(raw: object) -> tuple[Values, list[str]]:
    """Values from a mapping (NVIDIA's chart keys read by nvidia_chart.py), and the notes for the operator."""
    if not isinstance(raw, dict):
        raise ValuesError("the values file must be a mapping")
    prepared = prepare(raw, Values)
    found = prepared.problems
    good = prepared.raw
    try:
        v = msgspec.convert(good, Values)
    except msgspec.ValidationError:
        # One key at a time, so every bad value is named, not the first only; the others are still checked.
        good = {}
        for key, value in prepared.raw.items():
            try:
                msgspec.convert({key: value}, Values)
                good[key] = value
            except msgspec.ValidationError as exc:
                found.append(_validation_problem(str(exc), Values))
        v = msgspec.convert(good, Values)
    if v.kubegpu_image is not None:
        v.image = v.kubegpu_image
    if not v.image.tag:
        v.image = msgspec.structs.replace(v.image, tag=__version__)
    found += problems(v)
    if found:
        raise ValuesError(found)
    return v, prepared.notes


def _validation_problem(message: str, schema: type[msgspec.Struct]) -> str:
    """msgspec's "Expected `int`, got `str` - at `$.scheduler.weight`" as "scheduler.weight: expected ...", with
    the choices where the key has a fixed set."""
    m = re.fullmatch(r"(.*) - at `\$\.?(.*)`", message, re.S)
    if not m:
        return f"invalid values: {message}"
    what = m[1][:1].lower() + m[1][1:]
    choices = [a for t in (field_type(schema, m[2]),) for a in _literals(t)]
    if choices:
        what += f": give one of {', '.join(choices)}"
    return f"{m[2]}: {what}"


def _literals(tp: Any) -> list[str]:
    """The string choices of a ``Literal[...]`` type (also inside ``X | None``)."""
    if typing.get_origin(tp) is Literal:
        return [str(a) for a in typing.get_args(tp)]
    return [c for a in typing.get_args(tp) for c in _literals(a)]
