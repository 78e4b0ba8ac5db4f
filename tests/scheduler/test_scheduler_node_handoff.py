"""The node side of the handoff: identical pods bound at once each get their own recorded GPUs;
acknowledgements survive a restart; PodResources mismatches become Events and a metric; node capacity."""

from __future__ import annotations

import concurrent.futures as cf
import json
import threading
from pathlib import Path

import pytest
from sched_harness import Cluster
from test_scheduler_accounting import _concurrent_binds
from test_scheduler_behaviour import pod, share

from kubegpu.inventory.fake import FakeBackend
from kubegpu.kube import Node, Pod, make_client
from kubegpu.model import resources as R
from kubegpu.model.allocation import decode
from kubegpu.model.annotations import DEVICE_ALLOCATED
from kubegpu.node.capacity import publish_capacity, share_capacity
from kubegpu.node.handoff import DEVICE_ASSIGNED, HandoffResolver, make_resolver
from kubegpu.node.resolver import AllocationRefused

NODE = "gpu-node-a"


def _slots(n_per_gpu: int = 4) -> list[str]:
    gpus = FakeBackend("dgx-a100", node_name=NODE).discover().gpus
    return [f"{g.uuid}::{k}" for g in gpus for k in range(n_per_gpu)]


class KubeletOrder:
    """Watches pods bound to the node the way the kubelet does, and admits them in that order."""

    def __init__(self, cluster: Cluster) -> None:
        self.client = make_client(cluster.api.write_kubeconfig(Path(cluster.api_dir) / "kl"))
        self.order: list[str] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for kind, p in self.client.watch(Pod, namespace="*", fields={"spec.nodeName": NODE}, server_timeout=5):
                if kind == "ADDED" and p.metadata.name not in self.order:
                    self.order.append(p.metadata.name)
        except Exception:
            return  # the API server stopped at the end of the test

    def admission_order(self, names: set[str]) -> list[str]:
        created = {p.metadata.name: p.metadata.creationTimestamp for p in self.client.list(Pod, namespace="*")}
        seen = [n for n in self.order if n in names]
        return sorted(seen, key=lambda n: (str(created[n]), seen.index(n)))


@pytest.fixture
def handoff(cluster: Cluster, tmp_path: Path):
    cluster.api_dir = tmp_path  # type: ignore[attr-defined]
    client = make_client(cluster.api.write_kubeconfig(tmp_path / "node-kc"))
    resolver = make_resolver(client, NODE, pod_resources_socket=str(tmp_path / "none.sock"), verify_interval_s=3600)
    try:
        yield resolver
    finally:
        resolver.close()


def test_identical_pods_bound_at_once_each_get_their_own_gpus(cluster: Cluster, handoff: HandoffResolver) -> None:
    kubelet = KubeletOrder(cluster)
    pods = [pod(f"same-{i}", share(60, ratio=40)) for i in range(8)]  # one per GPU: 60 % leaves no room for two
    assert _concurrent_binds(cluster, pods, NODE) == [""] * 8
    names = {p["metadata"]["name"] for p in pods}
    for _ in range(400):  # generous: the machine may be busy
        with handoff._lock:
            seen = len(handoff._pending(R.GPU_SLOTS, 1))
        if len([n for n in kubelet.order if n in names]) == 8 and seen == 8:
            break
        threading.Event().wait(0.05)
    order = kubelet.admission_order(names)
    assert len(order) == 8
    free = set(_slots())
    for name in order:  # the kubelet admits one pod at a time: GetPreferredAllocation, then Allocate
        hint = handoff.preferred(R.GPU_SLOTS, sorted(free), [], 1)
        ids = list(hint) if hint else [sorted(free)[0]]
        free -= set(ids)
        got = handoff.resolve(R.GPU_SLOTS, ids)
        assert got is not None and got.pod == f"default/{name}"
        recorded = decode(cluster.api.get_object("pods", name, "default")["metadata"]["annotations"][DEVICE_ALLOCATED])
        assert got.uuids == tuple(g.uuid for g in recorded.grants())
        assert [(s.core_percent, s.memory_bytes) for s in got.gpus] == [(60, g.memory_bytes) for g in recorded.grants()]
        assert {i.split("::")[0] for i in ids} == set(got.uuids)  # steering made the kubelet agree
    # Nothing is left to serve, and every pod carries its acknowledgement.
    with pytest.raises(AllocationRefused):
        handoff.wait_s = 0.2
        handoff.resolve(R.GPU_SLOTS, [sorted(free)[0]])
    for name in order:
        assert DEVICE_ASSIGNED in cluster.api.get_object("pods", name, "default")["metadata"]["annotations"]


def test_concurrent_allocates_serve_each_container_once(cluster: Cluster, handoff: HandoffResolver) -> None:
    pods = [pod(f"c-{i}", share(20, ratio=10)) for i in range(12)]
    assert _concurrent_binds(cluster, pods, NODE).count("") == 12
    slots = _slots()
    handoff.wait_s = 3.0
    with cf.ThreadPoolExecutor(12) as ex:
        got = list(ex.map(lambda i: handoff.resolve(R.GPU_SLOTS, [slots[i]]), range(12)))
    assert sorted(g.pod for g in got) == sorted(f"default/c-{i}" for i in range(12))
    # A restarted node daemon rebuilds what was served from the acknowledgements: nothing is served twice.
    fresh = make_resolver(handoff.client, NODE, pod_resources_socket="/nonexistent", verify_interval_s=3600)
    try:
        fresh.wait_s = 0.3
        with pytest.raises(AllocationRefused):
            fresh.resolve(R.GPU_SLOTS, [slots[0]])
    finally:
        fresh.close()


def test_every_container_of_a_pod_is_acknowledged(cluster: Cluster, handoff: HandoffResolver) -> None:
    two = pod("two", [{"nvidia.com/gpu": "1"}, share(20, ratio=10)])
    assert _concurrent_binds(cluster, [two], NODE) == [""]
    whole = handoff.resolve(R.NVIDIA_GPU, ["GPU-k"])
    part = handoff.resolve(R.GPU_SLOTS, [_slots()[5]])
    assert (whole.container, part.container) == ("c0", "c1")
    for _ in range(200):
        ack = cluster.api.get_object("pods", "two", "default")["metadata"]["annotations"].get(DEVICE_ASSIGNED, "{}")
        if set(json.loads(ack).get("containers", {})) == {"c0", "c1"}:
            break
        threading.Event().wait(0.05)
    assert json.loads(ack)["containers"]["c1"]["resource"] == R.GPU_SLOTS
    fresh = make_resolver(handoff.client, NODE, pod_resources_socket="/nonexistent", verify_interval_s=3600)
    try:
        fresh.wait_s = 0.2
        assert fresh.resolve(R.NVIDIA_GPU, ["GPU-k"]) is None  # served before the restart: not again
        with pytest.raises(AllocationRefused):
            fresh.resolve(R.GPU_SLOTS, [_slots()[5]])
    finally:
        fresh.close()


def test_pod_resources_mismatch_is_an_event_and_a_metric(cluster: Cluster, handoff: HandoffResolver) -> None:
    pods = [pod("p1", {"nvidia.com/gpu": "1"}), pod("p2", {"nvidia.com/gpu": "1"})]
    assert _concurrent_binds(cluster, pods, NODE) == ["", ""]
    a = handoff.resolve(R.NVIDIA_GPU, ["GPU-x"])
    b = handoff.resolve(R.NVIDIA_GPU, ["GPU-y"])
    assert {a.pod, b.pod} == {"default/p1", "default/p2"}
    # The kubelet says the devices served as p1's went to p2 and the other way round.
    first, second = (a, b) if a.pod == "default/p1" else (b, a)
    holdings = [("default", "p2", "c0", R.NVIDIA_GPU, ["GPU-x" if first is a else "GPU-y"]),
                ("default", "p1", "c0", R.NVIDIA_GPU, ["GPU-y" if first is a else "GPU-x"])]
    problems = handoff.verify(holdings)
    assert len(problems) == 2 and all("served as the recorded allocation of" in p for p in problems)
    assert handoff.verify(holdings) == problems  # still wrong, but reported once
    assert handoff.metrics.mismatches._value.get() == 2
    events = [e for e in cluster.api.objects("events", namespace="default") if e["reason"] == "GpuHandoffMismatch"]
    assert sorted(e["involvedObject"]["name"] for e in events) == ["p1", "p2"]
    assert all(e["type"] == "Warning" for e in events)
    # Matching holdings are quiet.
    good = [("default", "p1", "c0", R.NVIDIA_GPU, ["GPU-x" if first is a else "GPU-y"])]
    assert handoff.verify(good) == []
    assert second.pod == "default/p2"


def test_unrecorded_whole_gpu_pods_are_served_as_asked(handoff: HandoffResolver) -> None:
    handoff.wait_s = 0.1
    assert handoff.resolve(R.NVIDIA_GPU, ["GPU-1"]) is None
    assert handoff.resolve("nvidia.com/mig-1g.10gb", ["MIG-1"]) is None
    with pytest.raises(AllocationRefused, match=r"recorded kubegpu\.io/gpu\.shared"):
        handoff.resolve(R.GPU_SLOTS, ["GPU-1::0"])


def test_node_capacity_follows_health(cluster: Cluster, tmp_path: Path) -> None:
    client = make_client(cluster.api.write_kubeconfig(tmp_path / "cap"))
    inv = FakeBackend("dgx-a100", node_name=NODE).discover()
    assert share_capacity(inv) == {R.GPU_CORE: "800", R.GPU_MEMORY: "640Gi", R.GPU_MEMORY_RATIO: "800"}
    assert publish_capacity(client, inv)
    status = client.get(Node, NODE).status
    assert status.capacity[R.GPU_CORE] == "800" and status.allocatable[R.GPU_MEMORY] == "640Gi"
    assert status.capacity["nvidia.com/gpu"] == "8"  # the kubelet's own entries are kept
    sick = inv.with_gpu_health(inv.gpus[3].uuid, False)
    assert publish_capacity(client, sick)
    status = client.get(Node, NODE).status
    assert (status.capacity[R.GPU_CORE], status.capacity[R.GPU_MEMORY_RATIO]) == ("700", "700")
    assert status.allocatable[R.GPU_MEMORY] == "560Gi"
    from dataclasses import replace

    assert not publish_capacity(client, replace(inv, name="no-such-node"))


class _PodResources:
    """A kubelet PodResources endpoint on a unix socket, answering ``List`` with given holdings."""

    def __init__(self, path: str, holdings: list[tuple[str, str, str, str, list[str]]]) -> None:
        from concurrent import futures

        import grpc

        from kubegpu.node.proto import podresources_pb2 as pr
        from kubegpu.node.proto import podresources_pb2_grpc as prg

        class Lister(prg.PodResourcesListerServicer):
            def List(self, request, context):
                pods: dict[tuple[str, str], pr.PodResources] = {}
                for ns, name, container, resource, ids in holdings:
                    p = pods.setdefault((ns, name), pr.PodResources(name=name, namespace=ns))
                    p.containers.append(pr.ContainerResources(name=container, devices=[
                        pr.ContainerDevices(resource_name=resource, device_ids=ids)]))
                return pr.ListPodResourcesResponse(pod_resources=list(pods.values()))

        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        prg.add_PodResourcesListerServicer_to_server(Lister(), self.server)
        self.server.add_insecure_port(f"unix://{path}")
        self.server.start()

    def stop(self) -> None:
        self.server.stop(0)


def test_verifier_reads_the_kubelet_pod_resources_api(cluster: Cluster, handoff: HandoffResolver) -> None:
    import tempfile

    from kubegpu.node.handoff import Verifier

    pods = [pod("v1", {"nvidia.com/gpu": "1"}), pod("v2", {"nvidia.com/gpu": "1"})]
    assert _concurrent_binds(cluster, pods, NODE) == ["", ""]
    a = handoff.resolve(R.NVIDIA_GPU, ["GPU-a"])
    b = handoff.resolve(R.NVIDIA_GPU, ["GPU-b"])
    sock = tempfile.mktemp(prefix="kgpr-", suffix=".sock", dir="/tmp")
    right = [("default", a.pod.split("/")[1], "c0", R.NVIDIA_GPU, ["GPU-a"]),
             ("default", b.pod.split("/")[1], "c0", R.NVIDIA_GPU, ["GPU-b"]),
             ("default", "other", "c0", "nvidia.com/mig-1g.10gb", ["MIG-1"])]
    server = _PodResources(sock, right)
    try:
        assert Verifier(handoff, sock).check() == []
    finally:
        server.stop()
    swapped = [("default", a.pod.split("/")[1], "c0", R.NVIDIA_GPU, ["GPU-b"])]
    server = _PodResources(sock, swapped)
    try:
        problems = Verifier(handoff, sock).check()
        assert len(problems) == 1 and f"served as the recorded allocation of {b.pod}" in problems[0]
        assert handoff.metrics.mismatches._value.get() == 1
    finally:
        server.stop()
    assert Verifier(handoff, sock + ".gone").check() == []  # no kubelet socket: nothing to compare, no crash
