"""The totals add what each holder holds unrounded: a MIG device is n of its GPU's 7 slices, which the record
writes as a whole percent rounded down (a 3g is 42 %, a 1g 14 %), so adding percents undercounts."""

from __future__ import annotations

import pytest

from kubegpu.model.allocation import ContainerAllocation, DeviceGrant, PodAllocation
from kubegpu.model.inventory import Gpu, MigDevice, NodeInventory
from kubegpu.status.view import PodRecord, build_view, gpu_fraction

GiB = 2**30


def _node(profiles: list[str]) -> NodeInventory:
    migs = tuple(MigDevice(f"MIG-{i}", p, "GPU-0", gi=i, ci=0, memory_bytes=int(p.split(".")[-1][:-2]) * GiB,
                           index=i, attributes={"slices.gi": int(p[0])}) for i, p in enumerate(profiles))
    return NodeInventory("n", (Gpu("GPU-0", 0, 0, "NVIDIA A100-SXM4-80GB", 80 * GiB, mig_enabled=True,
                                   mig_devices=migs),
                               Gpu("GPU-1", 1, 1, "NVIDIA A100-SXM4-80GB", 80 * GiB)))


def _mig_grant(inv: NodeInventory, i: int, core: int, *, profile: bool = True) -> DeviceGrant:
    m = inv.gpus[0].mig_devices[i]
    return DeviceGrant(0, "GPU-0", core, m.memory_bytes, 50, m.uuid, m.profile if profile else None)


@pytest.mark.parametrize("with_profile", [True, False], ids=["api-server record", "extender record"])
def test_a_3g_and_a_1g_add_to_four_sevenths_of_a_gpu(with_profile: bool) -> None:
    # The extender's summary names the MIG device held, not its profile: the node's device says it.
    inv = _node(["3g.40gb", "1g.10gb"])
    pod = PodRecord("ns", "p", "n", PodAllocation((ContainerAllocation("c", (
        _mig_grant(inv, 0, 42, profile=with_profile), _mig_grant(inv, 1, 14, profile=with_profile))),)))
    view = build_view([inv], [pod])
    assert view.totals.allocated_gpu == pytest.approx(4 / 7)
    assert view.to_json()["totals"]["allocated_gpu"] == 0.571
    assert view.nodes[0].gpus[0].core_used == 56  # the percents as recorded, per GPU


def test_seven_1g_devices_fill_the_gpu_and_shares_add_as_percents() -> None:
    inv = _node(["1g.10gb"] * 7)
    mig = ContainerAllocation("m", tuple(_mig_grant(inv, i, 14) for i in range(7)))
    share = ContainerAllocation("s", (DeviceGrant(1, "GPU-1", 30, 8 * GiB, 10), DeviceGrant(1, "GPU-1", 20, GiB, 2)))
    view = build_view([inv], [PodRecord("ns", "p", "n", PodAllocation((mig, share)))])
    assert view.totals.allocated_gpu == pytest.approx(1.5)
    assert view.totals.free_gpu == pytest.approx(0.5)
    assert view.totals.stranded_gpu == pytest.approx(0.5)


def test_a_grant_that_is_not_a_whole_mig_device_counts_its_percent() -> None:
    assert gpu_fraction(25, None) == 0.25
    assert gpu_fraction(42, "3g.40gb") == pytest.approx(3 / 7)
    assert gpu_fraction(28, "1c.2g.20gb") == pytest.approx(2 / 7)
    assert gpu_fraction(10, "3g.40gb") == 0.1  # not what placement records for the device: taken as written
