"""Config + inventory expand into NVIDIA's resources and device IDs, MIG strategies and replicas included."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubegpu.inventory.topology import load_topology, parse_topology
from kubegpu.model.inventory import NodeInventory
from kubegpu.node.config import ConfigError, load_config
from kubegpu.node.deviceplugin.plugin_model import PluginSettings
from kubegpu.node.deviceplugin.resources import (
    ResourceError,
    base_resources,
    expand,
    mig_resource_name,
    plugin_settings,
    resource_counts,
)


def cfg(**file: object):
    file.setdefault("kubegpu", {"sharedSlots": 0})
    return load_config(file=file)


def names(plans) -> list[str]:
    return [p.name for p in plans]


def test_whole_gpus_by_uuid_with_indexes_and_numa() -> None:
    inv = load_topology("t4x4").inventory
    (plan,) = expand(inv, cfg())
    assert plan.name == "nvidia.com/gpu" and plan.sharing == "none" and plan.replicas == 1
    assert [d.id for d in plan.devices] == [g.uuid for g in inv.gpus]
    assert [d.index for d in plan.devices] == ["0", "1", "2", "3"]
    assert [d.numa_node for d in plan.devices] == [0, 0, 1, 1]
    assert plan.socket_name == "nvidia-gpu.sock"


def test_mig_strategy_none_serves_mig_enabled_gpus_whole() -> None:
    inv = load_topology("a100-mig").inventory
    (plan,) = expand(inv, cfg(flags={"migStrategy": "none"}))
    assert len(plan.devices) == 4 and not any(d.is_mig for d in plan.devices)


def test_mig_strategy_mixed_serves_each_profile() -> None:
    inv = load_topology("a100-mig").inventory
    plans = expand(inv, cfg(flags={"migStrategy": "mixed"}))
    assert names(plans) == ["nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "nvidia.com/mig-2g.20gb",
                            "nvidia.com/mig-3g.40gb", "nvidia.com/mig-4g.40gb"]
    counts = resource_counts(plans)
    assert counts == {"nvidia.com/gpu": 2, "nvidia.com/mig-1g.10gb": 2, "nvidia.com/mig-2g.20gb": 1,
                      "nvidia.com/mig-3g.40gb": 2, "nvidia.com/mig-4g.40gb": 1}
    three = next(p for p in plans if p.name == "nvidia.com/mig-3g.40gb")
    assert [d.index for d in three.devices] == ["0:0", "1:1"]
    assert all(d.id.startswith("MIG-") and d.gi is not None and d.ci == 0 for d in three.devices)
    assert three.devices[0].gpu_uuid == inv.gpus[0].uuid and three.devices[0].minor == inv.gpus[0].minor
    assert three.socket_name == "nvidia-mig-3g.40gb.sock"


def _single_node(profiles: list[list[str]], extra_whole: int = 0) -> NodeInventory:
    gpus = [{"mig": [{"profile": p, "gi": 1 + j} for j, p in enumerate(ps)]} for ps in profiles]
    gpus += [{}] * extra_whole
    return parse_topology({"gpu": {"model": "NVIDIA A100-SXM4-40GB", "memoryMiB": 40960, "migCapable": True},
                           "gpus": gpus}).inventory


def test_mig_strategy_single_serves_mig_devices_as_gpus() -> None:
    inv = _single_node([["1g.5gb"] * 7, ["1g.5gb"] * 7])
    (plan,) = expand(inv, cfg(flags={"migStrategy": "single"}))
    assert plan.name == "nvidia.com/gpu" and len(plan.devices) == 14 and all(d.is_mig for d in plan.devices)


def test_mig_strategy_single_without_mig_is_none() -> None:
    inv = load_topology("t4x4").inventory
    assert resource_counts(expand(inv, cfg(flags={"migStrategy": "single"}))) == {"nvidia.com/gpu": 4}


@pytest.mark.parametrize(
    ("strategy", "inv", "message"),
    [
        ("single", lambda: load_topology("a100-mig").inventory,
         "invalid MIG configuration: more than one MIG device type present on node"),
        ("single", lambda: _single_node([["1g.5gb"] * 7], extra_whole=1),
         "all devices on the node must be configured with the same migEnabled value"),
        ("single", lambda: _single_node([["1g.5gb"] * 7, []]),
         "invalid MIG configuration: at least one device with migEnabled=true was not configured correctly: "
         "device 1 has no MIG devices configured"),
        ("mixed", lambda: _single_node([["1g.5gb"], []]),
         "device 1 has no MIG devices configured"),
    ],
)
def test_nvidia_mig_errors(strategy: str, inv, message: str) -> None:
    with pytest.raises(ResourceError) as err:
        expand(inv(), cfg(flags={"migStrategy": strategy}))
    assert message in str(err.value)


def test_compute_instance_splits_and_me_profiles_in_mixed() -> None:
    inv = parse_topology({"gpu": {"model": "NVIDIA A100-SXM4-80GB", "memoryMiB": 81920},
                          "gpus": [{"mig": [{"profile": "1c.3g.40gb", "gi": 1, "ci": 0},
                                            {"profile": "1g.10gb+me", "gi": 9}]}]}).inventory
    assert names(expand(inv, cfg(flags={"migStrategy": "mixed"}))) == ["nvidia.com/mig-1g.10gb.me"]
    assert mig_resource_name("1g.10gb+me") == "nvidia.com/mig-1g.10gb.me"
    named = cfg(flags={"migStrategy": "mixed"}, resources={"migs": [{"pattern": "*3g.40gb", "name": "mig-3g"}]})
    assert names(expand(inv, named)) == ["nvidia.com/mig-3g"]


def test_gpu_patterns_rename_by_model() -> None:
    inv = load_topology("t4x4").inventory
    inv = replace(inv, gpus=(*inv.gpus[:2], *(replace(g, model="NVIDIA L4") for g in inv.gpus[2:])))
    plans = expand(inv, cfg(resources={"gpus": [{"pattern": "*T4*", "name": "t4"},
                                                {"pattern": "NVIDIA L4", "name": "l4"}]}))
    assert resource_counts(plans) == {"nvidia.com/l4": 2, "nvidia.com/t4": 2}
    unmatched = expand(inv, cfg(resources={"gpus": [{"pattern": "*T4*", "name": "gpu"}]}))
    assert resource_counts(unmatched) == {"nvidia.com/gpu": 2}


def test_time_slicing_replicas_keep_the_name() -> None:
    inv = load_topology("t4x4").inventory
    (plan,) = expand(inv, cfg(sharing={"timeSlicing": {"failRequestsGreaterThanOne": True,
                                                       "resources": [{"name": "gpu", "replicas": 3}]}}))
    assert plan.name == "nvidia.com/gpu" and plan.sharing == "time-slicing" and plan.replicas == 3
    assert plan.fail_requests_greater_than_one
    assert [d.id for d in plan.devices[:3]] == [f"{inv.gpus[0].uuid}::{k}" for k in range(3)]
    assert [d.replica for d in plan.devices[:4]] == [0, 1, 2, 0]
    assert all(d.uuid == d.gpu_uuid for d in plan.devices) and len(plan.devices) == 12


def test_rename_by_default_gives_dot_shared() -> None:
    inv = load_topology("t4x4").inventory
    (plan,) = expand(inv, cfg(sharing={"mps": {"renameByDefault": True,
                                               "resources": [{"name": "gpu", "replicas": 2}]}}))
    assert plan.name == "nvidia.com/gpu.shared" and plan.sharing == "mps"
    assert plan.socket_name == "nvidia-gpu.shared.sock"


def test_devices_selection_is_honoured() -> None:
    inv = load_topology("t4x4").inventory
    plans = expand(inv, cfg(sharing={"timeSlicing": {"resources": [
        {"name": "gpu", "replicas": 2, "rename": "shared", "devices": [1, inv.gpus[3].uuid]}]}}))
    by = {p.name: p for p in plans}
    assert [d.id for d in by["nvidia.com/gpu"].devices] == [inv.gpus[0].uuid, inv.gpus[2].uuid]
    assert {d.gpu_uuid for d in by["nvidia.com/shared"].devices} == {inv.gpus[1].uuid, inv.gpus[3].uuid}
    count = expand(inv, cfg(sharing={"timeSlicing": {"resources": [{"name": "gpu", "replicas": 2, "devices": 1}]}}))
    (p,) = count
    assert [d.id for d in p.devices] == [g.uuid for g in inv.gpus[1:]] + [f"{inv.gpus[0].uuid}::0",
                                                                         f"{inv.gpus[0].uuid}::1"]
    with pytest.raises(ResourceError, match="devices entry '7' matches no device"):
        expand(inv, cfg(sharing={"timeSlicing": {"resources": [{"name": "gpu", "replicas": 2, "devices": [7]}]}}))
    with pytest.raises(ResourceError, match="asks for 9 devices but the node has 4"):
        expand(inv, cfg(sharing={"timeSlicing": {"resources": [{"name": "gpu", "replicas": 2, "devices": 9}]}}))


def test_mig_replicas_and_mps_refusal() -> None:
    inv = load_topology("a100-mig").inventory
    plans = expand(inv, cfg(flags={"migStrategy": "mixed"},
                            sharing={"timeSlicing": {"resources": [{"name": "mig-1g.10gb", "replicas": 4}]}}))
    small = next(p for p in plans if p.name == "nvidia.com/mig-1g.10gb")
    assert len(small.devices) == 8 and small.devices[0].id.endswith("::0") and small.devices[0].is_mig
    with pytest.raises(ResourceError, match="MPS is not supported for MIG devices"):
        expand(inv, cfg(flags={"migStrategy": "mixed"},
                        sharing={"mps": {"resources": [{"name": "mig-1g.10gb", "replicas": 2}]}}))


def test_sharing_fork_short_form() -> None:
    inv = load_topology("a100-mig").inventory
    c = load_config(flags={"mig-strategy": "mixed", "shared-slots": "0",
                           "resource-config": "gpu:sharedgpu:4,mig-3g.40gb:gpu:1,mig-1g.10gb:small:2"})
    plans = {p.name: p for p in expand(inv, c)}
    assert "nvidia.com/mig-3g.40gb" not in plans and "nvidia.com/mig-1g.10gb" not in plans
    # mig-3g.40gb renamed to plain nvidia.com/gpu (no sharing); whole GPUs became sharedgpu replicas.
    assert [d.is_mig for d in plans["nvidia.com/gpu"].devices] == [True, True]
    assert plans["nvidia.com/gpu"].sharing == "none"
    assert len(plans["nvidia.com/sharedgpu"].devices) == 2 * 4 and plans["nvidia.com/sharedgpu"].replicas == 4
    assert len(plans["nvidia.com/small"].devices) == 2 * 2


def test_replicated_resource_absent_on_node_is_skipped() -> None:
    inv = load_topology("t4x4").inventory
    plans = expand(inv, cfg(sharing={"timeSlicing": {"resources": [{"name": "mig-1g.10gb", "replicas": 2}]}}))
    assert names(plans) == ["nvidia.com/gpu"]


def test_gpu_shared_slots_per_whole_gpu() -> None:
    inv = load_topology("a100-mig").inventory
    plans = expand(inv, load_config(flags={"mig-strategy": "mixed", "shared-slots": "100"}))
    slots = next(p for p in plans if p.name == "kubegpu.io/gpu.shared")
    assert slots.sharing == "slots" and slots.replicas == 100 and len(slots.devices) == 2 * 100
    assert {d.gpu_uuid for d in slots.devices} == {inv.gpus[2].uuid, inv.gpus[3].uuid}
    assert slots.devices[99].id == f"{inv.gpus[2].uuid}::99"
    assert slots.socket_name == "kubegpu-gpu.shared.sock"
    assert "kubegpu.io/gpu.shared" not in names(expand(inv, cfg(flags={"migStrategy": "mixed"})))


def test_base_resources_rejects_unknown_strategy() -> None:
    with pytest.raises(ResourceError, match="unknown MIG strategy 'weird'"):
        base_resources(load_topology("t4x4").inventory, "weird")


def test_plugin_settings_from_config() -> None:
    c = load_config(flags={"device-list-strategy": "cdi-cri,envvar", "device-id-strategy": "index",
                           "pass-device-specs": "true", "nvidia-driver-root": "/run/nvidia/driver",
                           "replica-choice": "packed", "cdi-spec-dir": "/tmp/cdi"})
    s = plugin_settings(c)
    assert isinstance(s, PluginSettings)
    assert s.device_list_strategies == ("cdi-cri", "envvar") and s.device_id_strategy == "index"
    assert s.pass_device_specs and s.driver_root == "/run/nvidia/driver"
    assert s.replica_policy == "packed" and s.cdi_dir == "/tmp/cdi"


def test_expansion_is_deterministic() -> None:
    inv = load_topology("dgx-a100").inventory
    c = load_config()
    assert expand(inv, c) == expand(inv, c)


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(["t4x4", "dgx1-v100", "a100-mig", "l4x8"]),
       strategy=st.sampled_from(["none", "mixed"]),
       replicas=st.integers(2, 5), count=st.none() | st.integers(1, 2), rename=st.booleans(),
       slots=st.sampled_from([0, 3]))
def test_every_device_is_served_once(name: str, strategy: str, replicas: int, count: int | None,
                                     rename: bool, slots: int) -> None:
    inv = load_topology(name).inventory
    entry: dict = {"name": "gpu", "replicas": replicas}
    if count is not None:
        entry["devices"] = count
    doc = {"flags": {"migStrategy": strategy}, "kubegpu": {"sharedSlots": slots},
           "sharing": {"timeSlicing": {"renameByDefault": rename, "resources": [entry]}}}
    if slots:  # share slots on replicated GPUs would overcommit them
        with pytest.raises(ConfigError, match="would overcommit"):
            load_config(file=doc)
        return
    plans = expand(inv, c := load_config(file=doc))
    assert c.kubegpu.shared_slots == 0
    served: dict[str, int] = {}
    for p in plans:
        ids = [d.id for d in p.devices]
        assert len(set(ids)) == len(ids), p.name
        if p.sharing == "slots":
            assert len(ids) == slots * len({d.gpu_uuid for d in p.devices})
            continue
        for d in p.devices:
            served[d.uuid] = served.get(d.uuid, 0) + 1
    physical = {g.uuid for g in inv.gpus if strategy == "none" or not g.mig_enabled}
    physical |= {m.uuid for g in inv.gpus if strategy != "none" and g.mig_enabled for m in g.mig_devices}
    assert set(served) == physical
    # A replicated GPU appears `replicas` times, every other device once.
    assert set(served.values()) <= {1, replicas}
    whole = sum(1 for g in inv.gpus if strategy == "none" or not g.mig_enabled)
    assert sum(1 for v in served.values() if v == replicas) == (count or whole)
