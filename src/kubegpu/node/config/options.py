"""The option table: file key, flag, environment variable, type, default and help of every scalar setting.

The single source the loader layers (flag > env > file > default) and ``kubegpu node``'s command line is made
from (:mod:`kubegpu.node.config.argv`), flags and ``--help`` alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal

from kubegpu.node.config.model import (
    DEVICE_ID_STRATEGIES,
    DEVICE_LIST_STRATEGIES,
    DISCOVERY_STRATEGIES,
    MIG_STRATEGIES,
    REPLICA_CHOICES,
    SHARE_ENFORCEMENTS,
)


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
    Option("kubegpu.metricsAddress", "metrics-address", "KUBEGPU_METRICS_ADDRESS", "str", ":9400",
           "host:port of /metrics, /healthz and /readyz ('' or 0 disables them)"),
    Option("kubegpu.resourceConfig", "resource-config", "RESOURCE_CONFIG", "list", (),
           "short form <resource>:<new name>:<replicas>, comma separated (gpu:sharedgpu:4)",
           ()),
    Option("kubegpu.podResourcesSocket", "pod-resources-socket", "KUBEGPU_POD_RESOURCES_SOCKET", "str",
           "/var/lib/kubelet/pod-resources/kubelet.sock",
           "the kubelet's PodResources socket, used to verify the handoff (full mode)"),
    Option("kubegpu.shareEnforcement", "share-enforcement", "KUBEGPU_SHARE_ENFORCEMENT", "choice", "none",
           "what holds fine-grained GPU shares to their limits: strict (one MPS server per GPU, the GPU "
           "EXCLUSIVE_PROCESS while it holds shares: no container edit escapes), mps or per-shape (an MPS control "
           "daemon per share shape; a container that skips its server escapes) or none (environment variables "
           "only)", SHARE_ENFORCEMENTS),
    Option("kubegpu.mpsServerUid", "mps-server-uid", "KUBEGPU_MPS_SERVER_UID", "int", 0,
           "strict share enforcement: the user each GPU's MPS server runs for (share containers must run as it)",
           (), 0, 2**31 - 1),
    Option("kubegpu.mpsControlBinary", "mps-control-binary", "KUBEGPU_MPS_CONTROL_BINARY", "str", "",
           "the nvidia-cuda-mps-control to run ('' = the one under the driver root)"),
    # The DRA driver's own settings (--kubelet-plugin dra); the device plugins ignore them.
    Option("kubegpu.dra.sharedGpus", "dra-shared-gpus", "KUBEGPU_DRA_SHARED_GPUS", "str", "all",
           "DRA: the GPUs that take shares beside whole claims: all, none (whole GPUs only) or indexes (0,2-3)"),
    Option("kubegpu.dra.pluginsDir", "dra-plugins-dir", "KUBEGPU_DRA_PLUGINS_DIR", "str",
           "/var/lib/kubelet/plugins", "DRA: the kubelet's plugins directory (the driver's socket goes there)"),
    Option("kubegpu.dra.registryDir", "dra-registry-dir", "KUBEGPU_DRA_REGISTRY_DIR", "str",
           "/var/lib/kubelet/plugins_registry", "DRA: the kubelet's plugin registration directory"),
    Option("kubegpu.dra.stateDir", "dra-state-dir", "KUBEGPU_DRA_STATE_DIR", "str", "",
           "DRA: where prepared claims are checkpointed ('' = the driver's directory under the plugins dir)"),
    Option("kubegpu.dra.resync", "dra-resync", "KUBEGPU_DRA_RESYNC", "duration", 30.0,
           "DRA: time between two full ResourceSlice reconciles (the slice watch repairs sooner)"),
)

OPTIONS_BY_KEY: Final = {o.key: o for o in OPTIONS}
OPTIONS_BY_FLAG: Final = {name: o for o in OPTIONS for name in (o.flag, *o.aliases)}
CONFIG_FILE_FLAG: Final = "config-file"
CONFIG_FILE_ENV: Final = "CONFIG_FILE"
