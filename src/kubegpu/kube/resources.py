"""The typed resources kubegpu reads and writes, including its ``Device`` custom resource.

``Device`` (``kubegpu.io/v1alpha1``, plural ``devices``, cluster-scoped, named
after its node) is one lightkube generic resource shared by its writer (the node
daemon) and its readers (the extender, the CLI); ``kubegpu.model.device_object``
converts its body to and from :class:`~kubegpu.model.NodeInventory`.
"""

from __future__ import annotations

from typing import Final

from lightkube.generic_resource import create_global_resource
from lightkube.resources.core_v1 import Binding, Event, Node, Pod

DEVICE_GROUP: Final = "kubegpu.io"
DEVICE_VERSION: Final = "v1alpha1"
DEVICE_KIND: Final = "Device"
DEVICE_PLURAL: Final = "devices"

Device = create_global_resource(DEVICE_GROUP, DEVICE_VERSION, DEVICE_KIND, DEVICE_PLURAL)

__all__ = ["DEVICE_GROUP", "DEVICE_KIND", "DEVICE_PLURAL", "DEVICE_VERSION",
           "Binding", "Device", "Event", "Node", "Pod"]
