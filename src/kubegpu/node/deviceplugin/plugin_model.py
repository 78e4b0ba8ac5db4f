"""What a device-plugin server serves, in the plugin's own terms.

The inventory engineer's ``node.resources`` expands config + inventory into resources and
device IDs straight into these values (``node.resources.expand``), so the gRPC servers,
the Allocate builder and GetPreferredAllocation never read config files or NVML.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from kubegpu.node.mps.spec import Binding

Sharing = Literal["none", "time-slicing", "mps", "slots"]
DeviceListStrategy = Literal["envvar", "volume-mounts", "cdi-annotations", "cdi-cri"]
DeviceIdStrategy = Literal["uuid", "index"]

DEVICE_LIST_STRATEGIES: tuple[str, ...] = ("envvar", "volume-mounts", "cdi-annotations", "cdi-cri")
DEVICE_ID_STRATEGIES: tuple[str, ...] = ("uuid", "index")
REPLICA_SEPARATOR = "::"


@dataclass(frozen=True, slots=True)
class AdvertisedDevice:
    """One device ID as the kubelet sees it, and what it stands for on the node."""

    id: str  # advertised ID: GPU-…, MIG-…, or <uuid>::<k> for a replica / slot
    uuid: str  # the GPU or MIG device handed to the runtime (replica suffix stripped)
    index: str  # NVML index: "3", or "3:1" for a MIG device
    gpu_uuid: str  # the physical GPU (topology, health parent)
    minor: int  # the physical GPU's minor: /dev/nvidia<minor>
    numa_node: int | None = None
    replica: int | None = None
    gi: int | None = None  # MIG GPU instance, for the nvidia-caps device nodes
    ci: int | None = None
    memory_bytes: int = 0  # of the GPU or MIG device

    @property
    def is_mig(self) -> bool:
        return self.gi is not None


@dataclass(frozen=True, slots=True)
class ResourcePlan:
    """One resource served by one gRPC server on one socket."""

    name: str  # e.g. nvidia.com/gpu, nvidia.com/mig-1g.10gb, nvidia.com/gpu.shared, kubegpu.io/gpu.shared
    devices: tuple[AdvertisedDevice, ...]
    sharing: Sharing = "none"
    replicas: int = 1  # per GPU, for replicas and slots
    fail_requests_greater_than_one: bool = False

    @property
    def socket_name(self) -> str:
        """NVIDIA's naming: ``nvidia-<name part>.sock``; kubegpu.io resources get ``kubegpu-``."""
        domain, _, part = self.name.partition("/")
        prefix = "nvidia" if domain == "nvidia.com" else domain.split(".")[0]
        return f"{prefix}-{part}.sock"

    @property
    def shared(self) -> bool:
        return self.sharing != "none"


class Enforcer(Protocol):
    """What Allocate asks of the node's MPS side (:class:`kubegpu.node.mps.enforcer.ShareEnforcer`);
    each raises ``MpsError`` (a RuntimeError) when the share cannot be enforced now, or (strict) when a GPU
    cannot change hands now. ``holder`` names the container (:func:`~.allocate.holder_of`)."""

    def for_replicas(self, resource: str, order: Sequence[str]) -> Binding: ...

    def for_share(self, parts: Sequence[tuple[str, int, int]], order: Sequence[str] | None = None,
                  holder: str = "") -> Binding | None: ...

    def claim_whole(self, uuid: str, holder: str) -> None: ...

    def release_whole(self, uuid: str, holder: str) -> None: ...


@dataclass(frozen=True, slots=True)
class PluginSettings:
    """The flags that shape Allocate answers and the servers (NVIDIA's ``flags.plugin`` and friends)."""

    device_list_strategies: tuple[str, ...] = ("envvar",)
    device_id_strategy: str = "uuid"
    pass_device_specs: bool = False
    driver_root: str = "/"
    dev_root: str = "/"  # NVIDIA's devRoot: where the /dev/nvidia* nodes live on the host (device specs, CDI)
    gdrcopy_enabled: bool = False
    gds_enabled: bool = False
    mofed_enabled: bool = False
    # CDI spec generation with the NVIDIA Container Toolkit (node/cdi.py).
    nvidia_ctk_path: str = "/usr/bin/nvidia-ctk"
    container_driver_root: str = "/driver-root"
    cdi_feature_flags: tuple[str, ...] = ()
    cdi_dir: str = "/var/run/cdi"
    cdi_vendor: str = "k8s.device-plugin.nvidia.com"
    cdi_class: str = "gpu"
    cdi_annotation_prefix: str = "cdi.k8s.io/"
    mps_root: str = "/run/nvidia/mps"
    mig_minors_file: str = "/proc/driver/nvidia-caps/mig-minors"
    replica_policy: Literal["distributed", "packed"] = "distributed"
    pre_start_required: bool = False
    extra_env: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    # The node's MPS side (set by the daemon when MPS replicas or share enforcement are on).
    enforcer: Enforcer | None = None

    @property
    def cdi_enabled(self) -> bool:
        return any(s.startswith("cdi-") for s in self.device_list_strategies)
