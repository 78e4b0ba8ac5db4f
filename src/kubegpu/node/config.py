"""The node daemon's configuration, taken exactly as NVIDIA's k8s-device-plugin takes it.

One typed :class:`Config`, one loader (:func:`load_config`), one precedence rule:
**command-line flag > environment variable > config file > default**. A ConfigMap written for
NVIDIA's plugin (``version: v1``, ``flags``, ``resources``, ``sharing``, ``imex``) loads
unchanged; kubegpu's own settings live beside it under ``kubegpu:`` in the same file, and
have flags and ``KUBEGPU_*`` variables of their own. The sharing fork's short form
``--resource-config gpu:sharedgpu:4,mig-3g.20gb:small:2`` is accepted too.

Every mistake is a :class:`ConfigError` that names where it came from and the key:
``config.flags.migStrategy: 'foo' is not one of none, single, mixed``,
``--mig-strategy: …`` or ``MIG_STRATEGY: …``. Unknown keys are errors (NVIDIA's loader
silently drops them; a typo in a ConfigMap should not silently change behaviour).

The option table :data:`OPTIONS` is the single source for file keys, flag names, environment
variables, types and defaults; the CLI builds its ``--help`` from it.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import yaml

log = logging.getLogger(__name__)

CONFIG_VERSION: Final = "v1"
NVIDIA_DOMAIN: Final = "nvidia.com"

MIG_STRATEGIES: Final = ("none", "single", "mixed")
DEVICE_LIST_STRATEGIES: Final = ("envvar", "volume-mounts", "cdi-annotations", "cdi-cri")
DEVICE_ID_STRATEGIES: Final = ("uuid", "index")
DISCOVERY_STRATEGIES: Final = ("auto", "nvml", "tegra", "vfio")
REPLICA_CHOICES: Final = ("distributed", "packed")
SHARING_STRATEGIES: Final = ("none", "time-slicing", "mps")

# Xids NVIDIA's health checker treats as application errors (contracts.md §6.3).
DEFAULT_IGNORED_XIDS: Final = frozenset({13, 31, 43, 45, 68, 109})

_RESOURCE_PART_RE: Final = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")
_DOMAIN_RE: Final = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)+$")
_DURATION_RE: Final = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_DURATION_UNITS: Final = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names its source and key."""


# --- the typed configuration ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PluginFlags:
    """NVIDIA's ``flags.plugin``: how Allocate hands devices to the runtime."""

    pass_device_specs: bool = False
    device_list_strategy: tuple[str, ...] = ("envvar",)
    device_id_strategy: str = "uuid"
    cdi_annotation_prefix: str = "cdi.k8s.io/"
    nvidia_ctk_path: str = "/usr/bin/nvidia-ctk"
    container_driver_root: str = "/driver-root"
    cdi_feature_flags: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class GfdFlags:
    """NVIDIA's ``flags.gfd`` (the file is shared with GPU feature discovery)."""

    oneshot: bool = False
    no_timestamp: bool = False
    sleep_interval_s: float = 60.0
    output_file: str = "/etc/kubernetes/node-feature-discovery/features.d/gfd"
    machine_type_file: str = "/sys/class/dmi/id/product_name"


@dataclass(frozen=True, slots=True)
class Flags:
    """NVIDIA's ``flags``."""

    mig_strategy: str = "none"
    fail_on_init_error: bool = True
    restart_on_device_unhealthy: bool = False
    mps_root: str = "/run/nvidia/mps"
    nvidia_driver_root: str = "/"
    nvidia_dev_root: str = ""  # "" = the driver root, as NVIDIA defaults it
    gdrcopy_enabled: bool = False
    gds_enabled: bool = False
    mofed_enabled: bool = False
    use_node_feature_api: bool = False
    device_discovery_strategy: str = "auto"
    plugin: PluginFlags = field(default_factory=PluginFlags)
    gfd: GfdFlags = field(default_factory=GfdFlags)

    @property
    def dev_root(self) -> str:
        return self.nvidia_dev_root or self.nvidia_driver_root


@dataclass(frozen=True, slots=True)
class ResourcePattern:
    """``resources.gpus[]`` / ``resources.migs[]``: devices whose model (GPUs) or profile (MIG)
    matches the glob ``pattern`` are served as ``name``."""

    pattern: str
    name: str  # fully qualified: nvidia.com/gpu


@dataclass(frozen=True, slots=True)
class Resources:
    gpus: tuple[ResourcePattern, ...] = ()
    migs: tuple[ResourcePattern, ...] = ()


@dataclass(frozen=True, slots=True)
class ReplicaDevices:
    """Which devices of a resource are replicated: all, the first ``count``, or a list of GPU
    indexes (``"0"``), MIG indexes (``"0:1"``) or UUIDs. NVIDIA parses this and ignores it;
    kubegpu honours it."""

    all: bool = True
    count: int = 0
    ids: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ReplicatedResource:
    """One ``sharing.<strategy>.resources[]`` entry."""

    name: str  # fully qualified resource it replicates
    replicas: int
    rename: str = ""  # fully qualified, "" = keep (or <name>.shared with renameByDefault)
    devices: ReplicaDevices = field(default_factory=ReplicaDevices)


@dataclass(frozen=True, slots=True)
class ReplicaSharing:
    """``sharing.timeSlicing`` or ``sharing.mps``."""

    rename_by_default: bool = False
    fail_requests_greater_than_one: bool = False
    resources: tuple[ReplicatedResource, ...] = ()

    def served_name(self, r: ReplicatedResource) -> str:
        """The name a replicated resource is advertised under."""
        if r.rename:
            return r.rename
        return r.name + ".shared" if self.rename_by_default else r.name


@dataclass(frozen=True, slots=True)
class Sharing:
    time_slicing: ReplicaSharing = field(default_factory=ReplicaSharing)
    mps: ReplicaSharing = field(default_factory=ReplicaSharing)

    @property
    def strategy(self) -> str:
        """``none``, ``time-slicing`` or ``mps``: NVIDIA's rule, a section with a resource of more
        than one replica is active, and MPS wins when both are."""
        if any(r.replicas > 1 for r in self.mps.resources):
            return "mps"
        if any(r.replicas > 1 for r in self.time_slicing.resources):
            return "time-slicing"
        return "none"

    @property
    def active(self) -> ReplicaSharing:
        """The section whose resources are replicated (NVIDIA: MPS when configured)."""
        return self.mps if self.mps.resources else self.time_slicing

    def replication(self, name: str) -> ReplicatedResource | None:
        """The replication entry for a (fully qualified) base resource name, if any."""
        for r in self.active.resources:
            if r.name == name:
                return r
        return None


@dataclass(frozen=True, slots=True)
class Imex:
    """NVIDIA's ``imex`` section (IMEX channels); parsed so NVIDIA ConfigMaps load."""

    channel_ids: tuple[int, ...] = ()
    required: bool = False


def _parse_xids(value: str) -> tuple[bool, set[int]]:
    """``(all, xids)`` from a comma list; ``all``/``xids`` means every Xid. Malformed entries are
    logged and skipped, as NVIDIA does."""
    out: set[int] = set()
    for item in value.lower().split(","):
        item = item.strip()
        if not item:
            continue
        if item in ("all", "xids"):
            return True, set()
        if not item.isdigit():
            log.warning("ignoring malformed Xid value %r", item)
            continue
        out.add(int(item))
    return False, out


@dataclass(frozen=True, slots=True)
class XidPolicy:
    """Which Xids mark a device unhealthy: NVIDIA's ``DP_DISABLE_HEALTHCHECKS`` (``all``, ``xids`` or
    extra Xids to ignore) and ``DP_ENABLE_HEALTHCHECKS`` (Xids forced on; wins), contracts.md §6.3."""

    all_disabled: bool = False
    disabled: frozenset[int] = DEFAULT_IGNORED_XIDS
    all_enabled: bool = False
    enabled: frozenset[int] = frozenset()

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> XidPolicy:
        dis_all, dis = _parse_xids(env.get("DP_DISABLE_HEALTHCHECKS", ""))
        en_all, en = _parse_xids(env.get("DP_ENABLE_HEALTHCHECKS", ""))
        return cls(all_disabled=dis_all, disabled=frozenset(dis | DEFAULT_IGNORED_XIDS),
                   all_enabled=en_all, enabled=frozenset(en))

    @property
    def checks_off(self) -> bool:
        """Health checks are off entirely: every Xid disabled and none re-enabled."""
        return self.all_disabled and not self.enabled and not self.all_enabled

    def is_ignored(self, xid: int) -> bool:
        if self.all_enabled or xid in self.enabled:
            return False
        if self.all_disabled:
            return True
        return xid in self.disabled

    def describe(self) -> str:
        if self.checks_off:
            return "health checks disabled"
        ign = "all" if self.all_disabled else ",".join(map(str, sorted(self.disabled)))
        en = "all" if self.all_enabled else ",".join(map(str, sorted(self.enabled))) or "-"
        return f"ignored Xids: {ign}; forced on: {en}"


@dataclass(frozen=True, slots=True)
class KubegpuSettings:
    """kubegpu's own settings (``kubegpu:`` in the file)."""

    shared_slots: int = 100  # kubegpu.io/gpu.shared slots per GPU; 0 = not served
    replica_choice: str = "distributed"  # which replicas GetPreferredAllocation prefers
    health_recovery_interval_s: float = 60.0  # quiet time before a probe may recover a GPU; 0 = never
    cdi_spec_dir: str = "/var/run/cdi"
    device_plugin_dir: str = "/var/lib/kubelet/device-plugins"
    metrics_address: str = ":9402"
    resource_config: tuple[str, ...] = ()  # the sharing fork's short forms, as given
    # The kubelet's PodResources API, used to verify the handoff (full mode).
    pod_resources_socket: str = "/var/lib/kubelet/pod-resources/kubelet.sock"

    @property
    def kubelet_socket(self) -> str:
        return os.path.join(self.device_plugin_dir, "kubelet.sock")


@dataclass(frozen=True, slots=True)
class Config:
    """Everything ``kubegpu node`` is configured with."""

    version: str = CONFIG_VERSION
    flags: Flags = field(default_factory=Flags)
    resources: Resources = field(default_factory=Resources)
    sharing: Sharing = field(default_factory=Sharing)
    imex: Imex = field(default_factory=Imex)
    kubegpu: KubegpuSettings = field(default_factory=KubegpuSettings)
    health: XidPolicy = field(default_factory=XidPolicy)
    config_file: str = ""  # the file it was read from ("" = none)

    @property
    def mig_strategy(self) -> str:
        return self.flags.mig_strategy


# --- the option table ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Option:
    """One scalar setting: its file key path, flag, environment variable, type and default."""

    key: str  # dotted path in the file, e.g. flags.plugin.deviceIDStrategy
    flag: str  # command-line name without dashes, e.g. device-id-strategy
    env: str
    kind: Literal["str", "bool", "int", "ints", "duration", "choice", "choices", "list"]
    default: Any
    help: str = ""
    choices: tuple[str, ...] = ()
    minimum: int = 0
    maximum: int = 1 << 30
    aliases: tuple[str, ...] = ()  # other flag names for the same setting
    more_env: tuple[str, ...] = ()  # other variables, read in order after ``env``

    @property
    def envs(self) -> tuple[str, ...]:
        return (self.env, *self.more_env)


OPTIONS: Final[tuple[Option, ...]] = (
    Option("flags.migStrategy", "mig-strategy", "MIG_STRATEGY", "choice", "none",
           "the strategy for exposing MIG devices",
           MIG_STRATEGIES),
    Option("flags.failOnInitError", "fail-on-init-error", "FAIL_ON_INIT_ERROR", "bool", True,
           "fail if initialization fails, otherwise block indefinitely"),
    Option("flags.restartOnDeviceUnhealthy", "restart-on-device-unhealthy", "RESTART_ON_DEVICE_UNHEALTHY",
           "bool", False, "restart the plugin when a device turns unhealthy", ()),
    Option("flags.mpsRoot", "mps-root", "MPS_ROOT", "str", "/run/nvidia/mps",
           "the host path where the MPS control daemon keeps its pipes and shm"),
    Option("flags.nvidiaDriverRoot", "nvidia-driver-root", "NVIDIA_DRIVER_ROOT", "str", "/",
           "the root of the NVIDIA driver installation ('/' or '/run/nvidia/driver')",
           aliases=("driver-root",)),
    Option("flags.nvidiaDevRoot", "nvidia-dev-root", "NVIDIA_DEV_ROOT", "str", "",
           "the root of the NVIDIA device nodes (default: the driver root)", aliases=("dev-root",)),
    Option("flags.gdrcopyEnabled", "gdrcopy-enabled", "GDRCOPY_ENABLED", "bool", False,
           "start containers with NVIDIA_GDRCOPY=enabled"),
    Option("flags.gdsEnabled", "gds-enabled", "GDS_ENABLED", "bool", False,
           "start containers with NVIDIA_GDS=enabled"),
    Option("flags.mofedEnabled", "mofed-enabled", "MOFED_ENABLED", "bool", False,
           "start containers with NVIDIA_MOFED=enabled"),
    Option("flags.useNodeFeatureAPI", "use-node-feature-api", "USE_NODE_FEATURE_API", "bool", False,
           "publish labels through the NodeFeature API", more_env=("GFD_USE_NODE_FEATURE_API",)),
    Option("flags.deviceDiscoveryStrategy", "device-discovery-strategy", "DEVICE_DISCOVERY_STRATEGY",
           "choice", "auto", "how GPUs are discovered", DISCOVERY_STRATEGIES),
    Option("flags.plugin.passDeviceSpecs", "pass-device-specs", "PASS_DEVICE_SPECS", "bool", False,
           "pass the /dev/nvidia* device specs to the kubelet on Allocate"),
    Option("flags.plugin.deviceListStrategy", "device-list-strategy", "DEVICE_LIST_STRATEGY", "choices",
           ("envvar",), "how the device list reaches the runtime (comma list)", DEVICE_LIST_STRATEGIES),
    Option("flags.plugin.deviceIDStrategy", "device-id-strategy", "DEVICE_ID_STRATEGY", "choice", "uuid",
           "how devices are named to the runtime", DEVICE_ID_STRATEGIES),
    Option("flags.plugin.cdiAnnotationPrefix", "cdi-annotation-prefix", "CDI_ANNOTATION_PREFIX", "str",
           "cdi.k8s.io/", "the prefix of CDI container annotation keys"),
    Option("flags.plugin.nvidiaCTKPath", "nvidia-cdi-hook-path", "NVIDIA_CDI_HOOK_PATH", "str",
           "/usr/bin/nvidia-ctk", "the NVIDIA CDI hook (nvidia-ctk) path written in the generated CDI spec",
           aliases=("nvidia-ctk-path",), more_env=("NVIDIA_CTK_PATH",)),
    Option("flags.plugin.containerDriverRoot", "driver-root-ctr-path", "DRIVER_ROOT_CTR_PATH", "str",
           "/driver-root", "where the driver root is mounted in this container (for CDI specs)",
           aliases=("container-driver-root",), more_env=("CONTAINER_DRIVER_ROOT",)),
    Option("flags.plugin.cdiFeatureFlags", "cdi-feature-flags", "CDI_FEATURE_FLAGS", "list", (),
           "feature flags for CDI spec generation (comma list)"),
    Option("imex.channelIDs", "imex-channel-ids", "IMEX_CHANNEL_IDS", "ints", (),
           "IMEX channels to inject (comma list of numbers)"),
    Option("imex.required", "imex-required", "IMEX_REQUIRED", "bool", False,
           "the IMEX channels are required"),
    Option("flags.gfd.oneshot", "oneshot", "GFD_ONESHOT", "bool", False, "label once and exit"),
    Option("flags.gfd.noTimestamp", "no-timestamp", "GFD_NO_TIMESTAMP", "bool", False,
           "do not add the timestamp label"),
    Option("flags.gfd.sleepInterval", "sleep-interval", "GFD_SLEEP_INTERVAL", "duration", 60.0,
           "time between two labellings"),
    Option("flags.gfd.outputFile", "output-file", "GFD_OUTPUT_FILE", "str",
           "/etc/kubernetes/node-feature-discovery/features.d/gfd", "the NFD feature file"),
    Option("flags.gfd.machineTypeFile", "machine-type-file", "GFD_MACHINE_TYPE_FILE", "str",
           "/sys/class/dmi/id/product_name", "the file holding the machine type"),
    Option("kubegpu.sharedSlots", "shared-slots", "KUBEGPU_SHARED_SLOTS", "int", 100,
           "kubegpu.io/gpu.shared slots per GPU (0: not served)",
           (), 0, 10000),
    Option("kubegpu.replicaChoice", "replica-choice", "KUBEGPU_REPLICA_CHOICE", "choice", "distributed",
           "which replicas are preferred: least-shared GPU first, or packed", REPLICA_CHOICES),
    Option("kubegpu.healthRecoveryInterval", "health-recovery-interval", "KUBEGPU_HEALTH_RECOVERY_INTERVAL",
           "duration", 60.0, "quiet time after which an answering GPU is Healthy again (0: never)", ()),
    Option("kubegpu.cdiSpecDir", "cdi-spec-dir", "KUBEGPU_CDI_SPEC_DIR", "str", "/var/run/cdi",
           "where the node's CDI spec is written"),
    Option("kubegpu.devicePluginDir", "device-plugin-dir", "KUBEGPU_DEVICE_PLUGIN_DIR", "str",
           "/var/lib/kubelet/device-plugins", "the kubelet's device-plugin directory"),
    Option("kubegpu.metricsAddress", "metrics-address", "KUBEGPU_METRICS_ADDRESS", "str", ":9402",
           "host:port of the Prometheus endpoint ('' disables it)"),
    Option("kubegpu.resourceConfig", "resource-config", "RESOURCE_CONFIG", "list", (),
           "short form <resource>:<new name>:<replicas>, comma separated (gpu:sharedgpu:4)",
           ()),
    Option("kubegpu.podResourcesSocket", "pod-resources-socket", "KUBEGPU_POD_RESOURCES_SOCKET", "str",
           "/var/lib/kubelet/pod-resources/kubelet.sock",
           "the kubelet's PodResources socket, used to verify the handoff (full mode)"),
)

OPTIONS_BY_KEY: Final = {o.key: o for o in OPTIONS}
OPTIONS_BY_FLAG: Final = {name: o for o in OPTIONS for name in (o.flag, *o.aliases)}
CONFIG_FILE_FLAG: Final = "config-file"
CONFIG_FILE_ENV: Final = "CONFIG_FILE"


# --- value parsing --------------------------------------------------------------------------------


def _parse_bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        # Go's strconv.ParseBool, which NVIDIA's flags use.
        if value in ("1", "t", "T", "TRUE", "true", "True"):
            return True
        if value in ("0", "f", "F", "FALSE", "false", "False"):
            return False
    raise ConfigError(f"{where}: {value!r} is not a boolean (true or false)")


def parse_duration(value: Any, where: str) -> float:
    """Seconds from a Go duration (``90s``, ``1m30s``, ``500ms``) or a number of seconds."""
    if isinstance(value, bool):
        raise ConfigError(f"{where}: {value!r} is not a duration such as 30s or 5m")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and value.strip():
        text = value.strip()
        if re.fullmatch(r"\d+(\.\d+)?", text):
            seconds = float(text)
        else:
            parts = _DURATION_RE.findall(text)
            if not parts or "".join(n + u for n, u in parts) != text:
                raise ConfigError(f"{where}: {value!r} is not a duration such as 30s or 5m")
            seconds = sum(float(n) * _DURATION_UNITS[u] for n, u in parts)
    else:
        raise ConfigError(f"{where}: {value!r} is not a duration such as 30s or 5m")
    if seconds < 0:
        raise ConfigError(f"{where}: {value!r} is negative")
    return seconds


def _split(value: Any) -> list[str]:
    if isinstance(value, str):
        return [p.strip() for p in value.split(",") if p.strip()]
    if isinstance(value, list | tuple):
        out: list[str] = []
        for v in value:
            if not isinstance(v, str):
                raise TypeError(v)
            out += _split(v)
        return out
    raise TypeError(value)


def _parse_value(opt: Option, value: Any, where: str) -> Any:
    if opt.kind == "bool":
        return _parse_bool(value, where)
    if opt.kind == "duration":
        return parse_duration(value, where)
    if opt.kind == "int":
        if isinstance(value, str) and re.fullmatch(r"-?\d+", value.strip()):
            value = int(value.strip())
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: {value!r} is not an integer")
        if not opt.minimum <= value <= opt.maximum:
            raise ConfigError(f"{where}: {value} is not between {opt.minimum} and {opt.maximum}")
        return value
    if opt.kind == "ints":
        raw = value.split(",") if isinstance(value, str) else value
        if not isinstance(raw, list | tuple):
            raise ConfigError(f"{where}: {value!r} is not a list of numbers")
        out = []
        for item in raw:
            text = item.strip() if isinstance(item, str) else item
            if isinstance(text, str) and text.isdigit():
                text = int(text)
            if isinstance(text, bool) or not isinstance(text, int) or text < 0:
                raise ConfigError(f"{where}: {item!r} is not a channel number")
            out.append(text)
        return tuple(out)
    if opt.kind in ("choices", "list"):
        try:
            items = _split(value)
        except TypeError:
            raise ConfigError(f"{where}: {value!r} is not a string or a list of strings") from None
        if opt.kind == "choices":
            if not items:
                raise ConfigError(f"{where}: empty; want one or more of {', '.join(opt.choices)}")
            for item in items:
                if item not in opt.choices:
                    raise ConfigError(f"{where}: {item!r} is not one of {', '.join(opt.choices)}")
            if len(set(items)) != len(items):
                raise ConfigError(f"{where}: {value!r} names a strategy twice")
        return tuple(items)
    if not isinstance(value, str):
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = str(value)
        else:
            raise ConfigError(f"{where}: {value!r} is not a string")
    if opt.kind == "choice" and value not in opt.choices:
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(opt.choices)}")
    return value


# --- the file's structured sections -----------------------------------------------------------------


def _mapping(value: Any, where: str, allowed: Iterable[str]) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    allowed = tuple(allowed)
    for key in value:
        if key not in allowed:
            raise ConfigError(f"{where}.{key}: unknown key (allowed: {', '.join(allowed)})")
    return value


def resource_name(value: Any, where: str) -> str:
    """NVIDIA's ResourceName: ``gpu`` -> ``nvidia.com/gpu``; a domain-qualified name stays."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: {value!r} is not a resource name")
    domain, slash, part = value.rpartition("/")
    if not slash:
        domain = NVIDIA_DOMAIN
    if not _DOMAIN_RE.match(domain) or not _RESOURCE_PART_RE.match(part):
        raise ConfigError(f"{where}: {value!r} is not a valid extended resource name")
    return f"{domain}/{part}"


def _patterns(value: Any, where: str) -> tuple[ResourcePattern, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError(f"{where}: expected a list of {{pattern, name}}")
    out = []
    for i, item in enumerate(value):
        item = _mapping(item, f"{where}[{i}]", ("pattern", "name"))
        pattern = item.get("pattern")
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(f"{where}[{i}].pattern: {pattern!r} is not a pattern")
        name = resource_name(item.get("name"), f"{where}[{i}].name")
        out.append(ResourcePattern(pattern=pattern, name=name))
    return tuple(out)


_GPU_UUID_RE: Final = re.compile(r"^GPU-[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}$")
_MIG_UUID_RE: Final = re.compile(
    r"^MIG-([0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}|GPU-[0-9a-fA-F-]{36}/\d+/\d+)$")


def _replica_devices(value: Any, where: str) -> ReplicaDevices:
    if value is None or value == "all":
        return ReplicaDevices()
    if isinstance(value, str):
        raise ConfigError(f"{where}: devices set as {value!r} but the only valid string input is 'all'")
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ConfigError(f"{where}: devices set as {value} but a count of devices must be > 0")
        return ReplicaDevices(all=False, count=value)
    if isinstance(value, list) and value:
        ids = []
        for i, item in enumerate(value):
            ref = str(item) if isinstance(item, int) and not isinstance(item, bool) and item >= 0 else item
            if not isinstance(ref, str) or not (
                    re.fullmatch(r"\d+", ref) or re.fullmatch(r"\d+:\d+", ref)
                    or _GPU_UUID_RE.match(ref) or _MIG_UUID_RE.match(ref)):
                raise ConfigError(
                    f"{where}[{i}]: {item!r} is not a GPU index, MIG index (0:1) or device UUID")
            ids.append(ref)
        return ReplicaDevices(all=False, ids=tuple(ids))
    raise ConfigError(f"{where}: {value!r} is not 'all', a count or a list of devices")


def _replica_sharing(value: Any, where: str, mps: bool) -> ReplicaSharing:
    keys = ["renameByDefault", "failRequestsGreaterThanOne", "resources"]
    if not mps:
        keys.append("strategy")  # time-slicing's (only "" is defined)
    v = _mapping(value, where, keys)
    if not v:
        return ReplicaSharing()
    if v.get("strategy") not in (None, ""):
        raise ConfigError(f"{where}.strategy: unknown time-slicing strategy {v['strategy']!r}")
    raw = v.get("resources")
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{where}.resources: no resources specified")
    resources = []
    for i, item in enumerate(raw):
        w = f"{where}.resources[{i}]"
        item = _mapping(item, w, ("name", "rename", "devices", "replicas"))
        if "name" not in item:
            raise ConfigError(f"{w}.name: no resource name specified")
        if "replicas" not in item:
            raise ConfigError(f"{w}.replicas: no replicas specified")
        replicas = item["replicas"]
        if isinstance(replicas, bool) or not isinstance(replicas, int):
            raise ConfigError(f"{w}.replicas: {replicas!r} is not an integer")
        if replicas < 2:
            raise ConfigError(f"{w}.replicas: number of replicas must be >= 2, got {replicas} "
                              "(to stop sharing, remove the sharing section)")
        name = resource_name(item["name"], f"{w}.name")
        rename = resource_name(item["rename"], f"{w}.rename") if item.get("rename") else ""
        resources.append(ReplicatedResource(name=name, replicas=replicas, rename=rename,
                                            devices=_replica_devices(item.get("devices"), f"{w}.devices")))
    names = [r.name for r in resources]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}.resources: a resource is listed twice")
    return ReplicaSharing(
        rename_by_default=_parse_bool(v.get("renameByDefault", False), f"{where}.renameByDefault"),
        # NVIDIA defaults this to true for MPS (a second replica would not add compute) and
        # false for time-slicing.
        fail_requests_greater_than_one=_parse_bool(v.get("failRequestsGreaterThanOne", mps),
                                                   f"{where}.failRequestsGreaterThanOne"),
        resources=tuple(resources),
    )


def parse_resource_config(items: Iterable[str],
                          where: str = "--resource-config") -> tuple[ReplicatedResource, ...]:
    """The sharing fork's ``<source>:<new name>:<replicas>`` entries as replicated resources."""
    out = []
    for item in items:
        parts = item.split(":")
        if len(parts) != 3:
            raise ConfigError(
                f"{where}: {item!r} is not <resource>:<new name>:<replicas> (e.g. gpu:sharedgpu:4)")
        src, dst, n = (p.strip() for p in parts)
        if not re.fullmatch(r"\d+", n) or not 1 <= int(n) <= 10000:
            raise ConfigError(f"{where}: {item!r}: replicas {n!r} is not a whole number from 1 to 10000")
        out.append(ReplicatedResource(name=resource_name(src, f"{where}: {item!r}: resource"),
                                      rename=resource_name(dst, f"{where}: {item!r}: new name"),
                                      replicas=int(n)))
    names = [r.name for r in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}: a resource is configured twice")
    return tuple(out)


# --- loading --------------------------------------------------------------------------------------------

_TOP_KEYS: Final = ("version", "flags", "resources", "sharing", "imex", "kubegpu")


def _walk(data: Mapping[str, Any], prefix: str, out: dict[str, tuple[Any, str]]) -> None:
    """Collect the scalar options of a section, rejecting unknown keys."""
    section_keys = {o.key[len(prefix) + 1:].split(".")[0] for o in OPTIONS if o.key.startswith(prefix + ".")}
    for key, value in data.items():
        path = f"{prefix}.{key}"
        if key not in section_keys:
            raise ConfigError(f"config.{path}: unknown key (allowed: {', '.join(sorted(section_keys))})")
        if path in OPTIONS_BY_KEY:
            if value is not None:
                out[path] = (value, f"config.{path}")
        elif isinstance(value, Mapping):
            _walk(value, path, out)
        elif value is not None:
            raise ConfigError(f"config.{path}: expected a mapping, got {type(value).__name__}")


def read_config_file(path: str | Path) -> Mapping[str, Any]:
    """The YAML (or JSON) document of a config file."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError) as exc:  # RecursionError: nested too deeply
        raise ConfigError(f"config file {path}: not valid YAML: {str(exc)[:300]}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"config file {path}: expected a mapping at the top, got {type(data).__name__}")
    return data


def load_config(flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
                file: str | Path | Mapping[str, Any] | None = None) -> Config:
    """Build the one :class:`Config` from command-line flags, environment and file.

    ``flags`` holds only the flags the user set, keyed by flag name without dashes
    (``mig-strategy``); values may be strings as typed or already-typed values. ``env`` is
    usually ``os.environ``. ``file`` is a path or an already-parsed document; without it the
    ``config-file`` flag, then ``CONFIG_FILE``, name the file. Precedence: flag > env > file >
    default. Raises :class:`ConfigError`.
    """
    flags = dict(flags or {})
    env = env or {}
    for name in flags:
        if name not in OPTIONS_BY_FLAG and name != CONFIG_FILE_FLAG:
            raise ConfigError(f"--{name}: unknown flag")
    for opt in OPTIONS:
        given = [n for n in (opt.flag, *opt.aliases) if flags.get(n) is not None]
        if len(given) > 1:
            raise ConfigError(f"--{given[0]} and --{given[1]} are the same setting; give one")
    source = ""
    if file is None:
        file = flags.get(CONFIG_FILE_FLAG) or env.get(CONFIG_FILE_ENV) or None
    if isinstance(file, str | Path):
        source = str(file)
        doc = read_config_file(file)
    else:
        doc = file or {}
    doc = _mapping(doc, "config", _TOP_KEYS)

    version = doc.get("version", CONFIG_VERSION)
    if version != CONFIG_VERSION:
        raise ConfigError(f"config.version: {version!r} is not supported (only {CONFIG_VERSION})")

    # Layer the scalar options: file, then env, then flags.
    chosen: dict[str, tuple[Any, str]] = {}
    for section in ("flags", "kubegpu", "imex"):
        value = doc.get(section)
        if value is not None:
            if not isinstance(value, Mapping):
                raise ConfigError(f"config.{section}: expected a mapping, got {type(value).__name__}")
            _walk(value, section, chosen)
    for opt in OPTIONS:
        for name in opt.envs:  # the first one set wins, as urfave/cli reads EnvVars
            if env.get(name, "") != "":
                chosen[opt.key] = (env[name], name)
                break
        for name in (opt.flag, *opt.aliases):
            if flags.get(name) is not None:
                chosen[opt.key] = (flags[name], f"--{name}")
                break
    values = {o.key: o.default for o in OPTIONS}
    for key, (raw, where) in chosen.items():
        values[key] = _parse_value(OPTIONS_BY_KEY[key], raw, where)

    resources_doc = _mapping(doc.get("resources"), "config.resources", ("gpus", "migs"))
    resources = Resources(gpus=_patterns(resources_doc.get("gpus"), "config.resources.gpus"),
                          migs=_patterns(resources_doc.get("migs"), "config.resources.migs"))
    sharing_doc = _mapping(doc.get("sharing"), "config.sharing", ("timeSlicing", "mps"))
    sharing = Sharing(
        time_slicing=_replica_sharing(sharing_doc.get("timeSlicing"), "config.sharing.timeSlicing", mps=False),
        mps=_replica_sharing(sharing_doc.get("mps"), "config.sharing.mps", mps=True),
    )
    short = parse_resource_config(values["kubegpu.resourceConfig"],
                                  chosen.get("kubegpu.resourceConfig", ("", "--resource-config"))[1])
    if short:
        if sharing.mps.resources:
            raise ConfigError(
                "--resource-config: cannot be combined with sharing.mps (it configures time-slicing)")
        taken = {r.name for r in sharing.time_slicing.resources}
        for r in short:
            if r.name in taken:
                raise ConfigError(f"--resource-config: {r.name} is already in sharing.timeSlicing.resources")
        ts = sharing.time_slicing
        sharing = Sharing(time_slicing=ReplicaSharing(ts.rename_by_default, ts.fail_requests_greater_than_one,
                                                      ts.resources + short), mps=sharing.mps)

    # Replicas of whole GPUs and fine-grained share slots on the same GPUs would each account the GPU
    # as theirs and overcommit it: with replica sharing of nvidia.com/gpu the slots default to 0.
    replicated = sharing.replication("nvidia.com/gpu")
    if replicated is not None and values["kubegpu.sharedSlots"] > 0:
        if "kubegpu.sharedSlots" in chosen:
            raise ConfigError(
                f"{chosen['kubegpu.sharedSlots'][1]}: {values['kubegpu.sharedSlots']} share slots on GPUs that "
                f"nvidia.com/gpu replicas ({replicated.replicas} per GPU) also share would overcommit them; "
                "set it to 0 or remove the replica sharing")
        values["kubegpu.sharedSlots"] = 0

    imex = Imex(channel_ids=tuple(values["imex.channelIDs"]), required=values["imex.required"])

    v = values
    return Config(
        version=CONFIG_VERSION,
        flags=Flags(
            mig_strategy=v["flags.migStrategy"],
            fail_on_init_error=v["flags.failOnInitError"],
            restart_on_device_unhealthy=v["flags.restartOnDeviceUnhealthy"],
            mps_root=v["flags.mpsRoot"],
            nvidia_driver_root=v["flags.nvidiaDriverRoot"],
            nvidia_dev_root=v["flags.nvidiaDevRoot"],
            gdrcopy_enabled=v["flags.gdrcopyEnabled"],
            gds_enabled=v["flags.gdsEnabled"],
            mofed_enabled=v["flags.mofedEnabled"],
            use_node_feature_api=v["flags.useNodeFeatureAPI"],
            device_discovery_strategy=v["flags.deviceDiscoveryStrategy"],
            plugin=PluginFlags(
                pass_device_specs=v["flags.plugin.passDeviceSpecs"],
                device_list_strategy=tuple(v["flags.plugin.deviceListStrategy"]),
                device_id_strategy=v["flags.plugin.deviceIDStrategy"],
                cdi_annotation_prefix=v["flags.plugin.cdiAnnotationPrefix"],
                nvidia_ctk_path=v["flags.plugin.nvidiaCTKPath"],
                container_driver_root=v["flags.plugin.containerDriverRoot"],
                cdi_feature_flags=tuple(v["flags.plugin.cdiFeatureFlags"]),
            ),
            gfd=GfdFlags(
                oneshot=v["flags.gfd.oneshot"],
                no_timestamp=v["flags.gfd.noTimestamp"],
                sleep_interval_s=v["flags.gfd.sleepInterval"],
                output_file=v["flags.gfd.outputFile"],
                machine_type_file=v["flags.gfd.machineTypeFile"],
            ),
        ),
        resources=resources,
        sharing=sharing,
        imex=imex,
        kubegpu=KubegpuSettings(
            shared_slots=v["kubegpu.sharedSlots"],
            replica_choice=v["kubegpu.replicaChoice"],
            health_recovery_interval_s=v["kubegpu.healthRecoveryInterval"],
            cdi_spec_dir=v["kubegpu.cdiSpecDir"],
            device_plugin_dir=v["kubegpu.devicePluginDir"],
            metrics_address=v["kubegpu.metricsAddress"],
            resource_config=tuple(v["kubegpu.resourceConfig"]),
            pod_resources_socket=v["kubegpu.podResourcesSocket"],
        ),
        health=XidPolicy.from_env(env),
        config_file=source,
    )


def flag_help() -> list[tuple[str, str, str, str]]:
    """(flag, env var, default, help) rows, for ``kubegpu node --help`` and the docs."""
    def show(o: Option) -> str:
        d = o.default
        if isinstance(d, tuple):
            return ",".join(str(x) for x in d)
        if isinstance(d, bool):
            return str(d).lower()
        if o.kind == "duration":
            return f"{d:g}s"
        return str(d)
    rows = [(", ".join(f"--{n}" for n in (o.flag, *o.aliases)), ", ".join(o.envs), show(o), o.help)
            for o in OPTIONS]
    rows.append((f"--{CONFIG_FILE_FLAG}", CONFIG_FILE_ENV, "",
                 "the config file (NVIDIA's format plus a kubegpu: section)"))
    return rows

