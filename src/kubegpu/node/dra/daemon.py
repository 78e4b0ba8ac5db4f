"""``kubegpu node --kubelet-plugin dra``: discovery, health, the DRA kubelet plugin and the node's slices.

One object per node wires the parts: the inventory backend (NVML or a topology file), the
health monitor shared with the device-plugin mode, the :class:`~.prepare.Preparer` (claims ->
CDI), the gRPC :class:`~.plugin.DraPlugin` and the :class:`~.kube.SlicePublisher`. A health
change taints or untaints devices (republished at once) and is streamed to the kubelet on
``NodeWatchResources``. A lifecycle thread serves again any socket deleted under the plugin.
In this mode no device plugin is served: a GPU is served by one or the other, never both.

It is a :class:`~kubegpu.node.lifecycle.KubeletPath`: the node's one lifecycle starts, reloads (discovers
again) and stops it, and serves its metrics and probes as it serves the device plugins'.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from lightkube import Client

from kubegpu.inventory.base import InventoryBackend, InventoryError
from kubegpu.model.inventory import NodeInventory
from kubegpu.node.config import XidPolicy
from kubegpu.node.dra.kube import ApiClaimReader, SlicePublisher
from kubegpu.node.dra.names import DRIVER, SUPPORTED_VERSIONS, TAINT_RESTARTING
from kubegpu.node.dra.plugin import DraPlugin
from kubegpu.node.dra.prepare import ClaimReader, Preparer
from kubegpu.node.dra.slices import (
    DeviceTaint,
    DraSettings,
    PoolContent,
    PublishedDevice,
    health_taints,
    pool_content,
    slice_bodies,
)
from kubegpu.node.health.monitor import HealthMonitor
from kubegpu.node.health.state import HealthState
from kubegpu.node.lifecycle import DaemonInitError, ReloadRefused
from kubegpu.node.metrics import NodeMetrics
from kubegpu.node.mps.compute_mode import ComputeModes
from kubegpu.node.mps.dra import DraEnforcement
from kubegpu.node.mps.enforcer import GpuView

log = logging.getLogger(__name__)

DEFAULT_PLUGINS_DIR = "/var/lib/kubelet/plugins"
DEFAULT_REGISTRY_DIR = "/var/lib/kubelet/plugins_registry"


@dataclass(frozen=True)
class DraOptions:
    settings: DraSettings
    plugins_dir: str = DEFAULT_PLUGINS_DIR
    registry_dir: str = DEFAULT_REGISTRY_DIR
    cdi_dir: str = "/var/run/cdi"
    state_dir: str = ""  # "" = <plugins_dir>/gpu.kubegpu.io
    versions: tuple[str, ...] = SUPPORTED_VERSIONS
    xid_policy: XidPolicy = field(default_factory=XidPolicy)
    recovery_interval_s: float = 30.0
    health_wait_s: float = 0.25
    resync_s: float = 30.0
    socket_check_s: float = 1.0
    watch_slices: bool = True
    # The most a stop waits for its devices to be published as withdrawn (0: not withdrawn, as a killed driver).
    withdraw_timeout_s: float = 5.0

    @property
    def state_path(self) -> str:
        return self.state_dir or str(Path(self.plugins_dir) / DRIVER)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class DraDaemon:
    def __init__(self, backend: InventoryBackend, options: DraOptions, client: Client | None, *,
                 reader: ClaimReader | None = None,
                 metrics: NodeMetrics | None = None, env: Mapping[str, str] | None = None) -> None:
        self.env = env  # the node's environment, from its entry: the MPS control daemons run with it
        if client is None and reader is None:
            raise ValueError("the DRA plugin needs an API client (to read claims and publish slices)")
        self.backend = backend
        self.options = options
        self.client = client
        self.reader: ClaimReader = reader or ApiClaimReader(client)  # type: ignore[arg-type]
        self.metrics = metrics or NodeMetrics()
        self.inventory: NodeInventory | None = None
        self.state: HealthState | None = None
        self.monitor: HealthMonitor | None = None
        self.preparer: Preparer | None = None
        self.mps: DraEnforcement | None = None
        self.plugin: DraPlugin | None = None
        self.publisher: SlicePublisher | None = None
        self.taints: dict[str, DeviceTaint] = {}
        self._views: dict[str, GpuView] = {}  # what the published slices show of each GPU's enforcement
        self.content = PoolContent()
        self.timings: dict[str, list[float]] = {"prepare": [], "unprepare": [], "publish": []}
        self.health_changed_at: float | None = None
        self.last_publish_after_change_s: float | None = None
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # From the start of a stop every device is published tainted: the kubelet cannot prepare claims here
        # until the next driver has registered, which publishes them untainted only then (docs/handoff.md,
        # "Restarts").
        self.restarting = False
        self._away: DeviceTaint | None = None  # that taint, its time kept while it lasts

    # ----- pieces ------------------------------------------------------------------------------

    def table(self) -> dict[str, PublishedDevice]:
        with self._lock:
            return self.content.table

    def _rebuild(self) -> None:
        assert self.inventory is not None and self.state is not None
        inv = self.inventory
        health = self.state.snapshot()
        reasons = {u: self.state.reason(u) for u, ok in health.items() if not ok}
        if self.mps is not None:  # a shared GPU whose shares MPS cannot enforce now is tainted with the reason
            for u, why in self.mps.blocked().items():
                if health.get(u, False) and self.options.settings.is_shared(inv.gpu(u)):
                    health[u], reasons[u] = False, why
        with self._lock:
            self.taints = health_taints(inv, health, reasons, self.taints, _now())
            self._views = self.mps.views() if self.mps is not None else {}
            shown = self.taints
            if self.restarting:
                away = self._away = self._away or DeviceTaint(TAINT_RESTARTING, "", "NoSchedule", _now())
                every = [g.uuid for g in inv.gpus] + [m.uuid for g in inv.gpus for m in g.mig_devices]
                shown = {**dict.fromkeys(every, away), **self.taints}
            self.content = pool_content(inv, self.options.settings, shown, self._views)

    def desired(self, generation: int) -> list[dict[str, Any]]:
        with self._lock:
            return slice_bodies(self.content, self.options.settings, generation)

    def health_snapshot(self) -> list[tuple[str, str, bool, str]]:
        if self.state is None:
            return []
        health = self.state.snapshot()
        out = []
        for d in self.table().values():
            ok = health.get(d.uuid, True) and health.get(d.gpu_uuid, True)
            out.append((d.pool, d.name, ok, "" if ok else (self.state.reason(d.uuid)
                                                             or self.state.reason(d.gpu_uuid))))
        return out

    def _on_health(self, _snapshot: dict[str, bool]) -> None:
        self.health_changed_at = time.monotonic()
        self._rebuild()
        self._update_gauges()
        if self.publisher is not None:
            self.publisher.wake()
        if self.plugin is not None:
            self.plugin.health_changed()

    def _on_published(self, seconds: float) -> None:
        self.timings["publish"].append(seconds)
        if self.health_changed_at is not None:
            self.last_publish_after_change_s = time.monotonic() - self.health_changed_at
            self.health_changed_at = None

    def _update_gauges(self) -> None:
        """The device series the device-plugin node exports, for the devices this driver publishes."""
        if self.state is None:
            return
        health = self.state.snapshot()
        self.metrics.set_health(health)
        rows = self.health_snapshot()
        ok = sum(1 for _pool, _name, healthy, _why in rows if healthy)
        self.metrics.devices.labels(resource=DRIVER, health="Healthy").set(ok)
        self.metrics.devices.labels(resource=DRIVER, health="Unhealthy").set(len(rows) - ok)
        if self.mps is not None:
            daemons = [(d.name, d.kind, d.limits, d.up, d.restarts) for d in self.mps.manager.states()]
            self.metrics.set_enforcement(self._views, daemons)

    def _observe(self, what: str, seconds: float) -> None:
        if what == "prepare":
            self.metrics.dra_prepare_seconds.observe(seconds)
        elif what == "unprepare":
            self.metrics.dra_unprepare_seconds.observe(seconds)
        if self.preparer is not None:
            self.metrics.dra_prepared_claims.set(len(self.preparer.claims))
        lst = self.timings.setdefault(what, [])
        lst.append(seconds)
        if len(lst) > 10000:
            del lst[: len(lst) - 10000]
        if self.mps is not None and self.inventory is not None and self.mps.views() != self._views:
            self._on_health({})  # a strict GPU changed mode or lock: the slices show it

    # ----- lifecycle ---------------------------------------------------------------------------

    def _watch_health(self, inv: NodeInventory, previous: dict[str, bool] | None = None) -> None:
        opts = self.options
        state = HealthState(inv)
        if previous:  # devices still present keep their health until the monitor recovers them
            state.apply({u: h for u, h in previous.items() if not h and u in set(state.uuids())})
        with self._lock:
            self.inventory, self.state = inv, state
        self.metrics.set_inventory(inv)
        self._rebuild()
        self._update_gauges()
        state.add_listener(self._on_health)
        placement = {m.uuid: (m.gi, m.ci) for g in inv.gpus for m in g.mig_devices}
        self.monitor = HealthMonitor(self.backend, state, policy=opts.xid_policy, wait_timeout_s=opts.health_wait_s,
                                     recovery_interval_s=opts.recovery_interval_s, mig_placement=placement,
                                     on_xid=lambda xid, _uuid: self.metrics.xid_events.labels(xid=str(xid)).inc())
        self.monitor.start()

    def rediscover(self) -> bool:
        """Discover again (SIGHUP, e.g. after a MIG reconfiguration); republish when the GPUs changed.

        Claims already prepared keep their checkpointed answer; a device that disappeared is no
        longer published, so the scheduler stops handing it out."""
        inv = self.backend.discover()
        if inv == self.inventory:
            return False
        previous = self.state.snapshot() if self.state is not None else None
        if self.monitor is not None:
            self.monitor.stop()
        if self.mps is not None:
            self.mps.set_inventory(inv)
        if self.state is not None:
            self.state.close()
        self._watch_health(inv, previous)
        log.info("GPUs changed on rediscovery: %d devices now published", len(self.table()))
        if self.publisher is not None:
            self.publisher.wake()
        if self.plugin is not None:
            self.plugin.health_changed()
        return True

    def reload(self) -> None:
        """SIGHUP: :meth:`rediscover`; GPUs that cannot be discovered now leave the published ones served."""
        try:
            self.rediscover()
        except InventoryError as exc:
            raise ReloadRefused(f"rediscovery failed, keeping the published devices: {exc}") from None

    def start(self) -> None:
        """Discover, publish and serve; raises :class:`DaemonInitError` (after stopping what had started)."""
        try:
            self._start()
        except Exception as exc:
            self.stop()
            raise DaemonInitError(f"DRA driver start failed: {exc}") from exc

    def _start(self) -> None:
        opts = self.options
        self._watch_health(self.backend.discover())
        if opts.settings.mps and self.inventory is not None:  # shares enforced by MPS daemons (node/mps)
            s = opts.settings
            # strict: GPU compute modes through the inventory backend (NVML); without them strict shares are
            # refused with the reason.
            modes = self.backend if isinstance(self.backend, ComputeModes) else None
            self.mps = DraEnforcement(s.mps_root, s.driver_root, s.mps_binary, on_change=lambda: self._on_health({}),
                                      selected=s.enforcement, compute_modes=modes, server_uid=s.mps_server_uid,
                                      base_env=self.env)
            self.mps.start(self.inventory)
            self._rebuild()
        self.preparer = Preparer(self.reader, self.table, opts.settings, cdi_dir=opts.cdi_dir,
                                 state_dir=opts.state_path, enforcer=self.mps)
        if self.client is not None:
            self.publisher = SlicePublisher(self.client, opts.settings.node_name, self.desired,
                                            resync_s=opts.resync_s, watch=opts.watch_slices,
                                            on_published=self._on_published)
        self.plugin = DraPlugin(self.preparer, self.health_snapshot, plugins_dir=opts.plugins_dir,
                                registry_dir=opts.registry_dir, versions=opts.versions,
                                on_registered=self._on_registered, observe=self._observe)
        self.plugin.start()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kubegpu-dra-lifecycle", daemon=True)
        self._thread.start()
        log.info("DRA driver %s started on node %s: %d devices (%d claims prepared from the checkpoint)",
                 DRIVER, opts.settings.node_name, len(self.table()), len(self.preparer.claims))

    def _on_registered(self) -> None:
        self.metrics.registrations.labels(resource=DRIVER).inc()
        publisher = self.publisher
        if publisher is not None and not publisher.started and not self._stop.is_set():
            publisher.start()  # the kubelet can prepare claims here now: the devices are offered (again)
        # The kubelet deletes the node's slices right after a (re-)registration: look again soon.
        if self.publisher is not None:
            self.publisher.wake()

    def _run(self) -> None:
        while not self._stop.wait(self.options.socket_check_s):
            try:
                if self.plugin is not None:
                    self.plugin.ensure_sockets()
            except Exception:
                log.exception("DRA lifecycle check failed; retrying")

    def _withdraw(self) -> None:
        """Before the plugin goes: every device tainted and published (bounded), so the scheduler allocates
        nothing here that the kubelet could not prepare until the next driver has registered."""
        publisher = self.publisher
        timeout_s = self.options.withdraw_timeout_s
        if (publisher is None or self.inventory is None or self.state is None or self._stop.is_set()
                or timeout_s <= 0):
            return
        self.restarting, self._away = True, None
        self._rebuild()
        done = threading.Event()
        deadline = time.monotonic() + timeout_s

        def write() -> None:
            error: Exception | None = None
            while time.monotonic() < deadline:
                try:
                    publisher.reconcile()  # the publisher's own loop may write too: a conflict is tried again
                    done.set()
                    return
                except Exception as exc:
                    error = exc
                    time.sleep(0.05)
            log.warning("DRA driver: cannot publish the devices as withdrawn: %s", error)

        t = threading.Thread(target=write, name="kubegpu-dra-withdraw", daemon=True)
        t.start()
        t.join(timeout_s)
        if not done.is_set():
            log.warning("DRA driver: devices not published as withdrawn within %.1fs; stopping anyway", timeout_s)

    def stop(self) -> None:
        self._withdraw()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.plugin is not None:
            self.plugin.stop()
        if self.publisher is not None:
            self.publisher.stop()
        if self.monitor is not None:
            self.monitor.stop()
        if self.mps is not None:
            for uuid, why in self.mps.stop().items():
                log.warning("GPU %s keeps its compute mode and its MPS server: %s", uuid, why)
        if self.state is not None:
            self.state.close()

    def liveness(self) -> dict[str, str]:
        """Whether the loops that keep the driver served run: "ok" or what died."""
        checks = {"lifecycle": "ok" if self._thread is not None and self._thread.is_alive()
                  else "the lifecycle loop is not running"}
        if self.inventory is not None and self.inventory.gpus:
            alive = self.monitor is not None and self.monitor.alive()
            checks["nvml-events"] = "ok" if alive else "the health monitor (NVML event loop) is not running"
        return checks

    def readiness(self) -> dict[str, str]:
        """Whether claims can be prepared here: GPUs discovered with one healthy, the driver registered with
        the kubelet and the node's ResourceSlices written ("ok" or what is missing)."""
        rows = self.health_snapshot()
        if self.inventory is None:
            inventory = "not discovered yet"
        elif not rows:
            inventory = "no devices to publish"
        elif not any(healthy for _pool, _name, healthy, _why in rows):
            inventory = f"no healthy device ({len(rows)} published, all tainted)"
        else:
            inventory = "ok"
        registered = self.plugin is not None and self.plugin.registered
        synced = self.publisher is not None and self.publisher.last_error == "" and self.publisher.generation > 0
        return {"inventory": inventory,
                f"kubelet:{DRIVER}": "ok" if registered else "not registered with the kubelet",
                "resourceslices": "ok" if synced else (self.publisher.last_error if self.publisher is not None
                                                       and self.publisher.last_error else "not published yet")}

    def status(self) -> dict[str, Any]:
        prepared = self.preparer.prepared() if self.preparer else {}
        return {
            "mode": "dra", "driver": DRIVER, "node": self.options.settings.node_name,
            "devices": len(self.table()), "registered": bool(self.plugin and self.plugin.registered),
            "claims": [{"namespace": c.namespace, "name": c.name, "uid": c.uid,
                        "devices": [d.device for d in c.devices]} for c in prepared.values()],
            "poolGeneration": self.publisher.generation if self.publisher else 0,
            "taints": {u: t.as_dict() for u, t in self.taints.items()},
        }
