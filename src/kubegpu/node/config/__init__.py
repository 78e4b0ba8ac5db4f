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

from kubegpu.node.config.load import load_config, read_config_file
from kubegpu.node.config.model import (
    CONFIG_VERSION,
    DEFAULT_IGNORED_XIDS,
    DEVICE_ID_STRATEGIES,
    DEVICE_LIST_STRATEGIES,
    DISCOVERY_STRATEGIES,
    MIG_STRATEGIES,
    NVIDIA_DOMAIN,
    REPLICA_CHOICES,
    SHARE_ENFORCEMENTS,
    SHARING_STRATEGIES,
    Config,
    ConfigError,
    DraConfig,
    Flags,
    GfdFlags,
    Imex,
    KubegpuSettings,
    PluginFlags,
    ReplicaDevices,
    ReplicaSharing,
    ReplicatedResource,
    ResourcePattern,
    Resources,
    Sharing,
    XidPolicy,
)
from kubegpu.node.config.options import (
    CONFIG_FILE_ENV,
    CONFIG_FILE_FLAG,
    OPTIONS,
    OPTIONS_BY_FLAG,
    OPTIONS_BY_KEY,
    Option,
)
from kubegpu.node.config.parse import parse_duration, parse_resource_config, resource_name

__all__ = [
    "CONFIG_FILE_ENV", "CONFIG_FILE_FLAG", "CONFIG_VERSION", "DEFAULT_IGNORED_XIDS", "DEVICE_ID_STRATEGIES",
    "DEVICE_LIST_STRATEGIES", "DISCOVERY_STRATEGIES", "MIG_STRATEGIES", "NVIDIA_DOMAIN", "OPTIONS",
    "OPTIONS_BY_FLAG", "OPTIONS_BY_KEY", "REPLICA_CHOICES", "SHARE_ENFORCEMENTS", "SHARING_STRATEGIES", "Config",
    "ConfigError", "DraConfig",
    "Flags", "GfdFlags", "Imex", "KubegpuSettings", "Option", "PluginFlags", "ReplicaDevices",
    "ReplicaSharing", "ReplicatedResource", "ResourcePattern", "Resources", "Sharing", "XidPolicy",
    "load_config", "parse_duration", "parse_resource_config", "read_config_file",
    "resource_name",
]
