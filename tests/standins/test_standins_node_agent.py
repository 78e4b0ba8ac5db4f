"""The stand-in kubelet's pod side: it registers a Ready Node, copies device-plugin capacity into it,
admits bound pods through the real plugins (GetPreferredAllocation + Allocate over gRPC) in the
kubelet's order, keeps each container's environment, and fails a pod the way the kubelet does."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kubegpu.inventory.fake import FakeBackend
from kubegpu.kube.client import make_client
from kubegpu.kube.resources import Pod
from kubegpu.node.daemon import NodeDaemon
from kubegpu.node.options import load_node_options
from kubegpu_standins.apiserver import ApiServer
from kubegpu_standins.kubelet import StandinKubelet
from kubegpu_standins.node_agent import StandinNode


@dataclass
class Env:
    api: ApiServer
    node: StandinNode
    kubelet: StandinKubelet
    backend: FakeBackend


@pytest.fixture
def env() -> Iterator[Env]:
    d = Path(tempfile.mkdtemp(prefix="kgs-", dir="/tmp"))  # unix socket paths must stay short
    api = ApiServer().start()
    client = make_client(api.write_kubeconfig(d / "kc"))
    kubelet = StandinKubelet(d / "dp")
    kubelet.start()
    backend = FakeBackend("t4x4", node_name="n1")

    def load() -> Any:
        return load_node_options({"shared-slots": 0, "health-recovery-interval": 0}, {},
                                 settings={"cdi_dir": str(d / "cdi"), "mig_minors_file": str(d / "mig")},
                                 plugin_dir=str(d / "dp"), stream_wait_s=2.0, resync_s=0.4)

    daemon = NodeDaemon(backend, load)
    node = StandinNode("n1", client, kubelet)
    try:
        node.register()
        daemon.start()
        assert kubelet.wait_registered("nvidia.com/gpu", timeout_s=10)
        assert kubelet.wait_for(lambda: kubelet.allocatable("nvidia.com/gpu") == 4, 10)
        yield Env(api, node, kubelet, backend)
    finally:
        daemon.stop()
        backend.close()
        kubelet.stop()
        api.stop()
        shutil.rmtree(d, ignore_errors=True)


def _bound_pod(env: Env, name: str, limits: dict[str, str], spec_env: list[dict[str, str]] | None = None
               ) -> None:
    c: dict[str, Any] = {"name": "main", "image": "x", "resources": {"limits": limits}}
    if spec_env:
        c["env"] = spec_env
    env.node.client.create(Pod.from_dict({"metadata": {"name": name, "namespace": "default"},
                                          "spec": {"nodeName": "n1", "containers": [c]}}))


def _phase(env: Env, name: str) -> dict[str, Any]:
    return env.api.get_object("pods", name, namespace="default")["status"]


def test_register_and_device_status(env: Env) -> None:
    node = env.api.get_object("nodes", "n1")
    assert node["metadata"]["labels"]["kubernetes.io/hostname"] == "n1"
    assert any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"]["conditions"])
    env.node.sync_device_status()
    status = env.api.get_object("nodes", "n1")["status"]
    assert status["capacity"]["nvidia.com/gpu"] == "4" and status["allocatable"]["nvidia.com/gpu"] == "4"
    assert status["allocatable"]["cpu"] == "64"  # the merge keeps what was there


def test_unhealthy_gpu_leaves_allocatable(env: Env) -> None:
    env.backend.inject_xid(2, 48)
    assert env.kubelet.wait_for(lambda: env.kubelet.allocatable("nvidia.com/gpu") == 3, 10)
    env.node.sync_device_status()
    status = env.api.get_object("nodes", "n1")["status"]
    assert status["capacity"]["nvidia.com/gpu"] == "4" and status["allocatable"]["nvidia.com/gpu"] == "3"


def test_admit_runs_the_pod_with_the_plugins_environment(env: Env) -> None:
    _bound_pod(env, "p", {"nvidia.com/gpu": "2", "kubegpu.io/gpu-core": "200"},
               [{"name": "FOO", "value": "bar"}, {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}])
    assert env.node.admit_pending() == ["default/p"]
    assert _phase(env, "p")["phase"] == "Running"
    run = env.node.runs[("default/p", "main")]
    assert len(run.devices["nvidia.com/gpu"]) == 2
    visible = run.environment["NVIDIA_VISIBLE_DEVICES"].split(",")
    assert sorted(visible) == sorted(run.devices["nvidia.com/gpu"])  # the plugin's value wins over the spec's
    assert run.environment["FOO"] == "bar" and run.spec_envs["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert env.node.admit_pending() == []  # Running pods are not admitted twice
    # The kubelet's PodResources view records the holding.
    assert set(env.kubelet.holdings["default/p"]["main"][0][1]) == set(visible)


def test_too_many_devices_fail_admission_like_the_kubelet(env: Env) -> None:
    _bound_pod(env, "big", {"nvidia.com/gpu": "5"})
    assert env.node.admit_pending() == ["default/big"]
    status = _phase(env, "big")
    assert status["phase"] == "Failed" and status["reason"] == "UnexpectedAdmissionError"
    assert "requested number of devices unavailable" in env.node.failed["default/big"]


def test_fractional_device_count_fails_admission(env: Env) -> None:
    _bound_pod(env, "half", {"nvidia.com/gpu": "500m"})
    env.node.admit_pending()
    assert _phase(env, "half")["phase"] == "Failed"
    assert "not a whole number" in env.node.failed["default/half"]


def test_admission_follows_creation_then_binding_order(env: Env) -> None:
    for name in ("zeta", "alpha", "mid"):  # one second: binding (creation) order, not names
        _bound_pod(env, name, {"nvidia.com/gpu": "1"})
    assert env.node.admit_pending() == ["default/zeta", "default/alpha", "default/mid"]
