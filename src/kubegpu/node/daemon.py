"""The node daemon's lifecycle: discover, serve, register, heal, reload, stop.

:class:`NodeDaemon` owns one :class:`~kubegpu.node.deviceplugin.server.PluginServer` per resource, the
health monitor, the CDI spec and the publisher, and one lifecycle thread that keeps every
plugin registered with whatever kubelet owns ``<dir>/kubelet.sock``:

- a new ``kubelet.sock`` (inotify via watchdog, like NVIDIA's fsnotify Create, plus a 1 s
  inode poll as a fallback) -> re-serve any plugin whose socket is gone, register all again;
- a plugin socket deleted (the kubelet cleans its dir on start) -> re-serve and register;
- a ListAndWatch stream that ended with no newer stream open -> register again;
- a Register that no stream followed within ``stream_wait_s`` (a v1.24 kubelet's dial-back
  can fail silently) -> re-serve and register again;
- failed registrations are retried with a capped backoff.

Every decision is made by :meth:`NodeDaemon.reconcile` from the observed state (files,
streams), never from the events themselves, so duplicate or lost events are harmless.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

from kubegpu.inventory.base import InventoryBackend, InventoryError
from kubegpu.model.inventory import NodeInventory
from kubegpu.model.node_daemon import SERVING, STOPPING, new_boot
from kubegpu.node.container_edits import read_mig_minors
from kubegpu.node.deviceplugin.allocate import holder_of
from kubegpu.node.deviceplugin.cdi import CdiGenerationError, build_spec, generate_spec, write_spec
from kubegpu.node.deviceplugin.plugin_model import REPLICA_SEPARATOR, PluginSettings, ResourcePlan
from kubegpu.node.deviceplugin.resolver import AllocationResolver
from kubegpu.node.deviceplugin.server import KUBELET_SOCKET, PluginServer, RegistrationError, SocketGone, device_health
from kubegpu.node.health.monitor import HealthMonitor, XidPolicy
from kubegpu.node.health.state import HealthState
from kubegpu.node.lifecycle import DaemonInitError
from kubegpu.node.metrics import NodeMetrics
from kubegpu.node.mps import (
    ENFORCED_MODES,
    MODE_STRICT,
    ComputeModeGuard,
    ComputeModes,
    MpsManager,
    find_binary,
    replica_spec,
)
from kubegpu.node.mps.enforcer import GpuView, ShareEnforcer
from kubegpu.node.publish.publisher import NodePublisher, NullPublisher, StateAnnouncer

if TYPE_CHECKING:
    from kubegpu.node.handoff.verify import Holding

log = logging.getLogger(__name__)

DEFAULT_PLUGIN_DIR = "/var/lib/kubelet/device-plugins/"


@runtime_checkable
class _Unserved(Protocol):
    """A resolver that can say how many containers of pods bound here still wait to be served (the handoff's)."""

    def unserved(self) -> int: ...


def enforcement_fields(view: GpuView | None) -> dict[str, Any]:
    """What the Device object says of one GPU's share enforcement (node/mps/enforcer.py views)."""
    if view is None:
        return {"share_enforcement": "none", "share_enforcement_reason": ""}
    return {"share_enforcement": view.mode, "share_enforcement_reason": view.reason,
            "compute_mode": view.compute_mode, "share_shape_lock": view.shape_lock, "share_escapable": view.escapable}


def _whole_gpus_only(inv: NodeInventory) -> list[ResourcePlan]:
    from kubegpu.node.deviceplugin.resources import whole_device

    if not inv.gpus:
        return []
    return [ResourcePlan(name="nvidia.com/gpu", devices=tuple(whole_device(g) for g in inv.gpus))]


@dataclass(frozen=True)
class NodeOptions:
    """Everything the daemon needs, already validated (built from config + flags + env by
    :func:`kubegpu.node.options.node_options`)."""

    plugin_dir: str = DEFAULT_PLUGIN_DIR
    # The resources to serve for an inventory (``node.resources.expand`` bound to a config);
    # raises ValueError when the config cannot be served on this node.
    expand: Callable[[NodeInventory], Sequence[ResourcePlan]] = _whole_gpus_only
    settings: PluginSettings = field(default_factory=PluginSettings)
    fail_on_init_error: bool = True
    xid_policy: XidPolicy = field(default_factory=XidPolicy)
    recovery_interval_s: float = 30.0
    health_wait_s: float = 0.25
    kubelet_socket: str = KUBELET_SOCKET
    stream_wait_s: float = 5.0
    resync_s: float = 1.0
    register_timeout_s: float = 5.0
    republish_s: float = 60.0  # the publisher is also called this often (API writes retried)
    write_cdi_spec: bool | None = None  # None: when a CDI strategy is on
    share_enforcement: str = "none"  # mps, strict: fine-grained shares are served through MPS daemons (node/mps)
    mps_binary: str = ""  # "" = nvidia-cuda-mps-control under the driver root
    mps_server_uid: int = 0  # strict: the user each GPU's MPS server runs for
    pod_resources_socket: str = ""  # the kubelet's PodResources (strict: which containers still hold GPUs)
    # strict: a container served this recently counts as live though PodResources does not list it yet (the
    # kubelet records an allocation after Allocate answers)
    holder_grace_s: float = 10.0
    holders_s: float = 5.0  # strict: how often the live holders are read from PodResources
    mps_supervise_s: float = 5.0  # how often every MPS daemon is asked whether it answers
    # The most a stop waits for its "stopping" to land on the Node before it closes the plugins anyway.
    announce_timeout_s: float = 5.0
    # After "stopping" landed, the plugins keep serving at least stop_settle_s (binds the extender made before it
    # saw it reach this node's watch) and until no pod bound here waits for its devices, at most stop_drain_s.
    stop_settle_s: float = 1.0
    stop_drain_s: float = 10.0


class _DirWatch:
    """watchdog on the plugin dir: wakes the daemon on kubelet.sock creation or socket deletion."""

    def __init__(self, directory: Path, wake: Callable[[str, str], None]) -> None:
        from watchdog.events import FileSystemEvent, FileSystemEventHandler
        from watchdog.observers import Observer

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event: FileSystemEvent) -> None:
                if event.event_type in ("created", "deleted", "moved"):
                    path = str(event.dest_path if event.event_type == "moved" else event.src_path)
                    wake(event.event_type, os.path.basename(path))

        self._observer = Observer(timeout=0.1)
        self._observer.schedule(Handler(), str(directory), recursive=False)
        self._observer.daemon = True
        self._observer.start()

    def stop(self) -> None:
        self._observer.stop()
        self._observer.join(timeout=2)


@dataclass
class _RegState:
    needs: bool = True
    attempts: int = 0
    next_try: float = 0.0
    registered_at: float | None = None
    kubelet_inode: int | None = None  # the kubelet.sock we last registered with
    stream_ended_at: float | None = None


class NodeDaemon:
    """Runs the device plugins of one node. ``start()`` / ``stop()``; ``reload()`` for SIGHUP."""

    def __init__(self, backend: InventoryBackend, load_options: Callable[[], NodeOptions], *,
                 publisher: NodePublisher | None = None, resolver: AllocationResolver | None = None,
                 metrics: NodeMetrics | None = None, env: Mapping[str, str] | None = None) -> None:
        self.backend = backend
        self.env = env  # the node's environment, from its entry: the MPS control daemons run with it
        self.load_options = load_options
        self.publisher: NodePublisher = publisher or NullPublisher()
        self.resolver = resolver
        self.metrics = metrics or NodeMetrics()
        self.options = load_options()
        self.inventory: NodeInventory | None = None
        self.state: HealthState | None = None
        self.monitor: HealthMonitor | None = None
        self.servers: list[PluginServer] = []
        self.reg: dict[str, _RegState] = {}
        self.waiting_reason = ""  # set when the daemon blocks without serving (no GPUs, init error)
        self.reloads = 0
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._kubelet_changed = False
        self._last_publish = time.monotonic()
        self._publish_pending = False
        self._kubelet_inode: int | None = None
        self._thread: threading.Thread | None = None
        self._watch: _DirWatch | None = None
        self.mps: MpsManager | None = None
        self.enforcer: ShareEnforcer | None = None
        self._last_holders = time.monotonic()
        self._unlisted: dict[str, float] = {}  # strict holder -> when PodResources first did not list it
        # This process's id in the Node's daemon state (model/node_daemon.py), and whether "serving" is written
        # for the plugins served now.
        self.boot = new_boot()
        self.announced_serving = False
        self._announcing = threading.Lock()  # one state write at a time, so "serving" never lands after "stopping"
        self._serving_writer: threading.Thread | None = None
        self._closing = False

    # ----- start / stop / reload -------------------------------------------------------------

    @property
    def plugin_dir(self) -> Path:
        return Path(self.options.plugin_dir)

    def start(self) -> None:
        """Discover, serve and register. Raises :class:`DaemonInitError` (failOnInitError), having stopped what
        had started."""
        try:
            self._start()
        except DaemonInitError:
            self.stop()
            raise

    def _start(self) -> None:
        self._stop.clear()
        self._closing = False
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        self._start_plugins()
        self._kubelet_inode = self._inode(self.plugin_dir / self.options.kubelet_socket)
        try:
            self._watch = _DirWatch(self.plugin_dir, self._on_fs_event)
        except Exception as exc:  # inotify limits and the like: the poll still covers us
            log.warning("cannot watch %s (%s); relying on polling", self.plugin_dir, exc)
            self._watch = None
        self._thread = threading.Thread(target=self._run, name="kubegpu-node-lifecycle", daemon=True)
        self._thread.start()

    def _start_plugins(self) -> None:
        opts = self.options
        prev = self.state.snapshot() if self.state is not None else {}
        try:
            inv = self.backend.discover()
            plans = list(opts.expand(inv))
        except (InventoryError, ValueError) as exc:
            self._init_failed(f"initialisation failed: {exc}")
            return
        if not plans:
            self._init_failed("no devices found" if not inv.gpus
                              else "no resources to serve with this config")
            return
        self.waiting_reason = ""
        state = HealthState(inv)
        # Devices found unhealthy before a reload stay so until the monitor recovers them.
        state.apply({u: h for u, h in prev.items() if not h and u in set(state.uuids())})
        state.add_listener(self._on_health_change)
        self.inventory, self.state = inv, state
        if self.resolver is not None:
            self.resolver.set_inventory(inv)
        if not self._write_cdi(inv):
            return
        minors = read_mig_minors(opts.settings.mig_minors_file) if any(
            g.mig_enabled for g in inv.gpus) else {}
        placement = {m.uuid: (m.gi, m.ci) for g in inv.gpus for m in g.mig_devices}
        self.monitor = HealthMonitor(self.backend, state, policy=opts.xid_policy,
                                     wait_timeout_s=opts.health_wait_s,
                                     recovery_interval_s=opts.recovery_interval_s,
                                     on_xid=self._on_xid, mig_placement=placement)
        self.monitor.start()
        self.metrics.set_inventory(inv)
        self._setup_mps(inv, plans)
        self.servers = [self._make_server(p, inv, state, minors) for p in plans]
        self._refresh_enforcement()
        self.reg = {s.resource: _RegState() for s in self.servers}
        for s in self.servers:
            s.start()  # serve before Register
        for s in self.servers:
            self._try_register(s, time.monotonic())
        self.metrics.set_health(state.snapshot())
        self._update_device_gauges()
        self._publish()

    def _setup_mps(self, inv: NodeInventory, plans: Sequence[ResourcePlan]) -> None:
        """The MPS side: a daemon per ``sharing.mps`` resource (started now, as NVIDIA's plugin does) and,
        with ``shareEnforcement: mps``, a daemon per share shape started when a share is served."""
        opts = self.options
        replica_plans = [p for p in plans if p.sharing == "mps"]
        if not replica_plans and opts.share_enforcement not in ENFORCED_MODES:
            self.enforcer = None
            return
        strict = opts.share_enforcement == MODE_STRICT
        s = opts.settings
        if self.mps is None or self.mps.mps_root != s.mps_root:
            if self.mps is not None:
                self.mps.stop()
            binary = find_binary(s.driver_root, opts.mps_binary)
            self.mps = MpsManager(binary, s.mps_root, interval_s=opts.mps_supervise_s, base_env=self.env)
            self.mps.add_listener(self._refresh_enforcement)
            self.mps.start()
            if binary is None:
                log.error("MPS: %s (driver root %s): MPS-enforced devices stay Unhealthy",
                          self.mps.missing_reason, s.driver_root)
            else:
                self.mps.recover((g.uuid for g in inv.gpus), opts.mps_server_uid if strict else None)
        specs = {p.name: replica_spec(p.name, [(d.uuid, d.memory_bytes) for d in p.devices if d.replica is not None],
                                      p.replicas) for p in replica_plans}
        sliced = {d.uuid for p in plans if p.sharing == "time-slicing" for d in p.devices if d.replica is not None}
        # Strict: the GPUs' compute modes through the inventory backend (NVML), state kept under the MPS root.
        # A backend without compute-mode control leaves ``guard`` None: every strict share is refused, with why.
        modes = self.backend if isinstance(self.backend, ComputeModes) else None
        guard = ComputeModeGuard(modes, s.mps_root) if strict and modes is not None else None
        self.enforcer = ShareEnforcer(self.mps, opts.share_enforcement, inv, time_sliced=sliced,
                                      replica_specs=specs, compute_modes=guard, server_uid=opts.mps_server_uid)
        for spec in specs.values():
            self.mps.ensure(spec)

    def _enforced_scope(self, plan: ResourcePlan) -> bool:
        """Whether this resource's devices are served only while MPS enforces them."""
        e = self.enforcer
        return e is not None and (plan.sharing == "mps" or (plan.sharing == "slots" and e.selected in ENFORCED_MODES))

    def _refresh_enforcement(self) -> None:
        """Hold back the MPS-enforced devices of every GPU whose shares cannot be enforced now (reason
        given), and report each GPU's enforcement. Called at start and whenever a daemon goes up or down."""
        e, state = self.enforcer, self.state
        if e is None or state is None:
            return
        table = e.table()
        for srv in list(self.servers):
            if not self._enforced_scope(srv.plan):
                continue
            gpus = {d.gpu_uuid for d in srv.plan.devices}
            state.set_blocked(srv.plan.name, {u: f"shares cannot be enforced: {t.reason}"
                                              for u, t in table.items() if u in gpus and not t.enforced})
        daemons = [(d.name, d.kind, d.limits, d.up, d.restarts) for d in (self.mps.states() if self.mps else [])]
        self.metrics.set_enforcement(e.views(), daemons)
        self._publish_pending = True
        self._wake.set()

    def reconcile_holders(self, rows: Iterable[Holding] | None = None) -> list[str]:
        """Strict: tell the enforcer which containers still hold each GPU (the device-plugin path hears of no
        container's end), so a GPU whose shares all ended gets its compute mode back and may go whole. ``rows``
        as PodResources lists them (asked of the kubelet when None). Returns the GPUs whose mode went back."""
        e = self.enforcer
        if e is None or e.strict is None:
            return []
        if rows is None:
            if not self.options.pod_resources_socket:
                return []
            from kubegpu.node import rpc
            from kubegpu.node.handoff.verify import list_pod_resources

            try:
                rows = list_pod_resources(self.options.pod_resources_socket, timeout_s=1.0)
            except rpc.CallFailed as exc:  # no word from the kubelet: nobody is taken as gone
                log.debug("strict enforcement: PodResources unavailable: %s", exc)
                return []
        whole_resources = {srv.resource for srv in self.servers if not srv.plan.shared}
        listed = {holder_of(res, ids): (res in whole_resources, {i.split(REPLICA_SEPARATOR, 1)[0] for i in ids})
                  for _ns, _pod, _c, res, ids in rows if res and ids}
        shares: dict[str, set[str]] = {}
        whole: dict[str, set[str]] = {}
        known: set[str] = set()
        now = time.monotonic()
        for key, (is_whole, gpus) in listed.items():
            for u in gpus:
                held_s, held_w = e.holders(u)
                (whole if key in held_w or (is_whole and key not in held_s) else shares).setdefault(u, set()).add(key)
        for g in e.inventory.gpus:
            held_s, held_w = e.holders(g.uuid)
            for key in (held_s | held_w) - listed.keys():
                known.add(key)
                # Served but not listed yet (the kubelet records an allocation after Allocate answers): live
                # for a grace period, so a container about to start never finds its server gone.
                if now - self._unlisted.setdefault(key, now) < self.options.holder_grace_s:
                    (shares if key in held_s else whole).setdefault(g.uuid, set()).add(key)
        self._unlisted = {k: t for k, t in self._unlisted.items() if k in known}
        restored = e.reconcile(shares, whole)
        if restored:
            log.info("strict enforcement: GPU(s) %s hold no share now: compute mode restored", ", ".join(restored))
            self._refresh_enforcement()
        return restored

    def _make_server(self, plan: ResourcePlan, inv: NodeInventory, state: HealthState,
                     minors: dict[tuple[int, int, int], int]) -> PluginServer:
        settings = replace(self.options.settings, enforcer=self.enforcer) if self.enforcer else self.options.settings
        return PluginServer(plan, settings, state.view(plan.name), inv, self.plugin_dir, resolver=self.resolver,
                            metrics=self.metrics, mig_minors=minors, on_stream_end=self._on_stream_end,
                            kubelet_socket=self.options.kubelet_socket)

    def _init_failed(self, reason: str) -> None:
        if self.options.fail_on_init_error:
            raise DaemonInitError(f"{reason} (failOnInitError is set)")
        self.waiting_reason = reason
        log.warning("%s; failOnInitError is false: waiting indefinitely", reason)

    def _write_cdi(self, inv: NodeInventory) -> bool:
        """Write the node's CDI spec where one is wanted; False when the CDI strategies cannot be served."""
        s = self.options.settings
        want = self.options.write_cdi_spec if self.options.write_cdi_spec is not None else s.cdi_enabled
        if not want:
            return True
        if s.cdi_enabled:
            # What a container can run with: the toolkit's spec (libraries, hooks), or a refusal.
            try:
                spec = generate_spec(inv, vendor=s.cdi_vendor, cls=s.cdi_class, nvidia_ctk_path=s.nvidia_ctk_path,
                                     container_driver_root=s.container_driver_root, driver_root=s.driver_root,
                                     dev_root=s.dev_root, feature_flags=s.cdi_feature_flags, work_dir=s.cdi_dir)
            except (CdiGenerationError, OSError) as exc:
                self._init_failed(f"deviceListStrategy {','.join(s.device_list_strategies)}: {exc}")
                return False
        else:
            spec = build_spec(inv, vendor=s.cdi_vendor, cls=s.cdi_class, driver_root=s.driver_root,
                              mig_minors=read_mig_minors(s.mig_minors_file))
        try:
            path = write_spec(spec, s.cdi_dir, s.cdi_vendor, s.cdi_class)
            log.info("wrote CDI spec %s (%d devices)", path, len(spec["devices"]))
        except OSError as exc:
            if self.options.fail_on_init_error:
                raise DaemonInitError(f"cannot write CDI spec to {s.cdi_dir}: {exc}") from exc
            log.error("cannot write CDI spec to %s: %s", s.cdi_dir, exc)
        return True

    def _stop_plugins(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()
            self.monitor = None
        # Stop the servers side by side: each waits for its streams to end.
        threads = [threading.Thread(target=s.stop, name=f"stop-{s.resource}") for s in self.servers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        self.servers = []

    def stop(self) -> None:
        """Stop everything: servers (sockets removed), monitor, watcher, lifecycle thread. The cluster is told
        first, so that nothing is placed here while the kubelet has no healthy device of ours."""
        self._closing = True
        if self.servers:
            self._announce(STOPPING)
            self._drain()
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        with self._lock:
            self._stop_plugins()
        kept = self.enforcer.stop() if self.enforcer is not None else {}  # strict: modes back where no share runs
        for uuid, why in kept.items():
            log.warning("GPU %s keeps its compute mode and its MPS server: %s", uuid, why)
        if self.mps is not None:
            self.mps.stop(keep=kept)  # quit the other MPS daemons: their servers end once their clients have
            self.mps = None
        self.publisher.close()
        log.info("node daemon stopped")

    def reload(self) -> None:
        """SIGHUP: read the config again, rediscover, restart every server and register again."""
        with self._lock:
            log.info("reloading configuration")
            new = self.load_options()
            if self.servers:
                self._announce(STOPPING)  # the kubelet loses the plugins' devices until they register again
            self._stop_plugins()
            self.options = new
            self.reloads += 1
            self._start_plugins()
        self._wake.set()

    # ----- events ----------------------------------------------------------------------------

    def _on_fs_event(self, kind: str, name: str) -> None:
        if name == self.options.kubelet_socket and kind in ("created", "moved"):
            self._kubelet_changed = True
            self._wake.set()
        elif kind == "deleted" and any(s.plan.socket_name == name for s in self.servers):
            self._wake.set()

    def _on_stream_end(self, server: PluginServer) -> None:
        st = self.reg.get(server.resource)
        if st is not None:
            st.stream_ended_at = time.monotonic()
        log.info("%s: ListAndWatch stream ended", server.resource)
        self._wake.set()

    def _on_xid(self, xid: int, uuid: str) -> None:
        self.metrics.xid_events.labels(xid=str(xid)).inc()

    def _on_health_change(self, health: dict[str, bool]) -> None:
        self.metrics.set_health(health)
        self._update_device_gauges()
        # API writes can be slow: the lifecycle thread publishes, the health monitor moves on.
        self._publish_pending = True
        self._wake.set()

    def _update_device_gauges(self) -> None:
        if self.state is None:
            return
        for s in self.servers:
            health = s.state.snapshot()
            ok = sum(1 for d in s.plan.devices if health.get(d.uuid, False))
            self.metrics.devices.labels(resource=s.resource, health="Healthy").set(ok)
            self.metrics.devices.labels(resource=s.resource, health="Unhealthy").set(len(s.plan.devices) - ok)

    def _publish(self) -> None:
        self._last_publish = time.monotonic()
        self._publish_pending = False
        if self.inventory is None or self.state is None:
            return
        health = self.state.snapshot()
        inv = self.inventory
        # GPUs the kubelet sees only as replicas (time-slicing / MPS) are marked, so the extender never
        # records a whole GPU or a share on one (the kubelet could not give it).
        replicated = {d.uuid for srv in self.servers if srv.plan.sharing in ("time-slicing", "mps")
                      for d in srv.plan.devices}
        views = self.enforcer.views() if self.enforcer is not None else {}
        gpus = tuple(replace(g, healthy=health.get(g.uuid, g.healthy), replicated=g.uuid in replicated,
                             **enforcement_fields(views.get(g.uuid)))
                     for g in inv.gpus)
        try:
            current = NodeInventory(inv.name, gpus, inv.cpu_milli, inv.memory_bytes, inv.labels,
                                    inv.driver_version, inv.cuda_version)
            self.publisher.publish(current, device_health(self.servers))
        except Exception:
            log.exception("publishing node state failed; will retry on the next change")

    # ----- the lifecycle loop ----------------------------------------------------------------

    @staticmethod
    def _inode(path: Path) -> int | None:
        try:
            return path.stat().st_ino
        except FileNotFoundError:
            return None

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            due = [st.next_try - now for st in self.reg.values() if st.needs]
            self._wake.wait(timeout=max(0.01, min([self.options.resync_s / 4, *due])))
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                with self._lock:
                    self.reconcile()
                    ready = not self.announced_serving and self.kubelet_has_devices()
                if ready and (self._serving_writer is None or not self._serving_writer.is_alive()):
                    # An API write, on its own thread: an API server that does not answer must not slow the
                    # kubelet registrations this loop keeps (each try waits up to announce_timeout_s).
                    self._serving_writer = threading.Thread(target=self._announce_serving, daemon=True,
                                                            name="kubegpu-node-serving")
                    self._serving_writer.start()
            except Exception:
                log.exception("lifecycle: reconcile failed; retrying")

    def reconcile(self) -> None:
        """Bring every plugin to 'served on its own socket and registered with the current kubelet'."""
        now = time.monotonic()
        opts = self.options
        if self._publish_pending or (opts.republish_s > 0 and now - self._last_publish >= opts.republish_s):
            self._publish()
        kpath = self.plugin_dir / opts.kubelet_socket
        inode = self._inode(kpath)
        kubelet_new = self._kubelet_changed or (inode is not None and inode != self._kubelet_inode)
        self._kubelet_changed = False
        if inode is not None:
            self._kubelet_inode = inode
        if kubelet_new:
            log.info("kubelet socket %s (re)created: registering again", kpath)
        strict = self.enforcer is not None and self.enforcer.strict is not None
        if strict and now - self._last_holders >= opts.holders_s:
            self._last_holders = now
            self.reconcile_holders()
        for s in self.servers:
            st = self.reg[s.resource]
            if not s.socket_intact():
                log.info("%s: plugin socket %s is gone: serving again", s.resource, s.socket_path)
                s.stop(grace_s=0)
                s.start()
                st.needs, st.attempts, st.next_try = True, 0, now
            if kubelet_new and (inode is None or st.kubelet_inode != inode):
                # Not yet registered with this kubelet instance (its socket inode).
                st.needs, st.attempts, st.next_try = True, 0, now
            if (st.stream_ended_at is not None and s.active_streams == 0
                    and now - st.stream_ended_at >= 0.2
                    and (s.last_stream_open is None or s.last_stream_open <= st.stream_ended_at)):
                log.info("%s: no ListAndWatch stream since one ended: registering again", s.resource)
                st.stream_ended_at = None
                st.needs, st.attempts, st.next_try = True, 0, now
            elif st.stream_ended_at is not None and (s.active_streams > 0 or (
                    s.last_stream_open is not None and s.last_stream_open > st.stream_ended_at)):
                st.stream_ended_at = None  # replaced by a newer stream: nothing to do
            if (not st.needs and st.registered_at is not None
                    and (s.last_stream_open is None or s.last_stream_open < st.registered_at)
                    and now - st.registered_at > opts.stream_wait_s):
                log.warning("%s: registered %.1fs ago but the kubelet never opened ListAndWatch: "
                            "serving and registering again", s.resource, now - st.registered_at)
                s.stop(grace_s=0)
                s.start()
                st.needs, st.attempts, st.next_try = True, 0, now
            if st.needs and now >= st.next_try:
                self._try_register(s, now)

    def kubelet_has_devices(self) -> bool:
        """Every plugin is registered with the kubelet and the kubelet has opened its ListAndWatch since, whose
        first answer is the device list: from here the kubelet can allocate, so the cluster may bind here."""
        if not self.servers or self.waiting_reason:
            return False
        for s in self.servers:
            st = self.reg[s.resource]
            if (st.needs or st.registered_at is None or s.active_streams == 0 or s.last_stream_open is None
                    or s.last_stream_open < st.registered_at):
                return False
        return True

    def _drain(self) -> None:
        """Serve on while pods bound here still wait for their devices (bounded): the kubelet admits them with
        healthy devices instead of rejecting them once the plugins are gone."""
        opts = self.options
        start = time.monotonic()
        resolver = self.resolver if isinstance(self.resolver, _Unserved) else None
        while True:
            waited = time.monotonic() - start
            if waited >= opts.stop_drain_s:
                left = resolver.unserved() if resolver is not None else 0
                if left:
                    log.warning("stopping with %d pods bound here not served yet (waited %.1fs)", left, waited)
                return
            if waited >= opts.stop_settle_s and (resolver is None or resolver.unserved() == 0):
                return
            time.sleep(0.05)

    def _announce_serving(self) -> None:
        if not self._announce(SERVING):
            self._stop.wait(1.0)  # then the loop tries again

    def _announce(self, state: str) -> bool:
        """Tell the cluster whether this daemon serves the node now (a publisher that cannot: nothing to say).
        Whether it was said; :attr:`announced_serving` follows, under the same lock."""
        with self._announcing:
            if state == SERVING and self._closing:
                return False
            said = (self.publisher.announce(state, self.boot, self.options.announce_timeout_s)
                    if isinstance(self.publisher, StateAnnouncer) else True)
            self.announced_serving = state == SERVING and said
            return said

    def _try_register(self, s: PluginServer, now: float) -> None:
        st = self.reg[s.resource]
        started = time.monotonic()
        try:
            try:
                s.register(timeout_s=self.options.register_timeout_s)
            except SocketGone:
                log.info("%s: plugin socket %s is gone: serving again", s.resource, s.socket_path)
                s.stop(grace_s=0)
                s.start()
                started = time.monotonic()
                s.register(timeout_s=self.options.register_timeout_s)
        except RegistrationError as exc:
            st.attempts += 1
            delay = min(10.0, 0.1 * 2 ** min(st.attempts, 7))
            st.next_try = time.monotonic() + delay
            st.needs = True
            log.warning("%s: %s; retrying in %.1fs", s.resource, exc, delay)
            return
        st.needs, st.attempts = False, 0
        st.kubelet_inode = self._inode(self.plugin_dir / self.options.kubelet_socket)
        # A stream opened during Register (current kubelets dial back before answering) counts.
        st.registered_at = started
        if not s.socket_intact():
            # A restarting kubelet cleaned its dir while we registered: the endpoint it got is
            # gone. Serve again and register again at once rather than wait for the watch.
            log.info("%s: plugin socket vanished during Register: serving and registering again", s.resource)
            s.stop(grace_s=0)
            s.start()
            st.needs, st.next_try = True, time.monotonic()
            self._wake.set()

    # ----- introspection (CLI, tests, the /healthz and /readyz probes) ------------------------

    def liveness(self) -> dict[str, str]:
        """Whether the loops that keep the node served are running: "ok" or what died."""
        checks = {"lifecycle": "ok" if self._thread is not None and self._thread.is_alive()
                  else "the lifecycle loop is not running"}
        if self.servers:  # serving: the NVML event loop must be watching the devices
            monitor = self.monitor
            alive = monitor is not None and monitor.alive()
            checks["nvml-events"] = "ok" if alive else "the health monitor (NVML event loop) is not running"
        return checks

    def readiness(self) -> dict[str, str]:
        """Whether the kubelet can use this node: GPUs discovered (NVML / inventory) with at least one healthy,
        and every resource registered with the kubelet ("ok" or what is missing)."""
        status = self.status()
        resources = cast(list[dict[str, Any]], status["resources"])
        checks: dict[str, str] = {}
        if status["waiting"]:
            checks["inventory"] = str(status["waiting"])
        elif not resources:
            checks["inventory"] = "not discovered yet"
        else:
            healthy = sum(int(r["healthy"]) for r in resources)
            total = sum(int(r["devices"]) for r in resources)
            checks["inventory"] = "ok" if healthy else f"no healthy device ({total} advertised, all unhealthy)"
        for r in resources:
            checks[f"kubelet:{r['name']}"] = "ok" if r["registered"] else "not registered with the kubelet"
        return checks

    def status(self) -> dict[str, object]:
        with self._lock:
            table = self.enforcer.table() if self.enforcer is not None else {}
            return {
                "enforcement": {u: {"mode": t.mode, "reason": t.reason} for u, t in table.items()},
                "mps_daemons": [{"name": d.name, "kind": d.kind, "limits": d.limits, "gpus": list(d.gpus),
                                 "up": d.up, "reason": d.reason, "restarts": d.restarts}
                                for d in (self.mps.states() if self.mps else [])],
                "node": self.inventory.name if self.inventory else "",
                "waiting": self.waiting_reason,
                "reloads": self.reloads,
                "resources": [
                    {"name": s.resource, "socket": str(s.socket_path), "devices": len(s.plan.devices),
                     "healthy": sum(1 for d in s.plan.devices if s.state.is_healthy(d.uuid)),
                     "streams": s.active_streams, "registered": not self.reg[s.resource].needs}
                    for s in self.servers
                ],
            }
