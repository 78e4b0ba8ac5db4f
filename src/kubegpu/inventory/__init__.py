"""Where GPUs come from: NVML on a real node, a topology file everywhere else.

Both backends implement :class:`kubegpu.inventory.base.InventoryBackend`, so the node daemon
never knows which one it talks to. :func:`open_backend` picks one from a command-line value:
``nvml`` for the real driver, anything else is a shipped topology name (``dgx-a100``) or a
topology file path served by :class:`~kubegpu.inventory.fake.FakeBackend`.
"""

from __future__ import annotations

from pathlib import Path

from kubegpu.inventory.base import HealthEvent, InventoryBackend, InventoryError
from kubegpu.inventory.fake import FakeBackend
from kubegpu.inventory.topology import Fault, Topology, TopologyError, load_topology, shipped_topologies


def open_backend(source: str | Path, node_name: str | None = None) -> InventoryBackend:
    """``"nvml"`` -> the NVML backend; a topology name or path -> the fake backend."""
    if str(source) == "nvml":
        from kubegpu.inventory.nvml import NvmlBackend

        return NvmlBackend(node_name=node_name)
    return FakeBackend(source, node_name=node_name)


__all__ = [
    "FakeBackend",
    "Fault",
    "HealthEvent",
    "InventoryBackend",
    "InventoryError",
    "Topology",
    "TopologyError",
    "load_topology",
    "open_backend",
    "shipped_topologies",
]
