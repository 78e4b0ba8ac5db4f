"""The node daemon's HTTP endpoint: /healthz and /readyz tell the truth about kubelet registration and the
NVML / inventory state (not the metrics page), GPU metrics carry node, index and model, a taken metrics
port is one clear line and a non-zero exit, and the CLI's default port is the one the manifests expose."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kubegpu.node.metrics import MetricsAddressError, NodeMetrics, serve
from kubegpu_standins.kubelet import StandinKubelet

GPU = "nvidia.com/gpu"


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture
def served(make_daemon: Any) -> Any:
    servers = []

    def start(daemon: Any) -> int:
        server, _ = serve(daemon.metrics, 0, "127.0.0.1", daemon)
        servers.append(server)
        return server.server_port

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def test_readyz_waits_for_kubelet_registration(make_daemon: Any, sockdir: Path, served: Any) -> None:
    # No kubelet yet: the plugins serve, but nothing is registered.
    d, _ = make_daemon("t4x4")
    port = served(d)
    code, body = get(port, "/readyz")
    assert code == 503
    checks = json.loads(body)["checks"]
    assert checks["inventory"] == "ok" and checks[f"kubelet:{GPU}"] == "not registered with the kubelet"
    code, body = get(port, "/healthz")  # alive all the same: the daemon keeps trying to register
    assert code == 200 and json.loads(body) == {"ok": True, "checks": {"lifecycle": "ok", "nvml-events": "ok"}}
    kubelet = StandinKubelet(sockdir / "dp")
    kubelet.start()
    try:
        assert kubelet.wait_registered(GPU, timeout_s=10)
        assert kubelet.wait_for(lambda: get(port, "/readyz")[0] == 200, 10), get(port, "/readyz")
        assert json.loads(get(port, "/readyz")[1])["checks"] == {"inventory": "ok", f"kubelet:{GPU}": "ok"}
    finally:
        kubelet.stop()


def test_readyz_names_a_failed_inventory(make_daemon: Any, served: Any) -> None:
    d, backend = make_daemon("t4x4", start=False, flags={"fail-on-init-error": "false"})
    backend.fail_discovery(message="Driver Not Loaded")
    port = served(d)
    d.start()  # waits (serves nothing) instead of failing
    try:
        code, body = get(port, "/readyz")
        assert code == 503
        assert "Driver Not Loaded" in json.loads(body)["checks"]["inventory"]
        assert get(port, "/healthz")[0] == 200  # waiting is not dying: no restart loop
    finally:
        d.stop()


def test_healthz_fails_when_the_nvml_event_loop_dies(make_daemon: Any, served: Any) -> None:
    d, _ = make_daemon("t4x4")
    port = served(d)
    assert get(port, "/healthz")[0] == 200
    d.monitor.stop()
    code, body = get(port, "/healthz")
    assert code == 503
    assert json.loads(body)["checks"]["nvml-events"] == "the health monitor (NVML event loop) is not running"


def test_metrics_page_only_at_metrics_and_gpus_labelled(make_daemon: Any, served: Any) -> None:
    d, _ = make_daemon("a100-mig")
    port = served(d)
    code, text = get(port, "/metrics")
    assert code == 200 and "kubegpu_node_gpu_healthy{" in text
    assert get(port, "/nope")[0] == 404 and "kubegpu_node" not in get(port, "/healthz")[1]
    inv = d.inventory
    g = next(g for g in inv.gpus if not g.mig_enabled)
    assert (f'kubegpu_node_gpu_healthy{{index="{g.index}",model="{g.model}",node="{inv.name}",'
            f'uuid="{g.uuid}"}} 1.0') in text
    mig_gpu = next(g for g in inv.gpus if g.mig_enabled)
    m = mig_gpu.mig_devices[0]
    assert (f'index="{mig_gpu.index}:{m.index}",model="{mig_gpu.model} MIG {m.profile}"') in text


def test_a_taken_port_is_named() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(MetricsAddressError, match=rf"cannot serve metrics on 127\.0\.0\.1:{port}: "
                                                      "address already in use"):
            serve(NodeMetrics(), port, "127.0.0.1")


def test_node_cli_exits_with_one_line_when_the_metrics_port_is_taken(sockdir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-c", "from kubegpu.cli.main import main; main()", "node", "--standalone",
             "--inventory", "t4x4", "--device-plugin-dir", str(sockdir / "dp"), "--cdi-spec-dir",
             str(sockdir / "cdi"), "--metrics-address", f"127.0.0.1:{port}", "--run-for", "30"],
            capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1, proc.stderr
    assert errors[0].endswith(f"cannot serve metrics on 127.0.0.1:{port}: address already in use (set "
                              "--metrics-address, or 0 to serve no metrics)"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_default_metrics_port_is_the_manifests() -> None:
    from kubegpu.install.values import Values
    from kubegpu.node.config import load_config

    assert load_config(flags={}, env={}).kubegpu.metrics_address == f":{Values().metrics_port}"
