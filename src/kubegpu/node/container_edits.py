"""What a container gets for its GPUs, as one value both kubelet paths build from the grants.

The device plugin renders a :class:`ContainerEdits` as a ``ContainerAllocateResponse``
(:mod:`kubegpu.node.deviceplugin.allocate`), the DRA driver as a CDI spec (:mod:`kubegpu.node.dra.prepare`);
neither builds the share environment, the device nodes or the MPS binding itself, so the two paths cannot
drift apart. The names are the NVIDIA runtime's (contracts.md §4–§5) and kubegpu's own ``KUBEGPU_*``.

A GPU is ``/dev/nvidia<minor>`` plus the control nodes; a MIG device also needs its GI and CI capability
nodes, whose minors the driver lists in ``/proc/driver/nvidia-caps/mig-minors`` (lines
``gpu<minor>/gi<gi>/access <capMinor>`` and ``gpu<minor>/gi<gi>/ci<ci>/access <capMinor>``).

This module imports no protobuf, so the DRA daemon does not load the device-plugin messages.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

from kubegpu.node.mps.spec import Binding

log = logging.getLogger(__name__)

VOLUME_MOUNTS_ROOT: Final = "/var/run/nvidia-container-devices"
VOLUME_MOUNTS_HOST: Final = "/dev/null"
VISIBLE_DEVICES: Final = "NVIDIA_VISIBLE_DEVICES"

ENV_VISIBLE_GPUS: Final = "KUBEGPU_VISIBLE_GPUS"
ENV_CORE: Final = "KUBEGPU_GPU_CORE_PERCENT"
ENV_MEMORY: Final = "KUBEGPU_GPU_MEMORY_BYTES"

CONTROL_DEVICES: tuple[str, ...] = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
_LINE_RE = re.compile(r"^gpu(\d+)/gi(\d+)(?:/ci(\d+))?/access\s+(\d+)$")

# (gpu minor, gi, ci) -> cap minor; ci = -1 for the GPU-instance access node.
MigMinors = dict[tuple[int, int, int], int]

# One GPU's part of a share: (GPU uuid, compute percent, memory bytes), the shape MPS enforces.
SharePart = tuple[str, int, int]


def read_mig_minors(path: str | Path) -> MigMinors:
    """Parse the driver's mig-minors file; a missing or unreadable file gives an empty map."""
    out: MigMinors = {}
    try:
        text = Path(path).read_text()
    except OSError as exc:
        log.debug("no MIG capability minors at %s: %s", path, exc)
        return out
    for line in text.splitlines():
        m = _LINE_RE.match(line.strip())
        if not m:
            continue
        gpu, gi, ci, cap = m.groups()
        out[(int(gpu), int(gi), int(ci) if ci is not None else -1)] = int(cap)
    return out


def mig_cap_paths(gpu_minor: int, gi: int, ci: int, minors: MigMinors) -> list[str]:
    """The nvidia-caps nodes of one MIG device (empty when the driver did not list them)."""
    out = []
    for key in ((gpu_minor, gi, -1), (gpu_minor, gi, ci)):
        cap = minors.get(key)
        if cap is not None:
            out.append(f"/dev/nvidia-caps/nvidia-cap{cap}")
    return out


class ServedDevice(Protocol):
    """A device handed to a container, as either kubelet path describes it."""

    @property
    def uuid(self) -> str: ...  # the GPU's, or the MIG device's

    @property
    def minor(self) -> int: ...  # the physical GPU's

    @property
    def gi(self) -> int | None: ...  # MIG GPU instance; None for a whole GPU

    @property
    def ci(self) -> int | None: ...


def device_nodes(dev: ServedDevice, minors: MigMinors) -> tuple[str, ...]:
    """The GPU's node, and for a MIG device its GI and CI capability nodes."""
    if dev.gi is None or dev.ci is None:
        return (f"/dev/nvidia{dev.minor}",)
    caps = mig_cap_paths(dev.minor, dev.gi, dev.ci, minors)
    if len(caps) < 2:  # served without them, but said: the container may not be able to open the device
        log.warning("MIG device %s: no capability minors for GPU minor %d GI %d CI %d in the mig-minors "
                    "file; its container may not be able to open it", dev.uuid, dev.minor, dev.gi, dev.ci)
    return (f"/dev/nvidia{dev.minor}", *caps)


def unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def one_or_list(values: Sequence[int]) -> str:
    """One value when every GPU gets the same, else one per GPU in ``KUBEGPU_VISIBLE_GPUS`` order."""
    uniq = unique(str(v) for v in values)
    return uniq[0] if len(uniq) == 1 else ",".join(str(v) for v in values)


@dataclass(frozen=True, slots=True)
class DeviceEdits:
    """One device a container gets: the name the runtime knows it by and its ``/dev`` nodes."""

    name: str  # UUID (or NVML index, with the device plugin's ``index`` strategy)
    nodes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ContainerEdits:
    """What one container gets for its GPUs: its devices, its share, and the MPS daemon enforcing it.

    ``shares`` is empty when the container holds its devices whole; ``mps`` is None when no daemon
    enforces the share. The control nodes every GPU container needs are in :meth:`device_nodes`."""

    devices: tuple[DeviceEdits, ...]
    gpus: tuple[str, ...]  # KUBEGPU_VISIBLE_GPUS, in the container's order
    shares: tuple[SharePart, ...] = ()
    mps: Binding | None = None

    @property
    def names(self) -> list[str]:
        """The runtime device names, each once."""
        return unique(d.name for d in self.devices)

    def device_nodes(self) -> list[str]:
        """Every ``/dev`` node the container needs, each once, the control nodes last."""
        return unique([*(p for d in self.devices for p in d.nodes), *CONTROL_DEVICES])

    def env(self) -> list[tuple[str, str]]:
        """kubegpu's variables and the MPS daemon's, in the order a container sees them."""
        out = [(ENV_VISIBLE_GPUS, ",".join(self.gpus))]
        if self.shares:
            out += [(ENV_CORE, one_or_list([c for _, c, _ in self.shares])),
                    (ENV_MEMORY, one_or_list([m for _, _, m in self.shares]))]
        if self.mps is not None:
            out += self.mps.env
        return out

    def mps_mounts(self) -> tuple[tuple[str, str], ...]:
        """(host, container) mounts of the MPS daemon's pipe and shared memory."""
        return self.mps.mounts if self.mps is not None else ()


def container_edits(devices: Sequence[tuple[str, ServedDevice]], gpus: Sequence[str],
                    shares: Sequence[SharePart] = (), mps: Binding | None = None, *,
                    minors: MigMinors | None = None) -> ContainerEdits:
    """The edits for ``devices`` given as (runtime name, device), in the container's order."""
    return ContainerEdits(tuple(DeviceEdits(name, device_nodes(d, minors or {})) for name, d in devices),
                          tuple(gpus), tuple(shares), mps)
