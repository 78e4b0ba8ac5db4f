"""The one interface between the node daemon and a source of GPUs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kubegpu.model.inventory import NodeInventory


class InventoryError(RuntimeError):
    """Discovery or a health call failed; the message says what and why (no raw NVML codes only)."""


@dataclass(frozen=True, slots=True)
class HealthEvent:
    """A health event from the GPU driver.

    ``uuid`` is the GPU (or MIG device) it concerns; ``None`` means it cannot be
    attributed and concerns every device (NVIDIA's plugin then marks all unhealthy).
    ``xid`` is the Xid number (0 for a non-Xid failure such as a GPU lost).
    """

    uuid: str | None
    xid: int
    gi: int | None = None
    ci: int | None = None
    message: str = ""


class InventoryBackend(Protocol):
    def discover(self) -> NodeInventory:
        """Every GPU of this node, with topology and MIG state. Raises InventoryError."""
        ...

    def wait_event(self, timeout_s: float) -> HealthEvent | None:
        """Block up to ``timeout_s`` for the next health event; ``None`` on timeout."""
        ...

    def probe(self, uuid: str) -> bool:
        """True when the device answers a cheap query now (the probe that recovers unhealthy GPUs)."""
        ...

    def close(self) -> None: ...
