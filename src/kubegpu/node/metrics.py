"""Prometheus metrics of the node daemon (GPU health, allocations, Xids, registrations, latencies) and its
HTTP endpoint: ``/metrics``, ``/healthz`` and ``/readyz``, the same for both kubelet paths (device plugins and
the DRA driver, which adds its prepare latencies and prepared claims to the same ``kubegpu_node_*`` series).

One :class:`NodeMetrics` per daemon, on its own registry (so tests and several daemons in one process never
collide), served over HTTP by :func:`serve`. The probes tell the truth about the daemon, not about the HTTP
server: ``/healthz`` fails when the daemon's lifecycle loop or its NVML event loop has died (restarting the
container is the cure); ``/readyz`` fails while the GPUs could not be discovered (NVML or the inventory) or
a resource (or the DRA driver) is not registered with the kubelet. Each answers a JSON object naming what
failed; the checks are the daemon's own (``liveness()``, ``readiness()``).
"""

from __future__ import annotations

import errno
import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kubegpu.model.inventory import NodeInventory
from kubegpu.node.mps.capability import ENFORCED_MODES

if TYPE_CHECKING:
    from kubegpu.node.mps.enforcer import GpuView

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
        self.compute_mode = Gauge("kubegpu_node_gpu_compute_mode",
                                  "1 for the compute mode of a GPU that strict share enforcement manages "
                                  "(Exclusive_Process while it holds shares)", [*DEVICE_LABELS, "mode"], registry=r)
        self.share_escapable = Gauge("kubegpu_node_gpu_share_escapable",
                                     "1 when a container could take more than its share on the GPU by editing "
                                     "what it was given (0 only under strict enforcement)", list(DEVICE_LABELS),
                                     registry=r)
        self.share_shape_lock = Gauge("kubegpu_node_gpu_share_shape_lock",
                                      "1 for the one share shape a strict GPU takes while its shares run",
                                      [*DEVICE_LABELS, "shape"], registry=r)
        self.mps_daemon_up = Gauge("kubegpu_node_mps_daemon_up", "1 while the MPS control daemon answers",
                                   ["daemon", "kind", "limits"], registry=r)
        self.mps_daemon_restarts = Gauge("kubegpu_node_mps_daemon_restarts",
                                         "times the MPS control daemon was started again after it stopped "
                                         "answering", ["daemon"], registry=r)
        self.dra_prepare_seconds = Histogram("kubegpu_node_dra_prepare_seconds",
                                             "NodePrepareResources latency (DRA)", buckets=_LATENCY_BUCKETS,
                                             registry=r)
        self.dra_unprepare_seconds = Histogram("kubegpu_node_dra_unprepare_seconds",
                                               "NodeUnprepareResources latency (DRA)", buckets=_LATENCY_BUCKETS,
                                               registry=r)
        self.dra_prepared_claims = Gauge("kubegpu_node_dra_prepared_claims",
                                         "ResourceClaims prepared on this node (DRA)", registry=r)
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

    def set_enforcement(self, views: Mapping[str, GpuView],
                        daemons: Sequence[tuple[str, str, str, bool, int]]) -> None:
        """``views``: GPU UUID -> its enforcement (:meth:`kubegpu.node.mps.enforcer.ShareEnforcer.views`);
        ``daemons``: (name, kind, limits, up, restarts)."""
        for g in (self.share_enforced, self.compute_mode, self.share_escapable, self.share_shape_lock):
            g.clear()
        for uuid, v in views.items():
            labels = self.device_labels(uuid)
            self.share_enforced.labels(**labels, mode=v.mode).set(1 if v.mode in ENFORCED_MODES else 0)
            self.share_escapable.labels(**labels).set(1 if v.escapable else 0)
            if v.compute_mode:
                self.compute_mode.labels(**labels, mode=v.compute_mode).set(1)
            if v.shape_lock:
                self.share_shape_lock.labels(**labels, shape=v.shape_lock).set(1)
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
    """What the probes read: a kubelet path (:class:`kubegpu.node.lifecycle.KubeletPath`) names its checks."""

    def liveness(self) -> dict[str, str]: ...

    def readiness(self) -> dict[str, str]: ...


def _probe(checks: Mapping[str, str]) -> Probe:
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
        probes = {"/healthz": lambda: _probe(daemon.liveness()), "/readyz": lambda: _probe(daemon.readiness())}
    where = f"{addr}:{port}"
    try:
        server = _Server((addr, port), _handler(metrics, probes))
    except OSError as exc:
        why = "address already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        raise MetricsAddressError(f"cannot serve metrics on {where}: {why}") from None
    thread = threading.Thread(target=server.serve_forever, name="kubegpu-node-metrics", daemon=True)
    thread.start()
    return server, thread


def serve_address(address: str, metrics: NodeMetrics, daemon: ProbeSource | None = None,
                  ) -> ThreadingHTTPServer | None:
    """:func:`serve` on ``host:port`` as the ``--metrics-address`` option gives it (``:9400`` is every
    address); None for ``""``, ``0``, ``off`` or ``none`` (no endpoint). Raises :class:`MetricsAddressError`."""
    if not address or address in ("0", "off", "none"):
        return None
    host, _, port = address.rpartition(":")
    try:
        number = int(port or 0)
    except ValueError:
        raise MetricsAddressError(f"cannot serve metrics on {address!r}: the port is not a number") from None
    server, _ = serve(metrics, number, host or "0.0.0.0", daemon)
    log.info("metrics on http://%s:%d/metrics (and /healthz, /readyz)", host or "0.0.0.0", server.server_port)
    return server
