"""``kubegpu status`` shows DRA nodes (from ResourceSlices) and claim allocations beside device-plugin ones."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from typer.testing import CliRunner

from kubegpu.cli.main import app
from kubegpu.install.dra import device_classes
from kubegpu.install.values import Values
from kubegpu.inventory.fake import FakeBackend
from kubegpu.node.dra.slices import DraSettings, health_taints, pool_content, slice_bodies
from kubegpu_standins.apiserver import ApiServer
from kubegpu_standins.dra_allocator import Allocator

GiB = 2**30


def _claim(api: ApiServer, name: str, request: dict, pod: str) -> None:
    api.put_object({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                    "metadata": {"name": name, "namespace": "ml"},
                    "spec": {"devices": {"requests": [{"name": "gpu", "exactly": request}]}}})
    assert Allocator(api).allocate("ml", name, pod={"metadata": {"name": pod, "uid": str(uuid.uuid4())}})


def test_status_shows_claims_on_dra_nodes(tmp_path: Path) -> None:
    api = ApiServer().start()
    try:
        inv = FakeBackend("a100-mig", node_name="dra-node").discover()
        s = DraSettings(node_name="dra-node", shared_gpus=frozenset({3}))
        g2 = inv.gpus[2]
        taints = health_taints(inv, {g2.uuid: False}, {g2.uuid: "Xid 48"}, {}, "2026-11-24T00:00:00Z")
        for b in slice_bodies(pool_content(inv, s, taints), s, 1):
            api.put_object(b)
        for c in device_classes(Values()):
            api.put_object(c)
        _claim(api, "small", {"deviceClassName": "mig.kubegpu.io", "allocationMode": "ExactCount", "count": 1,
                              "selectors": [{"cel": {"expression":
                                                     'device.attributes["gpu.kubegpu.io"].profile == "1g.10gb"'}}]},
               "tiny")
        _claim(api, "infer", {"deviceClassName": "shared-gpu.kubegpu.io", "allocationMode": "ExactCount",
                              "count": 1, "capacity": {"requests": {"compute": "30", "memory": "20Gi"}}}, "server")
        whole = {"deviceClassName": "gpu.kubegpu.io", "allocationMode": "ExactCount", "count": 1}
        _claim(api, "train", whole, "trainer")  # GPU 3 has a share, GPU 2 is tainted: the free MIG parent
        r = CliRunner().invoke(app, ["status", "--kubeconfig", str(api.write_kubeconfig(tmp_path / "kc")), "--json"])
        assert r.exit_code == 0, r.output
        view = json.loads(r.stdout)
        [node] = view["nodes"]
        assert node["name"] == "dra-node" and len(node["gpus"]) == 4
        by_index = {g["index"]: g for g in node["gpus"]}
        assert [h["pod"] for h in by_index[3]["holders"]] == ["ml/server"]
        assert by_index[3]["core_used"] == 30 and by_index[3]["memory_used"] == 20 * GiB
        holders = [h["pod"] for g in node["gpus"] for h in g["holders"]]
        assert "ml/trainer" in holders and "ml/tiny" in holders
        assert view["totals"]["healthy_gpus"] == 3  # the tainted GPU
        # The MIG layout: each device at its position on the parent with its GPU-instance slices; a
        # 1g.10gb counts 1 of 7 slices (14 %), as on the device-plugin path.
        assert [(m["index"], m["profile"], m["slices"]) for m in by_index[0]["mig"]] == [
            (0, "3g.40gb", 3), (1, "2g.20gb", 2), (2, "1g.10gb", 1), (3, "1g.10gb", 1)]
        assert by_index[0]["core_used"] == 14
        # Every healthy GPU counted once: allocated + free = healthy GPUs (MIG GPU 0's other devices are
        # free; MIG GPU 1 is held whole through its parent device).
        t = view["totals"]
        assert round(t["allocated_gpu"] + t["free_gpu"], 2) == t["healthy_gpus"] == 3
        assert (by_index[1]["core_used"], [h["pod"] for h in by_index[1]["holders"]]) == (100, ["ml/trainer"])
    finally:
        api.stop()
