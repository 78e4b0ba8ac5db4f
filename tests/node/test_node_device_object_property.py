"""Property: any inventory survives the Device object round trip, through YAML, and fits the CRD."""

from __future__ import annotations

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from kubegpu.model.device_object import device_object, device_to_inventory, inventory_from_device
from kubegpu.model.inventory import Gpu, MigDevice, NodeInventory

hexes = st.text("0123456789abcdef", min_size=12, max_size=12)


@st.composite
def inventories(draw: st.DrawFn) -> NodeInventory:
    n = draw(st.integers(0, 6))
    uuids = [f"GPU-00000000-0000-0000-0000-{draw(hexes)}" for _ in range(n)]
    if len(set(uuids)) != n:
        uuids = [f"GPU-00000000-0000-0000-0000-{i:012x}" for i in range(n)]
    gpus = []
    for i, uuid in enumerate(uuids):
        peers = draw(st.lists(st.sampled_from(uuids), unique=True, max_size=n)) if n > 1 else []
        links = {p: draw(st.integers(1, 18)) for p in peers if p != uuid}
        mig_enabled = draw(st.booleans())
        migs = tuple(
            MigDevice(uuid=f"MIG-{uuid[4:-12]}{j:012x}", profile=draw(st.sampled_from(["1g.10gb", "3g.40gb",
                                                                                        "1c.2g.20gb+me"])),
                      parent_uuid=uuid, gi=draw(st.integers(0, 14)), ci=draw(st.integers(0, 7)),
                      memory_bytes=draw(st.integers(1, 2**40)), index=j, healthy=draw(st.booleans()),
                      attributes=draw(st.dictionaries(st.sampled_from(["slices.gi", "multiprocessors"]),
                                                      st.integers(0, 200))))
            for j in range(draw(st.integers(0, 3)) if mig_enabled else 0))
        gpus.append(Gpu(
            uuid=uuid, index=i, minor=draw(st.integers(0, 255)),
            model=draw(st.sampled_from(["NVIDIA A100-SXM4-80GB", "Tesla T4", ""])),
            memory_bytes=draw(st.integers(0, 2**41)), healthy=draw(st.booleans()),
            numa_node=draw(st.none() | st.integers(0, 7)),
            pci_bus_id=draw(st.sampled_from(["", f"00000000:{i:02X}:00.0"])),
            compute_capability=draw(st.none() | st.tuples(st.integers(1, 12), st.integers(0, 9))),
            links=links, mig_enabled=mig_enabled, mig_devices=migs, core=draw(st.integers(1, 100)),
            mig_capable=draw(st.booleans()) or mig_enabled))
    return NodeInventory(
        name=draw(st.from_regex(r"[a-z][a-z0-9-]{0,20}", fullmatch=True)), gpus=tuple(gpus),
        cpu_milli=draw(st.integers(0, 512_000)), memory_bytes=draw(st.integers(0, 2**42)),
        labels=draw(st.dictionaries(st.sampled_from(["zone", "rack"]), st.sampled_from(["a", "b1"]))),
        driver_version=draw(st.sampled_from(["", "550.54.15"])), cuda_version=draw(st.sampled_from(["", "12.4"])))


@settings(max_examples=150, deadline=None)
@given(inventories())
def test_any_inventory_round_trips(inv: NodeInventory) -> None:
    obj = device_object(inv, node_uid="uid")
    assert inventory_from_device(obj) == inv
    assert device_to_inventory(yaml.safe_load(yaml.safe_dump(obj))) == inv
