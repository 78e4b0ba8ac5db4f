"""The fake backend behaves like NVML under faults: Xids, lost GPUs, probe and discovery errors, on time."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from kubegpu.inventory.base import HealthEvent, InventoryBackend, InventoryError
from kubegpu.inventory.fake import FakeBackend
from kubegpu.inventory.topology import Fault


def test_is_an_inventory_backend() -> None:
    backend: InventoryBackend = FakeBackend("dgx-a100")
    inv = backend.discover()
    assert inv.name == "dgx-a100" and len(inv.gpus) == 8
    assert backend.wait_event(0.0) is None
    assert all(backend.probe(g.uuid) for g in inv.gpus)
    assert backend.probe("GPU-00000000-0000-0000-0000-000000000000") is False
    backend.close()


def test_node_name_changes_name_and_uuids() -> None:
    a = FakeBackend("t4x4", node_name="gpu-7").discover()
    assert a.name == "gpu-7"
    assert a.gpus[0].uuid != FakeBackend("t4x4").discover().gpus[0].uuid


def test_inject_xid_on_gpu_and_on_mig_device() -> None:
    b = FakeBackend("a100-mig")
    inv = b.discover()
    b.inject_xid(2, 48)
    assert b.wait_event(1.0) == HealthEvent(uuid=inv.gpus[2].uuid, xid=48, message="injected Xid 48")
    mig = inv.gpus[0].mig_devices[1]
    b.inject_xid(0, 94, gi=mig.gi, ci=mig.ci)
    ev = b.wait_event(1.0)
    assert ev is not None and (ev.uuid, ev.xid, ev.gi, ev.ci) == (mig.uuid, 94, mig.gi, mig.ci)
    b.inject_xid(mig.uuid, 31)
    assert b.wait_event(1.0).uuid == mig.uuid  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="no MIG device with gi=99"):
        b.inject_xid(0, 94, gi=99, ci=0)
    with pytest.raises(ValueError, match="no GPU with index 9"):
        b.inject_xid(9, 48)


def test_wait_blocks_until_an_injected_event() -> None:
    b = FakeBackend("t4x4")
    uuid = b.discover().gpus[1].uuid
    got: list[HealthEvent | None] = []
    t = threading.Thread(target=lambda: got.append(b.wait_event(5.0)))
    t.start()
    time.sleep(0.05)
    b.inject_xid(uuid, 63)
    t.join(2.0)
    assert got and got[0] is not None and got[0].uuid == uuid and got[0].xid == 63


def test_wait_times_out_with_none() -> None:
    b = FakeBackend("t4x4")
    t0 = time.monotonic()
    assert b.wait_event(0.05) is None
    assert time.monotonic() - t0 >= 0.05


def test_close_wakes_a_waiter() -> None:
    b = FakeBackend("t4x4")
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(b.wait_event(10.0)))
    t.start()
    time.sleep(0.05)
    b.close()
    t.join(2.0)
    assert got == [None] and not t.is_alive()
    with pytest.raises(InventoryError):
        b.discover()


def test_gpu_falls_off_the_bus_and_comes_back() -> None:
    b = FakeBackend("dgx1-v100")
    gpu = b.discover().gpus[5]
    b.fall_off_bus(5)
    ev = b.wait_event(1.0)
    assert ev is not None and ev.uuid == gpu.uuid and ev.xid == 79
    assert b.probe(gpu.uuid) is False and b.probe(gpu.uuid) is False
    assert b.discover().gpus[5].healthy is False
    assert all(g.healthy for g in b.discover().gpus if g.index != 5)
    b.recover(5)
    assert b.probe(gpu.uuid) is True and b.discover().gpus[5].healthy is True


def test_lost_parent_makes_its_mig_devices_fail_probes() -> None:
    b = FakeBackend("a100-mig")
    inv = b.discover()
    b.fall_off_bus(0)
    assert all(not b.probe(m.uuid) for m in inv.gpus[0].mig_devices)
    assert all(not m.healthy for m in b.discover().gpus[0].mig_devices)
    assert all(b.probe(m.uuid) for m in inv.gpus[1].mig_devices)


def test_probe_failures_counted_or_until_recover() -> None:
    b = FakeBackend("t4x4")
    u = b.discover().gpus[0].uuid
    b.fail_probe(0, times=2)
    assert [b.probe(u) for _ in range(3)] == [False, False, True]
    b.fail_probe(u)
    assert [b.probe(u) for _ in range(3)] == [False] * 3
    b.recover(u)
    assert b.probe(u)


def test_discovery_and_wait_errors() -> None:
    b = FakeBackend("t4x4")
    b.fail_discovery(times=2, message="GPU is lost")
    for _ in range(2):
        with pytest.raises(InventoryError, match="NVML error during discovery: GPU is lost"):
            b.discover()
    assert len(b.discover().gpus) == 4
    b.fail_wait("Unknown Error")
    ev = b.wait_event(1.0)
    assert ev is not None and ev.uuid is None and "Unknown Error" in ev.message


def test_scheduled_faults_fire_at_their_time(tmp_path: Path) -> None:
    f = tmp_path / "faulty.yaml"
    f.write_text("""
name: faulty
gpu: {model: Tesla T4, memoryMiB: 15360, computeCapability: "7.5"}
gpus: [{numa: 0}, {numa: 0}, {numa: 1}]
faults:
  - {at: 0.30, kind: lost, gpu: 2}
  - {at: 0.15, kind: xid, gpu: 1, xid: 48}
  - {at: 0.45, kind: recover, gpu: 2}
  - {at: 0.45, kind: wait-error, message: boom}
""")
    b = FakeBackend(f)
    uuids = [g.uuid for g in b.discover().gpus]
    first = b.wait_event(2.0)
    t1 = b.elapsed()
    assert first is not None and (first.uuid, first.xid) == (uuids[1], 48)
    assert 0.15 <= t1 < 0.15 + 0.25
    assert b.probe(uuids[2])  # not lost yet
    second = b.wait_event(2.0)
    t2 = b.elapsed()
    assert second is not None and (second.uuid, second.xid) == (uuids[2], 79)
    assert 0.30 <= t2 < 0.30 + 0.25
    assert not b.probe(uuids[2])
    third = b.wait_event(2.0)
    assert third is not None and third.uuid is None and "boom" in third.message
    assert b.elapsed() >= 0.45 and b.probe(uuids[2])
    assert [round(t, 1) >= 0 for t, _ in b.delivered] == [True] * 3


def test_scheduled_fault_with_a_fake_clock() -> None:
    now = [100.0]
    b = FakeBackend("t4x4", clock=lambda: now[0])
    b.schedule(Fault(at=10.0, kind="probe-fail", gpu=0, times=1))
    b.schedule(Fault(at=20.0, kind="discover-error", times=1, message="Driver Not Loaded"))
    u = b.discover().gpus[0].uuid
    assert b.probe(u)
    now[0] = 110.0
    assert not b.probe(u) and b.probe(u)
    now[0] = 120.0
    with pytest.raises(InventoryError, match="Driver Not Loaded"):
        b.discover()


def test_bad_fault_reference_in_file_fails_at_load(tmp_path: Path) -> None:
    f = tmp_path / "f.yaml"
    f.write_text("""
gpu: {model: X, memory: 1Gi}
gpus: [{}]
faults: [{at: 1, kind: xid, gpu: GPU-nope, xid: 48}]
""")
    with pytest.raises(ValueError, match="no GPU or MIG device 'GPU-nope'"):
        FakeBackend(f)


def test_open_backend_picks_by_name() -> None:
    from kubegpu.inventory import open_backend
    from kubegpu.inventory.nvml import NvmlBackend

    assert isinstance(open_backend("t4x4", node_name="x"), FakeBackend)
    assert open_backend("t4x4", node_name="x").discover().name == "x"
    nvml = open_backend("nvml", node_name="x")
    assert isinstance(nvml, NvmlBackend)
    nvml.close()


def test_shipped_demo_topology_replays_its_faults() -> None:
    now = [0.0]
    b = FakeBackend("t4x4-faults", clock=lambda: now[0])
    uuids = [g.uuid for g in b.discover().gpus]
    assert b.wait_event(0) is None
    now[0] = 45.0
    events = [b.wait_event(0) for _ in range(3)]
    assert [(e.uuid, e.xid) for e in events if e] == [(uuids[1], 48), (uuids[2], 13), (uuids[3], 79)]
    assert not b.probe(uuids[3])
    now[0] = 71.0
    assert b.probe(uuids[3])
