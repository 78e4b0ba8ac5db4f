"""Bind refuses what filter accepted only when something took the room in between, and then says what.

Recorded on v1.36 under churn: ``kubegpu bind: gpu-node-11: 0 GPUs can take this, 1 needed`` 65 times, a median
0.83 s after a pod on that node was deleted. The deletion freed a GPU; kube-scheduler retried its waiting pods at
once and filtered several before the first one's bind arrived (binds are asynchronous), and its own count of the
node's ``nvidia.com/gpu`` does not see the GPUs shares fill, so it sent two pods to the one free GPU. The extender
passed both (nothing was bound yet) and the second bind found it taken, with a reason that did not say so."""

from __future__ import annotations

from sched_harness import Cluster
from test_scheduler_behaviour import args, bind, pod

from kubegpu.model import resources as R

NODE = "gpu-node-c"  # one A100


def test_a_bind_whose_room_went_to_a_pod_bound_since_its_filter_says_which(cluster: Cluster) -> None:
    first, second = pod("w1", {R.NVIDIA_GPU: "1"}), pod("w2", {R.NVIDIA_GPU: "1"})
    for p in (first, second):  # both filtered before either bind arrives: the one GPU is free for each
        passed = cluster.post("/filter", args(p, [NODE])).json()["NodeNames"]
        assert passed == [NODE]
    assert bind(cluster, first, NODE) == ""
    error = bind(cluster, second, NODE)
    assert error.startswith(f"kubegpu bind: {NODE}: 0 GPUs can take this, 1 needed")
    assert "taken since by pods bound there: default/w1 (GPU 0 whole" in error


def test_a_bind_whose_room_went_without_a_bind_here_says_so(cluster: Cluster) -> None:
    p = pod("w3", {R.NVIDIA_GPU: "2"})
    error = bind(cluster, p, NODE)  # never fitted: no bind took anything
    assert "0 GPUs can take this" in error or "1 GPUs can take this, 2 needed" in error
    assert "no pod was bound there through this extender" in error


def test_a_pod_without_gpus_on_a_node_without_kubegpu_gpus_gets_a_plain_binding(cluster: Cluster) -> None:
    """The bind extender names no managed resource (install/render.py: bind has its own, longer timeout), so
    kube-scheduler sends it every pod of its profile, CPU-only pods on CPU-only nodes too."""
    plain = pod("cpu", {"cpu": "1"})
    assert bind(cluster, plain, "cpu-node-1") == ""
    bound = cluster.api.get_object("pods", "cpu", "default")
    assert bound["spec"]["nodeName"] == "cpu-node-1"
    assert "kubegpu.io/device-allocated" not in (bound["metadata"].get("annotations") or {})
