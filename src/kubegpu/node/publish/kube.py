"""The node daemon's :class:`~kubegpu.node.publish.publisher.NodePublisher` for a cluster: labels, Device, capacity.

On start and on every health change the daemon hands over its inventory; this writes
what the rest of the cluster reads: the GFD node labels (only GFD's own keys are
ever removed), the cluster-scoped ``Device`` object (created, or replaced with the
version read, owned by the Node so it goes when the Node goes) and the
``kubegpu.io/*`` node capacity. A transient API error is logged and retried on the
next call (and on the daemon's periodic republish), never raised into the daemon.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from kubegpu.model.device_object import device_object
from kubegpu.model.inventory import NodeInventory
from kubegpu.node.config import Config
from kubegpu.node.publish.capacity import publish_capacity
from kubegpu.node.publish.labels import gpu_labels, label_changes

log = logging.getLogger(__name__)


class KubeNodePublisher:
    def __init__(self, client: Any, node_name: str, config: Config) -> None:
        self.client = client
        self.node_name = node_name
        self.config = config
        self.published = 0
        self.failures = 0

    def configure(self, config: Config) -> None:
        """The config the node serves now (a reload's): the next publication labels the node by it."""
        self.config = config

    def publish(self, inventory: NodeInventory, resources: Mapping[str, int]) -> None:
        import httpx2  # lightkube's HTTP client
        from lightkube.core.exceptions import ApiError

        try:
            uid = self._labels(inventory, resources)
            self._device(inventory, uid)
            if not publish_capacity(self.client, inventory):
                raise OSError("share capacity not published")
            self.published += 1
        except (ApiError, httpx2.HTTPError, OSError) as exc:
            self.failures += 1
            log.warning("node %s: publishing to the API server failed (will retry): %s", self.node_name, exc)

    def _labels(self, inventory: NodeInventory, resources: Mapping[str, int]) -> str | None:
        from lightkube.types import PatchType

        from kubegpu.kube.resources import Node
        from kubegpu.model.resources import SERVED_RESOURCES_ANNOTATION

        node = self.client.get(Node, self.node_name)
        current = dict(node.metadata.labels or {})
        patch = label_changes(current, gpu_labels(inventory, self.config))
        body: dict[str, Any] = {"labels": patch} if patch else {}
        # The resource names served here (renamed replicas included), for readers of Nodes (kubegpu status).
        served = ",".join(sorted(resources))
        if served and (node.metadata.annotations or {}).get(SERVED_RESOURCES_ANNOTATION) != served:
            body["annotations"] = {SERVED_RESOURCES_ANNOTATION: served}
        if body:
            self.client.patch(Node, self.node_name, {"metadata": body}, patch_type=PatchType.MERGE)
            log.info("node %s: labels %s", self.node_name, ", ".join(sorted(patch)) or "unchanged")
        return node.metadata.uid

    def _device(self, inventory: NodeInventory, node_uid: str | None) -> None:
        from lightkube.core.exceptions import ApiError

        from kubegpu.kube.resources import Device
        from kubegpu.kube.writes import is_conflict, is_not_found

        body = device_object(inventory, node_uid)
        for _ in range(3):
            try:
                current = self.client.get(Device, self.node_name)
            except ApiError as exc:
                if not is_not_found(exc):
                    raise
                self.client.create(Device(**body))
                return
            body["metadata"]["resourceVersion"] = current.metadata.resourceVersion
            try:
                self.client.replace(Device(**body))
                return
            except ApiError as exc:
                if not is_conflict(exc):
                    raise
        log.warning("node %s: Device object kept conflicting; next publish retries", self.node_name)

    def announce(self, state: str, boot: str, timeout_s: float) -> bool:
        """Write this daemon's state on the Node (:mod:`kubegpu.model.node_daemon`), waiting at most
        ``timeout_s``: a stop must not hang on an API server that does not answer. Whether it landed."""
        from lightkube.types import PatchType

        from kubegpu.kube.resources import Node
        from kubegpu.model.node_daemon import announce

        landed = threading.Event()

        def write() -> None:
            try:
                self.client.patch(Node, self.node_name, announce(state, boot), patch_type=PatchType.MERGE)
                landed.set()
            except Exception as exc:  # logged below with the outcome
                log.warning("node %s: cannot write the daemon state %r: %s", self.node_name, state, exc)

        # On its own thread so a stuck connection costs the caller timeout_s, not the client's own timeout.
        t = threading.Thread(target=write, name=f"announce-{state}", daemon=True)
        t.start()
        t.join(timeout_s)
        if landed.is_set():
            log.info("node %s: daemon %s (%s) written", self.node_name, state, boot[:8])
            return True
        log.warning("node %s: the daemon state %r was not written within %.1fs; going on", self.node_name, state,
                    timeout_s)
        return False

    def close(self) -> None:
        pass
