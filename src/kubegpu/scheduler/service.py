"""Running the extender: informers for Nodes, Devices and Pods feed the view; uvicorn serves the app.

Pods are watched as :class:`~kubegpu.kube.slim.SlimPod` (decoded straight into the fields the
accounting reads), all in one watch: bound ones feed the view, and the watch's copies of unbound ones are
what bind reads (:mod:`kubegpu.scheduler.pending`).

Everything runs in one asyncio loop, so watch events and HTTP verbs never
interleave inside a verb. The extender answers ``/healthz`` with 503 until the
three informers have listed once (before that its accounting is incomplete) and
the view is warmed up (the learned workload built, long-lived objects moved out
of the garbage collector's sight: a full collection over tens of thousands of
pods would otherwise stall the first verbs for a good part of a second).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightkube import AsyncClient
from lightkube.models.meta_v1 import ObjectMeta

from kubegpu import httpserve
from kubegpu.httpserve import BoundedServer, ServeLimits, server_context
from kubegpu.kube.informer import EventType, Informer, WatchEvent
from kubegpu.kube.resources import Device, Node
from kubegpu.kube.slim import SlimMeta, SlimPod, SlimSpec
from kubegpu.model import annotations as A
from kubegpu.model.device_object import DeviceObjectError, inventory_from_device
from kubegpu.placement import DEFAULT_POLICY
from kubegpu.placement.reservations import ReservationConfig
from kubegpu.scheduler.app import Extender
from kubegpu.scheduler.bind import DEFAULT_HANDOFF_WAIT_S
from kubegpu.scheduler.inflight import DEFAULT_FILTER_WAIT_S
from kubegpu.scheduler.limits import Limits
from kubegpu.scheduler.pending import PendingPods, kept_for_bind
from kubegpu.scheduler.plan import PodPlan
from kubegpu.scheduler.state import ClusterView

log = logging.getLogger(__name__)


def node_handler(view: ClusterView) -> Any:
    def on_node(ev: WatchEvent) -> None:
        name = ev.obj.metadata.name
        if ev.type is EventType.DELETED:
            view.remove_node(name)
        else:
            view.set_node_labels(name, ev.obj.metadata.labels or {})
            annotations = ev.obj.metadata.annotations or {}
            view.handoffs.node_progress(name, annotations.get(A.HANDOFF_SEEN))
            status = ev.obj.status
            view.set_node_daemon(name, annotations, None if status is None else
                                 {"capacity": status.capacity, "allocatable": status.allocatable})
    return on_node


def device_handler(view: ClusterView) -> Any:
    def on_device(ev: WatchEvent) -> None:
        name = ev.obj.metadata.name
        if ev.type is EventType.DELETED:
            view.set_inventory(name, None)
            return
        try:
            inv = inventory_from_device(ev.obj.to_dict() if hasattr(ev.obj, "to_dict") else dict(ev.obj))
        except DeviceObjectError as e:
            log.error("node %s: unreadable Device object: %s", name, e)
            view.set_inventory(name, None, error=str(e))
            return
        if inv.name != name:
            view.set_inventory(name, None, error=f"Device object names node {inv.name!r}")
            return
        view.set_inventory(name, inv)
    return on_device


def pod_handler(view: ClusterView, plan: Callable[[dict[str, Any]], PodPlan],
                landed: Callable[[str, str], None] = lambda key, uid: None) -> Any:
    """The pod watch's handler: each event's pod into the accounting, with its plan (the extender's); ``landed``
    is told the key and UID of each pod seen bound or deleted (filters stop counting it as in flight)."""
    ledger = view.ledger

    def on_pod(ev: WatchEvent) -> None:
        if view.reservations is not None:  # a waiting pod bound, deleted or finished; a bound pod's declared end
            view.reservations.observe_pod(ev.obj, ev.type is EventType.DELETED, plan)
        meta = ev.obj.metadata
        ann = meta.annotations or {}
        node = ev.obj.spec.nodeName if ev.obj.spec else None
        if node or ev.type is EventType.DELETED:
            landed(f"{meta.namespace}/{meta.name}", meta.uid or "")
        if (A.DEVICE_ALLOCATED not in ann and A.DEVICE_ASSIGNED not in ann
                and f"{meta.namespace}/{meta.name}" not in ledger.held
                and not ledger.tracks(node) and (not node or ledger.devices_listed)):
            return  # neither a GPU pod of ours nor on a GPU node (most pods of a cluster): skip the conversion
        pod = ev.obj.to_dict()
        ledger.observe_pod(pod, plan(pod), deleted=ev.type is EventType.DELETED, version=ev.version)
    return on_pod


def tombstone(obj: Any) -> Any:
    """What the extender's informers keep of an object: its identity and version, and for a pod the
    record annotations and node its handler reads when the pod goes (node_handler, device_handler and
    pod_handler read nothing else of a deleted object). The view holds what it needs; full objects
    would be most of the extender's memory at scale (a Device object is ~27 KB in lightkube's
    models, a pod ~4 KB)."""
    meta = obj.metadata
    if isinstance(obj, SlimPod):
        ann = (meta.annotations if meta else None) or {}
        kept = SlimMeta(name=meta.name, namespace=meta.namespace, uid=meta.uid, resourceVersion=meta.resourceVersion,
                        annotations={k: ann[k] for k in (A.DEVICE_ALLOCATED, A.DEVICE_ASSIGNED) if k in ann} or None)
        return SlimPod(metadata=kept, spec=SlimSpec(nodeName=obj.spec.nodeName if obj.spec else None))
    slim = ObjectMeta(name=meta.name, namespace=meta.namespace, uid=meta.uid, resourceVersion=meta.resourceVersion)
    if isinstance(obj, Node):
        return Node(metadata=slim)
    return type(obj)(metadata=slim)


def kept_pod(pod: SlimPod) -> SlimPod:
    """What the pod watch keeps: a bound pod's tombstone; an unbound pod's copy for bind."""
    return tombstone(pod) if pod.spec is not None and pod.spec.nodeName else kept_for_bind(pod)


@dataclass
class ExtenderService:
    """The informers and the extender app around one view and one API client."""

    client: AsyncClient
    node_policy: str = DEFAULT_POLICY
    gpu_policy: str = DEFAULT_POLICY
    resync_s: float = 1800.0  # a full relist is a safety net (410s relist anyway); at scale it costs seconds
    limits: Limits | None = None  # cost bounds of the verbs (scheduler/limits.py)
    # HTTP bounds (httpserve.py); keep-alive outlives Go's 90 s idle timeout so kube-scheduler never
    # reuses a connection the extender has just closed (a POST is not retried)
    serve_limits: ServeLimits = field(default_factory=lambda: ServeLimits(keep_alive_s=120))
    per_gpu_metrics: bool = False  # two series per GPU on /metrics (scheduler/metrics.py: small clusters)
    # Pods of one kind take turns per node (scheduler/handoff.py); off only where no kubegpu node daemon
    # acknowledges bound pods (simulations, extender-only tests).
    handoff_wait: bool = True
    handoff_wait_s: float = DEFAULT_HANDOFF_WAIT_S  # how long a bind waits for its turn
    filter_wait_s: float = DEFAULT_FILTER_WAIT_S  # how long a filter waits for binds in flight (scheduler/inflight.py)
    gpu_resources: frozenset[str] = frozenset()  # renamed GPU resources the deployment declared
    reservations: ReservationConfig | None = None  # GPUs kept for waiting wide pods (scheduler/reservations.py)
    clock: Callable[[], float] = time.time  # the wall clock reservations count waits on
    record_key: bytes | None = None  # signs the records it writes, checks those it reads (model/signing.py)

    def __post_init__(self) -> None:
        self.view = ClusterView(handoff_wait=self.handoff_wait, record_key=self.record_key)
        self.settled = asyncio.Event()  # the first lists are in and the view is warmed up (_settle_memory)
        self.informers = [
            Informer(self.client, Node, node_handler(self.view), resync_s=self.resync_s, name="nodes",
                     keep=tombstone),
            Informer(self.client, Device, device_handler(self.view), resync_s=self.resync_s, name="devices",
                     keep=tombstone),
            # Only bound pods hold GPUs (unbound ones are the extender's own assumptions); unbound ones are
            # kept for bind, which reads them instead of a GET.
            Informer(self.client, SlimPod, pod_handler(self.view, lambda pod: self.extender.plans.plan(pod),
                                                       lambda key, uid: self.extender.inflight.done(key, uid)),
                     resync_s=self.resync_s, name="pods",
                     keep=kept_pod),
        ]
        self.pending = PendingPods(self.informers[2].cache)
        self.extender = Extender(self.view, self.client, node_policy=self.node_policy,
                                 gpu_policy=self.gpu_policy, ready=self.settled, limits=self.limits,
                                 max_body_bytes=self.serve_limits.max_body_bytes,
                                 body_timeout_s=self.serve_limits.body_timeout_s, pending=self.pending,
                                 per_gpu_metrics=self.per_gpu_metrics, handoff_wait_s=self.handoff_wait_s,
                                 gpu_resources=self.gpu_resources, reservations=self.reservations,
                                 clock=self.clock, filter_wait_s=self.filter_wait_s)

    def synced(self) -> bool:
        return all(i.synced.is_set() for i in self.informers)

    def ready(self) -> bool:
        """Synced and warmed up: what ``/healthz`` answers 200 for."""
        return self.synced() and self.settled.is_set()

    async def wait_synced(self, timeout_s: float = 30.0) -> None:
        await asyncio.wait_for(asyncio.gather(*(i.synced.wait() for i in self.informers)), timeout_s)

    async def _settle_memory(self) -> None:
        """Once the first lists are in, move those long-lived objects out of the garbage collector's
        sight: with tens of thousands of pods a full collection would otherwise stall a verb for
        tens of milliseconds."""
        await self.wait_synced(timeout_s=3600)
        self.view.ledger.devices_are_listed()
        self.view.warm_up()
        gc.collect()
        gc.freeze()
        self.settled.set()

    async def serve(self, host: str, port: int, *, tls_cert: str | Path | None = None,
                    tls_key: str | Path | None = None, started: asyncio.Event | None = None,
                    metrics_listen: tuple[str, int] | None = None, debug_on_metrics: bool = False) -> None:
        """Run the informers and the HTTP server (and the metrics listener, with the debug API when
        ``debug_on_metrics``) until cancelled."""
        tls: Any = None
        if tls_cert and tls_key:
            context = server_context(tls_cert, tls_key)  # raises CertificateError: one clear line
            tls = lambda _config, _default: context  # noqa: E731 - uvicorn's ssl_context_factory
        server = BoundedServer(httpserve.config(self.extender.app, self.serve_limits, host=host, port=port,
                                                ssl_context_factory=tls))
        tasks = [asyncio.create_task(i.run(), name=f"informer-{i.name}") for i in self.informers]
        if metrics_listen is not None:
            outside = self.extender.debug_app if debug_on_metrics else self.extender.metrics_app
            debug = BoundedServer(httpserve.config(outside, self.serve_limits,
                                                   host=metrics_listen[0], port=metrics_listen[1]),
                                  quiet_signals=True)
            tasks.append(asyncio.create_task(debug.serve(), name="extender-metrics"))
        serve = asyncio.create_task(server.serve(), name="extender-http")
        try:
            while not server.started:
                if serve.done():
                    await serve  # raises the startup error
                    return
                await asyncio.sleep(0.01)
            self.port = server.servers[0].sockets[0].getsockname()[1]
            if started is not None:
                started.set()
            tasks.append(asyncio.create_task(self._settle_memory(), name="gc-freeze"))
            await serve
        finally:
            for i in self.informers:
                i.stop()
            for t in tasks:
                t.cancel()
            server.should_exit = True
            await asyncio.gather(*tasks, return_exceptions=True)
            if not serve.done():
                await asyncio.wait([serve], timeout=3)
            # What the end of the process does: a request still open (a bind waiting for its node's turn) ends
            # now, and its client (kube-scheduler) learns it at once rather than at its own time-out.
            for conn in list(server.server_state.connections):
                conn.transport.abort()


class ServiceThread:
    """The extender in a background thread with its own event loop (tests, the demo, the benchmark)."""

    def __init__(self, kubeconfig: str | Path, *, host: str = "127.0.0.1", port: int = 0,
                 node_policy: str = DEFAULT_POLICY, gpu_policy: str = DEFAULT_POLICY, handoff_wait: bool = True,
                 handoff_wait_s: float = DEFAULT_HANDOFF_WAIT_S, record_key: bytes | None = None,
                 reservations: ReservationConfig | None = None, clock: Callable[[], float] = time.time,
                 filter_wait_s: float = DEFAULT_FILTER_WAIT_S) -> None:
        self._kubeconfig = kubeconfig
        self._filter_wait_s = filter_wait_s
        self._reservations = (reservations, clock)
        self._record_key = record_key
        self._host, self._port = host, port
        self._policies = (node_policy, gpu_policy)
        self._handoff = (handoff_wait, handoff_wait_s)
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task[None] | None = None
        self.service: ExtenderService | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self.port}"

    def start(self, timeout_s: float = 20.0) -> ServiceThread:
        ready = threading.Event()
        failure: list[BaseException] = []

        async def main() -> None:
            from kubegpu.kube.client import make_async_client

            self.service = ExtenderService(make_async_client(self._kubeconfig), *self._policies,
                                           handoff_wait=self._handoff[0], handoff_wait_s=self._handoff[1],
                                           record_key=self._record_key, reservations=self._reservations[0],
                                           clock=self._reservations[1], filter_wait_s=self._filter_wait_s)
            started = asyncio.Event()
            self._task = asyncio.create_task(self.service.serve(self._host, self._port, started=started))
            waiter = asyncio.create_task(started.wait())
            await asyncio.wait([self._task, waiter], return_when=asyncio.FIRST_COMPLETED)
            if self._task.done():
                waiter.cancel()
                failure.append(self._task.exception() or RuntimeError("extender stopped at start"))
                ready.set()
                return
            await self.service.wait_synced()
            await asyncio.wait_for(self.service.settled.wait(), timeout_s)
            self.port = self.service.port
            ready.set()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

        def run() -> None:
            try:
                self._loop.run_until_complete(main())
            except BaseException as e:  # report a start failure to the caller, not to stderr
                failure.append(e)
                ready.set()

        self._thread = threading.Thread(target=run, name="kubegpu-extender", daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s):
            raise RuntimeError("the extender did not start in time")
        if failure:
            raise RuntimeError(f"the extender failed to start: {failure[0]}") from failure[0]
        return self

    def call(self, fn: Any) -> Any:
        """Run ``fn()`` inside the extender's loop (safe access to its view) and return the result."""
        async def wrapper() -> Any:
            return fn()
        return asyncio.run_coroutine_threadsafe(wrapper(), self._loop).result(10)

    def stop(self) -> None:
        if self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> ServiceThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
