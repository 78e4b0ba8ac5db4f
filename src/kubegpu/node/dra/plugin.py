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

The services run on grpclib through :mod:`kubegpu.node.rpc` (grpcio's C core alone would be a large
part of the daemon's memory budget, docs/performance.md), so this module never imports ``grpc``. Prepare
and unprepare read the API server and write CDI specs and the checkpoint: they run in the plugin's own
small thread pool, never on the process's one gRPC loop; ``GetInfo`` only formats a message and answers on the loop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

from grpclib.server import Stream

from kubegpu.node import rpc
from kubegpu.node.dra.names import DRIVER, PLUGIN_TYPE, SUPPORTED_VERSIONS, registration_socket_name
from kubegpu.node.dra.prepare import PrepareError, Preparer
from kubegpu.node.dra.proto import (
    dra_health_grpc,
    dra_health_pb2,
    dra_v1_grpc,
    dra_v1_pb2,
    dra_v1beta1_grpc,
    dra_v1beta1_pb2,
    pluginregistration_grpc,
    pluginregistration_pb2,
)

log = logging.getLogger(__name__)

HealthSnapshot = Callable[[], list[tuple[str, str, bool, str]]]  # (pool, device, healthy, message)


class _Registration(pluginregistration_grpc.RegistrationBase):
    def __init__(self, plugin: DraPlugin) -> None:
        self.plugin = plugin

    def info(self, _request: pluginregistration_pb2.InfoRequest) -> pluginregistration_pb2.PluginInfo:
        return pluginregistration_pb2.PluginInfo(type=PLUGIN_TYPE, name=DRIVER, endpoint=str(self.plugin.endpoint),
                                                 supported_versions=list(self.plugin.versions))

    def notify(self, request: pluginregistration_pb2.RegistrationStatus
               ) -> pluginregistration_pb2.RegistrationStatusResponse:
        self.plugin.on_registration(bool(request.plugin_registered), request.error)
        return pluginregistration_pb2.RegistrationStatusResponse()

    async def GetInfo(self, stream: Stream[Any, Any]) -> None:
        await rpc.answer(stream, self.info)

    async def NotifyRegistrationStatus(self, stream: Stream[Any, Any]) -> None:
        # on_registered is the daemon's callback: nothing promises it never blocks, so not on the loop.
        await rpc.answer(stream, self.notify, executor=self.plugin.pool)


def _node_service(pb: ModuleType, base: type) -> type:
    """The DRAPlugin service for one API version (v1 and v1beta1 have the same messages)."""

    class Service(base):  # type: ignore[misc, valid-type]
        def __init__(self, plugin: DraPlugin) -> None:
            self.plugin = plugin

        def prepare(self, request: Any) -> Any:
            started = time.perf_counter()
            resp = pb.NodePrepareResourcesResponse()
            for c in request.claims:
                if c.uid in resp.claims:  # listed twice: its devices once, not twice in one answer
                    continue
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

        def unprepare(self, request: Any) -> Any:
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

        async def NodePrepareResources(self, stream: Stream[Any, Any]) -> None:
            await rpc.answer(stream, self.prepare, executor=self.plugin.pool)

        async def NodeUnprepareResources(self, stream: Stream[Any, Any]) -> None:
            await rpc.answer(stream, self.unprepare, executor=self.plugin.pool)

    return Service


_V1Service = _node_service(dra_v1_pb2, dra_v1_grpc.DRAPluginBase)
_V1beta1Service = _node_service(dra_v1beta1_pb2, dra_v1beta1_grpc.DRAPluginBase)

_END = False  # put on a health stream's queue when its call ends; a change puts True


def _next_change(q: queue.Queue[bool]) -> bool:
    """Wait for a health change: True once one came (with every other that came meanwhile: one message
    carries them all, so a stream its client reads slowly sends the newest state, not a backlog), False
    once the call ended."""
    item = q.get()
    while item is not _END:
        try:
            item = q.get_nowait()
        except queue.Empty:
            return True
    return False


class _Health(dra_health_grpc.DRAResourceHealthBase):
    def __init__(self, plugin: DraPlugin) -> None:
        self.plugin = plugin

    def watch(self, _request: dra_health_pb2.NodeWatchResourcesRequest, context: rpc.StreamContext
              ) -> Iterator[dra_health_pb2.NodeWatchResourcesResponse]:
        """Runs in the stream's own thread: every device, then the devices again at each change."""
        q: queue.Queue[bool] = queue.Queue()
        context.on_cancel(lambda: q.put(_END))  # the client left or the server stops: wake at once
        self.plugin._add_stream(q)
        try:
            yield self.plugin.health_message()
            while context.is_active() and not self.plugin.stopping and _next_change(q):
                yield self.plugin.health_message()
        finally:
            self.plugin._remove_stream(q)

    async def NodeWatchResources(self, stream: Stream[Any, Any]) -> None:
        await rpc.stream_out(stream, self.watch, "dra-health")


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
        self.pool = self._new_pool()
        self._dra = rpc.UnixServer([_V1Service(self), _V1beta1Service(self), _Health(self)], self.endpoint)
        self._reg = rpc.UnixServer([_Registration(self)], self.registration_socket)

    # ----- sockets -----------------------------------------------------------------------------

    def _new_pool(self) -> ThreadPoolExecutor:
        # Its threads start on demand: a pool no call has used holds none.
        return ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="dra-rpc")

    def start(self) -> None:
        """Serve the DRA socket first, then the registration socket (the kubelet dials back at once)."""
        self.stopping = False
        self._dra.start()
        self._reg.start()
        log.info("DRA plugin %s serving %s, registering through %s", DRIVER, self.endpoint,
                 self.registration_socket)

    def ensure_sockets(self) -> bool:
        """Serve again any socket deleted (or replaced) under us; True when something was restarted."""
        restarted = False
        for server, what in ((self._dra, "DRA"), (self._reg, "registration")):
            if not self.stopping and server.serving and not server.intact():
                log.info("%s socket %s is gone: serving it again", what, server.path)
                server.stop(0)
                server.start()
                restarted = True
        return restarted

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving: the registration socket first (the kubelet stops dialling), then the DRA socket,
        each letting prepares and unprepares in flight finish within ``grace_s``; health streams end."""
        self.stopping = True
        with self._lock:
            for q in self._streams:
                q.put(_END)
        self._reg.stop(grace_s)
        self._dra.stop(grace_s)
        # A call still running past the grace finishes in its thread; its answer has nowhere to go.
        pool, self.pool = self.pool, self._new_pool()
        pool.shutdown(wait=False)

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
