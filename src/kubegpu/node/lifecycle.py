"""One lifecycle for both kubelet paths: start, serve until told to stop, reload on demand, stop.

A node serves its GPUs either through device plugins (:class:`kubegpu.node.daemon.NodeDaemon`) or as a DRA
driver (:class:`kubegpu.node.dra.daemon.DraDaemon`). What a node process does around either is the same, so
it is written once here: the metrics endpoint with its probes (``/metrics``, ``/healthz``, ``/readyz``) comes
up first, so a starting node already answers its probes; the path starts; the long-lived objects built at
start are frozen out of the cyclic collector (a full collection would stall ``Allocate`` or
``NodePrepareResources``); the loop then waits for a stop or a reload (SIGTERM / SIGINT, SIGHUP, the node's
config label) and finally stops the path and the endpoint. The exit codes are the node's contract with its
DaemonSet and are defined here only.
"""

from __future__ import annotations

import gc
import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

log = logging.getLogger("kubegpu.node")

EXIT_OK: Final = 0  # stopped when asked
EXIT_INIT: Final = 1  # could not start (failOnInitError), or the metrics address cannot be served
EXIT_CONFIG: Final = 2  # the command line or the configuration is wrong

# How often the loop looks at the clock for run_for; stop and reload wake it at once.
_TICK_S: Final = 0.5


class DaemonInitError(RuntimeError):
    """Start (or a reload's restart) failed and ``failOnInitError`` is set: the process exits with EXIT_INIT."""


class ReloadRefused(RuntimeError):
    """A reload that cannot be applied: the path keeps serving what it served (the message says why)."""


class KubeletPath(Protocol):
    """What the lifecycle drives: the device-plugin daemon or the DRA driver.

    ``start`` raises :class:`DaemonInitError` when the node cannot be served, having stopped whatever it had
    started; ``stop`` ends everything (sockets removed, streams ended); ``reload`` raises
    :class:`ReloadRefused` (or a :class:`~kubegpu.node.config.ConfigError`) to keep serving as before, and
    :class:`DaemonInitError` when what ran is gone and could not be brought back. ``liveness`` and
    ``readiness`` name each check ("ok" or what is wrong), for ``/healthz`` and ``/readyz``."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def reload(self) -> None: ...

    def status(self) -> dict[str, Any]: ...

    def liveness(self) -> dict[str, str]: ...

    def readiness(self) -> dict[str, str]: ...


@dataclass
class Controls:
    """The two requests a running node takes: stop and reload. Signals set them, and so may anything else
    (the config-label watch asks for a reload); each also wakes the loop at once."""

    stop: threading.Event = field(default_factory=threading.Event)
    reload: threading.Event = field(default_factory=threading.Event)
    _wake: threading.Event = field(default_factory=threading.Event)

    def ask_stop(self) -> None:
        self.stop.set()
        self._wake.set()

    def ask_reload(self) -> None:
        self.reload.set()
        self._wake.set()

    def install_signals(self) -> None:
        """SIGTERM / SIGINT stop, SIGHUP reloads (as NVIDIA's plugin; only the main thread may do this)."""
        signal.signal(signal.SIGTERM, lambda *_: self.ask_stop())
        signal.signal(signal.SIGINT, lambda *_: self.ask_stop())
        signal.signal(signal.SIGHUP, lambda *_: self.ask_reload())

    def wait(self, timeout_s: float) -> None:
        self._wake.wait(timeout_s)
        self._wake.clear()


def _reload(path: KubeletPath) -> int | None:
    """Apply one reload; an exit code when the node must stop."""
    from kubegpu.node.config import ConfigError

    try:
        path.reload()
    except (ConfigError, ReloadRefused) as exc:
        log.error("reload refused, keeping what is served: %s", exc)
    except DaemonInitError as exc:
        log.error("%s", exc)
        return EXIT_INIT
    return None


def run(path: KubeletPath, controls: Controls, *, metrics: Any = None, metrics_address: str = "",
        run_for: float | None = None) -> int:
    """Serve ``path`` until ``controls`` asks to stop (or ``run_for`` seconds passed); the exit code.

    ``metrics`` (a :class:`~kubegpu.node.metrics.NodeMetrics`) is served on ``metrics_address`` with the
    path's probes for as long as the path runs; an address that cannot be served is EXIT_INIT before the
    path starts."""
    from kubegpu.node.metrics import MetricsAddressError, serve_address

    try:
        server = serve_address(metrics_address, metrics, path) if metrics is not None else None
    except MetricsAddressError as exc:
        log.error("%s (set --metrics-address, or 0 to serve no metrics)", exc)
        return EXIT_INIT
    deadline = time.monotonic() + run_for if run_for else None
    try:
        try:
            path.start()
        except DaemonInitError as exc:  # start stopped what it had started
            log.error("%s", exc)
            return EXIT_INIT
        try:
            return _serve(path, controls, deadline)
        finally:
            path.stop()
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()


def _serve(path: KubeletPath, controls: Controls, deadline: float | None) -> int:
    # What start built lives as long as the process: out of the cyclic collector, a full collection no
    # longer walks it (and stalls the calls the kubelet is waiting on).
    gc.collect()
    gc.freeze()
    while not controls.stop.is_set():
        if controls.reload.is_set():
            controls.reload.clear()
            code = _reload(path)
            if code is not None:
                return code
        if deadline is not None and time.monotonic() >= deadline:
            break
        controls.wait(_TICK_S if deadline is None else max(0.0, min(_TICK_S, deadline - time.monotonic())))
    return EXIT_OK
