"""A whole GPU cluster in one process, for the handoff stress test and ``bench/handoff.py``.

The stand-in API server, kubegpu's extender (``ServiceThread``), and per node a stand-in kubelet
(device manager, PodResources, and the pod loop that admits bound pods in its watch order) with a
real ``kubegpu node`` daemon (device plugins over unix sockets, the handoff resolver, the Device
object publisher). Pods are scheduled as kube-scheduler would: pods naming kubegpu's scheduler go
through the extender's filter, prioritize and bind; the others through a default binder that
knows only the kubelet's ``nvidia.com/gpu`` count (the pods that bypass the extender).

Knobs the recordings call for: each node daemon's pod watch can lag the kubelet's
(``watch_lag_s``), the kubelet swaps adjacent admissions (``swap_prob``), and any node daemon or
the extender can be restarted mid-burst. :meth:`GpuCluster.check` then compares, per container,
the environment, the kubelet's devices, the record the accounting uses and the acknowledgement.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from kubegpu.inventory.fake import FakeBackend
from kubegpu.kube import make_client
from kubegpu.model import resources as R
from kubegpu.model.records import read_pod, request_shapes
from kubegpu.model.request import parse_pod
from kubegpu.node.config import load_config
from kubegpu.node.daemon import NodeDaemon
from kubegpu.node.handoff import HandoffResolver, make_resolver
from kubegpu.node.options import load_node_options
from kubegpu.node.publish.kube import KubeNodePublisher
from kubegpu.node.publish.publisher import NullPublisher
from kubegpu.scheduler.service import ServiceThread
from kubegpu_standins.apiserver import ApiServer
from kubegpu_standins.handoff_seams import lagging
from kubegpu_standins.kubelet import PodAdmitter, StandinKubelet
from kubegpu_standins.scheduler import SchedulingQueue

log = logging.getLogger(__name__)

SCHEDULER_NAME = "kubegpu-scheduler"


@dataclass
class NodeSpec:
    name: str
    topology: str
    flags: dict[str, Any] = field(default_factory=dict)
    watch_lag_s: float = 0.0
    # The node's config file (``config-file``), e.g. a ``sharing.timeSlicing`` section: written to
    # the node's directory and named by the flag.
    config_yaml: str = ""
    # One-way latency on the node daemon's own API connection (recorded: 1.5 s through a proxy): each of its
    # requests costs a round trip; set ``watch_lag_s`` to the same value for its watch.
    api_latency_s: float = 0.0
    # The kubelet is busy when a queued pod is deleted: it takes the pod's addition before its deletion (one
    # config channel, in order) and admits it anyway (PodAdmitter.admit_deleted).
    busy_kubelet: bool = False


class LaggedClient:
    """A lightkube ``Client`` behind a slow link: every request waits a round trip (``2 × one_way_s``) before
    it is sent, a watch waits one way before it opens (its events are delayed through
    ``make_resolver``'s ``watch_feed``)."""

    REQUESTS = frozenset({"list", "get", "patch", "create", "replace", "delete", "apply"})

    def __init__(self, client: Any, one_way_s: float) -> None:
        self._client, self._one_way_s = client, one_way_s

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if name in self.REQUESTS:
            def call(*args: Any, **kw: Any) -> Any:
                time.sleep(2 * self._one_way_s)
                return attr(*args, **kw)
            return call
        if name == "watch":
            def watch(*args: Any, **kw: Any) -> Any:
                time.sleep(self._one_way_s)
                yield from attr(*args, **kw)
            return watch
        return attr


class SimNode:
    """One GPU node: a stand-in kubelet and the real node daemon talking to it."""

    def __init__(self, spec: NodeSpec, kubeconfig: Path, root: Path, key: bytes | None, swap_prob: float,
                 seed: int, node_status_s: float = 0.0) -> None:
        self.spec, self.kubeconfig, self.key = spec, kubeconfig, key
        self.name = spec.name
        self.dir = root / spec.name
        self.kubelet = StandinKubelet(self.dir / "dp", seed=seed)
        self.kubelet.start()
        self.kubelet.serve_pod_resources(self.dir / "pr.sock")
        self.flags = {"shared-slots": 20, "device-list-strategy": "envvar", **spec.flags}
        if spec.config_yaml:
            cfg = self.dir / "config.yaml"
            cfg.write_text(spec.config_yaml)
            self.flags["config-file"] = str(cfg)
        self.backend = FakeBackend(spec.topology, node_name=spec.name)
        self.daemon_restarts = 0
        self.kubelet_restarts = 0
        self.held_at_restart: dict[str, dict[str, list[tuple[str, tuple[str, ...]]]]] = {}
        self.calls_at_restart = 0
        self._start_daemon()
        self.admitter = PodAdmitter(self.kubelet, make_client(kubeconfig), spec.name, swap_prob=swap_prob,
                                    seed=seed, node_status_s=node_status_s,
                                    admit_deleted=spec.busy_kubelet).start()

    def _start_daemon(self) -> None:
        client: Any = make_client(self.kubeconfig)
        if self.spec.api_latency_s > 0:
            client = LaggedClient(client, self.spec.api_latency_s)
        inv = self.backend.discover()
        self.resolver: HandoffResolver = make_resolver(
            client, self.name, pod_resources_socket=str(self.dir / "pr.sock"), verify_interval_s=0.3,
            key=self.key, inventory=inv, watch_feed=lagging(self.spec.watch_lag_s, f"handoff-lag-{self.name}"))
        publisher = KubeNodePublisher(client, self.name, load_config(flags=self.flags, env={}))
        settings = {"cdi_dir": str(self.dir / "cdi"), "mig_minors_file": str(self.dir / "mig-minors")}

        def options() -> Any:
            return load_node_options(self.flags, {}, settings=settings, plugin_dir=str(self.dir / "dp"),
                                     stream_wait_s=2.0, resync_s=0.2)

        self.daemon = NodeDaemon(self.backend, options, publisher=publisher, resolver=self.resolver)
        self.daemon.start()

    def wait_registered(self, timeout_s: float = 15.0) -> bool:
        want = [r.resource for r in self.daemon.servers]
        count = 1 + self.daemon_restarts + self.kubelet_restarts
        return all(self.kubelet.wait_registered(r, timeout_s=timeout_s, count=count) for r in want)

    def replicated_gpus(self) -> set[str]:
        """GPUs this node serves as time-slicing/MPS replicas (``<uuid>::<k>`` of a replica resource)."""
        return {d.gpu_uuid for s in self.daemon.servers if s.plan.sharing in ("time-slicing", "mps")
                and s.plan.replicas > 1 for d in s.plan.devices if d.replica is not None}

    def replica_resources(self) -> set[str]:
        return {s.resource for s in self.daemon.servers
                if s.plan.sharing in ("time-slicing", "mps") and s.plan.replicas > 1}

    def offered_after_restart(self) -> list[str]:
        """Devices the kubelet held at its last restart that it offered (GetPreferredAllocation's
        candidates) or allocated to another container since, while their pod still holds them: a
        kubelet that lost its checkpoint."""
        live = self.held()
        held = {(res, i): f"{p}/{c}" for p, cs in self.held_at_restart.items() if p in live
                for c, v in cs.items() for res, ids in v for i in ids}
        out = []
        for call in list(self.kubelet.calls)[self.calls_at_restart:]:
            req = call.request or {}
            for cr in req.get("container_requests") or []:
                ids = set(cr.get("available_deviceIDs") or cr.get("devices_ids") or [])
                ids -= set(cr.get("must_include_deviceIDs") or [])
                out += [f"{call.rpc.rsplit('/', 1)[1]} {i} (held by {held[(call.resource, i)]})"
                        for i in sorted(ids) if (call.resource, i) in held]
        return out

    def restart_kubelet(self) -> None:
        """A kubelet restart, as recorded (``fixtures/kubelet-v1.24``): the admission in progress
        finishes, then the device manager stops (plugin streams end), comes back reading its
        checkpoint (devices of admitted pods stay theirs), deletes the plugin sockets and serves a
        new ``kubelet.sock``; every resource is a stopped endpoint with no devices until its plugin
        registers again. Bound pods it admits before that fail (``requested number of devices
        unavailable``), as the recorded ``dp-nodename-before-rereg`` did; admitted pods are not
        re-allocated."""
        with self.admitter.pause():
            self.held_at_restart = self.held()
            self.calls_at_restart = len(self.kubelet.calls)
            self.kubelet.restart()
            self.kubelet_restarts += 1

    def held(self) -> dict[str, dict[str, list[tuple[str, tuple[str, ...]]]]]:
        """The kubelet's devices per pod it admitted with devices (what its checkpoint keeps)."""
        with self.kubelet._cond:
            return {p: {c: list(v) for c, v in cs.items()} for p, cs in self.kubelet.holdings.items()
                    if any(cs.values())}

    def restart_daemon(self) -> None:
        """The node daemon stops (its sockets go, the kubelet's streams end) and starts again, learning
        every pod from a LIST; the kubelet meanwhile fails nothing it has admitted."""
        self.stop_daemon()
        self.start_daemon()

    def stop_daemon(self, *, kill: bool = False) -> None:
        """The node daemon ends: SIGTERM (it tells the cluster it is stopping, then closes its plugins) or, with
        ``kill``, SIGKILL (it says nothing; its sockets close with the process)."""
        if kill:  # a killed process writes nothing more and serves nothing more
            self.daemon.publisher = NullPublisher()
            self.daemon.options = replace(self.daemon.options, stop_settle_s=0.0, stop_drain_s=0.0)
        self.daemon.stop()
        self.resolver.close()
        self.daemon_restarts += 1

    def start_daemon(self) -> None:
        """A new node daemon process (after :meth:`stop_daemon`)."""
        self._start_daemon()

    def stop(self) -> None:
        self.admitter.stop()
        self.daemon.stop()
        self.resolver.close()
        self.kubelet.stop()
        self.backend.close()


@dataclass
class ContainerCheck:
    pod: str
    container: str
    outcome: str  # "served", "refused", "pending"
    env_gpus: tuple[str, ...] = ()
    kubelet_gpus: tuple[str, ...] = ()
    record_gpus: tuple[str, ...] = ()
    ack_gpus: tuple[str, ...] = ()
    reason: str = ""
    forged: bool = False
    env_core: str = ""
    record_core: str = ""
    replica: bool = False  # a time-slicing/MPS replica container: no record, served from its IDs
    own_gpus: tuple[str, ...] = ()  # the GPUs its own signed record names (before any acknowledgement)
    own_core: str = ""  # and its compute per GPU (shares)

    @property
    def swapped(self) -> bool:
        """Served, with a record of its own, other GPUs or other amounts than that record names: it got
        another pod's record. Never allowed (docs/handoff.md)."""
        return self.outcome == "served" and bool(self.own_gpus) and (
            set(self.env_gpus) != set(self.own_gpus) or (self.own_core != "" and self.env_core != self.own_core))

    @property
    def divergent(self) -> bool:
        if self.outcome != "served":
            return False
        if self.replica:
            # Served from the kubelet's IDs: its GPUs are the kubelet's; it carries no record, and an
            # acknowledgement, if any, names the same GPUs.
            return (set(self.env_gpus) != set(self.kubelet_gpus) or not self.env_gpus or bool(self.record_gpus)
                    or (bool(self.ack_gpus) and set(self.ack_gpus) != set(self.env_gpus)))
        same = set(self.env_gpus) == set(self.kubelet_gpus) == set(self.record_gpus) == set(self.ack_gpus)
        return not same or (self.record_core != "" and self.env_core != self.record_core)


class ExtenderUnavailable(Exception):
    """The extender's filter could not be had (not running, unreachable, or its answer carries Error)."""


class GpuCluster:
    def __init__(self, nodes: list[NodeSpec], *, key: bytes | None = b"kubegpu-test-record-key-0123456789",
                 swap_prob: float = 0.3, seed: int = 0, root: Path | None = None, node_status_s: float = 0.0) -> None:
        self.specs, self.key, self.swap_prob, self.seed = nodes, key, swap_prob, seed
        # The kubelets' nodeStatusUpdateFrequency (0: they post no status, the extender never hears from them).
        self.node_status_s = node_status_s
        self.root = root or Path(tempfile.mkdtemp(prefix="kgc-", dir="/tmp"))  # short unix socket paths
        self.api = ApiServer(history=20000).start()
        self.nodes: dict[str, SimNode] = {}
        self.ext: ServiceThread | None = None
        self.http = httpx.Client(timeout=2)  # a call to an extender that is restarting must not stall the loop
        self._stop = threading.Event()
        self._sched: threading.Thread | None = None
        self.extender_restarts = 0
        self.schedule_errors: list[str] = []
        self.why_pending: dict[str, str] = {}  # pod -> the extender's last filter failures
        self.queue = SchedulingQueue()
        self._bind_lock = threading.Lock()
        # kube-scheduler's bind extender HTTP timeout as rendered (60 s): a bind may wait for its node's handoff.
        self.bind_http = httpx.Client(timeout=60)
        self.binds: list[tuple[float, str, str]] = []  # (when the bind answered, pod, node)
        self.bind_errors: list[tuple[float, str, str, str]] = []  # (when, pod, node, the extender's error)
        self._posted: dict[str, dict[str, int]] = {}  # node -> allocatable its kubelet posted on the Node
        # Binds issued while a pod of the same shape on that node was bound and not yet acknowledged (the
        # asynchronous binding the recorded kube-scheduler did, 33-130 ms apart).
        self.async_bind_pairs = 0
        self._pending_rv: dict[str, str] = {}
        self._assigned_rv: dict[str, str] = {}
        self._node_rv: dict[str, str] = {}

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> GpuCluster:
        self.kubeconfig = self.api.write_kubeconfig(self.root / "kubeconfig")
        self.client = make_client(self.kubeconfig)
        for i, spec in enumerate(self.specs):
            self.api.put_object({"apiVersion": "v1", "kind": "Node", "metadata": {"name": spec.name}})
            self.nodes[spec.name] = SimNode(spec, self.kubeconfig, self.root, self.key, self.swap_prob,
                                            self.seed + i, self.node_status_s)
        for n in self.nodes.values():
            if not n.wait_registered():
                raise RuntimeError(f"node {n.name}: plugins did not register with the stand-in kubelet")
        self._start_extender()
        self._sched = threading.Thread(target=self._schedule_loop, name="standin-scheduler", daemon=True)
        self._sched.start()
        return self

    def _start_extender(self) -> None:
        ext = ServiceThread(self.kubeconfig, record_key=self.key).start(timeout_s=60)
        deadline = time.monotonic() + 60
        service = ext.service
        assert service is not None
        while ext.call(lambda: sum(r.state is not None for r in service.view.nodes.values())) < len(self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the extender did not see every Device object")
            time.sleep(0.05)
        self.ext = ext  # scheduling resumes only once the new extender has its view

    def restart_extender(self) -> None:
        """The extender stops and starts again, rebuilding its accounting from the pods."""
        assert self.ext is not None
        old, self.ext = self.ext, None
        old.stop()
        self.extender_restarts += 1
        try:
            self._start_extender()
        except Exception as exc:
            self.schedule_errors.append(f"extender restart failed: {exc}")
            raise

    def stop(self) -> None:
        self._stop.set()
        if self._sched is not None:
            self._sched.join(timeout=5)
        if self.ext is not None:
            self.ext.stop()
        for n in self.nodes.values():
            n.stop()
        self.api.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> GpuCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- scheduling ----------------------------------------------------------------------------
    def create(self, pod: dict[str, Any]) -> dict[str, Any]:
        return self.api.put_object(pod)

    def _schedule_loop(self) -> None:
        """kube-scheduler's loop (:class:`SchedulingQueue`): a serial scheduling cycle per pod, the binding
        cycle on its own thread, back-off after a failed bind, requeue of unschedulable pods on any cluster
        event (an assigned pod or a node changed) or an update of the pod itself."""
        while not self._stop.is_set():
            try:
                if not self._cycle():
                    self._stop.wait(0.01)
            except Exception as exc:  # a restart in progress: try again on the next pass
                self.schedule_errors.append(str(exc)[:200])
                self._stop.wait(0.05)

    def _events(self) -> dict[str, dict[str, Any]]:
        """Feed the queue from the API server's objects: new pending pods, cluster events, pod updates.
        Returns the pending pods by key."""
        pods = self.api.objects("pods")
        assigned: dict[str, str] = {}
        pending: dict[str, dict[str, Any]] = {}
        for p in pods:
            meta = p["metadata"]
            key = f"{meta['namespace']}/{meta['name']}"
            rv = str(meta.get("resourceVersion", ""))
            if (p.get("spec") or {}).get("nodeName"):
                assigned[key] = rv
            elif (p.get("status") or {}).get("phase") == "Pending":
                pending[key] = p
                self.queue.add(key, str(meta.get("uid", "")))
                if self._pending_rv.get(key, rv) != rv:
                    self.queue.pod_updated(key)
                self._pending_rv[key] = rv
        # A node changes for kube-scheduler when its object does, and when its kubelet's device counts do: the
        # real kubelet publishes them in the Node's status.allocatable (a plugin gone, back, a GPU unhealthy),
        # an update every unschedulable pod is requeued on. These kubelets keep them to themselves.
        objs = self.api.objects("nodes")
        nodes = {n["metadata"]["name"]: str(n["metadata"].get("resourceVersion", "")) for n in objs}
        self._posted = {n["metadata"]["name"]: {r: int(str(q)) for r, q in alloc.items() if _is_device_resource(r)}
                        for n in objs if (alloc := (n.get("status") or {}).get("allocatable"))}
        for name, node in self.nodes.items():
            nodes[name] = f"{nodes.get(name, '')}/{sorted(node.kubelet.allocatable_counts().items())}"
        if assigned != self._assigned_rv or nodes != self._node_rv:
            self.queue.cluster_event()
            self._assigned_rv, self._node_rv = assigned, nodes
        for key in [k for k, q in self.queue.pods.items() if k not in pending and q.where != "binding"]:
            self.queue.forget(key)  # bound, or gone
            self._pending_rv.pop(key, None)
        return pending

    def _cycle(self) -> bool:
        """One scheduling cycle; False when nothing was ready to try."""
        with self._bind_lock:  # the binding threads report into the same queue
            pending = self._events()
            q = self.queue.pop()
            if q is None:
                return False
            pod = pending.get(q.key)
            if pod is None or str(pod["metadata"].get("uid", "")) != q.uid:
                self.queue.forget(q.key)
                return True
        if pod["spec"].get("schedulerName") != SCHEDULER_NAME:
            bound = self._default_bind(pod)
            with self._bind_lock:
                self.queue.forget(q.key) if bound else self.queue.unschedulable(q.key)
            return True
        try:
            node = self._filter_and_score(pod)
        except Exception as exc:  # an extender unreachable mid-cycle (a restart), or answering Error
            # kube-scheduler: an extender that errs (unreachable, or an answer carrying Error) fails the
            # scheduling cycle with an error, not Unschedulable: the pod goes to the back-off queue.
            with self._bind_lock:
                self.why_pending[pod["metadata"]["name"]] = f"filter: {exc}"[:300]
                self.queue.errored(q.key)
            return True
        if node is None:
            with self._bind_lock:
                self.queue.unschedulable(q.key)
            return True
        # The binding cycle runs on its own: the next pod is filtered before this bind reaches the extender.
        t = threading.Thread(target=self._bind, args=(q.key, pod, node), name=f"bind-{q.key}", daemon=True)
        t.start()
        return True

    def _filter_and_score(self, pod: dict[str, Any]) -> str | None:
        ext = self.ext
        host = (pod["spec"].get("nodeSelector") or {}).get("kubernetes.io/hostname")
        names = [n for n, node in self.nodes.items() if (host is None or n == host) and self._allocatable(node, pod)]
        if not names:
            return None
        if ext is None:
            raise ExtenderUnavailable("the extender is not running")
        args = {"Pod": pod, "Nodes": None, "NodeNames": names}
        try:
            out = self.http.post(f"{ext.url}/scheduler/filter", json=args).json()
        except Exception as exc:
            raise ExtenderUnavailable(f"{type(exc).__name__}: {exc}") from exc
        if out.get("Error"):
            raise ExtenderUnavailable(str(out["Error"]))
        passed = out.get("NodeNames") or []
        if not passed:
            self.why_pending[pod["metadata"]["name"]] = str(out.get("FailedNodes") or out.get("Error"))[:300]
            return None
        best: str = passed[0]
        if len(passed) > 1:
            try:
                scores = self.http.post(f"{ext.url}/scheduler/prioritize", json={**args, "NodeNames": passed}).json()
                best = max(scores, key=lambda h: (h["Score"], h["Host"]))["Host"]
            except Exception:  # kube-scheduler: "No score given by this extender", and the cycle goes on
                pass
        return best

    def _unacknowledged_alike(self, pod: Mapping[str, Any], node: str) -> int:
        """Pods bound to ``node``, not running, with a container of ``pod``'s shape not acknowledged yet:
        what a bind of ``pod`` issued now races (kube-scheduler does not wait for the handoff)."""
        shapes = request_shapes(parse_pod(pod))
        if not shapes:
            return 0
        n = 0
        for p in self.api.objects("pods"):
            if ((p.get("spec") or {}).get("nodeName") != node or p["metadata"].get("uid") == pod["metadata"].get("uid")
                    or (p.get("status") or {}).get("phase") in ("Running", "Succeeded", "Failed")):
                continue
            if shapes & request_shapes(parse_pod(p), read_pod(p, self.key).acks):
                n += 1
        return n

    def _bind(self, key: str, pod: dict[str, Any], node: str) -> None:
        meta = pod["metadata"]
        alike = self._unacknowledged_alike(pod, node)
        with self._bind_lock:
            self.async_bind_pairs += alike
        ext = self.ext
        try:
            if ext is None:
                raise RuntimeError("no extender")
            r = self.bind_http.post(f"{ext.url}/scheduler/bind", json={
                "PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"],
                "Node": node}).json()
            error = r.get("Error") or ""
        except Exception as exc:  # kube-scheduler: the binding cycle failed
            error = f"{type(exc).__name__}: {exc}"
        with self._bind_lock:
            if error:
                self.why_pending[meta["name"]] = f"bind: {error}"[:300]
                self.bind_errors.append((time.monotonic(), key, node, error))
                self.queue.bind_failed(key)
            else:
                self.binds.append((time.monotonic(), key, node))
                self.queue.forget(key)

    def _allocatable(self, node: SimNode, pod: dict[str, Any]) -> bool:
        """kube-scheduler's in-tree fit on what the kubelet reports: a resource whose plugin is away
        (allocatable 0), or that the node does not serve, rules the node out. Where the kubelets post their
        Node status (``node_status_s``), as posted (it lags the kubelet by up to that period), else live."""
        posted = self._posted.get(node.name) if self.node_status_s > 0 else None
        if posted is not None:
            return all(posted.get(res, 0) >= n for res, n in _device_requests(pod).items())
        return all(node.kubelet.allocatable(res) >= n for res, n in _device_requests(pod).items())

    def _default_bind(self, pod: dict[str, Any]) -> int:
        """kube-scheduler's default profile: it counts the kubelet's devices per resource (whole GPUs,
        MIG devices, replicas), and knows nothing of shares."""
        from kubegpu.kube.writes import bind_pod

        want = _device_requests(pod)
        bound: dict[str, dict[str, int]] = {}
        for p in self.api.objects("pods"):
            n = (p.get("spec") or {}).get("nodeName")
            if n and (p.get("status") or {}).get("phase") not in ("Failed", "Succeeded"):
                for res, k in _device_requests(p).items():
                    bound.setdefault(n, {})[res] = bound.setdefault(n, {}).get(res, 0) + k
        for name, node in self.nodes.items():
            if all(node.kubelet.allocatable(res) - bound.get(name, {}).get(res, 0) >= k for res, k in want.items()):
                meta = pod["metadata"]
                bind_pod(self.client, meta["namespace"], meta["name"], meta["uid"], name)
                return 1
        return 0

    # ---- checks --------------------------------------------------------------------------------
    def settled(self, names: set[str], timeout_s: float = 40.0, idle_s: float = 0.0) -> bool:
        """Every named pod admitted or failed by its kubelet. False after ``timeout_s``, or once
        ``idle_s`` (if set) passed with the rest unbound and nothing changing (they do not fit)."""
        deadline = time.monotonic() + timeout_s
        last: tuple[str, ...] = ()
        since = time.monotonic()
        while time.monotonic() < deadline:
            pods = {p["metadata"]["name"]: p for p in self.api.objects("pods")}
            phases = {n: (p.get("status") or {}).get("phase") for n, p in pods.items()}
            if all(phases.get(n) in ("Running", "Failed") for n in names):
                return True
            left = tuple(sorted(n for n in names if phases.get(n) not in ("Running", "Failed")))
            if left != last:
                last, since = left, time.monotonic()
            elif idle_s and time.monotonic() - since > idle_s and not any(
                    (pods.get(n, {}).get("spec") or {}).get("nodeName") for n in left):
                return False
            time.sleep(0.1)
        log.warning("not settled: %s", {n: self.why_pending.get(n, "") for n in names
                                         if phases.get(n) not in ("Running", "Failed")})
        return False

    def quiesce(self, timeout_s: float = 10.0) -> bool:
        """Run every node's PodResources verification until none finds anything left to correct."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            problems = []
            for n in self.nodes.values():
                if n.resolver.verifier is not None:
                    problems += n.resolver.verifier.check()
            if not problems:
                return True
            time.sleep(0.1)
        return False

    def check(self) -> list[ContainerCheck]:
        """Per GPU container of every bound pod: environment, kubelet devices, the record the accounting
        uses (record moved to acknowledged GPUs) and the acknowledgement."""
        out: list[ContainerCheck] = []
        for pod in self.api.objects("pods"):
            meta = pod["metadata"]
            key = f"{meta['namespace']}/{meta['name']}"
            node = self.nodes.get((pod.get("spec") or {}).get("nodeName") or "")
            if node is None:
                continue
            recs = read_pod(pod, self.key)
            alloc = recs.allocation()
            result = node.admitter.results.get(key)
            replicas = node.replica_resources()
            for c in pod["spec"].get("containers") or []:
                limits = (c.get("resources") or {}).get("limits") or {}
                resources = [r for r in limits if _is_device_resource(r)]
                if not resources:
                    continue
                name = c["name"]
                chk = ContainerCheck(key, name, "pending", forged=recs.forged,
                                     replica=all(r in replicas for r in resources))
                if result is not None and not result.ok:
                    chk.outcome, chk.reason = "refused", result.reason
                elif result is not None:
                    chk.outcome = "served"
                    got = result.containers.get(name, {})
                    envs: dict[str, str] = {}
                    kub: list[str] = []
                    for a in got.values():
                        envs.update(a.response.envs)
                        kub.extend(i.split("::", 1)[0] for i in a.device_ids)
                    vis = envs.get("NVIDIA_VISIBLE_DEVICES", "")
                    chk.env_gpus = tuple(v for v in vis.split(",") if v)
                    chk.env_core = envs.get("KUBEGPU_GPU_CORE_PERCENT", "")
                    chk.kubelet_gpus = tuple(kub)
                    own = recs.record.for_container(name) if recs.record is not None else None
                    if own is not None:
                        chk.own_gpus = tuple(g.mig_uuid or g.uuid for g in own.grants)
                        if R.GPU_SLOTS in limits:
                            chk.own_core = ",".join(dict.fromkeys(str(g.core) for g in own.grants))
                    rec = alloc.for_container(name) if alloc is not None else None
                    if rec is not None:
                        chk.record_gpus = tuple(g.mig_uuid or g.uuid for g in rec.grants)
                        if R.GPU_SLOTS in limits:
                            chk.record_core = ",".join(dict.fromkeys(str(g.core) for g in rec.grants))
                    ack = recs.acks.get(name)
                    if ack is not None:
                        chk.ack_gpus = tuple(g.mig_uuid or g.uuid for g in ack.grants) or tuple(
                            d.split("::", 1)[0] for d in ack.devices)
                out.append(chk)
        return out

    def double_held(self) -> list[str]:
        """Device IDs the kubelets hold for two app containers at once (a kubelet that lost its
        checkpoint, or handed a device twice)."""
        out: list[str] = []
        for n in self.nodes.values():
            owner: dict[tuple[str, str], str] = {}
            for p, cs in n.held().items():
                for cname, held in cs.items():
                    for res, ids in held:
                        for i in ids:
                            if (res, i) in owner:
                                out.append(f"{n.name} {res} {i}: {owner[(res, i)]} and {p}/{cname}")
                            owner[(res, i)] = f"{p}/{cname}"
        return out

    def records_on_replicated(self) -> list[str]:
        """Records and acknowledgements (what the accounting uses) that name a GPU its node serves as
        time-slicing/MPS replicas: a share or a whole GPU there would run beside the replicas."""
        out: list[str] = []
        for pod in self.api.objects("pods"):
            node = self.nodes.get((pod.get("spec") or {}).get("nodeName") or "")
            if node is None:
                continue
            replicated = node.replicated_gpus()
            recs = read_pod(pod, self.key)
            alloc = recs.allocation()
            held = [(c.container, g.uuid) for c in (alloc.containers if alloc is not None else ()) for g in c.grants]
            held += [(c, g.uuid) for c, a in recs.acks.items() for g in a.grants]
            out += [f"{pod['metadata']['name']}/{c}: {u}" for c, u in held if u in replicated]
        return out

    def overcommitted(self) -> list[str]:
        """GPUs above 100 % compute or their memory, by what the containers were actually served."""
        use: dict[tuple[str, str], list[int]] = {}
        who: dict[tuple[str, str], list[str]] = {}
        mem_cap: dict[str, int] = {}
        for n in self.nodes.values():
            for g in n.backend.discover().gpus:
                mem_cap[g.uuid] = g.memory_bytes
        for n in self.nodes.values():
            for res in n.admitter.results.values():
                if not res.ok:
                    continue
                pod = next((p for p in self.api.objects("pods")
                            if f"{p['metadata']['namespace']}/{p['metadata']['name']}" == res.pod), None)
                if pod is None:
                    continue
                apps = {c["name"] for c in pod["spec"].get("containers") or []}
                for cname, per in res.containers.items():
                    if cname not in apps:
                        continue  # init containers ran before, not beside, the app containers
                    for a in per.values():
                        envs = a.response.envs
                        gpus = [g for g in envs.get("NVIDIA_VISIBLE_DEVICES", "").split(",") if g]
                        cores = _per_gpu(envs.get("KUBEGPU_GPU_CORE_PERCENT", "100"), len(gpus))
                        mems = _per_gpu(envs.get("KUBEGPU_GPU_MEMORY_BYTES", "0"), len(gpus))
                        for g, core, mem in zip(gpus, cores, mems, strict=False):
                            u = use.setdefault((n.name, g), [0, 0])
                            u[0] += core
                            u[1] += mem or mem_cap.get(g, 0)
                            who.setdefault((n.name, g), []).append(f"{res.pod}/{cname}:{core}")
        return [f"{node}/{g}: {c} % compute, {m} bytes ({', '.join(who[(node, g)])})"
                for (node, g), (c, m) in use.items() if c > 100 or (g in mem_cap and m > mem_cap[g])]


def _is_device_resource(name: str) -> bool:
    """Resources the kubelet's device manager counts: nvidia.com GPUs, MIG devices and replicas, and
    kubegpu's share slots."""
    return name == R.GPU_SLOTS or R.is_nvidia_gpu_name(name)


def _device_requests(pod: Mapping[str, Any]) -> dict[str, int]:
    """Per device resource, what the pod holds by Kubernetes' rule: the larger of the largest init
    container and the sum of the app containers."""
    spec = pod.get("spec") or {}

    def limits(c: Mapping[str, Any]) -> dict[str, int]:
        lim = (c.get("resources") or {}).get("limits") or {}
        return {r: int(str(q)) for r, q in lim.items() if _is_device_resource(r)}

    out: dict[str, int] = {}
    for c in spec.get("containers") or []:
        for r, q in limits(c).items():
            out[r] = out.get(r, 0) + q
    for c in spec.get("initContainers") or []:
        for r, q in limits(c).items():
            out[r] = max(out.get(r, 0), q)
    return out


def _per_gpu(value: str, n: int) -> list[int]:
    parts = [int(x) for x in value.split(",") if x.strip().lstrip("-").isdigit()]
    if len(parts) == 1:
        return parts * n
    return parts


def pod(name: str, *containers: Mapping[str, str], init: list[Mapping[str, str]] | None = None,
        scheduler: str | None = SCHEDULER_NAME, namespace: str = "default",
        annotations: Mapping[str, str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": f"c{i}", "image": "cuda", "resources": {"limits": dict(lim)}}
                                           for i, lim in enumerate(containers)]}
    if init:
        spec["initContainers"] = [{"name": f"i{i}", "image": "cuda", "resources": {"limits": dict(lim)}}
                                  for i, lim in enumerate(init)]
    if scheduler:
        spec["schedulerName"] = scheduler
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if annotations:
        meta["annotations"] = dict(annotations)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def share(core: int, k: int = 1, ratio: int | None = None) -> dict[str, str]:
    return {R.GPU_CORE: str(core * k), R.GPU_MEMORY_RATIO: str((ratio or core) * k), R.GPU_SLOTS: str(k)}


def whole(n: int = 1) -> dict[str, str]:
    return {R.NVIDIA_GPU: str(n)}
