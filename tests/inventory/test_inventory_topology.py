"""Shipped topology files describe the real machines: counts, links, NUMA, MIG; bad files fail clearly."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from kubegpu.inventory.mig import memory_gb, profile_name
from kubegpu.inventory.topology import TopologyError, load_topology, parse_topology, shipped_topologies

GIB = 2**30
MIB = 2**20


def test_every_required_topology_is_shipped() -> None:
    assert {"dgx-a100", "dgx-h100", "dgx1-v100", "t4x4", "l4x8", "a100-mig"} <= set(shipped_topologies())


@pytest.mark.parametrize("name", ["dgx-a100", "dgx-h100", "dgx1-v100", "t4x4", "l4x8", "a100-mig"])
def test_shipped_topology_is_well_formed(name: str) -> None:
    inv = load_topology(name).inventory
    uuids = [g.uuid for g in inv.gpus]
    assert len(set(uuids)) == len(uuids)
    assert all(u.startswith("GPU-") and len(u) == 40 for u in uuids)
    assert [g.index for g in inv.gpus] == list(range(len(inv.gpus)))
    assert len({g.minor for g in inv.gpus}) == len(inv.gpus)
    assert len({g.pci_bus_id for g in inv.gpus}) == len(inv.gpus)
    assert all(len(g.pci_bus_id) == 16 for g in inv.gpus)
    assert inv.cpu_milli > 0 and inv.memory_bytes > 0
    assert inv.driver_version.count(".") >= 1 and inv.cuda_version
    m = inv.link_matrix()
    assert all(m[i][j] == m[j][i] for i in range(len(m)) for j in range(len(m)))


def test_dgx_a100_is_nvswitch_with_12_links_everywhere() -> None:
    inv = load_topology("dgx-a100").inventory
    assert len(inv.gpus) == 8
    assert {g.model for g in inv.gpus} == {"NVIDIA A100-SXM4-80GB"}
    assert all(g.memory_bytes == 80 * GIB for g in inv.gpus)
    assert all(g.compute_capability == (8, 0) and g.mig_capable for g in inv.gpus)
    m = inv.link_matrix()
    assert all(m[i][j] == (0 if i == j else 12) for i in range(8) for j in range(8))


def test_dgx_h100_has_18_links_and_two_numa_nodes() -> None:
    inv = load_topology("dgx-h100").inventory
    assert len(inv.gpus) == 8 and inv.gpus[0].compute_capability == (9, 0)
    m = inv.link_matrix()
    assert all(m[i][j] == 18 for i in range(8) for j in range(8) if i != j)
    assert [g.numa_node for g in inv.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_dgx1_v100_is_the_hybrid_cube_mesh() -> None:
    inv = load_topology("dgx1-v100").inventory
    m = inv.link_matrix()
    two = {(0, 3), (0, 4), (1, 2), (1, 5), (2, 3), (4, 7), (5, 6), (6, 7)}
    one = {(0, 1), (0, 2), (1, 3), (2, 6), (3, 7), (4, 5), (4, 6), (5, 7)}
    for i in range(8):
        for j in range(i + 1, 8):
            expected = 2 if (i, j) in two else 1 if (i, j) in one else 0
            assert m[i][j] == expected, (i, j)
    # Each V100 has six NVLinks, all used.
    assert [sum(row) for row in m] == [6] * 8
    # The quads are fully connected; the cross links pair i with i+4.
    for quad in ((0, 1, 2, 3), (4, 5, 6, 7)):
        assert all(m[a][b] > 0 for a in quad for b in quad if a != b)
    assert all(m[i][i + 4] > 0 for i in range(4))


def test_t4x4_and_l4x8_are_pcie_on_two_numa_nodes() -> None:
    t4 = load_topology("t4x4").inventory
    assert len(t4.gpus) == 4 and t4.model == "Tesla T4"
    assert [g.numa_node for g in t4.gpus] == [0, 0, 1, 1]
    assert not any(g.links for g in t4.gpus)
    l4 = load_topology("l4x8").inventory
    assert len(l4.gpus) == 8 and l4.model == "NVIDIA L4" and l4.gpus[0].compute_capability == (8, 9)
    assert [g.numa_node for g in l4.gpus] == [0] * 4 + [1] * 4
    assert not any(g.links for g in l4.gpus)


def test_a100_mig_has_mixed_profiles_with_ids() -> None:
    inv = load_topology("a100-mig").inventory
    assert [g.mig_enabled for g in inv.gpus] == [True, True, False, False]
    profiles = [[m.profile for m in g.mig_devices] for g in inv.gpus]
    assert profiles[0] == ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]
    assert profiles[1] == ["4g.40gb", "3g.40gb"]
    migs = [m for g in inv.gpus for m in g.mig_devices]
    assert len({m.uuid for m in migs}) == len(migs) and all(m.uuid.startswith("MIG-") for m in migs)
    assert all(m.parent_uuid == inv.gpus[0].uuid for m in inv.gpus[0].mig_devices)
    assert [m.index for m in inv.gpus[0].mig_devices] == [0, 1, 2, 3]
    assert [(m.gi, m.ci) for m in inv.gpus[0].mig_devices] == [(2, 0), (5, 0), (13, 0), (14, 0)]
    three = inv.gpus[0].mig_devices[0]
    assert three.attributes["multiprocessors"] == 42 and three.attributes["slices.gi"] == 3
    # Slices of a MIG-enabled GPU never exceed its 7.
    assert all(sum(m.attributes["slices.gi"] for m in g.mig_devices) <= 7 for g in inv.gpus)


def test_uuids_are_stable_and_differ_per_node() -> None:
    a = load_topology("t4x4", node_name="n1").inventory
    b = load_topology("t4x4", node_name="n1").inventory
    c = load_topology("t4x4", node_name="n2").inventory
    assert [g.uuid for g in a.gpus] == [g.uuid for g in b.gpus]
    assert not {g.uuid for g in a.gpus} & {g.uuid for g in c.gpus}
    assert a.name == "n1"


def test_go_nvlib_profile_names() -> None:
    # A100-40GB and A100-80GB and H100 real memory figures give NVIDIA's names.
    assert profile_name(1, 1, 4864, 40960 * MIB) == "1g.5gb"
    assert profile_name(3, 3, 19968, 40960 * MIB) == "3g.20gb"
    assert profile_name(7, 7, 80384, 81920 * MIB) == "7g.80gb"
    assert profile_name(3, 1, 40192, 81920 * MIB) == "1c.3g.40gb"
    assert profile_name(1, 1, 9728, 81920 * MIB, "+me") == "1g.10gb+me"
    assert memory_gb(9984, 81559 * MIB) == 10


def test_any_path_loads(tmp_path: Path) -> None:
    f = tmp_path / "two.yaml"
    f.write_text(textwrap.dedent("""
        name: tiny
        gpu: {model: Tesla T4, memory: 15Gi}
        gpus: [{numa: 0}, {numa: 1, uuid: GPU-11111111-2222-3333-4444-555555555555}]
        nvlink: {pairs: [[0, 1, 3]]}
    """))
    inv = load_topology(f).inventory
    assert inv.name == "tiny" and inv.gpus[1].uuid == "GPU-11111111-2222-3333-4444-555555555555"
    assert inv.link_matrix() == [[0, 3], [3, 0]]


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ({"gpus": []}, "gpus: expected a non-empty list"),
        ({"gpu": {"memory": "1Gi"}, "gpus": [{}]}, "gpus[0].model: missing"),
        ({"gpu": {"model": "X"}, "gpus": [{}]}, "gpus[0].memory: missing"),
        ({"gpu": {"model": "X", "memory": "lots"}, "gpus": [{}]}, "gpus[0].memory"),
        ({"gpu": {"model": "X", "memory": "1Gi", "colour": 1}, "gpus": [{}]}, "gpu.colour: unknown key"),
        ({"gpu": {"model": "X", "memory": "1Gi"}, "gpus": [{}], "nvlink": {"pairs": [[0, 0, 1]]}},
         "nvlink.pairs[0]"),
        ({"gpu": {"model": "X", "memory": "1Gi"}, "gpus": [{"uuid": "abc"}]}, "gpus[0].uuid"),
        ({"gpu": {"model": "X", "memory": "1Gi", "computeCapability": "eight"}, "gpus": [{}]},
         "gpus[0].computeCapability"),
        ({"gpu": {"model": "NVIDIA A100-SXM4-80GB", "memoryMiB": 81920},
          "gpus": [{"mig": [{"profile": "3g.20gb", "gi": 1}]}]}, "is not a MIG profile of NVIDIA A100"),
        ({"gpu": {"model": "NVIDIA A100-SXM4-80GB", "memoryMiB": 81920},
          "gpus": [{"mig": [{"profile": "3g.20gb", "gi": 1, "memoryMiB": 40192}]}]},
         "does not match its memory"),
        ({"gpu": {"model": "NVIDIA A100-SXM4-80GB", "memoryMiB": 81920},
          "gpus": [{"mig": [{"profile": "1g.10gb", "gi": 1}, {"profile": "1g.10gb", "gi": 1}]}]},
         "duplicate gi 1"),
        ({"gpu": {"model": "X", "memory": "1Gi"}, "gpus": [{}], "faults": [{"kind": "boom", "gpu": 0}]},
         "faults[0].kind"),
        ({"gpu": {"model": "X", "memory": "1Gi"}, "gpus": [{}],
          "faults": [{"kind": "xid", "gpu": 5, "xid": 1}]},
         "faults[0].gpu: no GPU with index 5"),
        ({"gpu": {"model": "X", "memory": "1Gi"}, "gpus": [{}], "faults": [{"kind": "xid", "gpu": 0}]},
         "faults[0].xid"),
        ("just a string", "expected a mapping"),
    ],
)
def test_bad_topology_names_the_field(doc: object, needle: str) -> None:
    with pytest.raises(TopologyError) as err:
        parse_topology(doc, source="t.yaml")
    assert needle in str(err.value)
    assert str(err.value).startswith("t.yaml")


def test_unknown_name_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match=r"unknown topology 'dgx-z9'.*dgx-a100"):
        load_topology("dgx-z9")
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpus: [unclosed\n")
    with pytest.raises(TopologyError, match="not valid YAML"):
        load_topology(bad)
    with pytest.raises(TopologyError, match="cannot read"):
        load_topology(tmp_path / "missing.yaml")
