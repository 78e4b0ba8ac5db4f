"""The names the DRA driver publishes and hands out, in one place.

The driver name qualifies every attribute (``gpu.kubegpu.io/uuid``), names the kubelet plugin
(its sockets) and the CDI kind. CDI device names carry the claim UID, so two claims on one GPU
never share a spec entry, and the share ID for a consumable-capacity share.
"""

from __future__ import annotations

from typing import Final

DRIVER: Final = "gpu.kubegpu.io"
PLUGIN_TYPE: Final = "DRAPlugin"
SUPPORTED_VERSIONS: Final = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
CDI_VENDOR: Final = "k8s." + DRIVER
CDI_CLASS: Final = "device"
CDI_KIND: Final = f"{CDI_VENDOR}/{CDI_CLASS}"

# Device types (the ``type`` attribute DeviceClasses select on).
TYPE_GPU: Final = "gpu"
TYPE_MIG: Final = "mig"
TYPE_SHARED: Final = "shared-gpu"  # published before GPUs took whole claims and shares alike; still selected

# Taints the driver puts on unhealthy devices.
TAINT_XID: Final = DRIVER + "/xid-error"
TAINT_UNHEALTHY: Final = DRIVER + "/unhealthy"
# On every device while the driver cannot prepare claims (stopping, or started and not yet registered).
TAINT_RESTARTING: Final = DRIVER + "/driver-restarting"

# The node label choosing the kubelet plugin (``dra`` for this driver), see kubegpu.install.dra.
MODE_LABEL: Final = "kubegpu.io/kubelet-plugin"

PCIE_ROOT_ATTRIBUTE: Final = "resource.kubernetes.io/pcieRoot"

API_GROUP: Final = "resource.k8s.io"
API_VERSION: Final = "v1"


def registration_socket_name() -> str:
    """The socket in ``plugins_registry`` the kubelet's plugin watcher finds."""
    return f"{DRIVER}-reg.sock"


def cdi_device_name(claim_uid: str, device: str, share_id: str | None = None) -> str:
    return f"{claim_uid}-{device}" + (f"-{share_id}" if share_id else "")


def cdi_device_id(claim_uid: str, device: str, share_id: str | None = None) -> str:
    return f"{CDI_KIND}={cdi_device_name(claim_uid, device, share_id)}"
