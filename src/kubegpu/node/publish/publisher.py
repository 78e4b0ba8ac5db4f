"""The seam between the node daemon and the API server (labels, Device object, node capacity).

The daemon calls a :class:`NodePublisher` once at start and again on every health change
(and on config reload). In ``--standalone`` mode it is :class:`NullPublisher`; with an API
server the ``kubegpu.kube``-based implementation writes the node labels, the cluster-scoped
``Device`` object and the ``kubegpu.io/*`` node capacity.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from kubegpu.model.inventory import NodeInventory

log = logging.getLogger(__name__)


class NodePublisher(Protocol):
    def publish(self, inventory: NodeInventory, resources: Mapping[str, int]) -> None:
        """Publish the node's current GPUs (with health) and the device-plugin resources
        it serves (resource name -> number of healthy devices). Must not raise for a
        transient API error: log it and retry on the next call."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class StateAnnouncer(Protocol):
    """A publisher that also tells the cluster whether this daemon serves the node's GPUs now
    (:mod:`kubegpu.model.node_daemon`): "stopping" before it stops serving, "serving" once the kubelet has its
    plugins. ``announce`` returns whether the write landed within ``timeout_s``; it never raises."""

    def announce(self, state: str, boot: str, timeout_s: float) -> bool: ...


class NullPublisher:
    """Standalone mode: no API server, nothing to publish."""

    def publish(self, inventory: NodeInventory, resources: Mapping[str, int]) -> None:
        log.debug("standalone: not publishing node %s (%d GPUs)", inventory.name, len(inventory.gpus))

    def close(self) -> None:
        pass
