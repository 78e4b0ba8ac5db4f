"""Whether a node's daemon serves its GPUs now: the Node annotation the daemon writes, read by the extender.

A node daemon that stops (SIGTERM: a DaemonSet rolling update) closes its plugins; the kubelet then marks
every device of theirs Unhealthy and rejects any pod it admits before the next daemon has registered
(``UnexpectedAdmissionError``). So the daemon says so first, ``{"state": "stopping", "boot": <its id>}``, and
the next one says ``{"state": "serving", "boot": <its id>}`` only once the kubelet has its plugins and their
device lists; the extender places nothing there in between (docs/handoff.md, "Restarts"). A node without the
annotation (an older daemon, a DRA-only node) is taken as serving.

A daemon that crashed says nothing: the kubelet's own word is used instead, the Node's ``allocatable``, which
it sets to the healthy device count of each plugin resource at its next status update
(:func:`kubelet_lost_devices`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

NODE_DAEMON: Final = "kubegpu.io/node-daemon"
SERVING: Final = "serving"
STOPPING: Final = "stopping"


@dataclass(frozen=True, slots=True)
class DaemonState:
    state: str  # SERVING or STOPPING
    boot: str  # the daemon process's id: a new one is a new daemon
    since: float = 0.0  # wall-clock seconds when written

    def encode(self) -> str:
        return json.dumps({"state": self.state, "boot": self.boot, "since": round(self.since, 3)},
                          separators=(",", ":"))

    @property
    def serving(self) -> bool:
        return self.state == SERVING


def new_boot() -> str:
    """An id for one daemon process."""
    return uuid.uuid4().hex


def announce(state: str, boot: str) -> dict[str, Any]:
    """The Node patch that says ``state`` for daemon ``boot``."""
    return {"metadata": {"annotations": {NODE_DAEMON: DaemonState(state, boot, time.time()).encode()}}}


def decode(value: str | None) -> DaemonState | None:
    """The annotation's value; None when absent or unreadable (the node is then taken as serving)."""
    if not value:
        return None
    try:
        raw = json.loads(value)
        return DaemonState(str(raw["state"]), str(raw.get("boot", "")), float(raw.get("since", 0.0)))
    except (ValueError, TypeError, KeyError):
        return None


def kubelet_lost_devices(status: Mapping[str, Any] | None, resources: Iterable[str]) -> list[str]:
    """The node's plugin resources (``resources``: those its daemon serves) the kubelet reports with capacity and
    not one healthy device, when that is all of them: what a daemon that died leaves (every stream ended).
    Empty when any of them has a healthy device (one resource alone unhealthy is a health matter, not a
    daemon gone) or when the status says nothing of them."""
    capacity = (status or {}).get("capacity") or {}
    allocatable = (status or {}).get("allocatable") or {}
    named = [r for r in resources if _count(capacity.get(r)) > 0]
    if not named or any(_count(allocatable.get(r)) > 0 for r in named):
        return []
    return named


def _count(value: object) -> int:
    try:
        return int(str(value))
    except ValueError:
        return 0
