"""``kubegpu status``: time-slicing replicas shown and counted (their GPUs are not whole free GPUs), the MIG
layout, a missing CRD or a non-Kubernetes answer as clear errors, and container names from the extender."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kubegpu.cli.main import app
from kubegpu.inventory.fake import FakeBackend
from kubegpu.model.allocation import ContainerAllocation, DeviceGrant, PodAllocation, encode
from kubegpu.model.annotations import DEVICE_ALLOCATED
from kubegpu.model.device_object import device_object
from kubegpu.status.sources import INSTALL_CRD
from kubegpu_standins.apiserver import ApiServer

GiB = 2**30


def _status(kubeconfig: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["status", "--kubeconfig", str(kubeconfig), *args])
    return result.exit_code, result.stdout + result.stderr


def _node(name: str, capacity: dict[str, str], labels: dict[str, str]) -> dict:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels},
            "status": {"capacity": capacity, "allocatable": capacity}}


def _pod(ns: str, name: str, node: str, containers: list[dict], alloc: PodAllocation | None = None,
         phase: str = "Running") -> dict:
    meta: dict = {"name": name, "namespace": ns}
    if alloc is not None:
        meta["annotations"] = {DEVICE_ALLOCATED: encode(alloc)}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"nodeName": node, "containers": containers}, "status": {"phase": phase}}


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[ApiServer, Path, dict]]:
    """a100-mig as the demo runs it (MIG on GPUs 0 and 1, GPUs 2 and 3 time-sliced as nvidia.com/sharedgpu,
    4 replicas each) and a T4 node with whole GPUs."""
    server = ApiServer(history=100).start()
    try:
        invs = {name: FakeBackend(topo, node_name=name).discover()
                for name, topo in (("a100-mig", "a100-mig"), ("t4-node", "t4x4"))}
        for inv in invs.values():
            server.put_object(device_object(inv))
        server.put_object(_node("a100-mig", {"nvidia.com/sharedgpu": "8", "nvidia.com/mig-1g.10gb": "2"},
                                {"nvidia.com/gpu.replicas": "4", "nvidia.com/gpu.sharing-strategy": "time-slicing"}))
        server.put_object(_node("t4-node", {"nvidia.com/gpu": "4"}, {"nvidia.com/gpu.replicas": "1"}))
        replica = {"name": "notebook", "image": "x", "resources": {"limits": {"nvidia.com/sharedgpu": "3"}}}
        server.put_object(_pod("demo", "replica", "a100-mig", [replica]))
        server.put_object(_pod("demo", "replica-done", "a100-mig", [replica], phase="Succeeded"))
        mig = next(g for g in invs["a100-mig"].gpus if g.mig_enabled)
        slice_ = next(m for m in mig.mig_devices if m.profile == "1g.10gb")
        server.put_object(_pod("demo", "mig-slice", "a100-mig", [{"name": "infer", "image": "x"}], PodAllocation((
            ContainerAllocation("infer", (DeviceGrant(mig.minor, mig.uuid, 14, slice_.memory_bytes, 12,
                                                      slice_.uuid, slice_.profile),)),))))
        t0 = invs["t4-node"].gpus[0]
        two = PodAllocation((ContainerAllocation("a", (DeviceGrant(t0.minor, t0.uuid, 30, GiB, 10),)),
                             ContainerAllocation("b", (DeviceGrant(t0.minor, t0.uuid, 20, GiB, 10),))))
        server.put_object(_pod("team", "two", "t4-node", [{"name": "a", "image": "x"}, {"name": "b", "image": "x"}],
                               two))
        yield server, server.write_kubeconfig(tmp_path / "kubeconfig"), invs
    finally:
        server.stop()


def test_replica_pods_are_shown_and_counted(cluster: tuple) -> None:
    _, kubeconfig, _ = cluster
    code, out = _status(kubeconfig, "--json")
    assert code == 0, out
    view = json.loads(out)
    t = view["totals"]
    assert (t["replicas_total"], t["replicas_held"], t["replica_pods"], t["replica_gpus"]) == (8, 3, 1, 2)
    node = next(n for n in view["nodes"] if n["name"] == "a100-mig")
    (r,) = node["replicas"]
    assert (r["resource"], r["gpus"], r["per_gpu"], r["held"]) == ("nvidia.com/sharedgpu", 2, 4, 3)
    assert r["holders"] == [{"pod": "demo/replica", "container": "notebook", "count": 3}]
    code, out = _status(kubeconfig)
    assert "demo/replica[notebook] ×3" in out and "3/8" in out


def test_gpus_offered_only_as_replicas_or_mig_are_not_whole_free_gpus(cluster: tuple) -> None:
    _, kubeconfig, invs = cluster
    view = json.loads(_status(kubeconfig, "--json")[1])
    gpus = {(n["name"], g["index"]): g for n in view["nodes"] for g in n["gpus"]}
    mig_enabled = {g.index for g in invs["a100-mig"].gpus if g.mig_enabled}
    assert {i for (n, i), g in gpus.items() if n == "a100-mig" and g["replica_only"]} == \
        {g.index for g in invs["a100-mig"].gpus} - mig_enabled
    # Only the T4s nobody holds are whole and free: 3 of 4 (GPU 0 holds two shares).
    assert view["totals"]["whole_free_gpus"] == 3
    assert view["totals"]["free_gpu"] == 3.5


def test_mig_layout_shows_each_device_and_its_holder(cluster: tuple) -> None:
    _, kubeconfig, invs = cluster
    view = json.loads(_status(kubeconfig, "--json", "--node", "a100-mig")[1])
    migs = [m for g in view["nodes"][0]["gpus"] for m in g["mig"]]
    expected = [m for g in invs["a100-mig"].gpus if g.mig_enabled for m in g.mig_devices]
    assert len(migs) == len(expected) == view["totals"]["mig_devices"]
    held = [m for m in migs if m["holders"]]
    assert len(held) == 1 and held[0]["profile"] == "1g.10gb"
    assert held[0]["holders"][0]["pod"] == "demo/mig-slice" and held[0]["holders"][0]["container"] == "infer"
    assert view["totals"]["mig_devices_free"] == len(expected) - 1
    code, out = _status(kubeconfig, "--node", "a100-mig")
    assert code == 0 and "MIG layout" in out and "demo/mig-slice[infer]" in out and "■■■" in out


def test_extender_source_names_containers(cluster: tuple) -> None:
    import time

    from kubegpu.scheduler.service import ServiceThread

    _, kubeconfig, _ = cluster
    extender = ServiceThread(kubeconfig).start()
    try:
        holders: list = []
        for _ in range(50):  # the extender's first sync is asynchronous
            code, out = _status(kubeconfig, "--json", "--extender", extender.url, "--node", "t4-node")
            if code == 0:
                holders = json.loads(out)["nodes"][0]["gpus"][0]["holders"]
                if holders:
                    break
            time.sleep(0.1)
        assert sorted((h["pod"], h["container"], h["core"]) for h in holders) == [("team/two", "a", 30),
                                                                                  ("team/two", "b", 20)]
    finally:
        extender.stop()


class _Answer(BaseHTTPRequestHandler):
    """404 for everything: a JSON Status (the CRD is not installed), or a bare page with no Content-Type."""

    json_status = True

    def do_GET(self) -> None:
        if self.json_status:
            body = json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
                               "message": "the server could not find the requested resource", "code": 404}).encode()
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
        else:
            body = b"404 page not found\n"
            self.send_response(404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("json_status", [True, False], ids=["status-json", "bare-404"])
def test_missing_crd_and_non_json_404_are_clear_errors(tmp_path: Path, json_status: bool) -> None:
    handler = type("Handler", (_Answer,), {"json_status": json_status})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "c",
            "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{httpd.server_address[1]}"}}],
            "users": [{"name": "u", "user": {}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
        code, out = _status(kubeconfig)
        assert code == 1, out
        assert "Traceback" not in out and out.startswith("error: ")
        assert "CRD is not installed" in out and INSTALL_CRD in " ".join(out.split())
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_some_gpus_replicated_are_taken_off_the_whole_free_count() -> None:
    """One of four T4s time-sliced (NVIDIA's `devices:` subset): the Node says how many, not which, so
    no GPU is marked but the whole free count drops by one."""
    from kubegpu.status.view import NodeInfo, ReplicaRecord, build_view

    inv = FakeBackend("t4x4", node_name="t4").discover()
    info = {"t4": NodeInfo({"nvidia.com/gpu": 3, "nvidia.com/gpu.shared": 4}, {"nvidia.com/gpu.replicas": "4"})}
    view = build_view([inv], [], node_info=info,
                      replica_pods=[ReplicaRecord("ns", "p", "t4", "c", "nvidia.com/gpu.shared", 1)])
    t = view.totals
    assert (t.whole_free_gpus, t.replica_gpus, t.replicas_total, t.replicas_held) == (3, 1, 4, 1)
    assert not any(g.replica_only for g in view.nodes[0].gpus)
    no_info = build_view([inv], [])
    assert no_info.totals.whole_free_gpus == 4 and no_info.nodes[0].replicas == ()
