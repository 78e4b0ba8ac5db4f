"""``kubegpu node --standalone`` as a real process: registers, reloads on SIGHUP, stops on SIGTERM,
serves metrics, and exits with the documented codes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kubegpu_standins.kubelet import StandinKubelet

GPU = "nvidia.com/gpu"
RUN = [sys.executable, "-c", "from kubegpu.cli.main import main; main()", "node"]


def _spawn(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen([*RUN, *args], stdout=subprocess.DEVNULL, stderr=log.open("wb"),
                            env={**os.environ, **(env or {})})


def _wait_log(log: Path, pattern: str, timeout_s: float = 10) -> re.Match[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = re.search(pattern, log.read_text(errors="replace"))
        if m:
            return m
        time.sleep(0.05)
    raise AssertionError(f"{pattern!r} not in log:\n{log.read_text(errors='replace')[-3000:]}")


def test_standalone_sighup_reload_and_sigterm_stop(kubelet: StandinKubelet, sockdir: Path) -> None:
    cfg = sockdir / "config.yaml"
    cfg.write_text("version: v1\nflags:\n  migStrategy: none\n")
    log = sockdir / "node.log"
    proc = _spawn(["--standalone", "--inventory", "t4x4", "--device-plugin-dir", str(kubelet.dir),
                   "--config-file", str(cfg), "--shared-slots", "0", "--cdi-spec-dir", str(sockdir / "cdi"),
                   "--metrics-address", "127.0.0.1:0", "--run-for", "60"], log)
    try:
        assert kubelet.wait_registered(GPU, timeout_s=15), log.read_text()
        assert kubelet.capacity(GPU) == 4
        port = int(_wait_log(log, r"metrics on http://127\.0\.0\.1:(\d+)/metrics").group(1))
        # The kubelet can stream before the daemon's Register call has returned and been counted, and the
        # health gauges are set after the registrations: poll for both.
        wanted = 'kubegpu_node_registrations_total{resource="nvidia.com/gpu"} 1.0'
        deadline = time.monotonic() + 10
        while True:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            if (wanted in text and text.count("kubegpu_node_gpu_healthy{") == 4) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert wanted in text
        assert text.count("kubegpu_node_gpu_healthy{") == 4

        # SIGHUP: the new config (time-slicing, renamed) is served without a restart of the process.
        cfg.write_text("version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n"
                       "    - name: nvidia.com/gpu\n      replicas: 3\n")
        proc.send_signal(signal.SIGHUP)
        assert kubelet.wait_registered("nvidia.com/gpu.shared", timeout_s=10), log.read_text()
        assert kubelet.capacity("nvidia.com/gpu.shared") == 12
        assert kubelet.wait_for(lambda: kubelet.allocatable(GPU) == 0, 5)  # old resource gone
        assert proc.poll() is None

        # A bad config on SIGHUP is refused; the running one stays.
        cfg.write_text("version: v1\nflags:\n  migStrategy: sideways\n")
        proc.send_signal(signal.SIGHUP)
        _wait_log(log, r"reload refused")
        assert kubelet.allocatable("nvidia.com/gpu.shared") == 12

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert not (kubelet.dir / "nvidia-gpu.shared.sock").exists()
        assert kubelet.wait_for(lambda: kubelet.allocatable("nvidia.com/gpu.shared") == 0, 5)
        assert "node daemon stopped" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


@pytest.mark.parametrize(("args", "code", "message"), [
    (["--inventory", "no-such-topology"], 1, "error"),
    (["--inventory", "t4x4", "--mig-strategy", "sideways"], 2, "configuration error"),
    (["--inventory", "t4x4", "--no-such-flag", "1"], 2, "unknown flag"),
])
def test_exit_codes(sockdir: Path, args: list[str], code: int, message: str) -> None:
    log = sockdir / "node.log"
    proc = _spawn(["--standalone", "--device-plugin-dir", str(sockdir / "dp"), "--metrics-address", "0", *args],
                  log)
    assert proc.wait(timeout=30) == code
    assert message in log.read_text()


def test_fail_on_init_error_false_waits(sockdir: Path) -> None:
    log = sockdir / "node.log"
    topo = sockdir / "empty.yaml"
    # NVML that cannot discover anything: every discovery fails.
    topo.write_text("name: broken\ngpu: {model: Tesla T4, memory: 16Gi}\ngpus: [{numa: 0}]\n"
                    "faults: [{at: 0, kind: discover-error, times: 1000, message: Driver Not Loaded}]\n")
    proc = _spawn(["--standalone", "--inventory", str(topo), "--device-plugin-dir", str(sockdir / "dp"),
                   "--metrics-address", "0", "--run-for", "30"], log, env={"FAIL_ON_INIT_ERROR": "false"})
    try:
        _wait_log(log, r"waiting indefinitely")
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    proc = _spawn(["--standalone", "--inventory", str(topo), "--device-plugin-dir", str(sockdir / "dp"),
                   "--metrics-address", "0"], log)
    assert proc.wait(timeout=30) == 1
    assert "Driver Not Loaded" in log.read_text() and "failOnInitError is set" in log.read_text()


def test_dry_run_json(sockdir: Path) -> None:
    import json

    def plans(*flags: str) -> dict:
        out = subprocess.run([*RUN, "--standalone", "--inventory", "dgx1-v100", "--dry-run", "--json", *flags],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        return {p["resource"]: p for p in json.loads(out.stdout)}

    replicated = plans("--resource-config", "gpu:sharedgpu:4")
    assert len(replicated["nvidia.com/sharedgpu"]["devices"]) == 32
    assert "kubegpu.io/gpu.shared" not in replicated  # replicated GPUs offer no share slots
    assert len(plans("--shared-slots", "10")["kubegpu.io/gpu.shared"]["devices"]) == 80


def test_full_mode_publishes_and_serves(kubelet: StandinKubelet, sockdir: Path) -> None:
    """Without --standalone: credentials from a kubeconfig, the node's labels, Device object and share
    capacity are published, and the plugins serve the kubelet as in standalone mode."""
    from kubegpu_standins.apiserver import ApiServer

    api = ApiServer().start()
    try:
        api.put_object({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-node-1"},
                        "status": {"capacity": {"cpu": "64"}, "allocatable": {"cpu": "64"}}})
        kubeconfig = api.write_kubeconfig(sockdir / "kubeconfig")
        log = sockdir / "node.log"
        proc = _spawn(["--kubeconfig", str(kubeconfig), "--inventory", "t4x4", "--node-name", "gpu-node-1",
                       "--device-plugin-dir", str(kubelet.dir), "--shared-slots", "10",
                       "--cdi-spec-dir", str(sockdir / "cdi"), "--metrics-address", "127.0.0.1:0", "--run-for", "60"],
                      log)
        try:
            assert kubelet.wait_registered("kubegpu.io/gpu.shared", timeout_s=20), log.read_text()
            port = int(_wait_log(log, r"metrics on http://127\.0\.0\.1:(\d+)/metrics").group(1))
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            assert "kubegpu_handoff_mismatches_total" in text  # the handoff's counters on the daemon's endpoint
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    dev = api.get_object("devices", "gpu-node-1", group="kubegpu.io")
                    break
                except Exception:
                    time.sleep(0.1)
            else:
                raise AssertionError("no Device object: " + log.read_text()[-2000:])
            assert len(dev["spec"]["devices"]) == 4
            assert all(g["health"] is True for g in dev["spec"]["devices"])
            # The publisher writes the labels, the Device, then the share capacity: wait for the last.
            node = api.get_object("nodes", "gpu-node-1")
            while "kubegpu.io/gpu-core" not in node["status"].get("capacity", {}) and time.monotonic() < deadline:
                time.sleep(0.1)
                node = api.get_object("nodes", "gpu-node-1")
            assert node["metadata"]["labels"]["nvidia.com/gpu.count"] == "4"
            assert node["status"]["capacity"]["kubegpu.io/gpu-core"] == "400"
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=15) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
    finally:
        api.stop()


def test_full_mode_without_credentials_fails(sockdir: Path) -> None:
    log = sockdir / "node.log"
    env = {"KUBECONFIG": str(sockdir / "missing-kubeconfig"), "KUBERNETES_SERVICE_HOST": ""}
    proc = _spawn(["--inventory", "t4x4", "--device-plugin-dir", str(sockdir / "dp"), "--metrics-address", "0"],
                  log, env=env)
    assert proc.wait(timeout=30) == 1
    assert "Kubernetes credentials" in log.read_text() or "kubeconfig" in log.read_text().lower()
