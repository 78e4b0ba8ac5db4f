"""The Kubernetes API adapter: every role's only door to the API server.

Built on lightkube. Role code gets a client from :mod:`.client`, the typed
resources (including the ``Device`` custom resource) from :mod:`.resources`,
typed watch events from :class:`.informer.Informer` (list + watch with
resourceVersion, resync, reconnect with backoff) and conflict-safe writes,
Bindings and Events from :mod:`.writes`.
"""

from kubegpu.kube.client import ClientConfigError, load_config, make_async_client, make_client
from kubegpu.kube.informer import EventType, Informer, WatchEvent
from kubegpu.kube.resources import Device, Event, Node, Pod

__all__ = [
    "ClientConfigError",
    "Device",
    "Event",
    "EventType",
    "Informer",
    "Node",
    "Pod",
    "WatchEvent",
    "load_config",
    "make_async_client",
    "make_client",
]
