"""The fake inventory backend: GPUs from a topology file, faults on demand.

It implements :class:`~kubegpu.inventory.base.InventoryBackend` exactly as the NVML backend
does, so the node daemon, its tests, the demo and the benchmarks run on any machine. Faults
come from the file's ``faults:`` list (``at`` seconds after the backend was created) or from
the methods below, and drive the same health paths a real driver would:

- ``inject_xid(gpu, xid, gi=None, ci=None)``: one Xid event (``gi``/``ci`` pick a MIG device);
- ``fall_off_bus(gpu)``: Xid 79, then every probe fails and discovery shows the GPU unhealthy,
  until ``recover(gpu)``;
- ``fail_probe(gpu, times=None)``: probes fail (``times`` times, or until ``recover``);
- ``fail_discovery(times=1)``: the next discoveries raise :class:`InventoryError`;
- ``fail_wait(message)``: the next wait returns an unattributed event (``uuid=None``), as
  NVML's non-timeout wait errors do in the NVML backend.

File fault kinds map one to one: ``xid``, ``lost``, ``recover``, ``probe-fail``,
``discover-error``, ``wait-error``. ``gpu`` is an index or a GPU/MIG UUID everywhere.

Compute modes (``compute_mode`` / ``set_compute_mode``, as NVML's) live in a
:class:`~kubegpu_standins.fake_driver.FakeDriverState` directory when one is given, so the stand-in MPS
control and its clients see and obey them as the driver's; otherwise in memory.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from kubegpu.inventory.base import HealthEvent, InventoryError
from kubegpu.inventory.compute_modes import DEFAULT, MODES
from kubegpu.inventory.topology import Fault, Topology, load_topology
from kubegpu.model.inventory import NodeInventory

if TYPE_CHECKING:
    from kubegpu_standins.fake_driver import FakeDriverState

XID_FALLEN_OFF_BUS = 79


class FakeBackend:
    """A topology file served as if NVML had discovered it."""

    def __init__(self, topology: Topology | str | Path, node_name: str | None = None,
                 clock: Callable[[], float] = time.monotonic, driver_state: str | Path | None = None) -> None:
        """``topology``: a shipped name, a file path, or a parsed Topology. ``node_name`` names the
        node; from a name or path it also seeds the derived UUIDs (distinct nodes, distinct GPUs),
        for a parsed Topology it only renames. ``clock`` is the time base of scheduled faults.
        ``driver_state``: the directory compute modes and contexts are shared in (see the module)."""
        if not isinstance(topology, Topology):
            topology = load_topology(topology, node_name=node_name)
        elif node_name is not None and node_name != topology.inventory.name:
            topology = replace(topology, inventory=replace(topology.inventory, name=node_name))
        self._inventory = topology.inventory
        self._clock = clock
        self._start = clock()
        self._cond = threading.Condition()
        self._events: deque[HealthEvent] = deque()
        self._schedule: list[tuple[float, int, Fault]] = []
        self._seq = itertools.count()
        self._lost: set[str] = set()
        self._probe_failures: dict[str, int | None] = {}
        self._discover_failures: list[str] = []
        self._closed = False
        self.driver: FakeDriverState | None = None
        if driver_state is not None:
            from kubegpu_standins.fake_driver import FakeDriverState as Driver

            self.driver = Driver(driver_state)
        self._modes: dict[str, str] = {}
        self.delivered: list[tuple[float, HealthEvent]] = []  # (elapsed s, event), for tests and demos
        for fault in topology.faults:
            if fault.gpu is not None:
                self._resolve(fault.gpu, fault.gi, fault.ci)  # a bad reference fails now, not mid-run
            self.schedule(fault)

    # --- InventoryBackend -------------------------------------------------------------------

    def discover(self) -> NodeInventory:
        with self._cond:
            self._fire_due()
            if self._closed:
                raise InventoryError("fake backend is closed")
            if self._discover_failures:
                message = self._discover_failures.pop(0)
                raise InventoryError(f"NVML error during discovery: {message}")
            gpus = tuple(
                replace(g, healthy=False,
                        mig_devices=tuple(replace(m, healthy=False) for m in g.mig_devices))
                if g.uuid in self._lost else g
                for g in self._inventory.gpus
            )
            return replace(self._inventory, gpus=gpus)

    def wait_event(self, timeout_s: float) -> HealthEvent | None:
        deadline = self._clock() + max(0.0, timeout_s)
        with self._cond:
            while True:
                self._fire_due()
                if self._events:
                    event = self._events.popleft()
                    self.delivered.append((self.elapsed(), event))
                    return event
                now = self._clock()
                if self._closed or now >= deadline:
                    return None
                wake = deadline
                if self._schedule:
                    wake = min(wake, self._start + self._schedule[0][0])
                self._cond.wait(max(0.0, wake - now))

    def probe(self, uuid: str) -> bool:
        with self._cond:
            self._fire_due()
            gpu_uuid = self._gpu_of(uuid)
            if gpu_uuid is None or gpu_uuid in self._lost:
                return False
            for key in (uuid, gpu_uuid):
                if key in self._probe_failures:
                    left = self._probe_failures[key]
                    if left is None:
                        return False
                    if left <= 1:
                        del self._probe_failures[key]
                    else:
                        self._probe_failures[key] = left - 1
                    return False
            return True

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # --- compute modes (NVML's nvmlDeviceGetComputeMode / nvmlDeviceSetComputeMode) ------------

    def compute_mode(self, uuid: str) -> str:
        self._known(uuid)
        return self.driver.mode(uuid) if self.driver is not None else self._modes.get(uuid, DEFAULT)

    def set_compute_mode(self, uuid: str, mode: str) -> None:
        self._known(uuid)
        if mode not in MODES:
            raise InventoryError(f"NVML failed to set compute mode {mode!r} on {uuid}: Invalid Argument")
        if self.driver is not None:
            self.driver.set_mode(uuid, mode)
        else:
            self._modes[uuid] = mode

    def _known(self, uuid: str) -> None:
        if not any(g.uuid == uuid for g in self._inventory.gpus):
            raise InventoryError(f"NVML has no GPU {uuid} on {self._inventory.name}: Not Found")

    # --- fault injection ---------------------------------------------------------------------

    def elapsed(self) -> float:
        """Seconds since the backend was created (the time base of ``at``)."""
        return self._clock() - self._start

    def schedule(self, fault: Fault) -> None:
        """Run ``fault`` at ``fault.at`` seconds after creation (at once if that has passed)."""
        with self._cond:
            heapq.heappush(self._schedule, (fault.at, next(self._seq), fault))
            self._cond.notify_all()

    def inject_xid(self, gpu: int | str, xid: int, gi: int | None = None, ci: int | None = None,
                   message: str = "") -> HealthEvent:
        """Queue one Xid event now; returns the event the next wait will see."""
        uuid, gi, ci = self._resolve(gpu, gi, ci)
        event = HealthEvent(uuid=uuid, xid=xid, gi=gi, ci=ci, message=message or f"injected Xid {xid}")
        self._push(event)
        return event

    def fall_off_bus(self, gpu: int | str) -> None:
        """The GPU is lost: Xid 79 now, probes fail and discovery marks it unhealthy until recover."""
        uuid, _, _ = self._resolve(gpu, None, None)
        with self._cond:
            self._lost.add(uuid)
        self._push(HealthEvent(uuid=uuid, xid=XID_FALLEN_OFF_BUS, message="GPU has fallen off the bus"))

    def recover(self, gpu: int | str) -> None:
        """The GPU (or MIG device) answers again: clears lost and probe failures."""
        uuid, _, _ = self._resolve(gpu, None, None)
        with self._cond:
            self._lost.discard(uuid)
            self._probe_failures.pop(uuid, None)
            parent = self._gpu_of(uuid)
            if parent is not None:
                self._lost.discard(parent)
                self._probe_failures.pop(parent, None)

    def fail_probe(self, gpu: int | str, times: int | None = None) -> None:
        """Probes of this device fail ``times`` times (``None``: until :meth:`recover`)."""
        uuid, _, _ = self._resolve(gpu, None, None)
        with self._cond:
            self._probe_failures[uuid] = times

    def fail_discovery(self, times: int = 1, message: str = "Unknown Error (injected)") -> None:
        """The next ``times`` discoveries raise InventoryError."""
        with self._cond:
            self._discover_failures.extend([message] * times)

    def fail_wait(self, message: str = "Unknown Error (injected)") -> None:
        """The next wait returns an event for every device, as a failed NVML wait does."""
        self._push(HealthEvent(uuid=None, xid=0, message=f"NVML event wait failed: {message}"))

    # --- internals ---------------------------------------------------------------------------

    def _push(self, event: HealthEvent) -> None:
        with self._cond:
            self._events.append(event)
            self._cond.notify_all()

    def _fire_due(self) -> None:
        """Apply scheduled faults whose time has come (caller holds the lock)."""
        now = self.elapsed()
        while self._schedule and self._schedule[0][0] <= now:
            _, _, fault = heapq.heappop(self._schedule)
            self._apply(fault)

    def _apply(self, f: Fault) -> None:
        # Runs under the (re-entrant by design: Condition wraps an RLock) lock.
        gpu: int | str = -1 if f.gpu is None else f.gpu  # the topology loader requires a GPU for these kinds
        if f.kind == "xid":
            self.inject_xid(gpu, f.xid, f.gi, f.ci, f.message)
        elif f.kind == "lost":
            self.fall_off_bus(gpu)
        elif f.kind == "recover":
            self.recover(gpu)
        elif f.kind == "probe-fail":
            self.fail_probe(gpu, f.times)
        elif f.kind == "discover-error":
            self.fail_discovery(f.times or 1, f.message or "Unknown Error (scheduled)")
        elif f.kind == "wait-error":
            self.fail_wait(f.message or "Unknown Error (scheduled)")

    def _gpu_of(self, uuid: str) -> str | None:
        for g in self._inventory.gpus:
            if g.uuid == uuid:
                return g.uuid
            if any(m.uuid == uuid for m in g.mig_devices):
                return g.uuid
        return None

    def _resolve(self, ref: int | str | None, gi: int | None,
                 ci: int | None) -> tuple[str, int | None, int | None]:
        """A GPU index or GPU/MIG UUID (+ optional gi/ci) -> (device uuid, gi, ci)."""
        gpus = self._inventory.gpus
        if ref is None:
            raise ValueError("a GPU index or uuid is needed")
        if isinstance(ref, int) and not isinstance(ref, bool):
            match = [g for g in gpus if g.index == ref]
            if not match:
                raise ValueError(f"no GPU with index {ref} on {self._inventory.name}")
            gpu = match[0]
        else:
            for g in gpus:
                for m in g.mig_devices:
                    if m.uuid == ref:
                        return m.uuid, m.gi, m.ci
            match = [g for g in gpus if g.uuid == ref]
            if not match:
                raise ValueError(f"no GPU or MIG device {ref!r} on {self._inventory.name}")
            gpu = match[0]
        if gi is None and ci is None:
            return gpu.uuid, None, None
        for m in gpu.mig_devices:
            if m.gi == gi and (ci is None or m.ci == ci):
                return m.uuid, m.gi, m.ci
        raise ValueError(f"GPU {gpu.index} ({gpu.uuid}) has no MIG device with gi={gi} ci={ci}")
