"""The stand-in kubelet behaves like the recorded real one (tests/fixtures/handoff, from the v1.24 kubelet
and kubegpu on v1.24/v1.36): init-container devices reused by app containers with no
GetPreferredAllocation when they suffice, ``must_include`` otherwise; PodResources one entry per device,
app containers only; Allocate IDs in no particular order; admission in watch order, not creation order."""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kubegpu.inventory.fake import FakeBackend
from kubegpu.node.daemon import NodeDaemon
from kubegpu.node.options import load_node_options
from kubegpu_standins.kubelet import StandinKubelet

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "handoff"
GPU = "nvidia.com/gpu"


@pytest.fixture
def node() -> Iterator[StandinKubelet]:
    d = Path(tempfile.mkdtemp(prefix="kgk-", dir="/tmp"))
    kubelet = StandinKubelet(d / "dp", seed=3)
    kubelet.start()
    backend = FakeBackend("dgx-a100")
    settings = {"cdi_dir": str(d / "cdi"), "mig_minors_file": str(d / "mm")}
    daemon = NodeDaemon(backend, lambda: load_node_options({"shared-slots": 0}, {}, settings=settings,
                                                           plugin_dir=str(d / "dp"), stream_wait_s=2.0))
    daemon.start()
    try:
        assert kubelet.wait_registered(GPU, timeout_s=10)
        yield kubelet
    finally:
        daemon.stop()
        kubelet.stop()
        backend.close()
        shutil.rmtree(d, ignore_errors=True)


def pod(name: str, app: int, init: int = 0) -> dict:
    spec: dict = {"containers": [{"name": "app", "resources": {"limits": {GPU: str(app)}}}]}
    if init:
        spec["initContainers"] = [{"name": "init", "resources": {"limits": {GPU: str(init)}}}]
    return {"metadata": {"name": name, "namespace": "dp", "uid": f"u-{name}"}, "spec": spec}


def calls(kubelet: StandinKubelet, since: int) -> list[tuple[str, dict | None]]:
    return [(c.rpc.rsplit("/", 1)[1], c.request) for c in kubelet.calls[since:]
            if c.rpc.endswith(("GetPreferredAllocation", "/Allocate"))]


def test_init_devices_are_reused_as_the_recorded_kubelet_did(node: StandinKubelet) -> None:
    # dp-init2-app1: GPA(init, size 2) -> Allocate; Allocate(app) with no GPA: its one device comes from init.
    n = len(node.calls)
    got = node.admit_pod(pod("init2-app1", app=1, init=2))
    seq = calls(node, n)
    assert [m for m, _ in seq] == ["GetPreferredAllocation", "Allocate", "Allocate"]
    init_ids = set(got.containers["init"][GPU].device_ids)
    assert set(got.containers["app"][GPU].device_ids) <= init_ids
    # dp-init1-app2: the app's GetPreferredAllocation must include the init device, size = the full request.
    n = len(node.calls)
    got = node.admit_pod(pod("init1-app2", app=2, init=1))
    seq = calls(node, n)
    assert [m for m, _ in seq] == ["GetPreferredAllocation", "Allocate", "GetPreferredAllocation", "Allocate"]
    gpa = seq[2][1]["container_requests"][0]
    init_dev = got.containers["init"][GPU].device_ids[0]
    assert gpa["must_include_deviceIDs"] == [init_dev] and gpa["allocation_size"] == 2
    assert init_dev in gpa["available_deviceIDs"]
    assert init_dev in got.containers["app"][GPU].device_ids


def test_pod_resources_lists_app_containers_one_entry_per_device(node: StandinKubelet) -> None:
    node.admit_pod(pod("two", app=2, init=1))
    listed = node.pod_resources().pod_resources
    (p,) = [x for x in listed if x.name == "two"]
    assert [c.name for c in p.containers] == ["app"]  # no init container
    assert [(d.resource_name, len(d.device_ids)) for d in p.containers[0].devices] == [(GPU, 1), (GPU, 1)]
    # As recorded from the real kubelet for a 2-GPU container:
    recorded = (FIXTURES / "podresources-two-gpu-container.txt").read_text()
    assert recorded.count("devices {") == 2 and recorded.count("device_ids:") == 2


def test_pod_resources_lists_the_pod_being_admitted_during_its_calls(node: StandinKubelet) -> None:
    """The kubelet adds a pod to its pod manager, which PodResources List enumerates, before it admits it: a List
    read during the pod's own Allocate names it (the node daemon relies on it to attribute the call)."""
    during: list[set[str]] = []
    unary = node._unary

    def spy(resource: str, method: str, call: Any, req: Any, timeout_s: float) -> Any:
        if method == "Allocate":
            during.append({p.name for p in node.pod_resources().pod_resources})
        return unary(resource, method, call, req, timeout_s)

    node._unary = spy  # type: ignore[method-assign]
    assert node.admit_pod(pod("first", app=1)).ok
    assert during == [{"first"}]


def test_allocate_ids_reach_the_plugin_in_no_particular_order(node: StandinKubelet) -> None:
    same_order = set()
    for i in range(6):
        got = node.admit_pod(pod(f"four-{i}", app=4)).containers["app"][GPU]
        assert got.preferred is not None and set(got.device_ids) == set(got.preferred)  # preference honoured
        same_order.add(got.device_ids == got.preferred)  # recorded: preferred [G0,G3] -> Allocate [G3,G0]
        node.release_pod(f"dp/four-{i}")
    assert False in same_order


def test_a_pod_that_cannot_be_served_fails_with_the_kubelets_message(node: StandinKubelet) -> None:
    got = node.admit_pod(pod("too-big", app=9))
    assert not got.ok and "Requested: 9, Available: 8" in got.reason
    assert [c.name for p in node.pod_resources().pod_resources if p.name == "too-big" for c in p.containers] == []


def test_the_recorded_kubelet_admitted_in_watch_order_not_creation_order() -> None:
    log = (FIXTURES / "kubelet-admission-order.log").read_text()
    adds = re.findall(r'"SyncLoop ADD".*pods=\[default/(c-whole-\d)\]', log)
    runs = re.findall(r'"Device run options for container" pod="default/(c-whole-\d)"', log)
    assert adds == runs == ["c-whole-1", "c-whole-4", "c-whole-3", "c-whole-2"]  # created 1, 2, 3, 4
