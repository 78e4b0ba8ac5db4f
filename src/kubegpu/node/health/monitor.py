"""GPU health: which Xids count (NVIDIA's rules), and the monitor thread that applies them.

The monitor reads :meth:`InventoryBackend.wait_event`; a non-ignored Xid marks the GPU (or
the MIG device it names) Unhealthy in :class:`HealthState`, which wakes every ListAndWatch
stream at once. Unlike NVIDIA's plugin it also recovers: a device quiet for
``recovery_interval_s`` that answers :meth:`InventoryBackend.probe` becomes Healthy again.

Xid rules (contracts.md §6.3): 13, 31, 43, 45, 68 and 109 are application errors and are
ignored; ``DP_DISABLE_HEALTHCHECKS`` = ``all`` / ``xids`` disables every Xid, or lists
extra Xids to ignore; ``DP_ENABLE_HEALTHCHECKS`` lists Xids to act on whatever the
disables say (``all`` there re-enables everything).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kubegpu.inventory.base import HealthEvent, InventoryBackend, InventoryError
from kubegpu.node.config import XidPolicy
from kubegpu.node.health.state import HealthState

log = logging.getLogger(__name__)

ENV_DISABLE = "DP_DISABLE_HEALTHCHECKS"
NOT_ATTRIBUTED = 0xFFFFFFFF  # NVML's gi/ci value for "not one MIG instance"


@dataclass
class HealthMonitor:
    """The thread that turns driver events into health changes, and recovers quiet devices."""

    backend: InventoryBackend
    state: HealthState
    policy: XidPolicy = field(default_factory=XidPolicy)
    wait_timeout_s: float = 0.5
    recovery_interval_s: float = 30.0  # <= 0 disables recovery
    on_xid: Callable[[int, str], None] | None = None  # metrics hook: (xid, uuid or "all")
    mig_placement: Mapping[str, tuple[int, int]] = field(default_factory=dict)  # MIG uuid -> (gi, ci)
    _thread: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _last_event: dict[str, float] = field(default_factory=dict)

    def start(self) -> None:
        if self.policy.checks_off:
            log.info("health checks disabled by %s", ENV_DISABLE)
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kubegpu-health", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            self._thread = None

    def _run(self) -> None:
        log.info("health monitor started (%s)", self.policy.describe())
        while not self._stop.is_set():
            try:
                event = self.backend.wait_event(self.wait_timeout_s)
            except InventoryError as exc:
                # NVIDIA: a wait error other than a timeout marks every device unhealthy.
                log.error("health: waiting for GPU events failed: %s; marking all devices unhealthy", exc)
                self._mark_all(f"event wait failed: {exc}")
                self._stop.wait(self.wait_timeout_s)
                event = None
            except Exception:
                log.exception("health: unexpected error while waiting for GPU events")
                self._stop.wait(self.wait_timeout_s)
                event = None
            if event is not None:
                self.handle(event)
            self.recover()

    def _mark_all(self, reason: str) -> None:
        now = time.monotonic()
        uuids = self.state.gpu_uuids()
        for u in uuids:
            self._last_event[u] = now
        self.state.set_health(uuids, False, reason)

    def handle(self, event: HealthEvent) -> list[str]:
        """Apply one driver event; returns the devices it marked unhealthy."""
        if self.policy.checks_off:
            return []
        if event.xid and self.policy.is_ignored(event.xid):
            log.info("health: ignoring Xid %d on %s (application error)", event.xid, event.uuid or "?")
            return []
        if self.on_xid is not None:
            self.on_xid(event.xid, event.uuid or "all")
        reason = f"Xid {event.xid}" + (f": {event.message}" if event.message else "")
        now = time.monotonic()
        if event.uuid is None:
            log.warning("health: %s not attributable to one device; marking all devices unhealthy", reason)
            self._mark_all(reason)
            return list(self.state.uuids())
        targets = self._targets(event)
        if not targets:
            log.info("health: ignoring event for unknown device %s", event.uuid)
            return []
        for t in targets:
            self._last_event[t] = now
            parent = self.state.parent(t)
            if parent is not None:
                self._last_event[parent] = now
        log.warning("health: %s on %s; marking %s unhealthy", reason, event.uuid, ",".join(targets))
        self.state.set_health(targets, False, reason)
        return targets

    def _targets(self, event: HealthEvent) -> list[str]:
        uuid = event.uuid
        assert uuid is not None
        known = set(self.state.uuids())
        if uuid not in known:
            return []
        kids = self.state.children(uuid)
        gi_ci_given = (event.gi is not None and event.ci is not None
                       and event.gi != NOT_ATTRIBUTED and event.ci != NOT_ATTRIBUTED)
        if kids and gi_ci_given:
            # A MIG event on the parent GPU: only the instance it names.
            match = [k for k in kids if self._gi_ci(k) == (event.gi, event.ci)]
            return match
        return [uuid]

    def _gi_ci(self, mig_uuid: str) -> tuple[int, int] | None:
        return self.mig_placement.get(mig_uuid)

    def recover(self) -> list[str]:
        """Mark healthy the unhealthy devices quiet for ``recovery_interval_s`` that answer a probe."""
        if self.recovery_interval_s <= 0:
            return []
        now = time.monotonic()
        recovered: list[str] = []
        for u in self.state.unhealthy():
            parent = self.state.parent(u)
            if parent is not None and not self.state.is_healthy(parent):
                continue  # recovers with its GPU
            last = self._last_event.setdefault(u, now)
            if now - last < self.recovery_interval_s:
                continue
            try:
                ok = self.backend.probe(u)
            except Exception as exc:
                log.info("health: probe of %s failed: %s", u, exc)
                ok = False
            if ok:
                log.info("health: %s quiet for %.1fs and answering; marking it healthy again",
                         u, now - last)
                recovered += self.state.set_health([u], True)
            else:
                self._last_event[u] = now  # probe failed: wait another interval
        return recovered
