"""The vocabulary every role shares: resource names, requests, inventory, allocations.

Pure values and parsers; no I/O, no global state.
"""

from kubegpu.model.allocation import AnnotationError, ContainerAllocation, DeviceGrant, PodAllocation
from kubegpu.model.inventory import Gpu, MigDevice, NodeInventory
from kubegpu.model.request import (
    ContainerRequest,
    GpuRequest,
    PodRequest,
    Refusal,
    RequestKind,
    RequestRefused,
    parse_pod,
    parse_resources,
)

__all__ = [
    "AnnotationError",
    "ContainerAllocation",
    "ContainerRequest",
    "DeviceGrant",
    "Gpu",
    "GpuRequest",
    "MigDevice",
    "NodeInventory",
    "PodAllocation",
    "PodRequest",
    "Refusal",
    "RequestKind",
    "RequestRefused",
    "parse_pod",
    "parse_resources",
]
