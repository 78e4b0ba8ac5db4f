"""ResourceSlice building against the recorded v1.36 shapes, and the stand-in API server's validation
against the recorded messages (fixtures copied from dra-v1.36)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from dra_harness import FIXTURES, RECORDED_BUSES, fixture, make_sysfs

from kubegpu.inventory.fake import FakeBackend
from kubegpu.model.inventory import Gpu, NodeInventory
from kubegpu.node.dra.slices import (
    DraSettings,
    SliceError,
    health_taints,
    pool_content,
    slice_bodies,
    taint_for,
)
from kubegpu_standins.dra_validation import kubectl_message, validate

EXTRA_ATTRIBUTES = {"pciBusID", "nvlinkClique", "nvlinkPeers", "nvlinkCliqueSize"}


def _build(tmp_path: Path, topology: str | Path = FIXTURES / "gpu-node-1.yaml", **kw: Any) -> list[dict[str, Any]]:
    inv = FakeBackend(topology, node_name=kw.pop("node", "gpu-node-1")).discover()
    settings = DraSettings(node_name=inv.name, sysfs_root=make_sysfs(tmp_path / "sys", RECORDED_BUSES), **kw)
    return slice_bodies(pool_content(inv, settings), settings, 1)


def test_whole_gpu_slice_matches_the_recorded_one(tmp_path: Path) -> None:
    rec = fixture("s1-resourceslice.json")
    built = _build(tmp_path)
    assert len(built) == 1
    b = built[0]
    assert b["metadata"]["name"] == rec["metadata"]["name"] == "gpu-node-1-gpu.kubegpu.io"
    for k in ("driver", "nodeName", "pool"):
        assert b["spec"][k] == rec["spec"][k]
    assert [d["name"] for d in b["spec"]["devices"]] == [d["name"] for d in rec["spec"]["devices"]]
    for got, want in zip(b["spec"]["devices"], rec["spec"]["devices"], strict=True):
        extra = set(got["attributes"]) - set(want["attributes"])
        assert extra <= EXTRA_ATTRIBUTES
        assert {k: got["attributes"][k] for k in want["attributes"]} == want["attributes"]
        assert got["capacity"] == want["capacity"]
        assert set(got) == set(want)
    assert validate("ResourceSlice", b) == []


def test_no_sysfs_means_no_pcie_root(tmp_path: Path) -> None:
    inv = FakeBackend(FIXTURES / "gpu-node-1.yaml").discover()
    s = DraSettings(node_name="gpu-node-1", sysfs_root=str(tmp_path / "none"))
    devs = slice_bodies(pool_content(inv, s), s, 1)[0]["spec"]["devices"]
    assert all("resource.kubernetes.io/pcieRoot" not in d["attributes"] for d in devs)


def test_shared_gpu_matches_the_recorded_consumable_capacity_shape(tmp_path: Path) -> None:
    rec = fixture("s4-resourceslice.json")["spec"]["devices"][0]
    b = _build(tmp_path, shared_gpus=frozenset({1}))[0]
    dev = next(d for d in b["spec"]["devices"] if d["name"] == "gpu-1")
    assert dev["allowMultipleAllocations"] is True
    # The recorded shape, except that the policy defaults are the whole GPU: a claim naming no capacity
    # (a whole-GPU claim) takes all of it, so the same device serves whole claims and shares.
    want = {k: dict(v, requestPolicy=dict(v["requestPolicy"], default=v["value"]))
            for k, v in rec["capacity"].items()}
    assert dev["capacity"] == want
    assert dev["attributes"]["type"] == {"string": "gpu"}
    # The other GPUs take whole claims only.
    assert [("allowMultipleAllocations" in d) for d in b["spec"]["devices"]] == [False, True, False, False]


def test_mig_devices_share_counters_with_their_parent(tmp_path: Path) -> None:
    built = _build(tmp_path, topology="a100-mig", node="a100-mig")
    devices, counters = built[0], built[1]
    assert "sharedCounters" in counters["spec"] and "devices" not in counters["spec"]
    assert devices["spec"]["pool"] == counters["spec"]["pool"]
    assert devices["spec"]["pool"]["resourceSliceCount"] == 2
    sets = {cs["name"]: cs["counters"] for cs in counters["spec"]["sharedCounters"]}
    assert set(sets) == {"gpu-0-counter-set", "gpu-1-counter-set"}
    by = {d["name"]: d for d in devices["spec"]["devices"]}
    # The parent consumes the whole set, each MIG device its part; the parts fit the whole.
    whole = [{"counterSet": "gpu-0-counter-set", "counters": sets["gpu-0-counter-set"]}]
    assert by["gpu-0"]["consumesCounters"] == whole
    kids = [d for n, d in by.items() if n.startswith("gpu-0-mig-")]
    assert sorted(d["attributes"]["profile"]["string"] for d in kids) == ["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"]
    assert sum(int(d["consumesCounters"][0]["counters"]["compute-slices"]["value"]) for d in kids) == 7
    assert all("." not in n for n in by)
    for s in built:
        assert validate("ResourceSlice", s) == []
    # Shape of a MIG device as recorded (s3): type, profile, parentUUID, capacity memory + multiprocessors.
    rec = fixture("s3-resourceslice-devices.json")["spec"]["devices"][1]
    mig = by["gpu-0-mig-1g10gb-13"]
    assert set(rec["attributes"]) - {"memorySliceStart"} <= set(mig["attributes"])
    assert set(mig["capacity"]) == set(rec["capacity"])


def test_nvlink_attributes(tmp_path: Path) -> None:
    built = _build(tmp_path, topology="dgx-a100", node="dgx")
    d0 = built[0]["spec"]["devices"][0]["attributes"]
    assert d0["nvlinkCliqueSize"] == {"int": 8}
    assert d0["nvlinkPeers"] == {"string": "1,2,3,4,5,6,7"}
    assert d0["nvlinkClique"] == {"string": "dgx.0"}


def test_more_than_128_devices_split_into_slices(tmp_path: Path) -> None:
    gpus = tuple(Gpu(uuid=f"GPU-{i:04d}", index=i, minor=i, model="X", memory_bytes=2**34) for i in range(130))
    s = DraSettings(node_name="big")
    built = slice_bodies(pool_content(NodeInventory("big", gpus), s), s, 3)
    assert [len(b["spec"]["devices"]) for b in built] == [128, 2]
    assert {b["spec"]["pool"]["resourceSliceCount"] for b in built} == {2}
    assert len({b["metadata"]["name"] for b in built}) == 2
    for b in built:
        assert validate("ResourceSlice", b) == []


def test_taints_follow_health(tmp_path: Path) -> None:
    rec = fixture("s5-resourceslice-tainted.json")["spec"]["devices"][0]["taints"][0]
    inv = FakeBackend(FIXTURES / "gpu-node-1.yaml").discover()
    u0 = inv.gpus[0].uuid
    taints = health_taints(inv, {u0: False}, {u0: "Xid 79: fell off the bus"}, {}, "2026-11-24T02:19:24Z")
    assert taints[u0].as_dict() == rec
    # Still unhealthy: the time is kept; recovered: gone.
    again = health_taints(inv, {u0: False}, {u0: "Xid 79"}, taints, "2027-01-01T00:00:00Z")
    assert again[u0].time_added == "2026-11-24T02:19:24Z"
    assert health_taints(inv, {u0: True}, {}, taints, "x") == {}
    assert taint_for("GPU lost", "t").key == "gpu.kubegpu.io/unhealthy"
    s = DraSettings(node_name="gpu-node-1")
    dev = slice_bodies(pool_content(inv, s, taints), s, 2)[0]["spec"]["devices"][0]
    assert dev["taints"] == [rec]


def test_parse_shared() -> None:
    assert DraSettings.parse_shared("all") is None
    assert DraSettings.parse_shared("none") == frozenset()
    assert DraSettings.parse_shared("0,2-3") == frozenset({0, 2, 3})
    with pytest.raises(SliceError, match="expected all, none"):
        DraSettings.parse_shared("gpu0")


# ----- the API server's validation, message for message ---------------------------------------------

def _slice(name: str, devices: list[dict[str, Any]] | None = None, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"driver": "gpu.kubegpu.io", "nodeName": "gpu-node-1",
                            "pool": {"name": "p", "generation": 1, "resourceSliceCount": 1}}
    if devices is not None:
        body["devices"] = devices
    body.update(spec)
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name}, "spec": body}


def _dev(name: str = "gpu-0", **kw: Any) -> dict[str, Any]:
    return {"name": name, **kw}


def _cap(policy: dict[str, Any]) -> dict[str, Any]:
    return {"memory": {"value": "80Gi", "requestPolicy": policy}}


CASES: dict[str, dict[str, Any]] = {
    "bad-attribute-name": _slice("val-bad-attr", [_dev(attributes={"gpu memory": {"int": 1}, "GPU_Mem": {"int": 2}})]),
    "attribute-two-types": _slice("val-two-types", [_dev(attributes={"uuid": {"int": 3, "string": "a"}})]),
    "capacity-default-out-of-range": _slice("val-cap-range", [_dev(capacity=_cap(
        {"default": "10Gi", "validRange": {"min": "1Gi", "max": "200Gi"}}))]),
    "capacity-min-gt-max": _slice("val-cap-minmax", [_dev(capacity=_cap(
        {"default": "10Gi", "validRange": {"min": "20Gi", "max": "10Gi"}}))]),
    "capacity-validvalues-unsorted": _slice("val-cap-values", [_dev(capacity=_cap(
        {"default": "10Gi", "validValues": ["10Gi", "5Gi"]}))]),
    "too-many-devices": _slice("val-too-many", [_dev(f"gpu-{i}") for i in range(129)]),
    "duplicate-device-names": _slice("val-dup", [_dev(), _dev()]),
    "counters-and-devices-in-same-slice": _slice("val-shared-and-devs", [_dev()], sharedCounters=[
        {"name": "s", "counters": {"memory": {"value": "1"}}}]),
    "consumes-unknown-counterset": _slice("val-unknown-set", [_dev(consumesCounters=[
        {"counterSet": "nowhere", "counters": {"memory": {"value": "1"}}}])]),
    "consumes-3-countersets": _slice("val-3-sets", [_dev(consumesCounters=[
        {"counterSet": f"s{i}", "counters": {"memory": {"value": "1"}}} for i in range(3)])]),
    "sharedcounters-duplicate-name": _slice("val-dup-sets", None, nodeName=None, sharedCounters=[
        {"name": "s", "counters": {"memory": {"value": "1"}}}] * 2),
    "sharedcounters-9-sets": _slice("val-9-sets", None, nodeName=None, sharedCounters=[
        {"name": f"s{i}", "counters": {"memory": {"value": "1"}}} for i in range(9)]),
    "bad-taint-effect": _slice("val-taint", [_dev(taints=[{"key": "k", "effect": "NoRun"}])]),
    "no-node-selection": _slice("val-nonode", [_dev()], nodeName=None),
    "bad-device-name": _slice("val-devname", [_dev("GPU_0")]),
    "bad-version-attribute": _slice("val-semver", [_dev(attributes={"driverVersion": {"version": "550.54"}})]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_validation_messages_are_the_recorded_ones(case: str) -> None:
    rec = {r["case"]: r for r in fixture("s9-results.json")}[case]
    obj = CASES[case]
    if obj["spec"].get("nodeName") is None:
        obj["spec"].pop("nodeName", None)
    causes = validate("ResourceSlice", obj)
    if rec["accepted"]:
        assert causes == []
    else:
        assert kubectl_message("ResourceSlice", obj["metadata"]["name"], causes) == rec["apiserver_message"]


def test_uppercase_counters_and_dotted_names_as_recorded() -> None:
    """The first s3 attempt: the same set of errors (Go map order varies, so compared as a set)."""
    rec = (FIXTURES / "s9-extra.txt").read_text().splitlines()
    devices = copy.deepcopy(fixture("s3-resourceslice-devices.json")["spec"]["devices"])
    for d in devices:
        if d["name"] != "gpu-4":
            d["name"] = d["name"].replace("1g10gb", "1g.10gb").replace("3g40gb", "3g.40gb").replace("7g80gb", "7g.80gb")
        for cc in d["consumesCounters"]:
            cc["counters"] = {("computeSlices" if k == "compute-slices" else
                               k.replace("memory-slice-", "memorySlice")): v for k, v in cc["counters"].items()}
    obj = _slice("gpu-node-1-partitioned-devices", devices)
    lines = kubectl_message("ResourceSlice", obj["metadata"]["name"], validate("ResourceSlice", obj)).splitlines()
    assert lines[0] == rec[0]
    assert sorted(lines[1:]) == sorted(x for x in rec[1:] if x)
