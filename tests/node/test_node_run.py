"""The node's one lifecycle (kubegpu.node.lifecycle.run), as both kubelet paths go through it: start, stop,
reload (refused or fatal), the exit codes, and the probes it serves from the path's own checks."""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import urllib.error
import urllib.request
from typing import Any

import pytest
from polling import until

from kubegpu.node.config import ConfigError
from kubegpu.node.lifecycle import EXIT_INIT, EXIT_OK, Controls, DaemonInitError, ReloadRefused, run
from kubegpu.node.metrics import NodeMetrics


class FakePath:
    """A kubelet path that records what the lifecycle asks of it."""

    def __init__(self, start_error: Exception | None = None, reload_error: Exception | None = None) -> None:
        self.calls: list[str] = []
        self.start_error, self.reload_error = start_error, reload_error
        self.started, self.reloaded = threading.Event(), threading.Event()

    def start(self) -> None:
        self.calls.append("start")
        if self.start_error is not None:
            raise self.start_error
        self.started.set()

    def stop(self) -> None:
        self.calls.append("stop")

    def reload(self) -> None:
        self.calls.append("reload")
        self.reloaded.set()
        if self.reload_error is not None:
            raise self.reload_error

    def status(self) -> dict[str, Any]:
        return {}

    def liveness(self) -> dict[str, str]:
        return {"lifecycle": "ok"}

    def readiness(self) -> dict[str, str]:
        return {"kubelet:fake": "ok" if self.started.is_set() else "not registered with the kubelet"}


def _in_thread(path: FakePath, controls: Controls, **kwargs: Any) -> tuple[threading.Thread, list[int]]:
    codes: list[int] = []
    t = threading.Thread(target=lambda: codes.append(run(path, controls, **kwargs)), daemon=True)
    t.start()
    return t, codes


def test_a_failed_start_exits_init_and_is_not_stopped_again() -> None:
    path = FakePath(start_error=DaemonInitError("no devices found (failOnInitError is set)"))
    assert run(path, Controls()) == EXIT_INIT
    assert path.calls == ["start"]  # start stopped what it had started


def test_stop_ends_the_loop_and_stops_the_path() -> None:
    path, controls = FakePath(), Controls()
    t, codes = _in_thread(path, controls)
    assert path.started.wait(30)
    controls.ask_stop()
    t.join(30)
    assert codes == [EXIT_OK] and path.calls == ["start", "stop"]


@pytest.mark.parametrize("error", [ConfigError("--mig-strategy: 'odd'"), ReloadRefused("rediscovery failed")])
def test_a_refused_reload_keeps_serving(error: Exception) -> None:
    path, controls = FakePath(reload_error=error), Controls()
    t, codes = _in_thread(path, controls)
    assert path.started.wait(30)
    controls.ask_reload()
    assert path.reloaded.wait(30)
    controls.ask_stop()
    t.join(30)
    assert codes == [EXIT_OK] and path.calls == ["start", "reload", "stop"]


def test_a_reload_that_could_not_restart_exits_init() -> None:
    path, controls = FakePath(reload_error=DaemonInitError("initialisation failed")), Controls()
    t, codes = _in_thread(path, controls)
    assert path.started.wait(30)
    controls.ask_reload()
    t.join(30)
    assert codes == [EXIT_INIT] and path.calls == ["start", "reload", "stop"]


def _get(port: int, path: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return int(r.status), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return int(e.code), json.loads(e.read())


def test_the_probes_are_the_paths_checks_over_a_real_socket(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kubegpu.node")
    gate = threading.Event()
    path, controls = FakePath(), Controls()
    start = path.start

    def held_start() -> None:  # the endpoint is up before the path has started: not ready yet
        assert gate.wait(30)
        start()

    path.start = held_start  # type: ignore[method-assign]
    t, codes = _in_thread(path, controls, metrics=NodeMetrics(), metrics_address="127.0.0.1:0")
    try:
        pattern = r"metrics on http://127\.0\.0\.1:(\d+)/"
        assert until(lambda: re.search(pattern, caplog.text), 30), caplog.text
        found = re.search(pattern, caplog.text)
        assert found is not None
        port = int(found.group(1))
        assert _get(port, "/readyz") == (503, {"ok": False, "checks": {
            "kubelet:fake": "not registered with the kubelet"}})
        assert _get(port, "/healthz") == (200, {"ok": True, "checks": {"lifecycle": "ok"}})
        gate.set()
        assert path.started.wait(30)
        assert _get(port, "/readyz") == (200, {"ok": True, "checks": {"kubelet:fake": "ok"}})
    finally:
        gate.set()
        controls.ask_stop()
        t.join(30)
    assert codes == [EXIT_OK]
    with pytest.raises(OSError):  # the endpoint went with the path
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_an_address_that_cannot_be_served_exits_init_before_start() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        path = FakePath()
        code = run(path, Controls(), metrics=NodeMetrics(), metrics_address=f"127.0.0.1:{taken.getsockname()[1]}")
    assert code == EXIT_INIT and path.calls == []
