"""Strict MPS enforcement on the DRA path: a strict GPU serving shares of one shape republishes its consumable
capacity so that kube-scheduler's allocator gives it that shape only (a smaller share rounded up to it, as the
claim's consumedCapacity shows and the node enforces; a larger one not at all), and the node's prepare-time
refusal stays the backstop for claims allocated before the lock was published, with its reason on the pod."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dra_harness import Bed, make_strict_bed
from test_dra_flows import _classes, _ready, _strict_attrs

from kubegpu.inventory.compute_modes import DEFAULT, EXCLUSIVE_PROCESS
from kubegpu.inventory.fake import FakeBackend
from kubegpu.node.dra.names import DRIVER
from kubegpu.node.dra.prepare import cdi_spec_path
from kubegpu.node.dra.slices import DraSettings, pool_content, slice_bodies
from kubegpu.node.mps.enforcer import GpuView
from kubegpu_standins.dra_validation import validate


@pytest.fixture
def strict_bed(monkeypatch: pytest.MonkeyPatch) -> Iterator[Bed]:
    root = Path(tempfile.mkdtemp(prefix="kgd-", dir="/tmp"))  # unix socket paths stay short
    mps_root = Path(tempfile.mkdtemp(prefix="kgm-", dir="/tmp"))
    bed = make_strict_bed(root, mps_root, monkeypatch)
    try:
        _ready(bed)
        _classes(bed)
        yield bed
    finally:
        bed.close()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(mps_root, ignore_errors=True)


def _share_pod(bed: Bed, name: str, gpu: str, compute: str, memory: str) -> dict[str, Any]:
    """A pod whose claim asks a share of GPU ``gpu`` (by its uuid attribute)."""
    bed.api.put_object({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                        "metadata": {"name": name, "namespace": "default"},
                        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                            "deviceClassName": "shared-gpu.kubegpu.io", "allocationMode": "ExactCount", "count": 1,
                            "selectors": [{"cel": {"expression": f'device.attributes["{DRIVER}"].uuid == "{gpu}"'}}],
                            "capacity": {"requests": {"compute": compute, "memory": memory}}}}]}}})
    return bed.pod(name, [{"name": "gpu", "resourceClaimName": name}])


def _policies(bed: Bed, gpu: str) -> dict[str, Any]:
    dev = next(d for s in bed.slices() for d in s["spec"].get("devices", [])
               if d["attributes"]["uuid"]["string"] == gpu and "shareEnforcement" in d["attributes"])
    return {k: v["requestPolicy"] for k, v in dev["capacity"].items()}


def test_the_allocator_keeps_to_a_strict_gpus_shape_and_the_node_refuses_what_came_before(strict_bed: Bed) -> None:
    bed = strict_bed
    gpu = bed.backend.discover().gpus[0].uuid
    unlocked = _policies(bed, gpu)
    assert "validRange" in unlocked["compute"] and "validRange" in unlocked["memory"]
    # Two claims allocated before either is prepared: no lock is published yet, so the allocator puts both
    # shapes on the empty GPU; the node serves the first and refuses the second, and the pod's event says why.
    first, second = _share_pod(bed, "a", gpu, "25", "4Gi"), _share_pod(bed, "b", gpu, "50", "8Gi")
    assert bed.controller.schedule(bed.allocator, first) and bed.controller.schedule(bed.allocator, second)
    bed.kubelet.add_pod(bed.api.get_object("pods", "a", "default"))
    bed.kubelet.add_pod(bed.api.get_object("pods", "b", "default"))
    assert bed.running(first) and not bed.running(second)
    why = [e for e in bed.kubelet.events if "ResourceClaim b" in e]
    assert why and "locked to the share shape 25% / 4096M" in why[-1], bed.kubelet.events[-3:]
    bed.delete(second)  # (else the kubelet's retry would take the GPU once it is empty)
    # Once the lock is published, the allocator keeps to it.
    assert bed.wait(lambda: _strict_attrs(bed, gpu).get("shareShapeLock") == "25% / 4096M")
    whole_mem = _policies(bed, gpu)["memory"]["default"]
    assert _policies(bed, gpu) == {"compute": {"default": "100", "validValues": ["25", "100"]},
                                   "memory": {"default": whole_mem, "validValues": ["4Gi", whole_mem]}}
    smaller = _share_pod(bed, "c", gpu, "10", "2Gi")
    assert bed.run(smaller) and bed.running(smaller)  # rounded up to the running shape
    claim = bed.claim("c")
    [result] = claim["status"]["allocation"]["devices"]["results"]
    assert result["consumedCapacity"] == {"compute": "25", "memory": "4Gi"}  # the user sees the rounding
    env = dict(e.split("=", 1) for e in json.loads(cdi_spec_path(bed.cdi_dir, claim["metadata"]["uid"])
                                                   .read_text())["containerEdits"]["env"])
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"  # and the node enforces what was recorded
    assert not bed.run(_share_pod(bed, "d", gpu, "30", "4Gi"))  # larger than the lock: not allocated
    # The lock falls with the GPU's last share: the policy is the plain range again.
    bed.delete(first)
    bed.delete(smaller)
    assert bed.backend.compute_mode(gpu) == DEFAULT
    assert bed.wait(lambda: _policies(bed, gpu) == unlocked)


@pytest.mark.parametrize(("lock", "compute", "memory"), [
    ("25% / 16384M", ["25", "100"], ["16Gi", "80Gi"]),
    ("100% / 16384M", ["100"], ["16Gi", "80Gi"]),  # a memory-only share runs with every thread
    ("25% / 81920M", ["25", "100"], ["80Gi"]),  # a share without memory has all of it
    ("25% / 16384M over 2 GPUs", ["100"], ["80Gi"]),  # one server over other GPUs too: no share joins
])
def test_a_locked_gpu_publishes_valid_values_the_api_accepts(lock: str, compute: list[str], memory: list[str]) -> None:
    inv = FakeBackend("dgx-a100", node_name="n").discover()
    gpu = inv.gpus[0]
    assert gpu.memory_bytes == 80 * 2**30
    settings = DraSettings(node_name="n", shared_gpus=None, mps=True, enforcement="strict")
    view = GpuView("strict", "", EXCLUSIVE_PROCESS, lock, False)
    [body] = slice_bodies(pool_content(inv, settings, views={gpu.uuid: view}), settings, 1)
    dev = next(d for d in body["spec"]["devices"] if d["attributes"]["uuid"]["string"] == gpu.uuid)
    assert dev["capacity"]["compute"]["requestPolicy"] == {"default": "100", "validValues": compute}
    assert dev["capacity"]["memory"]["requestPolicy"] == {"default": "80Gi", "validValues": memory}
    other = next(d for d in body["spec"]["devices"] if d["attributes"]["uuid"]["string"] == inv.gpus[1].uuid)
    assert "validRange" in other["capacity"]["compute"]["requestPolicy"]  # unlocked GPUs keep the range
    assert validate("ResourceSlice", body) == []
