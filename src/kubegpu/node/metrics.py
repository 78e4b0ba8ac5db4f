"""Prometheus metrics of the node daemon (GPU health, allocations, Xids, registrations, latencies) and its
HTTP endpoint: ``/metrics``, ``/healthz`` and ``/readyz``.

One :class:`NodeMetrics` per daemon, on its own registry (so tests and several daemons in one process never
collide), served over HTTP by :func:`serve`. The probes tell the truth about the daemon, not about the HTTP
server: ``/healthz`` fails when the daemon's lifecycle loop or its NVML event loop has died (restarting the
container is the cure); ``/readyz`` fails while the GPUs could not be discovered (NVML or the inventory) or
a resource is not registered with the kubelet. Each answers a JSON object naming what failed.
"""

from __future__ import annotations

import errno
import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kubegpu.model.inventory import NodeInventory

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0)
# Labels of the per-device gauges: the node, the GPU's index ("<gpu>:<mig>" for a MIG device), its model
# (with the MIG profile for a MIG device) and the UUID, so dashboards join with dcgm-exporter and GFD.
DEVICE_LABELS = ("node", "index", "model", "uuid")


class NodeMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.gpu_healthy = Gauge("kubegpu_node_gpu_healthy", "1 when the GPU (or MIG device) is healthy",
                                 list(DEVICE_LABELS), registry=r)
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
        self.share_enforced = Gauge("kubegpu_node_gpu_share_enforced",
                                    "1 when shares on the GPU are held to their limits (by the mode named)",
                                    [*DEVICE_LABELS, "mode"], registry=r)
        self.mps_daemon_up = Gauge("kubegpu_node_mps_daemon_up", "1 while the MPS control daemon answers",
                                   ["daemon", "kind", "limits"], registry=r)
        self.mps_daemon_restarts = Gauge("kubegpu_node_mps_daemon_restarts",
                                         "times the MPS control daemon was started again after it stopped "
                                         "answering", ["daemon"], registry=r)
        self._labels: dict[str, dict[str, str]] = {}

    def set_inventory(self, inv: NodeInventory) -> None:
        """Name the devices of this inventory (node, index, model) in the per-device gauges."""
        labels: dict[str, dict[str, str]] = {}
        for g in inv.gpus:
            labels[g.uuid] = {"node": inv.name, "index": str(g.index), "model": g.model, "uuid": g.uuid}
            for m in g.mig_devices:
                labels[m.uuid] = {"node": inv.name, "index": f"{g.index}:{m.index}",
                                  "model": f"{g.model} MIG {m.profile}", "uuid": m.uuid}
        self._labels = labels
        self.gpu_healthy.clear()  # a rediscovery may have renumbered devices: no stale series

    def device_labels(self, uuid: str) -> dict[str, str]:
        return self._labels.get(uuid) or {"node": "", "index": "", "model": "", "uuid": uuid}

    def set_enforcement(self, modes: Mapping[str, str],
                        daemons: Sequence[tuple[str, str, str, bool, int]]) -> None:
        """``modes``: GPU UUID -> mps / none / unenforced; ``daemons``: (name, kind, limits, up, restarts)."""
        self.share_enforced.clear()
        for uuid, mode in modes.items():
            self.share_enforced.labels(**self.device_labels(uuid), mode=mode).set(1 if mode == "mps" else 0)
        self.mps_daemon_up.clear()
        for name, kind, limits, up, restarts in daemons:
            self.mps_daemon_up.labels(daemon=name, kind=kind, limits=limits).set(1 if up else 0)
            self.mps_daemon_restarts.labels(daemon=name).set(restarts)

    def set_health(self, health: Mapping[str, bool]) -> None:
        for uuid, ok in health.items():
            self.gpu_healthy.labels(**self.device_labels(uuid)).set(1 if ok else 0)


@dataclass(frozen=True, slots=True)
class Probe:
    """One probe's answer: ok, and the checks behind it (name -> "ok" or what is wrong)."""

    ok: bool
    checks: Mapping[str, str]

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "checks": dict(self.checks)}


class ProbeSource(Protocol):
    """What the probes read; :class:`kubegpu.node.daemon.NodeDaemon` is one."""

    def status(self) -> dict[str, Any]: ...

    def liveness(self) -> dict[str, str]: ...


def liveness(daemon: ProbeSource) -> Probe:
    """``/healthz``: the daemon's loops are alive (each check "ok" or what died)."""
    checks = daemon.liveness()
    return Probe(all(v == "ok" for v in checks.values()), checks)


def readiness(daemon: ProbeSource) -> Probe:
    """``/readyz``: GPUs discovered (NVML / inventory) and every resource registered with the kubelet."""
    status = daemon.status()
    checks: dict[str, str] = {}
    waiting = str(status.get("waiting") or "")
    resources = list(status.get("resources") or [])
    if waiting:
        checks["inventory"] = waiting
    elif not resources:
        checks["inventory"] = "not discovered yet"
    else:
        healthy = sum(int(r.get("healthy", 0)) for r in resources)
        total = sum(int(r.get("devices", 0)) for r in resources)
        checks["inventory"] = "ok" if healthy else f"no healthy device ({total} advertised, all unhealthy)"
    for r in resources:
        checks[f"kubelet:{r['name']}"] = "ok" if r.get("registered") else "not registered with the kubelet"
    return Probe(all(v == "ok" for v in checks.values()), checks)


READ_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 64


class MetricsAddressError(OSError):
    """The metrics address cannot be served (taken, not an address of this host); names the address."""


def _handler(metrics: NodeMetrics, probes: Mapping[str, Callable[[], Probe]]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = READ_TIMEOUT_S  # a client that sends its request slowly (or never) gives its thread back

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, CONTENT_TYPE_LATEST, generate_latest(metrics.registry))
            elif path in probes:
                try:
                    probe = probes[path]()
                except Exception as exc:  # a probe that cannot tell is a failing probe, never a dropped answer
                    log.exception("%s failed", path)
                    probe = Probe(False, {"probe": f"{type(exc).__name__}: {exc}"})
                body = json.dumps(probe.to_json()).encode() + b"\n"
                self._send(200 if probe.ok else 503, "application/json", body)
            else:
                self._send(404, "text/plain; charset=utf-8",
                           b"not found: /metrics, " + ", ".join(sorted(probes)).encode() + b"\n")

        def _send(self, code: int, content_type: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # scrapes every few seconds: not worth a line
            pass

    return Handler


class _Server(ThreadingHTTPServer):
    """One thread per connection, at most MAX_CONNECTIONS of them (more are closed at once), and a client
    that hangs up is not a traceback on stderr."""

    daemon_threads = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("metrics request from %s failed", client_address, exc_info=True)


def serve(metrics: NodeMetrics, port: int, addr: str = "0.0.0.0", daemon: ProbeSource | None = None,
          ) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """Serve ``/metrics`` (and, given the daemon, ``/healthz`` and ``/readyz``) on ``addr:port``
    (port 0 = ephemeral; read it from ``server.server_port``). Raises :class:`MetricsAddressError`."""
    probes: dict[str, Callable[[], Probe]] = {}
    if daemon is not None:
        probes = {"/healthz": lambda: liveness(daemon), "/readyz": lambda: readiness(daemon)}
    where = f"{addr}:{port}"
    try:
        server = _Server((addr, port), _handler(metrics, probes))
    except OSError as exc:
        why = "address already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        raise MetricsAddressError(f"cannot serve metrics on {where}: {why}") from None
    thread = threading.Thread(target=server.serve_forever, name="kubegpu-node-metrics", daemon=True)
    thread.start()
    return server, thread
