"""An in-process stand-in for the kubelet's device manager, speaking the real v1beta1 gRPC API.

Used by the node daemon's tests, the end-to-end test and ``kubegpu demo``: it serves the
``Registration`` service on ``<dir>/kubelet.sock``, dials each plugin back over its unix
socket, keeps one ``ListAndWatch`` stream per resource and allocates devices the way the
kubelet does (contracts.md §1.4–§1.9). Two behaviours:

- ``mode="current"`` (default): ``Register`` checks the version and the resource name,
  dials the plugin back synchronously (10 s), calls ``GetDevicePluginOptions`` and only
  then returns; the options used later come from that answer.
- ``mode="v1.24"``: the recorded v1.24 kubelet (``fixtures/kubelet-v1.24``): options are
  taken from ``RegisterRequest.options``, ``GetDevicePluginOptions`` is never called and
  ``Register`` returns before the dial-back (which fails silently when the socket is gone).

Typical use::

    kubelet = StandinKubelet("/tmp/dp")
    kubelet.start()
    ... start the plugin ...
    kubelet.wait_registered("nvidia.com/gpu", timeout_s=5)
    got = kubelet.allocate("nvidia.com/gpu", 2)      # GetPreferredAllocation, then Allocate
    got.response.envs["NVIDIA_VISIBLE_DEVICES"]
    kubelet.restart()                                 # delete sockets, re-create kubelet.sock
    kubelet.stop()

Every RPC it makes or serves is appended to :attr:`StandinKubelet.calls` (method path,
request and response as dicts), in order, so tests can compare sequences with the recording.

``allocate(..., pod="ns/name", container="c")`` also records who holds which devices, and
:meth:`StandinKubelet.serve_pod_resources` serves them over the PodResources v1 API (one
``ContainerDevices`` per device, app containers only, as the recorded kubelet lists them).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import grpc
from google.protobuf.json_format import MessageToDict

from kubegpu.node.proto import deviceplugin_pb2 as pb
from kubegpu.node.proto import deviceplugin_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

KUBELET_SOCKET = "kubelet.sock"
CHECKPOINT = "kubelet_internal_checkpoint"
SUPPORTED_VERSIONS = ("v1beta1",)
DIAL_TIMEOUT_S = 10.0
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"

# A qualified name with a DNS-subdomain prefix: what the kubelet accepts as an extended resource.
_NAME_RE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_DNS_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")

Mode = Literal["current", "v1.24"]


class AllocationFailed(RuntimeError):
    """Pod admission failed the way the kubelet fails it (UnexpectedAdmissionError)."""


def go_status(exc: grpc.RpcError) -> str:
    """A failed call as the kubelet's error text shows it: grpc-go's ``rpc error: code = ... desc = ...``, the
    code in Go's spelling. The code is what tells a plugin that could not be reached, or went away mid-call
    (Unavailable), from the plugin's own answer; the description is grpcio's, not grpc-go's."""
    code = exc.code()  # type: ignore[attr-defined]
    go = "Canceled" if code is grpc.StatusCode.CANCELLED else code.name.title().replace("_", "")
    return f"rpc error: code = {go} desc = {exc.details()}"  # type: ignore[attr-defined]


def is_extended_resource_name(name: str) -> bool:
    """The kubelet's check: ``<domain>/<name>``, not in the ``kubernetes.io`` domain, not ``requests.``."""
    if name.count("/") != 1:
        return False
    prefix, base = name.split("/")
    if not prefix or not base or len(base) > 63 or len(prefix) > 253:
        return False
    if prefix == "kubernetes.io" or prefix.endswith(".kubernetes.io") or name.startswith("requests."):
        return False
    return bool(_DNS_SUBDOMAIN_RE.match(prefix) and _NAME_RE.match(base))


@dataclass
class CallRecord:
    """One RPC as the stand-in saw it (the fixture's ``device-plugin-calls.json`` shape, minus timing)."""

    rpc: str
    request: dict[str, Any] | None
    response: dict[str, Any] | None
    t: float = field(default_factory=time.monotonic)
    error: str | None = None
    event: str | None = None  # ListAndWatch: stream-opened / send / stream-terminated
    resource: str = ""
    latency_s: float | None = None  # unary RPCs the stand-in made: call to answer


@dataclass(frozen=True)
class Allocation:
    """What one container got for one resource: the devices and the plugin's response."""

    resource: str
    device_ids: tuple[str, ...]
    preferred: tuple[str, ...] | None  # None when GetPreferredAllocation was not called
    response: pb.ContainerAllocateResponse


@dataclass
class ResourceState:
    """The kubelet's view of one resource (an endpoint in its device manager)."""

    name: str
    endpoint: str = ""
    options: pb.DevicePluginOptions = field(default_factory=pb.DevicePluginOptions)
    healthy: set[str] = field(default_factory=set)
    unhealthy: set[str] = field(default_factory=set)
    topology: dict[str, tuple[int, ...]] = field(default_factory=dict)
    connected: bool = False  # a ListAndWatch stream is open
    stop_time: float | None = None
    lists_received: int = 0
    registrations: int = 0
    channel: grpc.Channel | None = None
    stream: Any = None  # the ListAndWatch call, cancellable

    @property
    def capacity(self) -> int:
        return len(self.healthy) + len(self.unhealthy)

    @property
    def allocatable(self) -> int:
        return len(self.healthy)


@dataclass
class PodAdmission:
    """One pod through the device manager's admit handler: per container and resource what it got,
    or the kubelet's failure message."""

    pod: str
    uid: str
    ok: bool = True
    reason: str = ""
    containers: dict[str, dict[str, Allocation]] = field(default_factory=dict)
    seconds: float = 0.0
    done_at: float = 0.0  # time.monotonic() when the last Allocate answered (or the admission failed)


class _Registration(pb_grpc.RegistrationServicer):
    def __init__(self, kubelet: StandinKubelet) -> None:
        self._k = kubelet

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        return self._k._on_register(request, context)


class _PodResources:
    """PodResourcesLister over the stand-in's recorded holdings."""

    def __init__(self, kubelet: StandinKubelet) -> None:
        self._k = kubelet

    def List(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._k.pod_resources()

    def GetAllocatableResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        from kubegpu.node.proto import podresources_pb2 as pr

        out = pr.AllocatableResourcesResponse()
        with self._k._cond:
            for name, st in sorted(self._k.resources.items()):
                for i in sorted(st.healthy):
                    out.devices.add(resource_name=name, device_ids=[i])
        return out

    def Get(self, request: Any, context: grpc.ServicerContext) -> Any:
        from kubegpu.node.proto import podresources_pb2 as pr

        for p in self._k.pod_resources().pod_resources:
            if p.name == request.pod_name and p.namespace == request.pod_namespace:
                return pr.GetPodResourcesResponse(pod_resources=p)
        context.abort(grpc.StatusCode.NOT_FOUND, f"pod {request.pod_namespace}/{request.pod_name} not found")
        raise AssertionError("unreachable")


class StandinKubelet:
    """The kubelet's device manager, in process. Thread-safe; every wait is bounded."""

    def __init__(self, plugin_dir: str | os.PathLike[str], *, mode: Mode = "current",
                 dial_timeout_s: float = DIAL_TIMEOUT_S, seed: int | None = 0) -> None:
        self.dir = Path(plugin_dir)
        self.mode: Mode = mode
        self.dial_timeout_s = dial_timeout_s
        self.calls: list[CallRecord] = []
        self.resources: dict[str, ResourceState] = {}
        self.in_use: dict[str, set[str]] = {}
        self.restarts = 0
        self.started_at: float | None = None
        # pod ("namespace/name") -> container -> [(resource, device IDs)], for PodResources.
        self.holdings: dict[str, dict[str, list[tuple[str, tuple[str, ...]]]]] = {}
        self._pod_devices: dict[str, dict[str, set[str]]] = {}  # pod -> resource -> devices (checkpoint)
        self.admitted: list[PodAdmission] = []
        self._extra_servers: list[grpc.Server] = []
        self._podres_paths: list[str] = []
        self._cond = threading.Condition()
        self._server: grpc.Server | None = None
        self._threads: list[threading.Thread] = []
        # The kubelet iterates a Go set: candidate order is random. Seeded for reproducible tests.
        self._rng = random.Random(seed)

    # ----- lifecycle -------------------------------------------------------------------------

    @property
    def socket_path(self) -> Path:
        return self.dir / KUBELET_SOCKET

    def start(self) -> None:
        """Delete stale plugin sockets (as the kubelet does on start) and serve ``kubelet.sock``."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self._clean_dir()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="standin-kubelet"))
        pb_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        server.add_insecure_port(f"unix://{self.socket_path}")
        server.start()
        self.started_at = time.monotonic()  # kubelet.sock is listening from here on
        self._server = server
        for path in self._podres_paths:
            self.serve_pod_resources(path)

    def stop(self) -> None:
        """Stop serving and close every plugin stream (like a kubelet stop: files stay behind).

        gRPC removes its socket file on stop; the real kubelet leaves ``kubelet.sock`` behind,
        so a dead socket file is put back in its place (connecting to it is refused)."""
        if self._server is not None:
            self._server.stop(grace=None).wait(timeout=5)
            self._server = None
            self._leave_stale_socket()
        for extra in self._extra_servers:
            extra.stop(grace=None)
        self._extra_servers = []
        with self._cond:
            states = list(self.resources.values())
        for st in states:
            self._disconnect(st)
        for t in self._threads:
            t.join(timeout=2)
        self._threads = [t for t in self._threads if t.is_alive()]

    def _leave_stale_socket(self) -> None:
        if self.socket_path.exists():
            return
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.bind(str(self.socket_path))  # bound, never listening: connections are refused
        except OSError:
            pass
        finally:
            s.close()

    def restart(self) -> None:
        """A kubelet restart: streams end, plugin sockets are deleted, ``kubelet.sock`` is re-created.

        Resources come back as stopped endpoints with no devices (capacity 0) until the plugin
        registers again; devices in use are kept (the checkpoint)."""
        self.stop()
        with self._cond:
            for st in self.resources.values():
                st.healthy.clear()
                st.unhealthy.clear()
                st.connected = False
                # The checkpoint restores the resource as a stopped endpoint with no options and no
                # client: nothing is called for it until the plugin registers again.
                st.options = pb.DevicePluginOptions()
                st.channel = None
                st.stream = None
                st.stop_time = time.monotonic()
            self.restarts += 1
            self._cond.notify_all()
        self.start()

    def __enter__(self) -> StandinKubelet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _clean_dir(self) -> None:
        for entry in self.dir.iterdir():
            if entry.name == CHECKPOINT:
                continue
            try:
                mode = entry.lstat().st_mode
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(mode):
                continue
            # The current kubelet removes only sockets; v1.24 removed every non-directory file.
            if self.mode == "v1.24" or stat.S_ISSOCK(mode):
                with contextlib.suppress(FileNotFoundError):
                    entry.unlink()

    # ----- registration ----------------------------------------------------------------------

    def _record(self, rec: CallRecord) -> None:
        with self._cond:
            self.calls.append(rec)
            self._cond.notify_all()

    def _on_register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        req = MessageToDict(request, preserving_proto_field_name=True)
        rec = CallRecord("/v1beta1.Registration/Register", req, {}, resource=request.resource_name)
        if request.version not in SUPPORTED_VERSIONS:
            rec.error = (f"Requested device plugin version {request.version!r} is not supported; "
                         f"supported versions: {list(SUPPORTED_VERSIONS)}")
            self._record(rec)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, rec.error)
        if not is_extended_resource_name(request.resource_name):
            rec.error = (f"invalid name of device plugin socket: {request.resource_name!r} "
                         "is not an extended resource")
            self._record(rec)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, rec.error)
        self._record(rec)
        if self.mode == "v1.24":
            # addEndpoint runs in a goroutine: Register returns first; the dial can fail silently.
            t = threading.Thread(target=self._connect, args=(request, request.options), daemon=True,
                                 name=f"standin-connect-{request.resource_name}")
            self._threads.append(t)
            t.start()
            return pb.Empty()
        try:
            options = self._connect(request, None)
        except Exception as exc:
            context.abort(grpc.StatusCode.UNKNOWN, f"failed to dial device plugin: {exc}")
        if options is None:
            context.abort(grpc.StatusCode.UNKNOWN, "failed to dial device plugin")
        return pb.Empty()

    def _connect(self, request: pb.RegisterRequest,
                 options: pb.DevicePluginOptions | None) -> pb.DevicePluginOptions | None:
        """Dial the plugin back, fetch options (current mode) and start its ListAndWatch."""
        path = self.dir / request.endpoint
        channel = grpc.insecure_channel(f"unix://{path}", options=[("grpc.default_authority", "localhost")])
        try:
            grpc.channel_ready_future(channel).result(timeout=self.dial_timeout_s)
        except grpc.FutureTimeoutError:
            channel.close()
            log.warning("standin kubelet: failed to dial device plugin %s: context deadline exceeded", path)
            if self.mode == "current":
                raise RuntimeError(f"dial {path}: context deadline exceeded") from None
            return None
        stub = pb_grpc.DevicePluginStub(channel)
        if options is None:
            try:
                options = stub.GetDevicePluginOptions(pb.Empty(), timeout=self.dial_timeout_s)
            except grpc.RpcError as exc:
                channel.close()
                raise RuntimeError(f"GetDevicePluginOptions: {exc.details()}") from None  # type: ignore[attr-defined]
            self._record(CallRecord("/v1beta1.DevicePlugin/GetDevicePluginOptions", {},
                                    MessageToDict(options, preserving_proto_field_name=True),
                                    resource=request.resource_name))
        with self._cond:
            st = self.resources.get(request.resource_name)
            old_channel = None
            if st is None:
                st = self.resources[request.resource_name] = ResourceState(request.resource_name)
            else:
                old_channel = st.channel
            st.endpoint = request.endpoint
            st.options = options
            st.registrations += 1
            st.channel = channel
            st.stop_time = None
        if old_channel is not None:
            # Re-registration replaces the endpoint: the old client is disconnected (closed off
            # this thread: grpcio's close() can block, and Register must answer).
            threading.Thread(target=old_channel.close, daemon=True).start()
        stream = stub.ListAndWatch(pb.Empty())
        with self._cond:
            st.stream = stream
            st.connected = True
            self._cond.notify_all()
        self._record(CallRecord("/v1beta1.DevicePlugin/ListAndWatch", {}, None, event="stream-opened",
                                resource=request.resource_name))
        t = threading.Thread(target=self._watch, args=(st, stream, channel), daemon=True,
                             name=f"standin-law-{request.resource_name}")
        self._threads = [x for x in self._threads if x.is_alive()]
        self._threads.append(t)
        t.start()
        return options

    def _watch(self, st: ResourceState, stream: Any, channel: grpc.Channel) -> None:
        try:
            for msg in stream:
                self._record(CallRecord("/v1beta1.DevicePlugin/ListAndWatch", None,
                                        MessageToDict(msg, preserving_proto_field_name=True),
                                        event="send", resource=st.name))
                with self._cond:
                    if st.channel is not channel:
                        return
                    # Each message is the full list: it replaces both sets.
                    st.healthy = {d.ID for d in msg.devices if d.health == HEALTHY}
                    st.unhealthy = {d.ID for d in msg.devices if d.health != HEALTHY}
                    st.topology = {d.ID: tuple(n.ID for n in d.topology.nodes) for d in msg.devices}
                    st.lists_received += 1
                    self._cond.notify_all()
        except grpc.RpcError:
            pass
        except ValueError:
            pass  # channel closed under us
        self._record(CallRecord("/v1beta1.DevicePlugin/ListAndWatch", None, None,
                                event="stream-terminated", resource=st.name))
        with self._cond:
            if st.channel is channel:
                # listAndWatch ended: every device of the resource becomes unhealthy; no new call.
                st.unhealthy |= st.healthy
                st.healthy = set()
                st.connected = False
                st.stop_time = time.monotonic()
                st.stream = None
            self._cond.notify_all()

    def _disconnect(self, st: ResourceState) -> None:
        with self._cond:
            stream, channel = st.stream, st.channel
        if stream is not None:
            stream.cancel()
        if channel is not None:
            threading.Thread(target=channel.close, daemon=True).start()

    def drop_stream(self, resource: str) -> None:
        """End the resource's ListAndWatch stream from the kubelet side (the plugin must re-register)."""
        with self._cond:
            st = self.resources[resource]
            stream = st.stream
        if stream is not None:
            stream.cancel()

    # ----- observation -----------------------------------------------------------------------

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
        """Wait until ``predicate()`` (evaluated under the lock) is true; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
            return True

    def wait_registered(self, resource: str, timeout_s: float = 5.0, *, count: int = 1) -> bool:
        """Wait until ``resource`` has registered ``count`` times and its stream sent a list."""
        def ok() -> bool:
            st = self.resources.get(resource)
            return st is not None and st.registrations >= count and st.connected and st.lists_received > 0
        return self.wait_for(ok, timeout_s)

    def capacity(self, resource: str) -> int:
        with self._cond:
            st = self.resources.get(resource)
            return st.capacity if st else 0

    def allocatable(self, resource: str) -> int:
        with self._cond:
            st = self.resources.get(resource)
            return st.allocatable if st else 0

    def allocatable_counts(self) -> dict[str, int]:
        """Every resource's allocatable count, as the kubelet publishes them in its Node's status."""
        with self._cond:
            return {r: st.allocatable for r, st in self.resources.items()}

    def node_status(self) -> dict[str, dict[str, str]]:
        """The device part of the Node's status as the kubelet posts it: per resource, capacity (every device
        the plugin listed) and allocatable (the healthy ones)."""
        with self._cond:
            return {"capacity": {r: str(st.capacity) for r, st in self.resources.items()},
                    "allocatable": {r: str(st.allocatable) for r, st in self.resources.items()}}

    def healthy(self, resource: str) -> set[str]:
        with self._cond:
            st = self.resources.get(resource)
            return set(st.healthy) if st else set()

    def unhealthy(self, resource: str) -> set[str]:
        with self._cond:
            st = self.resources.get(resource)
            return set(st.unhealthy) if st else set()

    def register_count(self, resource: str | None = None) -> int:
        with self._cond:
            return sum(1 for c in self.calls if c.rpc.endswith("/Register") and c.error is None
                       and (resource is None or c.resource == resource))

    def rpc_sequence(self, resource: str | None = None) -> list[str]:
        """Method names (with the ListAndWatch event) in order, e.g. ``["Register", "ListAndWatch:send"]``."""
        with self._cond:
            out = []
            for c in self.calls:
                if resource is not None and c.resource != resource:
                    continue
                name = c.rpc.rsplit("/", 1)[1]
                out.append(f"{name}:{c.event}" if c.event else name)
            return out

    # ----- admission -------------------------------------------------------------------------

    def _unary(self, resource: str, method: str, call: Callable[..., Any], req: Any, timeout_s: float) -> Any:
        """One unary DevicePlugin RPC, recorded in :attr:`calls` whether it succeeds or fails (re-raised)."""
        path = f"/v1beta1.DevicePlugin/{method}"
        request = MessageToDict(req, preserving_proto_field_name=True)
        t0 = time.perf_counter()
        try:
            resp = call(req, timeout=timeout_s)
        except grpc.RpcError as exc:
            self._record(CallRecord(path, request, None, error=exc.details(), resource=resource,  # type: ignore[attr-defined]
                                    latency_s=time.perf_counter() - t0))
            raise
        self._record(CallRecord(path, request, MessageToDict(resp, preserving_proto_field_name=True),
                                resource=resource, latency_s=time.perf_counter() - t0))
        return resp

    def allocate(self, resource: str, n: int, *, must_include: Sequence[str] = (),
                 reserve: bool = True, timeout_s: float = 10.0, pod: str | None = None,
                 container: str = "", init: bool = False) -> Allocation:
        """Admit one container asking for ``n`` devices of ``resource``, as the kubelet does.

        Candidates are the healthy devices not in use (plus ``must_include``, devices reused from
        an init container). With ``get_preferred_allocation_available`` the plugin is asked
        first (one ``container_requests`` entry); its answer is intersected with the candidates
        and any shortfall is filled by the kubelet's own pick. Then ``Allocate`` is called with
        exactly one entry. Raises :class:`AllocationFailed` where the kubelet fails admission.
        """
        with self._cond:
            st = self.resources.get(resource)
            if st is None:
                raise AllocationFailed(f"Pod Allocate failed due to unknown resource {resource}")
            in_use = self.in_use.setdefault(resource, set())
            reused = [d for d in must_include]
            needed = n - len(reused)
            if not st.healthy and st.unhealthy:
                # The device manager's own check before any choice (devicesToAllocate): a plugin whose stream
                # ended leaves every device of its resource Unhealthy (recorded on v1.36, kubegpu-on-v1.36/
                # turn4-scale.md: a node daemon stopped while pods were bound there).
                raise AllocationFailed(f"no healthy devices present; cannot allocate unhealthy devices {resource}")
            available = [d for d in st.healthy if d not in in_use and d not in reused]
            self._rng.shuffle(available)
            if needed > len(available):
                raise AllocationFailed(
                    f"Pod Allocate failed due to requested number of devices unavailable for {resource}. "
                    f"Requested: {n}, Available: {len(available)}, which is unexpected")
            options, channel = st.options, st.channel
        if channel is None:
            raise AllocationFailed(f"no endpoint for {resource}")
        stub = pb_grpc.DevicePluginStub(channel)
        chosen: list[str] = list(reused)
        preferred: tuple[str, ...] | None = None
        if needed > 0 and options.get_preferred_allocation_available:
            req = pb.PreferredAllocationRequest(container_requests=[pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=[*available, *reused], must_include_deviceIDs=reused,
                allocation_size=n)])
            try:
                resp = self._unary(resource, "GetPreferredAllocation", stub.GetPreferredAllocation, req, timeout_s)
            except grpc.RpcError as exc:
                raise AllocationFailed(
                    f"device plugin GetPreferredAllocation rpc failed with err: {go_status(exc)}") from None
            preferred = tuple(resp.container_responses[0].deviceIDs) if resp.container_responses else ()
            avail_set = set(available)
            for d in preferred:
                if len(chosen) >= n:
                    break
                if d in avail_set and d not in chosen:
                    chosen.append(d)
        # The kubelet's fallback for any shortfall.
        for d in available:
            if len(chosen) >= n:
                break
            if d not in chosen:
                chosen.append(d)
        # The kubelet passes a set: the IDs reach Allocate in no particular order.
        sent = list(chosen)
        self._rng.shuffle(sent)
        areq = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=sent)])
        try:
            aresp = self._unary(resource, "Allocate", stub.Allocate, areq, timeout_s)
        except grpc.RpcError as exc:
            raise AllocationFailed(go_status(exc)) from None
        if not aresp.container_responses:
            raise AllocationFailed(f"Allocate for {resource} returned no container response")
        if reserve:
            with self._cond:
                self.in_use.setdefault(resource, set()).update(chosen)
        if pod is not None:
            with self._cond:
                entry = self.holdings.setdefault(pod, {})
                # PodResources lists app containers only (as the recorded v1.24 kubelet did).
                if not init:
                    entry.setdefault(container, []).append((resource, tuple(chosen)))
                else:
                    entry.setdefault("", [])
        return Allocation(resource, tuple(sent), preferred, aresp.container_responses[0])

    def allocate_ids(self, resource: str, device_ids: Iterable[str], *,
                     timeout_s: float = 10.0) -> pb.ContainerAllocateResponse:
        """Call ``Allocate`` with exactly these IDs (no preference, no checks): for bad-request tests."""
        with self._cond:
            channel = self.resources[resource].channel
        assert channel is not None
        areq = pb.AllocateRequest(container_requests=[
            pb.ContainerAllocateRequest(devices_ids=list(device_ids))])
        resp = self._unary(resource, "Allocate", pb_grpc.DevicePluginStub(channel).Allocate, areq, timeout_s)
        return resp.container_responses[0]

    def preferred(self, resource: str, available: Sequence[str], size: int,
                  must_include: Sequence[str] = (), *, timeout_s: float = 10.0) -> tuple[str, ...]:
        """Call ``GetPreferredAllocation`` directly with these candidates."""
        with self._cond:
            channel = self.resources[resource].channel
        assert channel is not None
        req = pb.PreferredAllocationRequest(container_requests=[pb.ContainerPreferredAllocationRequest(
            available_deviceIDs=list(available), must_include_deviceIDs=list(must_include),
            allocation_size=size)])
        resp = pb_grpc.DevicePluginStub(channel).GetPreferredAllocation(req, timeout=timeout_s)
        return tuple(resp.container_responses[0].deviceIDs)

    def pre_start(self, alloc: Allocation, *, timeout_s: float = 30.0) -> None:
        """``PreStartContainer`` before a container (re)start, when the plugin asked for it."""
        with self._cond:
            st = self.resources[alloc.resource]
            options, channel = st.options, st.channel
        if not options.pre_start_required or channel is None:
            return
        req = pb.PreStartContainerRequest(devices_ids=list(alloc.device_ids))
        self._unary(alloc.resource, "PreStartContainer", pb_grpc.DevicePluginStub(channel).PreStartContainer, req,
                    timeout_s)

    def release(self, alloc: Allocation) -> None:
        """The pod is gone: its devices become free at the next admission."""
        with self._cond:
            self.in_use.get(alloc.resource, set()).difference_update(alloc.device_ids)

    def admitting(self, pod: str) -> None:
        """``pod`` is listed (PodResources) from the start of its admission: the kubelet adds a pod to its pod
        manager, which List enumerates, before it admits it (HandlePodAdditions: podManager.AddPod, then
        canAdmitPod)."""
        with self._cond:
            self.holdings.setdefault(pod, {})

    def release_pod(self, pod: str) -> None:
        """Forget a pod's PodResources entry and free every device admitted for it (the kubelet frees
        them lazily, at the next admission: the same for the next pod)."""
        with self._cond:
            self.holdings.pop(pod, None)
            for resource, ids in self._pod_devices.pop(pod, {}).items():
                self.in_use.get(resource, set()).difference_update(ids)

    # ----- pod admission (the device manager's admit handler) --------------------------------

    def admit_pod(self, pod: dict[str, Any]) -> PodAdmission:
        """Admit one pod as the kubelet's device manager does: init containers first, then app
        containers, in spec order; for each device resource in a container's limits, devices its
        init containers had are reused first (``devicesToReuse``: a container wholly served by them
        gets no GetPreferredAllocation), the rest through GetPreferredAllocation and Allocate. Any
        failure fails the whole pod with the kubelet's message (``UnexpectedAdmissionError``)."""
        meta = pod.get("metadata") or {}
        key = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
        spec = pod.get("spec") or {}
        out = PodAdmission(key, str(meta.get("uid") or ""))
        reuse: dict[str, list[str]] = {}
        with self._cond:
            registered = set(self.resources)
        self.admitting(key)
        t0 = time.perf_counter()
        try:
            for init, c in [(True, c) for c in spec.get("initContainers") or []] + [
                    (False, c) for c in spec.get("containers") or []]:
                limits = (c.get("resources") or {}).get("limits") or {}
                for resource in sorted(limits):
                    if resource not in registered:
                        continue
                    try:
                        n = int(str(limits[resource]))
                    except ValueError:
                        continue
                    pool = reuse.get(resource, [])
                    must = pool if n >= len(pool) else self._rng.sample(pool, n)
                    got = self.allocate(resource, n, must_include=must, pod=key, container=str(c.get("name")),
                                        init=init)
                    out.containers.setdefault(str(c.get("name")), {})[resource] = got
                    with self._cond:
                        self._pod_devices.setdefault(key, {}).setdefault(resource, set()).update(got.device_ids)
                    if init:
                        reuse[resource] = list(dict.fromkeys([*pool, *got.device_ids]))
                    else:
                        reuse[resource] = [d for d in pool if d not in got.device_ids]
        except AllocationFailed as exc:
            out.ok, out.reason = False, str(exc)
            self.release_pod(key)
            with self._cond:
                self.holdings[key] = {}  # listed with its containers but no devices, as the kubelet does
        out.seconds = time.perf_counter() - t0
        out.done_at = time.monotonic()
        with self._cond:
            self.admitted.append(out)
            self._cond.notify_all()
        return out

    # ----- PodResources v1 -------------------------------------------------------------------

    def serve_pod_resources(self, path: str | os.PathLike[str]) -> grpc.Server:
        """Serve the kubelet's PodResources v1 API (``List``, ``GetAllocatableResources``, ``Get``)
        on a unix socket, from the allocations made with ``pod=``. Stopped by :meth:`stop`."""
        from kubegpu.node.proto import podresources_pb2_grpc as pr_grpc

        if str(path) not in self._podres_paths:
            self._podres_paths.append(str(path))  # served again after a restart()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            Path(path).unlink()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="standin-podres"))
        pr_grpc.add_PodResourcesListerServicer_to_server(_PodResources(self), server)
        server.add_insecure_port(f"unix://{path}")
        server.start()
        self._extra_servers.append(server)
        return server

    def pod_resources(self) -> Any:
        """The ``ListPodResourcesResponse`` the API would return now."""
        from kubegpu.node.proto import podresources_pb2 as pr

        with self._cond:
            out = pr.ListPodResourcesResponse()
            for pod, containers in sorted(self.holdings.items()):
                ns, _, name = pod.rpartition("/")
                p = out.pod_resources.add(name=name, namespace=ns)
                for cname, held in containers.items():
                    if not cname:
                        continue
                    c = p.containers.add(name=cname)
                    for resource, ids in held:
                        for i in ids:  # one entry per device, as the kubelet lists them
                            c.devices.add(resource_name=resource, device_ids=[i])
            return out


_DELETION = "deleted"  # a queue item of a busy PodAdmitter: {_DELETION: pod key}, handled in turn


class PodAdmitter:
    """The kubelet's pod loop for one node: watch the pods bound to it and admit them **in the order
    the watch delivers them**, as the recorded kubelets did (v1.24: four binds admitted 1, 4, 3, 2;
    v1.36: bind order with adjacent swaps of binds milliseconds apart). ``swap_prob`` swaps adjacent
    pods of a batch (those that arrived within ``batch_window_s``) with that probability, seeded.
    Each outcome goes to the pod's status (Running, or Failed with ``UnexpectedAdmissionError`` and
    the device manager's message); deleted pods free their devices. A pod deleted while queued is not
    admitted (a kubelet coming back from a restart relists and never sees it), or with ``admit_deleted`` is
    admitted anyway (a busy kubelet: its sync loop takes the pod's addition before its deletion, which comes
    after it on the same config channel), its deletion handled after its admission."""

    def __init__(self, kubelet: StandinKubelet, client: Any, node: str, *, swap_prob: float = 0.0,
                 batch_window_s: float = 0.02, seed: int = 0, write_status: bool = True,
                 node_status_s: float = 0.0, admit_deleted: bool = False) -> None:
        self.kubelet, self.client, self.node = kubelet, client, node
        self.admit_deleted = admit_deleted
        self.swap_prob, self.batch_window_s, self.write_status = swap_prob, batch_window_s, write_status
        # The kubelet's nodeStatusUpdateFrequency (10 s by default; 0: the Node's status is not written): every
        # period it posts the devices' capacity and allocatable when they changed.
        self.node_status_s = node_status_s
        self._status_thread: threading.Thread | None = None
        self._rng = random.Random(seed)
        self._queue: list[dict[str, Any]] = []
        self._seen: set[str] = set()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self.order: list[str] = []  # pods in the order they were admitted
        self.results: dict[str, PodAdmission] = {}
        self._watch: Any = None
        self._thread: threading.Thread | None = None
        self.paused = threading.Event()  # set: admissions wait (a kubelet restart)
        self._admitting = threading.Lock()  # held while one pod goes through the admit handler

    def start(self) -> PodAdmitter:
        from kubegpu.kube.informer import EventType
        from kubegpu.kube.resources import Pod
        from kubegpu.kube.threaded import InformerThread

        def on_event(ev: Any) -> None:
            pod = ev.obj.to_dict()
            meta = pod.get("metadata") or {}
            key = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
            uid = str(meta.get("uid") or "")
            if ev.type is EventType.DELETED:
                if self.admit_deleted:
                    with self._cond:  # in turn, after the pod's addition (and its admission, if queued)
                        self._queue.append({_DELETION: key})
                        self._cond.notify_all()
                    return
                with self._cond:
                    self._seen.discard(uid)  # if still queued, never admitted: _run skips it
                # After the admission in progress, never during it: the kubelet removes pods on the same sync
                # loop that admits them, so a pod stays in its pod manager (PodResources) while it is admitted.
                with self._admitting:
                    self.kubelet.release_pod(key)
                return
            phase = (pod.get("status") or {}).get("phase")
            with self._cond:
                if uid in self._seen or phase != "Pending":
                    return
                self._seen.add(uid)
                self._queue.append(pod)
                self._cond.notify_all()

        self._watch = InformerThread(self.client, Pod, on_event, fields={"spec.nodeName": self.node},
                                     name=f"standin-kubelet-{self.node}").start()
        self._watch.wait_synced(10)
        self._thread = threading.Thread(target=self._run, name=f"standin-admit-{self.node}", daemon=True)
        self._thread.start()
        if self.node_status_s > 0:
            self._status_thread = threading.Thread(target=self._post_status, name=f"standin-status-{self.node}",
                                                   daemon=True)
            self._status_thread.start()
        return self

    def _post_status(self) -> None:
        from lightkube.types import PatchType

        from kubegpu.kube.resources import Node

        posted: dict[str, dict[str, str]] = {}
        while not self._stop.wait(self.node_status_s):
            status = self.kubelet.node_status()
            if status == posted:
                continue
            try:
                self.client.patch(Node.Status, self.node, {"status": status}, patch_type=PatchType.MERGE)
                posted = status
            except Exception as exc:  # the next period tries again, as the kubelet does
                log.info("standin kubelet %s: cannot post the node status: %s", self.node, exc)

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._watch is not None:
            self._watch.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._status_thread is not None:
            self._status_thread.join(timeout=5)

    def _batch(self) -> list[dict[str, Any]]:
        with self._cond:
            while not self._queue and not self._stop.is_set():
                self._cond.wait(0.1)
            if self._stop.is_set():
                return []
        time.sleep(self.batch_window_s)  # binds milliseconds apart arrive together
        with self._cond:
            batch, self._queue = self._queue, []
        for i in range(len(batch) - 1):
            if _DELETION in batch[i] or _DELETION in batch[i + 1]:
                continue  # a deletion never overtakes, nor is overtaken by, the pod it follows
            if self._rng.random() < self.swap_prob:
                batch[i], batch[i + 1] = batch[i + 1], batch[i]
        return batch

    def _run(self) -> None:
        while not self._stop.is_set():
            for pod in self._batch():
                while self.paused.is_set() and not self._stop.is_set():
                    time.sleep(0.02)
                if self._stop.is_set():
                    return
                if _DELETION in pod:
                    with self._admitting:
                        self.kubelet.release_pod(pod[_DELETION])
                    continue
                with self._cond:
                    if (pod.get("metadata") or {}).get("uid") not in self._seen:
                        continue  # deleted before its turn: the real kubelet never admits it
                try:
                    with self._admitting:
                        self._admit(pod)
                except Exception:  # a stand-in must keep admitting: log and go on
                    log.exception("standin kubelet %s: admitting a pod failed", self.node)

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """No admission runs inside the block: the one in progress finishes first, the queued ones
        wait (what a kubelet restart looks like from the pod loop: it comes back with the same
        queue of bound pods, and the pods it admitted keep their devices)."""
        self.paused.set()
        with self._admitting:
            try:
                yield
            finally:
                self.paused.clear()

    def _admit(self, pod: dict[str, Any]) -> None:
        meta = pod.get("metadata") or {}
        got = self.kubelet.admit_pod(pod)
        with self._cond:
            self.order.append(got.pod)
            self.results[got.pod] = got
            self._cond.notify_all()
        if not self.write_status:
            return
        from lightkube.types import PatchType

        from kubegpu.kube.resources import Pod

        # The kubelet's words (rejectPod, and the device manager's admit handler).
        why = f"Pod was rejected: Allocate failed due to {got.reason}, which is unexpected"
        status: dict[str, Any] = ({"phase": "Running"} if got.ok else
                                  {"phase": "Failed", "reason": "UnexpectedAdmissionError", "message": why})
        try:
            self.client.patch(Pod.Status, meta.get("name"), {"status": status},
                              namespace=meta.get("namespace", "default"), patch_type=PatchType.MERGE)
        except Exception as exc:  # the pod may be gone already
            log.info("standin kubelet %s: cannot write the status of %s: %s", self.node, got.pod, exc)

    def wait_admitted(self, n: int, timeout_s: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self.results) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.1))
            return True

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 30.0) -> bool:
        """Wait until ``predicate()`` (evaluated under the admitter's lock) is true; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.1))
            return True
