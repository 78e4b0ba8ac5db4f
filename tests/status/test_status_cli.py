"""``kubegpu status`` against a populated stand-in API server: the table, the JSON, filters and problems."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from lightkube.types import PatchType
from typer.testing import CliRunner

from kubegpu.cli.main import app, kubectl_gpu
from kubegpu.inventory.fake import FakeBackend
from kubegpu.kube.client import make_client
from kubegpu.kube.resources import Device
from kubegpu.model.allocation import ContainerAllocation, DeviceGrant, PodAllocation, encode
from kubegpu.model.annotations import DEVICE_ALLOCATED
from kubegpu.model.device_object import device_object
from kubegpu_standins.apiserver import ApiServer

GiB = 2**30


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[ApiServer, Path, dict]]:
    server = ApiServer(history=100).start()
    try:
        invs = {name: FakeBackend(topo, node_name=name).discover()
                for name, topo in (("a100-node", "dgx-a100"), ("t4-node", "t4x4"))}
        for inv in invs.values():
            server.put_object(device_object(inv))
        a, t = invs["a100-node"], invs["t4-node"]

        def pod(ns: str, name: str, node: str, alloc: PodAllocation | str, phase: str = "Running") -> None:
            text = alloc if isinstance(alloc, str) else encode(alloc)
            server.put_object({"apiVersion": "v1", "kind": "Pod",
                               "metadata": {"name": name, "namespace": ns, "annotations": {DEVICE_ALLOCATED: text}},
                               "spec": {"nodeName": node, "containers": [{"name": "main", "image": "x"}]},
                               "status": {"phase": phase}})

        g0, g1 = a.gpus[0], a.gpus[1]
        pod("team-a", "whole", "a100-node", PodAllocation((ContainerAllocation("main", (
            DeviceGrant(g0.minor, g0.uuid, 100, g0.memory_bytes, 100),)),)))
        pod("team-b", "half", "a100-node", PodAllocation((ContainerAllocation("main", (
            DeviceGrant(g1.minor, g1.uuid, 50, 40 * GiB, 50),)),)))
        pod("team-b", "done", "a100-node", PodAllocation((ContainerAllocation("main", (
            DeviceGrant(g1.minor, g1.uuid, 50, 40 * GiB, 50),)),)), phase="Succeeded")
        pod("team-c", "corrupt", "t4-node", "{not json")
        t0 = t.gpus[0]
        pod("team-c", "quarter", "t4-node", PodAllocation((ContainerAllocation("", (
            DeviceGrant(t0.minor, t0.uuid, 25, 4 * GiB, 25),)),)))
        yield server, server.write_kubeconfig(tmp_path / "kubeconfig"), invs
    finally:
        server.stop()


def _status(kubeconfig: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["status", "--kubeconfig", str(kubeconfig), *args])
    return result.exit_code, result.stdout + result.stderr


def test_json_shows_holders_totals_and_stranded_gpu(cluster: tuple) -> None:
    _, kubeconfig, _ = cluster
    code, out = _status(kubeconfig, "--json")
    assert code == 0, out
    view = json.loads(out)
    t = view["totals"]
    assert t["nodes"] == 2 and t["gpus"] == 12 and t["healthy_gpus"] == 12
    assert t["allocated_gpu"] == 1.75  # 100 % + 50 % + 25 %; the Succeeded pod holds nothing
    assert t["stranded_gpu"] == 1.25  # the free halves/three-quarters of the two partly used GPUs
    assert t["whole_free_gpus"] == 9
    a100 = next(n for n in view["nodes"] if n["name"] == "a100-node")
    g1 = a100["gpus"][1]
    assert g1["core_used"] == 50 and g1["memory_used"] == 40 * GiB
    assert [h["pod"] for h in g1["holders"]] == ["team-b/half"]
    assert any("team-c/corrupt" in p for p in view["problems"])


def test_table_names_nodes_models_and_pods(cluster: tuple) -> None:
    _, kubeconfig, _ = cluster
    code, out = _status(kubeconfig)
    assert code == 0, out
    for text in ("a100-node", "t4-node", "A100", "T4", "team-a/whole", "team-b/half", "Healthy", "stranded"):
        assert text in out
    assert "team-b/done" not in out
    assert "problem" in out and "team-c/corrupt" in out


def test_filters_by_node_model_and_namespace(cluster: tuple) -> None:
    _, kubeconfig, _ = cluster
    view = json.loads(_status(kubeconfig, "--json", "--node", "t4-node")[1])
    assert [n["name"] for n in view["nodes"]] == ["t4-node"] and view["totals"]["gpus"] == 4
    view = json.loads(_status(kubeconfig, "--json", "--model", "a100")[1])
    assert [n["name"] for n in view["nodes"]] == ["a100-node"]
    view = json.loads(_status(kubeconfig, "--json", "--namespace", "team-a", "--node", "a100-node")[1])
    held = [g for n in view["nodes"] for g in n["gpus"] if g["holders"]]
    assert [h["pod"] for g in held for h in g["holders"]] == ["team-a/whole"]


def test_unhealthy_gpu_is_shown(cluster: tuple) -> None:
    _, kubeconfig, invs = cluster
    inv = invs["t4-node"]
    sick = device_object(inv.with_gpu_health(inv.gpus[3].uuid, False))
    client = make_client(kubeconfig)
    client.patch(Device, "t4-node", {"spec": sick["spec"]}, patch_type=PatchType.MERGE)
    view = json.loads(_status(kubeconfig, "--json", "--node", "t4-node")[1])
    assert view["totals"]["healthy_gpus"] == 3
    assert view["nodes"][0]["gpus"][3]["healthy"] is False


def test_watch_refreshes_then_stops(cluster: tuple) -> None:
    _, kubeconfig, _ = cluster
    code, out = _status(kubeconfig, "--watch", "--interval", "0.05", "--count", "2")
    assert code == 0, out
    assert "a100-node" in out


def test_unreachable_api_server_is_a_clear_error(tmp_path: Path) -> None:
    server = ApiServer().start()
    kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
    server.stop()
    code, out = _status(kubeconfig, "--json")
    assert code == 1, out
    assert "cannot reach the API server" in out


def test_kubectl_gpu_plugin_is_kubegpu_status(cluster: tuple, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    _, kubeconfig, _ = cluster
    monkeypatch.setattr("sys.argv", ["kubectl-gpu", "--kubeconfig", str(kubeconfig), "--json"])
    with pytest.raises(SystemExit) as exit_info:
        kubectl_gpu()
    assert exit_info.value.code == 0
    assert json.loads(capsys.readouterr().out)["totals"]["gpus"] == 12


def test_extender_debug_api_as_the_source(cluster: tuple) -> None:
    from kubegpu.scheduler.service import ServiceThread

    _, kubeconfig, _ = cluster
    extender = ServiceThread(kubeconfig).start()
    try:
        code, out = 1, ""
        for _ in range(50):  # the extender's first sync is asynchronous
            code, out = _status(kubeconfig, "--json", "--extender", extender.url)
            if code == 0 and json.loads(out)["totals"]["allocated_gpu"] == 1.75:
                break
            time.sleep(0.1)
        assert code == 0, out
        view = json.loads(out)
        assert view["totals"]["gpus"] == 12 and view["totals"]["allocated_gpu"] == 1.75
        a100 = next(n for n in view["nodes"] if n["name"] == "a100-node")
        assert [h["pod"] for h in a100["gpus"][1]["holders"]] == ["team-b/half"]
    finally:
        extender.stop()


def test_unreachable_extender_is_a_clear_error(tmp_path: Path) -> None:
    code, out = _status(tmp_path / "unused", "--json", "--extender", "http://127.0.0.1:9")
    assert code == 1 and "cannot read http://127.0.0.1:9" in out
