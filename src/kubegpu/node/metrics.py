"""Prometheus metrics of the node daemon: GPU health, allocations, Xids, registrations, latencies.

One :class:`NodeMetrics` per daemon, on its own registry (so tests and several daemons in
one process never collide), served over HTTP by :func:`serve`.
"""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0)


class NodeMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.gpu_healthy = Gauge("kubegpu_node_gpu_healthy", "1 when the GPU (or MIG device) is healthy",
                                 ["uuid"], registry=r)
        self.allocations = Counter("kubegpu_node_allocations", "Allocate container requests seen",
                                   ["resource", "result"], registry=r)
        self.xid_events = Counter("kubegpu_node_xid_events", "Xid events that marked devices unhealthy",
                                  ["xid"], registry=r)
        self.registrations = Counter("kubegpu_node_registrations", "Successful Register calls to the kubelet",
                                     ["resource"], registry=r)
        self.preferred_seconds = Histogram("kubegpu_node_preferred_allocation_seconds",
                                           "GetPreferredAllocation latency", ["resource"],
                                           buckets=_LATENCY_BUCKETS, registry=r)
        self.allocate_seconds = Histogram("kubegpu_node_allocate_seconds", "Allocate latency", ["resource"],
                                          buckets=_LATENCY_BUCKETS, registry=r)
        self.devices = Gauge("kubegpu_node_devices", "Devices advertised per resource and health",
                             ["resource", "health"], registry=r)

    def set_health(self, health: dict[str, bool]) -> None:
        for uuid, ok in health.items():
            self.gpu_healthy.labels(uuid=uuid).set(1 if ok else 0)


def serve(metrics: NodeMetrics, port: int, addr: str = "0.0.0.0") -> tuple[WSGIServer, threading.Thread]:
    """Serve ``/metrics`` on ``addr:port`` (port 0 = ephemeral; read it from ``server.server_port``)."""
    server, thread = start_http_server(port, addr=addr, registry=metrics.registry)
    return server, thread
