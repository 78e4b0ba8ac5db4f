"""Filter, prioritize and bind rules: kinds of request, reasons, models, health, NVLink, policies, bad bodies."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from sched_harness import Cluster, start_cluster

from kubegpu.inventory.fake import FakeBackend
from kubegpu.model.allocation import decode
from kubegpu.model.annotations import DEVICE_ALLOCATED, GPU_MODEL, GPU_POLICY, NODE_POLICY, REQUIRE_NVLINK
from kubegpu.scheduler.metrics import ExtenderMetrics


def pod(name: str, limits: dict[str, str] | list[dict[str, str]], annotations: dict[str, str] | None = None,
        ns: str = "default") -> dict:
    per = limits if isinstance(limits, list) else [limits]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "annotations": annotations or {}},
            "spec": {"containers": [{"name": f"c{i}", "image": "x", "resources": {"limits": lim}}
                                    for i, lim in enumerate(per)]}}


def args(p: dict, names: list[str]) -> dict:
    return {"Pod": p, "Nodes": None, "NodeNames": names}


ALL = ["gpu-node-a", "gpu-node-b", "gpu-node-c"]


def share(core: int, ratio: int | None = None, mem: str | None = None, k: int = 1) -> dict[str, str]:
    out = {"kubegpu.io/gpu-core": str(core), "kubegpu.io/gpu.shared": str(k)}
    if ratio is not None:
        out["kubegpu.io/gpu-memory-ratio"] = str(ratio)
    if mem is not None:
        out["kubegpu.io/gpu-memory"] = mem
    return out


def bind(cluster: Cluster, p: dict, node: str) -> str:
    created = cluster.api.put_object(p)
    r = cluster.post("/bind", {"PodName": p["metadata"]["name"], "PodNamespace": p["metadata"]["namespace"],
                               "PodUID": created["metadata"]["uid"], "Node": node})
    assert r.status_code == 200
    return r.json().get("Error", "")


def test_unknown_nodes_and_refused_requests_are_per_node_failures(cluster: Cluster) -> None:
    out = cluster.post("/filter", args(pod("p", {"nvidia.com/gpu": "1"}), ["gpu-node-a", "ghost"])).json()
    assert out["NodeNames"] == ["gpu-node-a"]
    assert "ghost" in out["FailedNodes"] and "Device object" in out["FailedNodes"]["ghost"]
    bad = pod("p", {"kubegpu.io/gpu-core": "50"})  # core without memory is refused by the protocol
    out = cluster.post("/filter", args(bad, ALL)).json()
    assert out["NodeNames"] == [] and set(out["FailedAndUnresolvableNodes"]) == set(ALL)
    assert "memory" in out["FailedAndUnresolvableNodes"]["gpu-node-a"]


def test_share_reasons_say_what_is_free_against_what_was_requested(cluster: Cluster) -> None:
    assert bind(cluster, pod("a", share(60, ratio=10)), "gpu-node-c") == ""
    out = cluster.post("/filter", args(pod("b", share(60, ratio=10)), ALL)).json()
    assert set(out["NodeNames"]) == {"gpu-node-a", "gpu-node-b"}
    assert out["FailedNodes"]["gpu-node-c"] == "GPU compute free: 40 percent at most, 60 percent requested"
    out = cluster.post("/filter", args(pod("m", share(10, mem="76Gi")), ["gpu-node-c"])).json()
    why = out["FailedNodes"]["gpu-node-c"]
    assert why.startswith("GPU memory free with the compute: ") and why.endswith("GiB at most, 76.0 GiB requested")
    out = cluster.post("/filter", args(pod("w", {"nvidia.com/gpu": "2"}), ["gpu-node-c"])).json()
    assert out["FailedNodes"]["gpu-node-c"] == "free whole GPUs: 0 of 1, 2 requested"


def test_share_over_k_gpus_and_multi_gpu(cluster: Cluster) -> None:
    assert bind(cluster, pod("k2", share(100, ratio=60, k=2)), "gpu-node-a") == ""
    alloc = decode(cluster.api.get_object("pods", "k2", "default")["metadata"]["annotations"][DEVICE_ALLOCATED])
    grants = alloc.grants()
    assert len(grants) == 2 and len({g.uuid for g in grants}) == 2
    assert all((g.core, g.memory_ratio) == (50, 30) for g in grants)
    assert bind(cluster, pod("w8", {"nvidia.com/gpu": "8"}), "gpu-node-b") == ""
    out = cluster.post("/filter", args(pod("w1", {"nvidia.com/gpu": "1"}), ["gpu-node-b"])).json()
    assert out["NodeNames"] == []


def test_gpu_model_constraint_from_annotation(cluster: Cluster) -> None:
    p = pod("h", {"nvidia.com/gpu": "1"}, {GPU_MODEL: "H100"})
    out = cluster.post("/filter", args(p, ALL)).json()
    assert out["NodeNames"] == ["gpu-node-b"]
    assert "not in the allowed H100" in out["FailedNodes"]["gpu-node-a"]
    # The GFD label spelling works too, and the bind honours it.
    p = pod("a", {"nvidia.com/gpu": "1"}, {GPU_MODEL: "NVIDIA-A100-SXM4-80GB|V100M16"})
    assert set(cluster.post("/filter", args(p, ALL)).json()["NodeNames"]) == {"gpu-node-a", "gpu-node-c"}
    assert "allowed" in bind(cluster, pod("x", {"nvidia.com/gpu": "1"}, {GPU_MODEL: "H100"}), "gpu-node-a")


def test_policies_default_and_per_pod_override(cluster: Cluster) -> None:
    assert bind(cluster, pod("base", share(50, ratio=50)), "gpu-node-a") == ""
    p = pod("s", share(20, ratio=20))
    packing = {h["Host"]: h["Score"] for h in cluster.post("/prioritize", args(
        {**p, "metadata": {**p["metadata"], "annotations": {NODE_POLICY: "packing"}}}, ALL)).json()}
    spread = {h["Host"]: h["Score"] for h in cluster.post("/prioritize", args(
        {**p, "metadata": {**p["metadata"], "annotations": {NODE_POLICY: "spread"}}}, ALL)).json()}
    assert packing != spread
    assert max(packing, key=packing.get) == "gpu-node-a"  # the already-used node packs best
    assert spread["gpu-node-a"] < max(spread.values())
    # GPU-level policy: binpack puts the share on the used GPU, spread on an empty one.
    used_gpu = decode(cluster.api.get_object("pods", "base", "default")["metadata"]["annotations"][
        DEVICE_ALLOCATED]).grants()[0].uuid
    assert bind(cluster, pod("g1", share(10, ratio=10), {GPU_POLICY: "bestfit"}), "gpu-node-a") == ""
    assert bind(cluster, pod("g2", share(10, ratio=10), {GPU_POLICY: "spread"}), "gpu-node-a") == ""
    g1 = decode(cluster.api.get_object("pods", "g1", "default")["metadata"]["annotations"][DEVICE_ALLOCATED])
    g2 = decode(cluster.api.get_object("pods", "g2", "default")["metadata"]["annotations"][DEVICE_ALLOCATED])
    assert g1.grants()[0].uuid == used_gpu and g2.grants()[0].uuid != used_gpu


def test_bad_bodies_are_400_with_a_message(cluster: Cluster) -> None:
    for verb in ("filter", "prioritize", "bind"):
        for body in (b"", b"{", b"[]", b'{"Pod": 3}', b'{"NodeNames": "x"}', b"\xff\xfe"):
            r = cluster.post(f"/{verb}", body)
            assert r.status_code == 400, (verb, body, r.text)
            assert r.json()["Error"]
    r = cluster.post("/filter", b'{"Pod": {"metadata": {}}, "Nodes": null, "NodeNames": null}')
    assert r.status_code == 400 and "neither NodeNames nor Nodes" in r.json()["Error"]
    huge = b'{"Pod": {}, "NodeNames": ["' + b"x" * (33 * 1024 * 1024) + b'"]}'
    r = cluster.post("/filter", huge)
    assert r.status_code == 413 and "larger than" in r.json()["Error"]
    assert cluster.http.get("/healthz").status_code == 200


def test_metrics_and_summaries(cluster: Cluster) -> None:
    cluster.post("/filter", args(pod("p", {"nvidia.com/gpu": "2"}), ALL))
    assert bind(cluster, pod("p", {"nvidia.com/gpu": "2"}), "gpu-node-a") == ""
    text = cluster.http.get("/metrics").text
    assert 'kubegpu_extender_request_seconds_count{verb="filter"} 1.0' in text
    assert 'kubegpu_node_rejections_total{reason="insufficient-gpu"} 1.0' in text
    assert "kubegpu_pods_placed_total 1.0" in text
    cluster.post("/filter", args(pod("big", {"nvidia.com/gpu": "9"}), ALL))
    text = cluster.http.get("/metrics").text
    assert 'kubegpu_pods_unschedulable_total{reason="insufficient-gpu"} 1.0' in text
    assert "kubegpu_cluster_fragmentation_milligpu" in text
    # The cluster's totals by default, from the arrays: the two whole GPUs just bound are full, the rest free.
    assert 'kubegpu_cluster_gpus{state="full"} 2.0' in text and 'kubegpu_cluster_gpus{state="partial"} 0.0' in text
    view = cluster.ext.service.view  # type: ignore[union-attr]
    usable = sum(1 for _ in view.gpu_allocation())
    assert f'kubegpu_cluster_gpus{{state="free"}} {float(usable - 2)}' in text
    ratio = next(float(line.split()[1]) for line in text.splitlines()
                 if line.startswith("kubegpu_cluster_gpu_compute_allocated_ratio "))
    assert ratio == pytest.approx(2 / usable)
    # Per-GPU series only when asked (two a GPU: 80,000 at 5,000 nodes), agreeing with the totals.
    assert "kubegpu_gpu_compute_allocated_ratio{" not in text
    per_gpu = generate_latest(ExtenderMetrics(view, per_gpu=True).registry).decode()
    assert 'kubegpu_gpu_compute_allocated_ratio{gpu="0",node="gpu-node-a"} 1.0' in per_gpu
    assert per_gpu.count("kubegpu_gpu_compute_allocated_ratio{") == usable
    assert sum(1 for line in per_gpu.splitlines()
               if line.startswith("kubegpu_gpu_compute_allocated_ratio{") and line.endswith(" 1.0")) == 2
    all_ = cluster.http.get("/apis/v1/plugins/DeviceShare/nodeDeviceSummaries").json()
    assert set(all_) == set(ALL)
    assert all_["gpu-node-a"]["deviceUsed"]["kubegpu.io/gpu-core"] == "200"
    assert cluster.http.get("/apis/v1/plugins/DeviceShare/nodeDeviceSummaries/nope").status_code == 404


def test_health_mig_and_nvlink(tmp_path: Path) -> None:
    a100 = FakeBackend("dgx-a100", node_name="nv").discover()
    sick = replace(a100, gpus=tuple(g.with_health(i != 0) for i, g in enumerate(a100.gpus)))
    t4 = FakeBackend("t4x4", node_name="pcie").discover()
    mig = FakeBackend("a100-mig", node_name="mig").discover()
    nodes = [{"apiVersion": "v1", "kind": "Node", "metadata": {"name": n}} for n in ("nv", "pcie", "mig")]
    api, ext = start_cluster(tmp_path, [sick, t4, mig], nodes)
    c = Cluster(api, ext)
    try:
        out = c.post("/filter", args(pod("w", {"nvidia.com/gpu": "8"}), ["nv"])).json()
        assert out["NodeNames"] == [] and out["FailedNodes"]["nv"] == "free whole GPUs: 7 of 7, 8 requested"
        assert bind(c, pod("w7", {"nvidia.com/gpu": "7"}), "nv") == ""
        uuids = {g.uuid for g in decode(api.get_object("pods", "w7", "default")["metadata"]["annotations"][
            DEVICE_ALLOCATED]).grants()}
        assert sick.gpus[0].uuid not in uuids  # the unhealthy GPU is never handed out
        link = pod("l", {"nvidia.com/gpu": "2"}, {REQUIRE_NVLINK: "true"})
        out = c.post("/filter", args(link, ["pcie", "mig"])).json()
        assert "NVLink" in out["FailedNodes"]["pcie"]
        out = c.post("/filter", args(pod("l2", {"nvidia.com/gpu": "2"}), ["pcie"])).json()
        assert out["NodeNames"] == ["pcie"]
        profile = mig.gpus[0].mig_devices[0].profile
        m = pod("m", {f"nvidia.com/mig-{profile}": "1"})
        assert c.post("/filter", args(m, ["mig", "pcie"])).json()["NodeNames"] == ["mig"]
        assert bind(c, m, "mig") == ""
        grant = decode(api.get_object("pods", "m", "default")["metadata"]["annotations"][DEVICE_ALLOCATED]).grants()
        assert grant[0].mig_uuid is not None and grant[0].mig_profile == profile
    finally:
        ext.stop()
        api.stop()


@pytest.mark.parametrize("mode", ["json"])
def test_filter_answer_is_compact_json_with_capitalised_keys(cluster: Cluster, mode: str) -> None:
    r = cluster.post("/filter", args(pod("p", {"nvidia.com/gpu": "1"}), ["gpu-node-a"]))
    assert r.headers["content-type"] == "application/json"
    assert json.loads(r.content)["NodeNames"] == ["gpu-node-a"]
    assert r.content.startswith(b'{"Nodes":null,"NodeNames":["gpu-node-a"],"FailedNodes":{}')


def test_all_summaries_stream_with_the_loop_free_between_steps(cluster: Cluster,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """At 5,000 nodes the all-nodes summary is ~32 MB and ~1 s of CPU: it is built a few nodes at a time with
    the loop's other work (the verbs) between, and says the same as the nodes' summaries one by one."""
    import asyncio
    import itertools

    from kubegpu.scheduler import app as app_module

    assert bind(cluster, pod("p", share(30, ratio=30)), "gpu-node-b") == ""
    ext = cluster.ext.service.extender  # type: ignore[union-attr]
    monkeypatch.setattr(app_module, "SUMMARY_NODES_PER_STEP", 1)
    events: list[str] = []
    one = ext.view.summary
    monkeypatch.setattr(ext.view, "summary", lambda n: (events.append(n), one(n))[1])

    async def stream() -> bytes:
        resp = await ext.summaries(None)  # type: ignore[arg-type]

        async def other_work() -> None:
            while True:
                events.append("tick")
                await asyncio.sleep(0)

        ticker = asyncio.create_task(other_work())
        body = b"".join([c if isinstance(c, bytes) else c.encode() async for c in resp.body_iterator])
        ticker.cancel()
        return body

    got = json.loads(asyncio.run(stream()))
    assert got == json.loads(cluster.http.get("/apis/v1/plugins/DeviceShare/nodeDeviceSummaries").content)
    assert set(got) == set(ALL) and got["gpu-node-b"]["deviceUsed"]["kubegpu.io/gpu-core"] == "30"
    nodes_at = [i for i, e in enumerate(events) if e != "tick"][:len(ALL)]
    assert all("tick" in events[a + 1:b] for a, b in itertools.pairwise(nodes_at)), events
