"""What a daemon is told and what a container gets: pure, no daemon."""

from __future__ import annotations

import pytest

from kubegpu.model.inventory import Gpu
from kubegpu.node.mps.capability import gpu_enforcement, refusal
from kubegpu.node.mps.spec import ShareShapeError, binding, replica_spec, share_spec

H200 = 150754820096  # bytes, as NVML reported the fixture's H200


def test_replica_defaults_are_nvidias() -> None:
    spec = replica_spec("nvidia.com/gpu", [("GPU-a", H200)] * 4, 4)
    # The fixture's Allocate answer for a 1-of-4 replica: 25 and 0=35942M.
    assert spec.default_commands() == ["set_default_active_thread_percentage 25",
                                       "set_default_device_pinned_mem_limit GPU-a 35942M"]
    b = binding(spec, "/run/nvidia/mps", ["GPU-a"])
    assert dict(b.env) == {"CUDA_MPS_PIPE_DIRECTORY": "/mps/nvidia.com_gpu/pipe",
                           "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
                           "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=35942M"}
    assert b.mounts == (("/run/nvidia/mps/nvidia.com_gpu/pipe", "/mps/nvidia.com_gpu/pipe"),
                        ("/run/nvidia/mps/nvidia.com_gpu/pipe", "/tmp/nvidia-mps"),
                        ("/run/nvidia/mps/shm", "/dev/shm"))


def test_share_daemon_is_named_by_its_shape_alone() -> None:
    a = share_spec([("GPU-a", 25, 16 * 2**30)])
    assert a == share_spec([("GPU-a", 25, 16 * 2**30)])
    assert a.name.startswith("share-c25-m16384-")
    others = {share_spec([("GPU-a", 50, 16 * 2**30)]).name, share_spec([("GPU-a", 25, 8 * 2**30)]).name,
              share_spec([("GPU-b", 25, 16 * 2**30)]).name, a.name}
    assert len(others) == 4
    two = share_spec([("GPU-b", 30, 4 * 2**30), ("GPU-a", 30, 6 * 2**30)])
    assert two.default_commands()[1:] == ["set_default_device_pinned_mem_limit GPU-b 4096M",
                                          "set_default_device_pinned_mem_limit GPU-a 6144M"]
    # The container's device order decides the ordinals of its memory limits.
    assert dict(binding(two, "/r", ["GPU-a", "GPU-b"]).env)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=6144M,1=4096M"


@pytest.mark.parametrize("parts, match", [
    ([("GPU-a", 30, 2**30), ("GPU-b", 40, 2**30)], "different compute percents"),
    ([("GPU-a", 30, 2**30), ("GPU-a", 30, 2**30)], "one GPU twice"),
    ([("GPU-a", 0, 2**30)], "outside 1..100"),
    ([], "no GPUs"),
])
def test_shapes_one_daemon_cannot_hold_are_refused(parts: list[tuple[str, int, int]], match: str) -> None:
    with pytest.raises(ShareShapeError, match=match):
        share_spec(parts)


def test_which_gpus_mps_can_enforce() -> None:
    hopper = Gpu("GPU-h", 0, 0, "H200", H200, compute_capability=(9, 0))
    pascal = Gpu("GPU-p", 1, 1, "P100", 16 * 2**30, compute_capability=(6, 0))
    mig = Gpu("GPU-m", 2, 2, "A100", 40 * 2**30, compute_capability=(8, 0), mig_enabled=True)
    assert refusal(hopper) == ""
    assert "older than Volta" in refusal(pascal)
    assert "MIG" in refusal(mig)
    assert "time-slicing" in refusal(hopper, time_sliced=True)
    assert gpu_enforcement(hopper, "mps").mode == "mps"
    assert gpu_enforcement(hopper, "none").mode == "none"
    down = gpu_enforcement(hopper, "mps", daemon_down="daemon x is down")
    assert (down.mode, down.reason) == ("unenforced", "daemon x is down")
    assert gpu_enforcement(pascal, "mps").mode == "unenforced"


class _Manager:
    """Records what the enforcer asks for (no daemon)."""

    missing_reason = ""

    def __init__(self) -> None:
        self.asked: list[object] = []

    def serve(self, spec: object, order: object = None) -> object:
        self.asked.append(spec)
        return spec

    def down(self) -> dict[str, object]:
        return {}


def test_what_the_enforcer_asks_for_each_kind_of_share() -> None:
    from kubegpu.model.inventory import NodeInventory
    from kubegpu.node.mps.enforcer import ShareEnforcer

    gpu = Gpu("GPU-h", 0, 0, "H200", H200, compute_capability=(9, 0))
    m = _Manager()
    e = ShareEnforcer(m, "mps", NodeInventory("n", (gpu,), 0, 0))  # type: ignore[arg-type]
    assert e.for_share([("GPU-h", 100, 0)]) is None  # a whole GPU: nothing to enforce
    e.for_share([("GPU-h", 0, 8 * 2**30)])  # memory only: threads unlimited, memory bound
    e.for_share([("GPU-h", 30, 0)])  # compute only: memory is the whole GPU's
    assert [(s.thread_percentage, s.gpus[0].memory_mib) for s in m.asked] == [(100, 8192), (30, H200 // 2**20)]
    assert ShareEnforcer(m, "none", NodeInventory("n", (gpu,), 0, 0)).for_share(  # type: ignore[arg-type]
        [("GPU-h", 30, 2**30)]) is None
