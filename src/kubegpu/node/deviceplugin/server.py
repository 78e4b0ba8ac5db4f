"""One kubelet device-plugin gRPC server: one resource, one unix socket, one registration.

It serves ``DevicePlugin`` (v1beta1) before it registers (contracts.md §1.4), sends the
same options in ``RegisterRequest.options`` and ``GetDevicePluginOptions`` (old kubelets read
the first, new ones the second), and keeps each ``ListAndWatch`` stream open, re-sending the
full device list on every health change. The lifecycle decisions (when to re-serve and
re-register) belong to :mod:`kubegpu.node.daemon`; this module reports stream ends to it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

from kubegpu.model import resources as R
from kubegpu.model.inventory import NodeInventory
from kubegpu.node import rpc
from kubegpu.node.container_edits import MigMinors
from kubegpu.node.deviceplugin import preferred as pref
from kubegpu.node.deviceplugin.allocate import AllocateError, build_response, check_request, container_edits_for
from kubegpu.node.deviceplugin.plugin_model import AdvertisedDevice, PluginSettings, ResourcePlan
from kubegpu.node.deviceplugin.resolver import AllocationRefused, AllocationResolver, ResolvedAllocation
from kubegpu.node.health.state import HealthReader
from kubegpu.node.metrics import NodeMetrics
from kubegpu.node.proto import deviceplugin_grpc as dp_grpc
from kubegpu.node.proto import deviceplugin_pb2 as pb

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
KUBELET_SOCKET = "kubelet.sock"
MAX_CONTAINER_REQUESTS = 256  # the kubelet sends one per call; a pod has far fewer containers


class RegistrationError(RuntimeError):
    """Register failed (kubelet absent, refused, or timed out); the message says which."""


class SocketGone(RegistrationError):
    """Our own socket was deleted (a kubelet restart): serve again before registering."""


class _Service(dp_grpc.DevicePluginBase):
    """``DevicePlugin`` on the node's gRPC loop. ``executor`` is None when the handlers never block: they
    answer on the loop, sparing the hand-off to a thread and back. Otherwise (:meth:`PluginServer.may_block`)
    Allocate and GetPreferredAllocation run in ``executor``."""

    def __init__(self, server: PluginServer, executor: futures.Executor | None) -> None:
        self._s = server
        self._executor = executor

    async def GetDevicePluginOptions(self, stream: Any) -> None:
        await rpc.answer(stream, self._s.answer_options)

    async def ListAndWatch(self, stream: Any) -> None:
        await rpc.stream_out(stream, self._s.answer_list_and_watch, f"dp-watch-{self._s.plan.socket_name}")

    async def GetPreferredAllocation(self, stream: Any) -> None:
        await rpc.answer(stream, self._s.answer_preferred, executor=self._executor)

    async def Allocate(self, stream: Any) -> None:
        await rpc.answer(stream, self._s.answer_allocate, executor=self._executor)

    async def PreStartContainer(self, stream: Any) -> None:
        await rpc.answer(stream, _pre_start)


def _pre_start(request: pb.PreStartContainerRequest) -> pb.PreStartContainerResponse:
    return pb.PreStartContainerResponse()


# A daemon that stops (rollout, restart) lets an Allocate in flight finish: cut off, the kubelet fails that
# pod's admission with the RPC error. Allocate never waits on the API server; its slowest step is the
# PodResources check (1 s timeout), so this bounds it with room on a loaded node. Streams end at once.
STOP_GRACE_S = 5.0


class PluginServer:
    """The gRPC server for one :class:`ResourcePlan`."""

    def __init__(self, plan: ResourcePlan, settings: PluginSettings, state: HealthReader,
                 inventory: NodeInventory, plugin_dir: str | os.PathLike[str], *,
                 resolver: AllocationResolver | None = None, metrics: NodeMetrics | None = None,
                 mig_minors: MigMinors | None = None,
                 on_stream_end: Callable[[PluginServer], None] | None = None,
                 kubelet_socket: str = KUBELET_SOCKET, workers: int = 4) -> None:
        self.plan = plan
        self.settings = settings
        self.state = state
        self.inventory = inventory
        self.dir = Path(plugin_dir)
        self.resolver = resolver
        self.metrics = metrics
        self.mig_minors = mig_minors or {}
        self.on_stream_end = on_stream_end
        self.kubelet_socket = kubelet_socket
        self.workers = workers
        self.known: dict[str, AdvertisedDevice] = {d.id: d for d in plan.devices}
        # A GPU/MIG UUID -> one of its advertised devices (for resolved allocations).
        self.by_uuid: dict[str, AdvertisedDevice] = {}
        for d in plan.devices:
            self.by_uuid.setdefault(d.uuid, d)
        self._server: rpc.UnixServer | None = None
        self._pool: futures.ThreadPoolExecutor | None = None
        self._totals = pref.replica_totals(plan.devices)
        # The memo of whole-device preferences, keyed by the available IDs as a bitmask over the plan's devices
        # and holding the plan's own ID strings, not the request's: an entry stays small whatever the number
        # of devices, and the memo holds up to 4096 of them (the daemon's memory, docs/performance.md).
        self._bit: dict[str, int] = {d.id: 1 << i for i, d in enumerate(plan.devices)}
        self._whole_cache: dict[tuple[int, tuple[str, ...], int], tuple[str, ...]] = {}
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._streams = 0
        self._stream_gen = 0
        self.streams_opened = 0
        self.last_stream_open: float | None = None

    # ----- serving ---------------------------------------------------------------------------

    @property
    def resource(self) -> str:
        return self.plan.name

    @property
    def socket_path(self) -> Path:
        return self.dir / self.plan.socket_name

    @property
    def active_streams(self) -> int:
        with self._lock:
            return self._streams

    @property
    def serving(self) -> bool:
        return self._server is not None

    def options(self) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(pre_start_required=self.settings.pre_start_required,
                                      get_preferred_allocation_available=True)

    def may_block(self) -> bool:
        """Whether Allocate or GetPreferredAllocation may wait: a resolver reads the API server and the
        kubelet's PodResources (a call on the gRPC loop, which from the loop's own thread would wait on
        itself), and an MPS enforcer may start a daemon. Without either they only compute."""
        return self.resolver is not None or self.settings.enforcer is not None

    def start(self) -> None:
        """Remove a stale socket and serve on a fresh one (before any Register)."""
        self._stopping.clear()
        if self.may_block():
            self._pool = futures.ThreadPoolExecutor(max_workers=self.workers,
                                                    thread_name_prefix=f"dp-{self.plan.socket_name}")
        server = rpc.UnixServer([_Service(self, self._pool)], self.socket_path)
        server.start()
        self._server = server
        log.info("serving %s on %s (%d devices)", self.resource, self.socket_path, len(self.plan.devices))

    def stop(self, grace_s: float | None = STOP_GRACE_S) -> None:
        """Stop serving: streams end at once, RPCs in flight get ``grace_s`` to finish, the socket is removed."""
        self._stopping.set()
        self.state.wake()
        server, self._server = self._server, None
        if server is not None:
            server.stop(grace_s)
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)  # a resolver still waiting past the grace finishes on its own

    def socket_intact(self) -> bool:
        """Our socket file still exists and is the one we bound (the kubelet deletes it on restart)."""
        server = self._server
        return server is not None and server.intact()

    def register(self, timeout_s: float = 5.0) -> None:
        """Call ``Register`` on the kubelet's socket. Raises :class:`RegistrationError`."""
        path = self.dir / self.kubelet_socket
        if not path.exists():
            raise RegistrationError(f"kubelet socket {path} does not exist")
        # A stale socket left by a stopped kubelet refuses at once; without this check gRPC
        # would sit in its reconnect backoff and delay the registration with the new kubelet.
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(timeout_s)
            probe.connect(str(path))
        except OSError as exc:
            raise RegistrationError(f"kubelet socket {path} is not accepting connections ({exc})") from None
        finally:
            probe.close()
        # The kubelet cleans its dir before it listens: once it accepts, a plugin socket that is
        # still ours survived the clean. Registering a socket it already deleted would leave the
        # kubelet dialing a dead endpoint (10 s, then nothing on a v1.24 kubelet).
        if not self.socket_intact():
            raise SocketGone(f"plugin socket {self.socket_path} was removed")
        req = pb.RegisterRequest(version=API_VERSION, endpoint=self.plan.socket_name,
                                 resource_name=self.resource, options=self.options())
        try:
            rpc.unix_call(path, lambda ch: dp_grpc.RegistrationStub(ch).Register(req), timeout_s)
        except rpc.CallFailed as exc:
            if exc.status is rpc.Status.DEADLINE_EXCEEDED:
                raise RegistrationError(f"kubelet at {path} did not answer within {timeout_s:.0f}s") from None
            raise RegistrationError(f"kubelet refused registration of {self.resource}: {exc.message}") from None
        if self.metrics is not None:
            self.metrics.registrations.labels(resource=self.resource).inc()
        log.info("registered %s with the kubelet (endpoint %s)", self.resource, self.plan.socket_name)
        # A (re)started kubelet fails the pods it admitted before this registration, without calling us: the
        # resolver must not take its view's word that they still wait (docs/handoff.md).
        if self.resolver is not None:
            self.resolver.kubelet_registered(self.resource)

    # ----- the handlers: a refusal is INVALID_ARGUMENT with its reason, as the kubelet reports it -----

    def answer_options(self, request: pb.Empty) -> pb.DevicePluginOptions:
        return self.options()

    def answer_list_and_watch(self, request: pb.Empty,
                              context: rpc.StreamContext) -> Iterator[pb.ListAndWatchResponse]:
        return self.list_and_watch(context)

    def answer_preferred(self, request: pb.PreferredAllocationRequest) -> pb.PreferredAllocationResponse:
        try:
            return self.preferred(request)
        except pref.PreferenceError as exc:
            raise rpc.RpcAbort(rpc.Status.INVALID_ARGUMENT,
                               f"error getting list of preferred allocation devices: {exc}") from None

    def answer_allocate(self, request: pb.AllocateRequest) -> pb.AllocateResponse:
        try:
            return self.allocate(request)
        except (AllocateError, AllocationRefused) as exc:
            raise rpc.RpcAbort(rpc.Status.INVALID_ARGUMENT, str(exc)) from None

    # ----- ListAndWatch ----------------------------------------------------------------------

    def device_list(self) -> pb.ListAndWatchResponse:
        health = self.state.snapshot()
        out = pb.ListAndWatchResponse()
        for d in self.plan.devices:
            dev = out.devices.add(ID=d.id, health=HEALTHY if health.get(d.uuid, False) else UNHEALTHY)
            if d.numa_node is not None and d.numa_node >= 0:
                dev.topology.nodes.add(ID=d.numa_node)
        return out

    def list_and_watch(self, context: rpc.StreamContext) -> Iterator[pb.ListAndWatchResponse]:
        # One live stream per server: the kubelet keeps one per resource and opens a new one when it
        # restarts or re-registers, so an older stream is stale. Ending it ends its thread, so however many
        # streams are opened, one thread a resource waits on the health state.
        with self._lock:
            self._streams += 1
            self.streams_opened += 1
            self.last_stream_open = time.monotonic()
            self._stream_gen += 1
            mine = self._stream_gen
        self.state.wake()  # older streams look, see they are superseded, and end
        ended = threading.Event()

        def done() -> None:
            if ended.is_set():
                return
            ended.set()
            with self._lock:
                self._streams -= 1
            if not self._stopping.is_set() and self.on_stream_end is not None:
                self.on_stream_end(self)

        context.add_callback(done)
        context.on_cancel(self.state.wake)  # the kubelet left: end now, so on_stream_end re-registers at once
        log.info("%s: ListAndWatch stream opened", self.resource)
        version = self.state.version
        msg = self.device_list()
        last = msg.SerializeToString(deterministic=True)
        yield msg
        while not self._stopping.is_set() and context.is_active() and mine == self._stream_gen:
            new = self.state.wait_changed(version, timeout_s=0.5)
            if self._stopping.is_set() or not context.is_active():
                break
            if mine != self._stream_gen:
                log.info("%s: a newer ListAndWatch stream was opened: ending this one", self.resource)
                break
            if new == version:
                continue
            version = new
            msg = self.device_list()
            raw = msg.SerializeToString(deterministic=True)
            if raw != last:
                last = raw
                n_bad = sum(1 for d in msg.devices if d.health != HEALTHY)
                log.info("%s: sending device list (%d devices, %d unhealthy)", self.resource,
                         len(msg.devices), n_bad)
                yield msg
        log.info("%s: ListAndWatch stream closing", self.resource)

    # ----- GetPreferredAllocation ------------------------------------------------------------

    def preferred(self, request: pb.PreferredAllocationRequest) -> pb.PreferredAllocationResponse:
        t0 = time.perf_counter()
        resp = pb.PreferredAllocationResponse()
        if len(request.container_requests) > MAX_CONTAINER_REQUESTS:
            raise pref.PreferenceError(f"{len(request.container_requests)} container requests in one call "
                                       f"(at most {MAX_CONTAINER_REQUESTS})")
        for creq in request.container_requests:
            ids = self.preferred_ids(list(creq.available_deviceIDs), list(creq.must_include_deviceIDs),
                                     int(creq.allocation_size))
            resp.container_responses.add(deviceIDs=ids)
        if self.metrics is not None:
            self.metrics.preferred_seconds.labels(resource=self.resource).observe(time.perf_counter() - t0)
        return resp

    def preferred_ids(self, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
        pref.check(available, must_include, size, self.known)
        if self.resolver is not None and self._resolver_applies():
            try:
                hint = self.resolver.preferred(self.resource, available, must_include, size)
            except Exception as exc:  # a resolver must never fail admission here: fall back
                log.warning("%s: resolver preferred() failed: %s; choosing locally", self.resource, exc)
                hint = None
            if hint is not None:
                avail = set(available) | set(must_include)
                return [i for i in hint if i in avail][:size]
        if not self.plan.shared:
            # The choice is a pure function of the sets (the inventory is fixed for this server):
            # memoise it, since the kubelet asks the same questions over and over.
            mask = 0
            for i in available:  # every ID is known: pref.check above
                mask |= self._bit[i]
            key = (mask, tuple(self.known[i].id for i in must_include), size)
            hit = self._whole_cache.get(key)
            if hit is None:
                hit = tuple(self.known[i].id for i in
                            pref.whole_gpus(self.inventory.gpus, available, must_include, size, self.known))
                if len(self._whole_cache) >= 4096:
                    self._whole_cache.clear()
                self._whole_cache[key] = hit
            return list(hit)
        policy = self.settings.replica_policy
        distinct = self.plan.sharing == "slots" or policy != "packed"
        return pref.replicas(self.plan.devices, available, must_include, size, self.known, policy,
                             distinct=distinct, totals=self._totals)

    def _resolver_applies(self) -> bool:
        # Whole GPUs, share slots and MIG devices carry records; replicas are served from their IDs.
        return self.resource in (R.GPU_SLOTS, R.NVIDIA_GPU) or self.resource.startswith(R.NVIDIA_MIG_PREFIX)

    # ----- Allocate --------------------------------------------------------------------------

    def allocate(self, request: pb.AllocateRequest) -> pb.AllocateResponse:
        t0 = time.perf_counter()
        resp = pb.AllocateResponse()
        try:
            if len(request.container_requests) > MAX_CONTAINER_REQUESTS:
                raise AllocateError(f"{len(request.container_requests)} container requests in one call "
                                    f"(at most {MAX_CONTAINER_REQUESTS})")
            for creq in request.container_requests:
                resp.container_responses.append(self.allocate_one(list(creq.devices_ids)))
        except (AllocateError, AllocationRefused) as exc:
            log.warning("%s: Allocate refused: %s", self.resource, exc)
            if self.metrics is not None:
                self.metrics.allocations.labels(resource=self.resource, result="refused").inc()
            raise
        if self.metrics is not None:
            self.metrics.allocations.labels(resource=self.resource, result="ok").inc(
                len(request.container_requests))
            self.metrics.allocate_seconds.labels(resource=self.resource).observe(time.perf_counter() - t0)
        return resp

    def allocate_one(self, ids: Sequence[str]) -> pb.ContainerAllocateResponse:
        check_request(self.plan, ids, self.known)
        bad = [i for i in ids if not self.state.is_healthy(self.known[i].uuid)]
        if bad:
            why = self.state.reason(self.known[bad[0]].uuid)
            raise AllocateError(f"invalid allocation request for '{self.resource}': device {bad[0]} "
                                "is unhealthy" + (f" ({why})" if why else ""))
        resolved: ResolvedAllocation | None = None
        if self.resolver is not None and self._resolver_applies():
            resolved = self.resolver.resolve(self.resource, ids)  # AllocationRefused propagates
            if resolved is not None:
                sick = [u for u in resolved.uuids if not self.state.is_healthy(u)]
                if sick:
                    raise AllocateError(f"allocation recorded for {resolved.pod or 'the pod'} names "
                                        f"unhealthy GPU {sick[0]}")
                log.info("%s: Allocate %s serves %s/%s on %s", self.resource, ",".join(ids), resolved.pod,
                         resolved.container, ",".join(resolved.uuids))
        edits = container_edits_for(self.plan, ids, self.known, self.settings, resolved=resolved,
                                    by_uuid=self.by_uuid, mig_minors=self.mig_minors)
        return build_response(self.plan, edits, self.settings)


def device_health(plans: Sequence[PluginServer]) -> Mapping[str, int]:
    """Resource -> healthy device count (what the publisher reports)."""
    out: dict[str, int] = {}
    for s in plans:
        health = s.state.snapshot()
        out[s.resource] = sum(1 for d in s.plan.devices if health.get(d.uuid, False))
    return out
