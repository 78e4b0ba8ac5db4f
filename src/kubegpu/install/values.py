"""The install values: one typed structure, keys mirroring NVIDIA's device-plugin chart where they overlap.

An operator who has a values file for ``nvidia-device-plugin`` can reuse its
``migStrategy``, ``deviceListStrategy``, ``config.map``, ``tolerations`` … here
unchanged. Unknown keys and bad values are errors that name the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml

from kubegpu import __version__


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
    # which entry of `map` the daemon reads; "" = the only one, or none.
    default: str = ""


class SchedulerValues(_Struct):
    kube_scheduler_image: str = "registry.k8s.io/kube-scheduler:v1.30.0"
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
    failure_policy: Literal["Fail", "Ignore"] = "Fail"
    timeout_seconds: int = 5
    # Namespaces carrying this label (any value) are not reviewed.
    exclude_namespace_label: str = "kubegpu.io/webhook-exclude"
    # cert-manager issues and rotates the serving certificate and injects the CA bundle;
    # without it, give the CA bundle (base64 PEM) and create the TLS secret yourself.
    cert_manager: bool = True
    # CEL matchConditions (Kubernetes >= 1.30) send only pods that concern GPUs; false for older API servers.
    match_conditions: bool = True
    ca_bundle: str = ""
    resources: dict[str, Any] = msgspec.field(default_factory=dict)


class Values(_Struct):
    mode: Literal["node-only", "full"] = "full"
    namespace: str = "kubegpu-system"
    image: Image = msgspec.field(default_factory=Image)
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
        return msgspec.convert(raw, Values)
    except msgspec.ValidationError as exc:
        # msgspec says "... - at `$.scheduler.weight`": keep that path, it names the key.
        raise ValuesError(f"invalid values: {exc}") from None
