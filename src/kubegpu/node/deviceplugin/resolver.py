"""The seam between the device plugin and the scheduler's recorded choice (full mode).

The kubelet's ``Allocate`` and ``GetPreferredAllocation`` calls carry only device IDs,
never a pod. In full mode the scheduler extender has already chosen the exact GPUs and
written them into the pod's ``kubegpu.io/device-allocated`` annotation; something on the
node must match the kubelet's call to that pod. That matching lives in
``kubegpu.node.handoff`` and plugs in here through
:class:`AllocationResolver`. In ``--standalone`` (node-only) mode no resolver is set and
the plugin answers from the device IDs alone.

Contract for implementers
-------------------------
``resolve(resource, device_ids)`` is called once per ``Allocate`` container request for
``kubegpu.io/gpu.shared``, ``nvidia.com/gpu`` and MIG resources, with the device IDs the kubelet
chose (slot IDs are ``<gpu-uuid>::<k>``, whole GPUs and MIG devices are UUIDs). It returns:

- a :class:`ResolvedAllocation`: the GPUs **the kubelet chose** (never others) with the part of each
  that the matched record grants (core percent, memory bytes). The plugin hands exactly those GPUs
  to the container (env / mounts / CDI) plus the ``KUBEGPU_*`` limits and, with MPS on, the MPS
  variables;
- ``None``: a pod without a record asking whole GPUs or MIG devices that are free: the plugin serves
  the device IDs as they are;
- or it raises :class:`AllocationRefused` with a message a person can act on; the ``Allocate`` fails
  with that message (the kubelet then fails the pod with ``UnexpectedAdmissionError``), which is
  better than handing a container GPUs its record does not name (docs/handoff.md lists every case).

``set_inventory(inventory)`` gives the node's GPUs at start and on every reload, and
``kubelet_registered(resource)`` says the kubelet (re)registered a resource.

``preferred(resource, available, must_include, size)`` is called for
``GetPreferredAllocation``: return device IDs (a subset of ``available``, containing
``must_include``, at most ``size`` long) that steer the kubelet onto the recorded GPUs, or
``None`` to let the plugin choose. It never fails admission: errors fall back to the plugin.

Both methods can be called concurrently from gRPC worker threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kubegpu.model.allocation import DeviceGrant
from kubegpu.model.inventory import NodeInventory


class AllocationRefused(Exception):
    """The resolver found the call cannot be served; ``str(exc)`` is the reason given to the kubelet."""


@dataclass(frozen=True, slots=True)
class ResolvedAllocation:
    """What the scheduler recorded for the container behind one ``Allocate`` call."""

    gpus: tuple[DeviceGrant, ...]  # memory_bytes 0: the whole device's memory
    pod: str = ""  # "namespace/name", for logs and metrics only
    container: str = ""

    @property
    def uuids(self) -> tuple[str, ...]:
        """The devices served: a MIG device's UUID, else its GPU's."""
        return tuple(g.mig_uuid or g.uuid for g in self.gpus)


class AllocationResolver(Protocol):
    """The handoff as the device plugins use it; every implementation provides every member."""

    def set_inventory(self, inventory: NodeInventory) -> None:
        """The node's GPUs, at start and after each reload: the handoff acknowledges pods by their GPUs'
        minor and memory."""
        ...

    def kubelet_registered(self, resource: str) -> None:
        """``resource`` was (re)registered with the kubelet: a restarted kubelet fails the pods it admitted
        before, without calling the plugin, so the resolver must not take its view's word that they wait."""
        ...

    def resolve(self, resource: str, device_ids: Sequence[str]) -> ResolvedAllocation | None:
        """The recorded allocation this ``Allocate`` call serves; raises AllocationRefused."""
        ...

    def preferred(self, resource: str, available: Sequence[str], must_include: Sequence[str],
                  size: int) -> Sequence[str] | None:
        """Device IDs steering the kubelet to the recorded GPUs, or None to let the plugin choose."""
        ...
