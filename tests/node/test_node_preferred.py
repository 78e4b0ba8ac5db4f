"""GetPreferredAllocation: NVLink-aware whole GPUs on the DGX-1, distributed/packed replicas, slots."""

from __future__ import annotations

import itertools
from typing import Any

from kubegpu.node.deviceplugin.plugin_model import AdvertisedDevice
from kubegpu.node.deviceplugin.preferred import replicas
from kubegpu_standins.kubelet import StandinKubelet

GPU = "nvidia.com/gpu"


def _links(d: Any) -> dict[tuple[int, int], int]:
    idx = {g.uuid: g.index for g in d.inventory.gpus}
    return {(idx[g.uuid], idx[p]): n for g in d.inventory.gpus for p, n in g.links.items()}


def test_dgx1_pairs_quads_and_singles(kubelet: StandinKubelet, make_daemon: Any) -> None:
    d, _ = make_daemon("dgx1-v100")
    assert kubelet.wait_registered(GPU, timeout_s=5)
    links = _links(d)
    idx = {g.uuid: g.index for g in d.inventory.gpus}
    everything = [g.uuid for g in d.inventory.gpus]

    pair = kubelet.preferred(GPU, everything, 2)
    a, b = sorted(idx[u] for u in pair)
    assert links[(a, b)] == 2, f"2-GPU request got a {links.get((a, b), 0)}-link pair"

    quad = sorted(idx[u] for u in kubelet.preferred(GPU, everything, 4))
    assert all(links.get((x, y), 0) >= 1 for x, y in itertools.combinations(quad, 2)), quad

    # A single GPU should not break a 2-link pair when a GPU outside any free pair exists:
    # with 0 and 3 taken (a 2-link pair), ask among the rest for one GPU, then for a pair.
    rest = [u for u in everything if idx[u] not in (0, 3)]
    one = kubelet.preferred(GPU, rest, 1)
    remaining = [u for u in rest if u not in one]
    pair2 = sorted(idx[u] for u in kubelet.preferred(GPU, remaining, 2))
    assert links[tuple(pair2)] == 2  # type: ignore[index]


def test_must_include_is_honoured(kubelet: StandinKubelet, make_daemon: Any) -> None:
    d, _ = make_daemon("dgx1-v100")
    assert kubelet.wait_registered(GPU, timeout_s=5)
    everything = [g.uuid for g in d.inventory.gpus]
    g5 = d.inventory.gpus[5].uuid
    got = kubelet.preferred(GPU, everything, 2, must_include=[g5])
    assert g5 in got and len(got) == 2
    links = _links(d)
    idx = {g.uuid: g.index for g in d.inventory.gpus}
    other = next(idx[u] for u in got if u != g5)
    assert links[(5, other)] == 2


def test_kubelet_uses_the_preference(kubelet: StandinKubelet, make_daemon: Any) -> None:
    make_daemon("dgx1-v100")
    assert kubelet.wait_registered(GPU, timeout_s=5)
    got = kubelet.allocate(GPU, 4)
    assert got.preferred is not None and set(got.device_ids) == set(got.preferred)


def _devs(n_gpus: int, reps: int) -> list[AdvertisedDevice]:
    return [AdvertisedDevice(id=f"GPU-{g}::{k}", uuid=f"GPU-{g}", index=str(g), gpu_uuid=f"GPU-{g}", minor=g,
                             replica=k) for g in range(n_gpus) for k in range(reps)]


def test_replicas_distributed_and_packed() -> None:
    devs = _devs(3, 4)
    known = {d.id: d for d in devs}
    # GPU-0 has 2 replicas in use, GPU-1 one, GPU-2 none.
    in_use = {"GPU-0::0", "GPU-0::1", "GPU-1::0"}
    avail = [d.id for d in devs if d.id not in in_use]
    assert replicas(devs, avail, [], 1, known, "distributed") == ["GPU-2::0"]
    assert replicas(devs, avail, [], 1, known, "packed") == ["GPU-0::2"]
    # Distributed: one container's replicas on distinct GPUs, least shared first.
    got = replicas(devs, avail, [], 3, known, "distributed")
    assert [known[i].uuid for i in got] == ["GPU-2", "GPU-1", "GPU-0"]
    # Packed replicas pile onto the busiest GPU.
    got = replicas(devs, avail, [], 2, known, "packed", distinct=False)
    assert [known[i].uuid for i in got] == ["GPU-0", "GPU-0"]
    # Must-include first.
    got = replicas(devs, avail, ["GPU-1::3"], 2, known, "distributed")
    assert got[0] == "GPU-1::3" and known[got[1]].uuid == "GPU-2"


def test_time_slicing_replicas_over_grpc(kubelet: StandinKubelet, make_daemon: Any) -> None:
    d, _ = make_daemon("t4x4", flags={"resource-config": "gpu:sharedgpu:4"})
    res = "nvidia.com/sharedgpu"
    assert kubelet.wait_registered(res, timeout_s=5)
    assert kubelet.capacity(res) == 16 and GPU not in kubelet.resources
    first = kubelet.allocate(res, 1)
    second = kubelet.allocate(res, 1)
    # Distributed: the second replica lands on another GPU.
    assert first.device_ids[0].split("::")[0] != second.device_ids[0].split("::")[0]
    envs = second.response.envs
    uuid = second.device_ids[0].split("::")[0]
    assert envs["NVIDIA_VISIBLE_DEVICES"] == uuid
    assert envs["KUBEGPU_GPU_CORE_PERCENT"] == "25"
    assert int(envs["KUBEGPU_GPU_MEMORY_BYTES"]) == d.inventory.gpu(uuid).memory_bytes // 4


def test_slots_on_distinct_gpus_8x100(kubelet: StandinKubelet, make_daemon: Any) -> None:
    make_daemon("dgx1-v100", flags={"shared-slots": "100"})
    res = "kubegpu.io/gpu.shared"
    assert kubelet.wait_registered(res, timeout_s=5)
    assert kubelet.capacity(res) == 800 and kubelet.capacity(GPU) == 8
    got = kubelet.allocate(res, 3)
    gpus = {i.split("::")[0] for i in got.device_ids}
    assert len(gpus) == 3
    assert set(got.response.envs["KUBEGPU_VISIBLE_GPUS"].split(",")) == gpus
    # Without a resolver the share is unknown: no core/memory variables are invented.
    assert "KUBEGPU_GPU_CORE_PERCENT" not in got.response.envs
    # The next single slot goes to a GPU not yet used (least shared).
    nxt = kubelet.allocate(res, 1)
    assert nxt.device_ids[0].split("::")[0] not in gpus



def test_packed_replica_choice_over_grpc(kubelet: StandinKubelet, make_daemon: Any) -> None:
    make_daemon("t4x4", flags={"resource-config": "gpu:sharedgpu:4", "replica-choice": "packed"})
    res = "nvidia.com/sharedgpu"
    assert kubelet.wait_registered(res, timeout_s=5)
    first = kubelet.allocate(res, 1)
    second = kubelet.allocate(res, 1)
    third = kubelet.allocate(res, 1)
    gpus = {a.device_ids[0].split("::")[0] for a in (first, second, third)}
    assert len(gpus) == 1  # packed: the busiest GPU with room first
