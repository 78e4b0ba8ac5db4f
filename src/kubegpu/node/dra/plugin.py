"""The DRA kubelet plugin's gRPC services, on two unix sockets.

- ``<plugins_registry>/gpu.kubegpu.io-reg.sock``: ``pluginregistration.Registration``. The
  kubelet's plugin watcher finds the socket, asks ``GetInfo`` (type ``DRAPlugin``, the driver
  name, the DRA endpoint, versions ``v1.DRAPlugin`` then ``v1beta1.DRAPlugin``: the kubelet takes
  the first it supports) and reports with ``NotifyRegistrationStatus``.
- ``<plugins>/gpu.kubegpu.io/dra.sock``: ``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`` and its
  v1beta1 twin (same payloads), and ``v1alpha1.DRAResourceHealth``, whose
  ``NodeWatchResources`` stream the kubelet opens after every registration: the first message
  is the health of every device, then one message per change.

A per-claim failure is answered inside the response (``error``), never as an RPC error, so the
other claims of the call still prepare; the kubelet retries the failed one (~every 13 s, recorded).
If the registration socket is deleted the plugin serves it again (:meth:`DraPlugin.ensure_sockets`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from kubegpu.node.dra.names import DRIVER, PLUGIN_TYPE, SUPPORTED_VERSIONS, registration_socket_name
from kubegpu.node.dra.prepare import PrepareError, Preparer
from kubegpu.node.dra.proto import (
    dra_health_pb2,
    dra_health_pb2_grpc,
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    dra_v1beta1_pb2,
    dra_v1beta1_pb2_grpc,
    pluginregistration_pb2,
    pluginregistration_pb2_grpc,
)

log = logging.getLogger(__name__)

HealthSnapshot = Callable[[], list[tuple[str, str, bool, str]]]  # (pool, device, healthy, message)


class _Registration(pluginregistration_pb2_grpc.RegistrationServicer):
    def __init__(self, plugin: DraPlugin) -> None:
        self.plugin = plugin

    def GetInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pluginregistration_pb2.PluginInfo(type=PLUGIN_TYPE, name=DRIVER, endpoint=str(self.plugin.endpoint),
                                                 supported_versions=list(self.plugin.versions))

    def NotifyRegistrationStatus(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.plugin.on_registration(bool(request.plugin_registered), request.error)
        return pluginregistration_pb2.RegistrationStatusResponse()


def _node_service(pb: Any, base: type) -> type:
    """The DRAPlugin servicer for one API version (v1 and v1beta1 have the same messages)."""

    class Service(base):  # type: ignore[misc, valid-type]
        def __init__(self, plugin: DraPlugin) -> None:
            self.plugin = plugin

        def NodePrepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
            started = time.perf_counter()
            resp = pb.NodePrepareResourcesResponse()
            for c in request.claims:
                entry = resp.claims[c.uid]
                try:
                    for d in self.plugin.preparer.prepare(c.namespace, c.uid, c.name):
                        dev = entry.devices.add(request_names=list(d.request_names), pool_name=d.pool,
                                                device_name=d.device, cdi_device_ids=list(d.cdi_device_ids))
                        if d.share_id:
                            dev.share_id = d.share_id
                except PrepareError as exc:
                    log.warning("prepare %s/%s (%s) failed: %s", c.namespace, c.name, c.uid, exc)
                    entry.error = str(exc)
                except Exception as exc:  # a bug must not drop the other claims
                    log.exception("prepare %s/%s failed", c.namespace, c.name)
                    entry.error = f"internal error: {exc}"
            self.plugin.observe("prepare", time.perf_counter() - started)
            return resp

        def NodeUnprepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
            started = time.perf_counter()
            resp = pb.NodeUnprepareResourcesResponse()
            for c in request.claims:
                entry = resp.claims[c.uid]
                try:
                    self.plugin.preparer.unprepare(c.namespace, c.uid, c.name)
                except PrepareError as exc:
                    entry.error = str(exc)
                except Exception as exc:
                    log.exception("unprepare %s/%s failed", c.namespace, c.name)
                    entry.error = f"internal error: {exc}"
            self.plugin.observe("unprepare", time.perf_counter() - started)
            return resp

    return Service


_V1Service = _node_service(dra_v1_pb2, dra_v1_pb2_grpc.DRAPluginServicer)
_V1beta1Service = _node_service(dra_v1beta1_pb2, dra_v1beta1_pb2_grpc.DRAPluginServicer)


class _Health(dra_health_pb2_grpc.DRAResourceHealthServicer):
    def __init__(self, plugin: DraPlugin) -> None:
        self.plugin = plugin

    def NodeWatchResources(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        q: queue.Queue[bool] = queue.Queue()
        self.plugin._add_stream(q)
        try:
            yield self.plugin.health_message()
            while context.is_active() and not self.plugin.stopping:
                try:
                    q.get(timeout=0.5)
                except queue.Empty:
                    continue
                yield self.plugin.health_message()
        finally:
            self.plugin._remove_stream(q)


class DraPlugin:
    """Serves the registration and DRA sockets; ``start()`` / ``stop()``; ``health_changed()`` on changes."""

    def __init__(self, preparer: Preparer, health: HealthSnapshot, *, plugins_dir: str | os.PathLike[str],
                 registry_dir: str | os.PathLike[str], versions: tuple[str, ...] = SUPPORTED_VERSIONS,
                 health_timeout_s: int = 60, on_registered: Callable[[], None] | None = None,
                 observe: Callable[[str, float], None] | None = None, workers: int = 8) -> None:
        self.preparer = preparer
        self.health = health
        self.plugin_dir = Path(plugins_dir) / DRIVER
        self.registry_dir = Path(registry_dir)
        self.endpoint = self.plugin_dir / "dra.sock"
        self.registration_socket = self.registry_dir / registration_socket_name()
        self.versions = versions
        self.health_timeout_s = health_timeout_s
        self.on_registered = on_registered
        self._observe = observe
        self.workers = workers
        self.registered = False
        self.registration_error = ""
        self.registrations = 0
        self.stopping = False
        self._streams: list[queue.Queue[bool]] = []
        self._lock = threading.Lock()
        self._dra: grpc.Server | None = None
        self._reg: grpc.Server | None = None
        self._inodes: dict[str, int | None] = {}

    # ----- sockets -----------------------------------------------------------------------------

    @staticmethod
    def _inode(p: Path) -> int | None:
        try:
            return p.stat().st_ino
        except FileNotFoundError:
            return None

    def _serve(self, path: Path, add: Callable[[grpc.Server], None]) -> grpc.Server:
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="dra-grpc"))
        add(server)
        server.add_insecure_port(f"unix://{path}")
        server.start()
        self._inodes[str(path)] = self._inode(path)
        return server

    def _start_dra(self) -> None:
        def add(s: grpc.Server) -> None:
            dra_v1_pb2_grpc.add_DRAPluginServicer_to_server(_V1Service(self), s)
            dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server(_V1beta1Service(self), s)
            dra_health_pb2_grpc.add_DRAResourceHealthServicer_to_server(_Health(self), s)
        self._dra = self._serve(self.endpoint, add)

    def _start_reg(self) -> None:
        self._reg = self._serve(self.registration_socket,
                                lambda s: pluginregistration_pb2_grpc.add_RegistrationServicer_to_server(
                                    _Registration(self), s))

    def start(self) -> None:
        """Serve the DRA socket first, then the registration socket (the kubelet dials back at once)."""
        self.stopping = False
        self._start_dra()
        self._start_reg()
        log.info("DRA plugin %s serving %s, registering through %s", DRIVER, self.endpoint,
                 self.registration_socket)

    def _intact(self, path: Path) -> bool:
        ino = self._inode(path)
        return ino is not None and ino == self._inodes.get(str(path))

    def ensure_sockets(self) -> bool:
        """Serve again any socket deleted (or replaced) under us; True when something was restarted."""
        restarted = False
        if self._dra is not None and not self._intact(self.endpoint):
            log.info("DRA socket %s is gone: serving it again", self.endpoint)
            self._dra.stop(grace=0)
            self._start_dra()
            restarted = True
        if self._reg is not None and not self._intact(self.registration_socket):
            log.info("registration socket %s is gone: serving it again", self.registration_socket)
            self._reg.stop(grace=0)
            self._start_reg()
            restarted = True
        return restarted

    def stop(self, grace_s: float = 1.0) -> None:
        self.stopping = True
        for s, path in ((self._reg, self.registration_socket), (self._dra, self.endpoint)):
            if s is not None:
                s.stop(grace=grace_s).wait(grace_s + 1)
            if self._intact(path):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        self._reg = self._dra = None

    # ----- callbacks ---------------------------------------------------------------------------

    def on_registration(self, ok: bool, error: str) -> None:
        self.registered, self.registration_error = ok, error
        if ok:
            self.registrations += 1
            log.info("registered with the kubelet as DRA driver %s", DRIVER)
            if self.on_registered is not None:
                self.on_registered()
        else:
            log.error("the kubelet refused the registration: %s", error)

    def observe(self, what: str, seconds: float) -> None:
        if self._observe is not None:
            self._observe(what, seconds)

    # ----- health ------------------------------------------------------------------------------

    def _add_stream(self, q: queue.Queue[bool]) -> None:
        with self._lock:
            self._streams.append(q)

    def _remove_stream(self, q: queue.Queue[bool]) -> None:
        with self._lock, contextlib.suppress(ValueError):
            self._streams.remove(q)

    @property
    def active_streams(self) -> int:
        with self._lock:
            return len(self._streams)

    def health_changed(self) -> None:
        with self._lock:
            for q in self._streams:
                q.put(True)

    def health_message(self) -> Any:
        now = int(time.time())
        pb = dra_health_pb2
        devices = [pb.DeviceHealth(device=pb.DeviceIdentifier(pool_name=pool, device_name=dev),
                                   health=pb.HEALTHY if ok else pb.UNHEALTHY, last_updated_time=now,
                                   health_check_timeout_seconds=self.health_timeout_s, message=msg)
                   for pool, dev, ok, msg in self.health()]
        return pb.NodeWatchResourcesResponse(devices=devices)
