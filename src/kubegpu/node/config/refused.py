"""NVIDIA settings kubegpu parses but cannot honour: refused with a message that names them, never dropped.

A ConfigMap written for NVIDIA's plugin loads unchanged as long as these keep NVIDIA's defaults (then
NVIDIA's behaviour and kubegpu's are the same); a value that would change NVIDIA's behaviour is an error,
because kubegpu would otherwise accept it and do something else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

from kubegpu.node.config.model import ConfigError

_GFD = ("an option of NVIDIA's GPU feature discovery; `kubegpu node` publishes GFD's labels itself, through "
        "the API server, continuously and without a timestamp or machine-type label, so it cannot take effect")

# file key -> (is the value refused?, why)
REFUSED: Final[dict[str, tuple[Callable[[Any], bool], str]]] = {
    "flags.deviceDiscoveryStrategy": (
        lambda v: v in ("tegra", "vfio"),
        "kubegpu discovers GPUs through NVML only: Tegra (CSV-described) and VFIO passthrough GPUs have no "
        "kubegpu backend; use auto or nvml, or NVIDIA's device plugin on those nodes"),
    "flags.gfd.oneshot": (lambda v: v is not False, _GFD),
    "flags.gfd.noTimestamp": (lambda v: v is not False, _GFD),
    "flags.gfd.sleepInterval": (lambda v: v != 60.0, _GFD),
    "flags.gfd.outputFile": (lambda v: v != "/etc/kubernetes/node-feature-discovery/features.d/gfd", _GFD),
    "flags.gfd.machineTypeFile": (lambda v: v != "/sys/class/dmi/id/product_name", _GFD),
    "flags.useNodeFeatureAPI": (
        lambda v: v is not False,
        "kubegpu publishes its labels on the Node directly, not through NodeFeature objects"),
    "imex.channelIDs": (
        lambda v: bool(v),
        "kubegpu does not inject IMEX channels (/dev/nvidia-caps-imex-channels) into containers; use NVIDIA's "
        "device plugin or DRA driver for multi-node NVLink"),
    "imex.required": (
        lambda v: v is not False,
        "kubegpu does not inject IMEX channels, so they cannot be required"),
    "flags.restartOnDeviceUnhealthy": (
        lambda v: v is not False,
        "kubegpu keeps serving and marks the device Unhealthy to the kubelet (and recovers it after "
        "kubegpu.healthRecoveryInterval); it never restarts itself on a device error"),
}


def check_refused(values: Mapping[str, Any], chosen: Mapping[str, tuple[Any, str]]) -> None:
    """Raise ConfigError for the first set value in :data:`REFUSED` that kubegpu cannot honour."""
    for key, (refused, why) in REFUSED.items():
        if key in chosen and refused(values[key]):
            where = chosen[key][1]
            raise ConfigError(f"{where}: {chosen[key][0]!r} is not supported: {why}")
