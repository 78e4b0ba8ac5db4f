"""The extender answers the exact bodies a real kube-scheduler v1.24 sent (both nodeCacheCapable modes)."""

from __future__ import annotations

import json

import pytest
from sched_harness import FIXTURES, Cluster, fixture_pod

from kubegpu.model.allocation import decode
from kubegpu.model.annotations import DEVICE_ALLOCATED

RAW = {mode: sorted((FIXTURES / mode / "raw").glob("*.request.body")) for mode in ("nodecache-true", "nodecache-false")}


def _sent_names(body: dict) -> list[str]:
    if body["NodeNames"] is not None:
        return body["NodeNames"]
    return [n["metadata"]["name"] for n in body["Nodes"]["items"]]


@pytest.mark.parametrize("mode", ["nodecache-true", "nodecache-false"])
def test_recorded_filter_bodies_get_answers_in_the_asked_shape(cluster: Cluster, mode: str) -> None:
    for path in (p for p in RAW[mode] if "-filter-" in p.name):
        raw = path.read_bytes()
        sent = json.loads(raw)
        r = cluster.post("/scheduler/filter", raw)
        assert r.status_code == 200, (path.name, r.text)
        out = r.json()
        assert set(out) == {"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}
        assert out["Error"] == ""
        names = _sent_names(sent)
        if mode == "nodecache-true":
            assert out["Nodes"] is None and isinstance(out["NodeNames"], list)
            passed = out["NodeNames"]
        else:
            assert out["NodeNames"] is None
            passed = [n["metadata"]["name"] for n in out["Nodes"]["items"]]
            # The passing nodes are echoed back as received.
            received = {n["metadata"]["name"]: n for n in sent["Nodes"]["items"]}
            assert all(n == received[n["metadata"]["name"]] for n in out["Nodes"]["items"])
        assert set(passed) | set(out["FailedNodes"]) | set(out["FailedAndUnresolvableNodes"]) == set(names)
        assert set(passed).isdisjoint(out["FailedNodes"])
        pod = sent["Pod"]["metadata"]["name"]
        if pod == "gpu-two-containers":
            # gpu-node-c has one GPU: the trainer takes it whole, the helper's share has nowhere to go.
            assert "gpu-node-c" in out["FailedNodes"] and "helper" in out["FailedNodes"]["gpu-node-c"]
            assert {"gpu-node-a", "gpu-node-b"} <= set(passed)
        else:
            assert set(passed) == set(names), (pod, out["FailedNodes"])


@pytest.mark.parametrize("mode", ["nodecache-true", "nodecache-false"])
def test_recorded_prioritize_bodies_get_a_host_priority_list(cluster: Cluster, mode: str) -> None:
    for path in (p for p in RAW[mode] if "-prioritize-" in p.name):
        raw = path.read_bytes()
        r = cluster.post("/scheduler/prioritize", raw)
        assert r.status_code == 200
        out = r.json()
        assert isinstance(out, list)
        assert sorted(h["Host"] for h in out) == sorted(_sent_names(json.loads(raw)))
        assert all(set(h) == {"Host", "Score"} and 0 <= h["Score"] <= 10 for h in out)
        assert max(h["Score"] for h in out) == 10


def test_recorded_binds_annotate_then_bind(cluster: Cluster) -> None:
    binds = [p for p in RAW["nodecache-true"] if "-bind-" in p.name]
    assert len(binds) == 4
    for path in binds:
        sent = json.loads(path.read_bytes())
        cluster.api.put_object(fixture_pod(sent["PodName"]))
        r = cluster.post("/scheduler/bind", path.read_bytes())
        assert r.status_code == 200 and r.json() == {"Error": ""}, r.text
        pod = cluster.api.get_object("pods", sent["PodName"], namespace=sent["PodNamespace"])
        assert pod["spec"]["nodeName"] == sent["Node"]
        alloc = decode(pod["metadata"]["annotations"][DEVICE_ALLOCATED])
        if sent["PodName"] == "gpu-whole-2":
            assert len(alloc.grants()) == 2 and all(g.core == 100 for g in alloc.grants())
            assert len({g.uuid for g in alloc.grants()}) == 2
        if sent["PodName"] == "gpu-frac-core50":
            (g,) = alloc.grants()
            assert (g.core, g.memory_ratio) == (50, 50)
        if sent["PodName"] == "gpu-two-containers":
            assert {c.container for c in alloc.containers} == {"trainer", "helper"}
        # Retrying a bind that went through is a success, and holds nothing twice.
        held = cluster.ext.call(lambda: len(cluster.view.ledger.held))
        again = cluster.post("/scheduler/bind", path.read_bytes())
        assert again.json() == {"Error": ""}
        assert cluster.ext.call(lambda: len(cluster.view.ledger.held)) == held
    # Whole GPUs of gpu-whole-2 and gpu-two-containers' trainer are distinct GPUs of gpu-node-a.
    summary = cluster.http.get("/apis/v1/plugins/DeviceShare/nodeDeviceSummaries/gpu-node-a").json()
    # The seed's keys, and kubegpu's additions for `kubegpu status --extender` (the holdings per container; each
    # GPU's model, health and MIG devices).
    assert set(summary) == {"allocateSet", "deviceTotal", "deviceFree", "deviceUsed", "deviceTotalDetail",
                            "deviceFreeDetail", "deviceUsedDetail", "allocateSetByContainer", "deviceInfo"}
    assert summary["deviceTotal"]["kubegpu.io/gpu-core"] == "800"
    assert "kubegpu-fixtures/gpu-whole-2" in summary["allocateSet"]["gpu"]
    used = sum(int(v["kubegpu.io/gpu-core"]) for v in summary["deviceUsedDetail"]["gpu"].values())
    # 2 whole + 50 % + a memory-only share (no compute) + 1 whole + 25 %, all on gpu-node-a.
    assert used == int(summary["deviceUsed"]["kubegpu.io/gpu-core"]) == 200 + 50 + 0 + 100 + 25
