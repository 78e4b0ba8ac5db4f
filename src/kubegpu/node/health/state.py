"""The node's live device health: one table every device plugin reads, one writer (the monitor).

ListAndWatch streams block on :meth:`HealthState.wait_changed` and re-send their full
device list whenever the version moves, so a health change reaches the kubelet at once.
Keys are device UUIDs: physical GPUs (``GPU-…``) and MIG devices (``MIG-…``).

Besides the GPUs' own health, a *scope* (one served resource) can hold devices back with a reason
(:meth:`HealthState.set_blocked`): MPS-enforced resources are Unhealthy on a GPU while the MPS daemon
that enforces them there is down, while the same GPU stays Healthy for the resources that need no daemon.
Each server reads its resource's :meth:`HealthState.view` through the :class:`HealthReader` interface;
one version counter covers both, so a stream wakes for either.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from kubegpu.model.inventory import NodeInventory

log = logging.getLogger(__name__)

Listener = Callable[[dict[str, bool]], None]


class HealthState:
    """Thread-safe health per device UUID, with a version counter and change listeners."""

    def __init__(self, inventory: NodeInventory) -> None:
        self._cond = threading.Condition()
        self._healthy: dict[str, bool] = {}
        self._children: dict[str, tuple[str, ...]] = {}
        self._parent: dict[str, str] = {}
        self._reason: dict[str, str] = {}
        self._blocked: dict[str, dict[str, str]] = {}  # scope -> uuid -> reason
        for g in inventory.gpus:
            self._healthy[g.uuid] = g.healthy
            kids = tuple(m.uuid for m in g.mig_devices)
            self._children[g.uuid] = kids
            for m in g.mig_devices:
                self._healthy[m.uuid] = m.healthy and g.healthy
                self._parent[m.uuid] = g.uuid
        self._version = 0
        self._wakes = 0
        self._closed = False
        self._listeners: list[Listener] = []

    @property
    def version(self) -> int:
        with self._cond:
            return self._version

    def uuids(self) -> tuple[str, ...]:
        with self._cond:
            return tuple(self._healthy)

    def gpu_uuids(self) -> tuple[str, ...]:
        with self._cond:
            return tuple(self._children)

    def children(self, uuid: str) -> tuple[str, ...]:
        return self._children.get(uuid, ())

    def parent(self, uuid: str) -> str | None:
        return self._parent.get(uuid)

    def is_healthy(self, uuid: str) -> bool:
        with self._cond:
            return self._healthy.get(uuid, False)

    def snapshot(self) -> dict[str, bool]:
        with self._cond:
            return dict(self._healthy)

    def reason(self, uuid: str) -> str:
        with self._cond:
            return self._reason.get(uuid, "")

    def unhealthy(self) -> tuple[str, ...]:
        with self._cond:
            return tuple(u for u, h in self._healthy.items() if not h)

    def add_listener(self, fn: Listener) -> None:
        with self._cond:
            self._listeners.append(fn)

    def set_health(self, uuids: Iterable[str], healthy: bool, reason: str = "") -> list[str]:
        """Set the health of these devices (a GPU carries its MIG devices along).

        Returns the UUIDs whose health actually changed; listeners and waiting streams are
        woken only when something changed."""
        changed: list[str] = []
        with self._cond:
            for u in uuids:
                if u not in self._healthy:
                    continue
                targets = [u, *self._children.get(u, ())]
                if healthy and u in self._parent and not self._healthy.get(self._parent[u], True):
                    # A MIG device cannot be healthier than its GPU.
                    continue
                for t in targets:
                    if self._healthy[t] != healthy:
                        self._healthy[t] = healthy
                        changed.append(t)
                    if healthy:
                        self._reason.pop(t, None)
                    else:
                        self._reason[t] = reason
            if changed:
                self._version += 1
                self._cond.notify_all()
            listeners = list(self._listeners)
            snap = dict(self._healthy)
        if changed:
            for fn in listeners:
                try:
                    fn(snap)
                except Exception:  # a listener (metrics, publisher) must never break health
                    log.exception("health listener failed")
        return changed

    def set_blocked(self, scope: str, blocked: Mapping[str, str]) -> bool:
        """Replace the devices ``scope`` holds back (uuid -> reason); True when that changed anything."""
        with self._cond:
            new = {u: r for u, r in blocked.items() if u in self._healthy}
            if self._blocked.get(scope, {}) == new:
                return False
            self._blocked[scope] = new
            self._version += 1
            self._cond.notify_all()
            listeners = list(self._listeners)
            snap = dict(self._healthy)
        for fn in listeners:
            try:
                fn(snap)
            except Exception:
                log.exception("health listener failed")
        return True

    def blocked(self, scope: str) -> dict[str, str]:
        with self._cond:
            return dict(self._blocked.get(scope, {}))

    def view(self, scope: str) -> HealthView:
        """This state as the resource ``scope`` sees it."""
        return HealthView(self, scope)

    def wait_changed(self, since: int, timeout_s: float) -> int:
        """Block until the version differs from ``since`` (or timeout / close); return the version."""
        with self._cond:
            wakes = self._wakes
            if self._version == since and not self._closed:
                self._cond.wait_for(lambda: self._version != since or self._closed or self._wakes != wakes,
                                    timeout=timeout_s)
            return self._version

    def wake(self) -> None:
        """Wake waiting streams without a change (a server is stopping and they should look)."""
        with self._cond:
            self._wakes += 1
            self._cond.notify_all()

    def close(self) -> None:
        """Wake every waiting stream so it can notice its server is stopping."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def apply(self, healthy: Mapping[str, bool]) -> None:
        """Bulk set (used when a reload keeps the previous health of known devices)."""
        for u, h in healthy.items():
            self.set_health([u], h, "carried over from before reload" if not h else "")


class HealthReader(Protocol):
    """What a device-plugin server reads of the node's health: its devices' health, the reason a device is
    held back, and the version to wait on for a change. It never writes health."""

    @property
    def version(self) -> int: ...

    def snapshot(self) -> dict[str, bool]: ...

    def is_healthy(self, uuid: str) -> bool: ...

    def reason(self, uuid: str) -> str: ...

    def wait_changed(self, since: int, timeout_s: float) -> int: ...

    def wake(self) -> None: ...


class HealthView:
    """One resource's reading of a :class:`HealthState` (a :class:`HealthReader`): a device is healthy when
    its GPU is and the resource does not hold it back."""

    def __init__(self, base: HealthState, scope: str) -> None:
        self._base = base
        self._scope = scope

    def _held(self, uuid: str) -> str:
        held = self._base.blocked(self._scope)
        parent = self._base.parent(uuid)
        return held.get(uuid) or (held.get(parent, "") if parent else "")

    @property
    def version(self) -> int:
        return self._base.version

    def is_healthy(self, uuid: str) -> bool:
        return self._base.is_healthy(uuid) and not self._held(uuid)

    def snapshot(self) -> dict[str, bool]:
        snap = self._base.snapshot()
        held = self._base.blocked(self._scope)
        return {u: h and u not in held and (self._base.parent(u) or "") not in held for u, h in snap.items()}

    def reason(self, uuid: str) -> str:
        return self._base.reason(uuid) or self._held(uuid)

    def wait_changed(self, since: int, timeout_s: float) -> int:
        return self._base.wait_changed(since, timeout_s)

    def wake(self) -> None:
        self._base.wake()
