"""Where GPUs come from: NVML on a real node, a topology file everywhere else.

Both backends implement :class:`kubegpu.inventory.base.InventoryBackend`, so the node daemon
never knows which one it talks to. :func:`open_backend` picks one from a command-line value:
``nvml`` for the real driver, anything else is a shipped topology name (``dgx-a100``) or a
topology file path served by :class:`~kubegpu.inventory.fake.FakeBackend`.

The fake backend and the topology loader are imported on first use, not with this package: the
node daemon on a GPU node imports :mod:`kubegpu.inventory.nvml`, and through it this package, and
has no use for them or for what they load (YAML, ``importlib.resources``, ``tempfile``), which would
count against its memory budget (``docs/performance.md``).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kubegpu.inventory.base import HealthEvent, InventoryBackend, InventoryError

if TYPE_CHECKING:
    from kubegpu.inventory.fake import FakeBackend
    from kubegpu.inventory.topology import Fault, Topology, TopologyError, load_topology, shipped_topologies

_LAZY = {"FakeBackend": "kubegpu.inventory.fake", "Fault": "kubegpu.inventory.topology",
         "Topology": "kubegpu.inventory.topology", "TopologyError": "kubegpu.inventory.topology",
         "load_topology": "kubegpu.inventory.topology", "shipped_topologies": "kubegpu.inventory.topology"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def open_backend(source: str | Path, node_name: str | None = None) -> InventoryBackend:
    """``"nvml"`` -> the NVML backend; a topology name or path -> the fake backend."""
    if str(source) == "nvml":
        from kubegpu.inventory.nvml import NvmlBackend

        return NvmlBackend(node_name=node_name)
    from kubegpu.inventory.fake import FakeBackend

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
