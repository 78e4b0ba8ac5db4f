"""The node's MPS control daemons: started on demand, defaults set first, supervised, stopped with the node.

Both kubelet paths (device-plugin ``Allocate``, DRA ``NodePrepareResources``) ask :meth:`MpsManager.serve`
for a share's binding and never talk to MPS themselves. ``serve`` answers only once the share's daemon
runs, holds the share's defaults and answers ``get_server_list``; otherwise it raises :class:`MpsError`
and the caller refuses the container: a limit nothing enforces is never handed out.

A supervisor pass (:meth:`supervise`, every ``interval_s`` on its own thread) asks every daemon for its
server list; a daemon that does not answer is down: its GPUs are reported (``on_change``) so the node
marks the devices it serves Unhealthy with the reason, and it is started again with a capped exponential
back-off. Decisions are made from what each daemon answers now, never from event order.

Once a daemon is up, ``serve`` answers from what it knows (the binding is a pure function of the shape):
the daemon is asked once per shape, not at every ``Allocate``, and liveness is the supervisor's job, plus a
look at the daemon's control pipe, which it removes when it ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kubegpu.node.mps.control import SPEC_FILE, MpsControl, MpsError, read_spec
from kubegpu.node.mps.spec import Binding, DaemonSpec, binding

log = logging.getLogger(__name__)

MAX_DAEMONS = 128  # distinct share shapes on one node; more is refused, never unbounded


@dataclass
class _Entry:
    spec: DaemonSpec
    control: MpsControl
    up: bool = False
    reason: str = "not started"
    failures: int = 0
    next_try: float = 0.0
    restarts: int = 0
    server_uid: int | None = None  # strict enforcement: the server started with the daemon, for this user
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True, slots=True)
class DaemonState:
    """What status, metrics and health see of one daemon."""

    name: str
    kind: str
    gpus: tuple[str, ...]
    limits: str
    up: bool
    reason: str
    restarts: int


class MpsManager:
    """Owns every control daemon of the node. Thread-safe."""

    def __init__(self, binary: str | None, mps_root: str, *, timeout_s: float = 5.0, backoff_s: float = 1.0,
                 backoff_max_s: float = 60.0, interval_s: float = 5.0,
                 base_env: Mapping[str, str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.binary = binary
        self.mps_root = mps_root
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.interval_s = interval_s
        self.base_env = base_env
        self.clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._listeners: list[Callable[[], None]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ----- what callers use ---------------------------------------------------------------------

    @property
    def missing_reason(self) -> str:
        """Why no daemon can run at all ("" when the binary is there)."""
        return "" if self.binary else "nvidia-cuda-mps-control not found under the driver root"

    def add_listener(self, fn: Callable[[], None]) -> None:
        """``fn()`` is called after any daemon goes up or down (health, status and metrics re-read)."""
        self._listeners.append(fn)

    def serve(self, spec: DaemonSpec, order: Sequence[str] | None = None, *,
              server_uid: int | None = None) -> Binding:
        """The binding of ``spec``'s daemon, started and checked first. Raises MpsError. ``server_uid``: start
        the daemon's MPS server at once for that user (strict enforcement: the server holds the GPU's one
        context before any container can reach the GPU)."""
        entry = self._entry(spec, server_uid)
        if entry.up and entry.control.listening():
            return binding(spec, self.mps_root, order)
        with entry.lock:
            self._went_silent(entry)  # asked now, not at the last supervision pass
            if not entry.up:
                if entry.failures and self.clock() < entry.next_try:
                    raise MpsError(f"MPS daemon {spec.name} ({spec.describe()}) is down: {entry.reason}")
                self._bring_up(entry)
        return binding(spec, self.mps_root, order)

    def ensure(self, spec: DaemonSpec, server_uid: int | None = None) -> bool:
        """Start ``spec``'s daemon if it is not up (the eager path for replica resources); True when up."""
        try:
            self.serve(spec, server_uid=server_uid)
        except MpsError as exc:
            log.warning("%s", exc)
            return False
        return True

    def retire(self, name: str) -> None:
        """Quit daemon ``name`` and forget it (and its record: a restarted node does not start it again);
        strict enforcement does this when its GPU holds no more shares, before the GPU's mode goes back."""
        with self._lock:
            e = self._entries.pop(name, None)
        if e is None:
            return
        with e.lock:
            if e.up:
                e.control.quit()
            e.up = False
            e.control.forget()
        self._notify()

    def daemon_of(self, uuid: str) -> DaemonSpec | None:
        """The share daemon that serves GPU ``uuid``, if one is known (strict: at most one)."""
        with self._lock:
            return next((e.spec for e in self._entries.values() if e.spec.kind == "share" and uuid in e.spec.uuids),
                        None)

    def recover(self, gpus: Iterable[str], server_uid: int | None = None) -> int:
        """Start again every daemon recorded under the MPS root whose GPUs are all in ``gpus`` (a node daemon
        restart ends them; containers the kubelet already admitted still hold their pipe). Returns how many
        answer. A record that cannot be read is logged and skipped."""
        have = set(gpus)
        up = 0
        root = Path(self.mps_root)
        for path in sorted(root.glob(f"*/{SPEC_FILE}")) if root.is_dir() else []:
            try:
                spec = read_spec(path)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("MPS: skipping %s: %s", path, exc)
                continue
            if not set(spec.uuids) <= have:
                log.info("MPS: not restarting %s: its GPUs are not all on this node now", spec.name)
                continue
            up += self.ensure(spec, server_uid if spec.kind == "share" else None)
        return up

    def states(self) -> list[DaemonState]:
        with self._lock:
            entries = list(self._entries.values())
        return [DaemonState(e.spec.name, e.spec.kind, e.spec.uuids, e.spec.describe(), e.up, e.reason, e.restarts)
                for e in entries]

    def down(self) -> dict[str, tuple[DaemonState, ...]]:
        """GPU UUID -> the daemons on it that are down (with their reasons)."""
        out: dict[str, list[DaemonState]] = {}
        for s in self.states():
            if not s.up:
                for u in s.gpus:
                    out.setdefault(u, []).append(s)
        return {u: tuple(v) for u, v in out.items()}

    # ----- supervision --------------------------------------------------------------------------

    def supervise(self) -> None:
        """One pass: check every daemon; restart those that are down and due."""
        with self._lock:
            entries = list(self._entries.values())
        changed = False
        for e in entries:
            with e.lock:
                was = e.up
                if self._went_silent(e):
                    log.warning("MPS daemon %s: %s; restarting", e.spec.name, e.reason)
                if not e.up and self.clock() >= e.next_try:
                    try:
                        self._bring_up(e)
                        e.restarts += 1
                    except MpsError:
                        pass
                changed |= was != e.up
        if changed:
            self._notify()

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kubegpu-mps-supervisor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.supervise()
            except Exception:
                log.exception("MPS supervision pass failed; retrying")

    def stop(self, keep: Iterable[str] = ()) -> None:
        """Stop supervising and quit every daemon (their servers end once their clients have), but those on
        GPUs in ``keep``: strict enforcement keeps a GPU's server while its shares run, so the server still
        holds the exclusive GPU's one context and the next node daemon adopts it (:meth:`recover`)."""
        kept = set(keep)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s + 2)
            self._thread = None
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
        for e in entries:
            with e.lock:
                if e.up and not kept & set(e.spec.uuids):
                    e.control.quit()
                e.up = False

    # ----- internals ----------------------------------------------------------------------------

    def _entry(self, spec: DaemonSpec, server_uid: int | None = None) -> _Entry:
        with self._lock:
            e = self._entries.get(spec.name)
            if e is not None:
                if e.spec != spec:  # a name is a hash of the shape: a clash is a bug, never served
                    raise MpsError(f"MPS daemon {spec.name} already serves {e.spec.describe()}, "
                                   f"not {spec.describe()}")
                return e
            if self.binary is None:
                raise MpsError(f"cannot enforce {spec.describe()}: {self.missing_reason}")
            if len(self._entries) >= MAX_DAEMONS:
                raise MpsError(f"this node already runs {MAX_DAEMONS} MPS daemons (one per share shape); "
                               f"refusing a new shape {spec.describe()}")
            e = _Entry(spec, MpsControl(self.binary, self.mps_root, spec, timeout_s=self.timeout_s,
                                        base_env=self.base_env), server_uid=server_uid)
            self._entries[spec.name] = e
            return e

    def _went_silent(self, e: _Entry) -> bool:
        """Mark a daemon that was up and no longer answers as down, due for a restart now. Caller holds
        ``e.lock``. True when it just went down."""
        if not e.up or e.control.answers():
            return False
        e.up, e.failures, e.next_try = False, 0, self.clock()
        e.reason = "the control daemon stopped answering get_server_list"
        return True

    def _bring_up(self, e: _Entry) -> None:
        """Start, set the defaults, verify them and the server list. Caller holds ``e.lock``."""
        try:
            e.control.start()
            e.control.set_defaults()
            wrong = e.control.check_defaults()
            if wrong:
                raise MpsError(f"MPS daemon {e.spec.name} holds {wrong}")
            if e.server_uid is not None and not e.control.server_list():
                e.control.command(f"start_server -uid {e.server_uid}")
                if not e.control.server_list():
                    raise MpsError(f"MPS daemon {e.spec.name}: its server did not start for user {e.server_uid}")
            else:
                e.control.server_list()
        except MpsError as exc:
            e.up, e.reason = False, str(exc)
            e.failures += 1
            delay = min(self.backoff_max_s, self.backoff_s * 2 ** min(e.failures - 1, 10))
            e.next_try = self.clock() + delay
            log.warning("MPS daemon %s: %s; next try in %.1fs", e.spec.name, exc, delay)
            self._notify()
            raise
        e.up, e.reason, e.failures = True, "", 0
        self._notify()

    def _notify(self) -> None:
        for fn in list(self._listeners):
            try:
                fn()
            except Exception:  # health and metrics listeners must never break supervision
                log.exception("MPS listener failed")
