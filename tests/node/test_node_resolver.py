"""The full-mode seam: an AllocationResolver steers GetPreferredAllocation and decides Allocate."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from kubegpu.model.allocation import DeviceGrant
from kubegpu.model.inventory import NodeInventory
from kubegpu.node.deviceplugin.resolver import AllocationRefused, ResolvedAllocation
from kubegpu_standins.kubelet import AllocationFailed, StandinKubelet

SLOTS = "kubegpu.io/gpu.shared"


class RecordedChoices:
    """A stand-in for node.handoff: one pending pod whose GPUs the scheduler recorded."""

    def __init__(self, gpus: list[DeviceGrant]) -> None:
        self.gpus = gpus
        self.calls: list[tuple[str, tuple[str, ...]]] = []
        self.lock = threading.Lock()

    def resolve(self, resource: str, device_ids: Sequence[str]) -> ResolvedAllocation | None:
        with self.lock:
            self.calls.append((resource, tuple(device_ids)))
        if resource != SLOTS:
            return None
        picked = {i.split("::")[0] for i in device_ids}
        if picked != {g.uuid for g in self.gpus}:
            raise AllocationRefused(f"no pending pod on this node was assigned GPUs {sorted(picked)}")
        return ResolvedAllocation(tuple(self.gpus), pod="default/trainer", container="main")

    def preferred(self, resource: str, available: Sequence[str], must_include: Sequence[str],
                  size: int) -> Sequence[str] | None:
        if resource != SLOTS:
            return None
        want = {g.uuid for g in self.gpus}
        out: list[str] = []
        for i in available:
            u = i.split("::")[0]
            if u in want:
                out.append(i)
                want.discard(u)
        return out

    def set_inventory(self, inventory: NodeInventory) -> None:
        pass

    def kubelet_registered(self, resource: str) -> None:
        pass


def test_slots_follow_the_recorded_choice(kubelet: StandinKubelet, make_daemon: Any) -> None:
    from kubegpu.inventory.fake import FakeBackend

    gpus = FakeBackend("dgx1-v100").discover().gpus
    rec = RecordedChoices([DeviceGrant(gpus[2].minor, gpus[2].uuid, 30, 4 * 2**30, 0),
                           DeviceGrant(gpus[5].minor, gpus[5].uuid, 30, 4 * 2**30, 0)])
    make_daemon("dgx1-v100", flags={"shared-slots": "10", "device-list-strategy": "envvar"}, resolver=rec)
    assert kubelet.wait_registered(SLOTS, timeout_s=5)
    got = kubelet.allocate(SLOTS, 2)
    assert {i.split("::")[0] for i in got.device_ids} == {gpus[2].uuid, gpus[5].uuid}
    envs = got.response.envs
    assert envs["NVIDIA_VISIBLE_DEVICES"] == f"{gpus[2].uuid},{gpus[5].uuid}"
    assert envs["KUBEGPU_VISIBLE_GPUS"] == envs["NVIDIA_VISIBLE_DEVICES"]
    assert envs["KUBEGPU_GPU_CORE_PERCENT"] == "30"
    assert envs["KUBEGPU_GPU_MEMORY_BYTES"] == str(4 * 2**30)
    # Whole GPUs: the resolver declines (None) and the plugin serves the IDs as they are.
    whole = kubelet.allocate("nvidia.com/gpu", 1)
    assert whole.response.envs["NVIDIA_VISIBLE_DEVICES"] == whole.device_ids[0]
    assert ("nvidia.com/gpu", whole.device_ids) in rec.calls


def test_refusal_fails_allocate_with_its_message(kubelet: StandinKubelet, make_daemon: Any) -> None:
    from kubegpu.inventory.fake import FakeBackend

    gpus = FakeBackend("t4x4").discover().gpus
    rec = RecordedChoices([DeviceGrant(gpus[0].minor, gpus[0].uuid, 50, 0, 0)])
    make_daemon("t4x4", flags={"shared-slots": "4"}, resolver=rec)
    assert kubelet.wait_registered(SLOTS, timeout_s=5)
    wrong = f"{gpus[3].uuid}::0"
    with pytest.raises(grpc.RpcError) as e:
        kubelet.allocate_ids(SLOTS, [wrong])
    assert "no pending pod on this node was assigned GPUs" in e.value.details()
    # Memory 0 in the record means "the GPU's memory" when it is a whole-memory grant.
    ok = kubelet.allocate(SLOTS, 1)
    assert ok.response.envs["KUBEGPU_GPU_MEMORY_BYTES"] == str(gpus[0].memory_bytes)


def test_resolver_naming_an_unhealthy_gpu_is_refused(kubelet: StandinKubelet, make_daemon: Any) -> None:
    from kubegpu.inventory.fake import FakeBackend

    gpus = FakeBackend("t4x4").discover().gpus

    class Stale(RecordedChoices):
        def resolve(self, resource: str, device_ids: Sequence[str]) -> ResolvedAllocation | None:
            return ResolvedAllocation((DeviceGrant(gpus[1].minor, gpus[1].uuid, 20, 2**30, 0),), pod="ns/p")

    _, backend = make_daemon("t4x4", flags={"shared-slots": "4", "health-recovery-interval": "0s"},
                             resolver=Stale([]))
    assert kubelet.wait_registered(SLOTS, timeout_s=5)
    backend.inject_xid(1, 79)
    assert kubelet.wait_for(lambda: any(i.startswith(gpus[1].uuid) for i in kubelet.unhealthy(SLOTS)), 2)
    with pytest.raises(AllocationFailed, match=f"names unhealthy GPU {gpus[1].uuid}"):
        kubelet.allocate(SLOTS, 1)


def test_with_a_resolver_calls_run_off_the_grpc_loop_and_can_read_pod_resources(
        kubelet: StandinKubelet, make_daemon: Any, sockdir: Path) -> None:
    """Cluster mode: the resolver may wait on the API server and reads the kubelet's PodResources, itself a call
    on the daemon's one gRPC loop; run on that loop it would block every call and could not read PodResources
    at all (rpc.call refuses to wait on its own thread, and the handoff takes a failed read as no answer)."""
    from kubegpu.node.handoff.verify import list_pod_resources

    sock = sockdir / "pod-resources.sock"
    kubelet.serve_pod_resources(sock)
    seen: list[tuple[str, str, int]] = []

    class ReadsPodResources(RecordedChoices):
        def resolve(self, resource: str, device_ids: Sequence[str]) -> ResolvedAllocation | None:
            seen.append(("resolve", threading.current_thread().name, len(list_pod_resources(str(sock), 1.0))))
            return None

        def preferred(self, resource: str, available: Sequence[str], must_include: Sequence[str],
                      size: int) -> Sequence[str] | None:
            seen.append(("preferred", threading.current_thread().name, len(list_pod_resources(str(sock), 1.0))))
            return None

    make_daemon("t4x4", resolver=ReadsPodResources([]))
    assert kubelet.wait_registered("nvidia.com/gpu", timeout_s=5)
    kubelet.allocate("nvidia.com/gpu", 1, pod="default/first", container="main")
    kubelet.allocate("nvidia.com/gpu", 1, pod="default/second", container="main")
    assert [what for what, _, _ in seen] == ["preferred", "resolve", "preferred", "resolve"]
    assert all(name.startswith("dp-") for _, name, _ in seen), seen
    assert seen[-1][2] == 2  # the kubelet's word read: the first pod and its GPU, while the second is admitted


def test_without_a_resolver_calls_answer_on_the_grpc_loop(kubelet: StandinKubelet, make_daemon: Any) -> None:
    """Standalone: nothing Allocate or GetPreferredAllocation does can block, and a thread hop costs ~0.2 ms
    of the 1 ms p99 target, so they answer on the loop."""
    d, _ = make_daemon("t4x4")
    assert kubelet.wait_registered("nvidia.com/gpu", timeout_s=5)
    server = d.servers[0]
    threads: list[str] = []
    for name in ("allocate", "preferred"):
        original = getattr(server, name)

        def recording(request: Any, original: Any = original) -> Any:
            threads.append(threading.current_thread().name)
            return original(request)

        setattr(server, name, recording)
    kubelet.allocate("nvidia.com/gpu", 1)
    assert threads == ["grpc-loop", "grpc-loop"]
