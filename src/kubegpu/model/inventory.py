"""What a node has: its GPUs (memory, compute, health, NUMA, NVLink, MIG) and its CPU and memory.

Plain immutable values. The inventory backends (NVML, topology files) produce
them, the node daemon publishes them in the ``Device`` object, the extender and
the simulator rebuild them, and placement reads them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace


@dataclass(frozen=True, slots=True)
class MigDevice:
    """One MIG device (GPU instance + compute instance) on a MIG-enabled GPU."""

    uuid: str  # MIG-...
    profile: str  # "1g.10gb", "3g.40gb", "1c.2g.20gb", ...
    parent_uuid: str
    gi: int
    ci: int
    memory_bytes: int
    index: int = 0  # position among the parent's MIG devices (for "<gpu>:<mig>" index IDs)
    healthy: bool = True
    # NVML's MIG attributes as GFD labels them: multiprocessors, slices.gi, slices.ci,
    # engines.copy|decoder|encoder|jpeg|ofa (empty when unknown).
    attributes: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Gpu:
    """One physical GPU.

    ``links`` maps a peer GPU's UUID to the number of NVLink links between the
    two (absent = PCIe only). ``core`` is the compute it offers in percent
    (100 for a whole GPU).
    """

    uuid: str
    index: int
    minor: int
    model: str
    memory_bytes: int
    healthy: bool = True
    numa_node: int | None = None
    pci_bus_id: str = ""
    compute_capability: tuple[int, int] | None = None
    links: Mapping[str, int] = field(default_factory=dict)
    mig_enabled: bool = False
    mig_devices: tuple[MigDevice, ...] = ()
    core: int = 100
    mig_capable: bool = False  # the GPU supports MIG (whether or not it is enabled now)
    # Offered to the kubelet only as time-slicing / MPS replicas: the kubelet cannot give it whole or to a
    # share, so no whole-GPU or share record may name it (the node daemon marks it, the Device object says it).
    replicated: bool = False
    # How shares on it are held to their limits, as the node reports it: "" (not reported), "strict", "mps", "none"
    # (shares are labels), "unenforced" (enforcement selected but not possible now; the reason says why).
    share_enforcement: str = ""
    share_enforcement_reason: str = ""
    # Strict enforcement, as the node reports it: the compute mode it manages ("" = not managed), the one share
    # shape the GPU takes while its shares run ("" = none), and whether a container could escape its share
    # (None = not reported).
    compute_mode: str = ""
    share_shape_lock: str = ""
    share_escapable: bool | None = None

    def with_health(self, healthy: bool) -> Gpu:
        return replace(self, healthy=healthy)

    @property
    def placeable(self) -> bool:
        """Whether placement may put whole GPUs or shares on it: healthy, not split by MIG, not replicated."""
        return self.healthy and not self.mig_enabled and not self.replicated


@dataclass(frozen=True, slots=True)
class NodeInventory:
    """A node's GPUs plus the CPU and memory that also bound what fits on it."""

    name: str
    gpus: tuple[Gpu, ...]
    cpu_milli: int = 0
    memory_bytes: int = 0
    labels: Mapping[str, str] = field(default_factory=dict)
    driver_version: str = ""
    cuda_version: str = ""

    @property
    def model(self) -> str:
        """The node's GPU model ("" without GPUs; the first GPU's on a mixed node)."""
        return self.gpus[0].model if self.gpus else ""

    def gpu(self, uuid: str) -> Gpu:
        for g in self.gpus:
            if g.uuid == uuid:
                return g
        raise KeyError(uuid)

    def healthy_gpus(self) -> tuple[Gpu, ...]:
        return tuple(g for g in self.gpus if g.healthy)

    def link_matrix(self) -> list[list[int]]:
        """NVLink counts between GPUs by position in ``gpus`` (0 = PCIe only)."""
        return [[a.links.get(b.uuid, 0) if a is not b else 0 for b in self.gpus] for a in self.gpus]

    def with_gpu_health(self, uuid: str, healthy: bool) -> NodeInventory:
        return replace(self, gpus=tuple(g.with_health(healthy) if g.uuid == uuid else g for g in self.gpus))
