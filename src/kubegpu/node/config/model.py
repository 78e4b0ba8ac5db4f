"""The typed node configuration: one frozen dataclass tree, what every part of the daemon reads.

Built only by :func:`kubegpu.node.config.load.load_config`; nothing else constructs or amends it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

log = logging.getLogger("kubegpu.node.config")

CONFIG_VERSION: Final = "v1"
NVIDIA_DOMAIN: Final = "nvidia.com"

MIG_STRATEGIES: Final = ("none", "single", "mixed")
DEVICE_LIST_STRATEGIES: Final = ("envvar", "volume-mounts", "cdi-annotations", "cdi-cri")
DEVICE_ID_STRATEGIES: Final = ("uuid", "index")
DISCOVERY_STRATEGIES: Final = ("auto", "nvml", "tegra", "vfio")
REPLICA_CHOICES: Final = ("distributed", "packed")
SHARING_STRATEGIES: Final = ("none", "time-slicing", "mps")
# What the operator may write for kubegpu.shareEnforcement (node/mps/capability.py says what each guarantees;
# per-shape is read as mps).
SHARE_ENFORCEMENTS: Final = ("none", "mps", "per-shape", "strict")

# Xids NVIDIA's health checker treats as application errors (contracts.md §6.3).
DEFAULT_IGNORED_XIDS: Final = frozenset({13, 31, 43, 45, 68, 109})


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
class DraConfig:
    """The DRA driver's settings (``kubegpu.dra`` in the file), read only with ``--kubelet-plugin dra``."""

    shared_gpus: str = "all"  # all, none, or GPU indexes (0,2-3) that take shares beside whole claims
    plugins_dir: str = "/var/lib/kubelet/plugins"
    registry_dir: str = "/var/lib/kubelet/plugins_registry"
    state_dir: str = ""  # "" = the plugin's own directory under plugins_dir
    resync_s: float = 30.0  # seconds between full ResourceSlice reconciles (the watch repairs sooner)


@dataclass(frozen=True, slots=True)
class KubegpuSettings:
    """kubegpu's own settings (``kubegpu:`` in the file)."""

    shared_slots: int = 100  # kubegpu.io/gpu.shared slots per GPU; 0 = not served
    replica_choice: str = "distributed"  # which replicas GetPreferredAllocation prefers
    health_recovery_interval_s: float = 60.0  # quiet time before a probe may recover a GPU; 0 = never
    cdi_spec_dir: str = "/var/run/cdi"
    device_plugin_dir: str = "/var/lib/kubelet/device-plugins"
    metrics_address: str = ":9400"  # the port the manifests expose (install values metricsPort)
    resource_config: tuple[str, ...] = ()  # the sharing fork's short forms, as given
    # The kubelet's PodResources API, used to verify the handoff (full mode).
    pod_resources_socket: str = "/var/lib/kubelet/pod-resources/kubelet.sock"
    # What holds a fine-grained share to its percent and memory (docs/sharing.md, "Enforcement modes"):
    # "strict" (one MPS server per GPU, the GPU EXCLUSIVE_PROCESS while it holds shares: no container edit
    # escapes), "mps" (a control daemon per share shape; a container that skips its server escapes) or "none"
    # (the KUBEGPU_* variables only: a label, not a limit). "per-shape" is read as "mps".
    share_enforcement: str = "none"
    mps_server_uid: int = 0  # strict: the user each GPU's MPS server runs for (its clients must run as it)
    mps_control_binary: str = ""  # "" = nvidia-cuda-mps-control under the driver root
    dra: DraConfig = field(default_factory=DraConfig)

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
