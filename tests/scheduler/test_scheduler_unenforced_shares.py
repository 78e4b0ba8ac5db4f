"""A node that cannot enforce shares as configured (MPS selected, its control binary missing): it advertises no
share capacity, and a pod asking a share is told why by the extender's filter, for that node whether or not
kube-scheduler sent it (kube-scheduler adds an extender's reason to a node it ruled out itself)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from sched_harness import plan_of
from test_scheduler_behaviour import pod, share

from kubegpu.inventory.fake import FakeBackend
from kubegpu.model import resources as R
from kubegpu.model.inventory import NodeInventory
from kubegpu.node.publish.capacity import share_capacity
from kubegpu.scheduler.limits import Limits, bounded_filter
from kubegpu.scheduler.state import ClusterView

WHY = "nvidia-cuda-mps-control not found under the driver root (driver root /)"


def unenforced(inv: NodeInventory) -> NodeInventory:
    return replace(inv, gpus=tuple(replace(g, share_enforcement="unenforced", share_enforcement_reason=WHY)
                                   for g in inv.gpus))


def test_a_node_that_cannot_enforce_shares_advertises_no_share_capacity() -> None:
    inv = FakeBackend("dgx-a100", node_name="gpu-node-3").discover()
    assert share_capacity(inv)[R.GPU_CORE] == "800"
    caps = share_capacity(unenforced(inv))
    assert caps == {R.GPU_CORE: "0", R.GPU_MEMORY: "0", R.GPU_MEMORY_RATIO: "0"}
    # One GPU still enforcing (its own reason for the others): only it is advertised.
    partly = replace(inv, gpus=(inv.gpus[0], *unenforced(inv).gpus[1:]))
    assert share_capacity(partly)[R.GPU_CORE] == "100"


def test_a_share_pod_is_told_why_a_node_cannot_take_shares() -> None:
    view = ClusterView(handoff_wait=False)
    view.set_inventory("gpu-node-2", FakeBackend("dgx-a100", node_name="gpu-node-2").discover())
    view.set_inventory("gpu-node-3", unenforced(FakeBackend("dgx-a100", node_name="gpu-node-3").discover()))
    # kube-scheduler ruled gpu-node-3 out itself (no share capacity) and sends only gpu-node-2, too small here.
    big = pod("s", share(25, mem="100Gi"))
    out = asyncio.run(bounded_filter(view, plan_of(big), ["gpu-node-2"], Limits()))
    assert list(out.passed) == []
    assert dict(out.failed)["gpu-node-3"] == f"node gpu-node-3 cannot enforce shares: {WHY}"
    # A share some node takes is placed: nothing to explain.
    fits = asyncio.run(bounded_filter(view, plan_of(pod("f", share(25, ratio=25))), ["gpu-node-2"], Limits()))
    assert list(fits.passed) == ["gpu-node-2"] and "gpu-node-3" not in dict(fits.failed)
    # A whole-GPU pod is not concerned.
    whole = asyncio.run(bounded_filter(view, plan_of(pod("w", {R.NVIDIA_GPU: "1"})), ["gpu-node-2"], Limits()))
    assert "gpu-node-3" not in dict(whole.failed)
