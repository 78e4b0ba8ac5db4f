"""CDI names, annotation keys, the node spec (MIG included) and the driver's MIG capability table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kubegpu.inventory.fake import FakeBackend
from kubegpu.node.container_edits import mig_cap_paths, read_mig_minors
from kubegpu.node.deviceplugin.cdi import CdiError, annotation_key, build_spec, qualified_name, write_spec


def test_qualified_names_follow_the_cdi_rules() -> None:
    assert qualified_name("nvidia.com", "gpu", "GPU-1234") == "nvidia.com/gpu=GPU-1234"
    assert qualified_name("k8s.device-plugin.nvidia.com", "gpu", "0:1") == "k8s.device-plugin.nvidia.com/gpu=0:1"
    for vendor, cls, name in (("1nvidia.com", "gpu", "x"), ("nvidia.com", "gpu", "-x"), ("nvidia.com", "gpu", "a/b"),
                              ("nvidia.com", "g pu", "x")):
        with pytest.raises(CdiError):
            qualified_name(vendor, cls, name)


def test_annotation_key_length_and_slashes() -> None:
    assert annotation_key("cdi.k8s.io/", "plugin", "a/b") == "cdi.k8s.io/plugin_a_b"
    with pytest.raises(CdiError, match="too long"):
        annotation_key("cdi.k8s.io/", "p", "x" * 70)


def test_mig_minors_file(tmp_path: Path) -> None:
    f = tmp_path / "mig-minors"
    f.write_text("config 1\nmonitor 2\ngpu0/gi1/access 21\ngpu0/gi1/ci0/access 22\ngarbage\ngpu3/gi9/access x\n")
    minors = read_mig_minors(f)
    assert minors == {(0, 1, -1): 21, (0, 1, 0): 22}
    assert mig_cap_paths(0, 1, 0, minors) == ["/dev/nvidia-caps/nvidia-cap21", "/dev/nvidia-caps/nvidia-cap22"]
    assert mig_cap_paths(0, 2, 0, minors) == []
    assert read_mig_minors(tmp_path / "missing") == {}


def test_spec_covers_mig_devices_by_uuid_and_index(tmp_path: Path) -> None:
    inv = FakeBackend("a100-mig").discover()
    g0 = inv.gpus[0]
    m = g0.mig_devices[0]
    minors = {(g0.minor, m.gi, -1): 31, (g0.minor, m.gi, m.ci): 32}
    spec = build_spec(inv, vendor="nvidia.com", cls="gpu", driver_root="/run/nvidia/driver", mig_minors=minors)
    by = {d["name"]: d for d in spec["devices"]}
    for name in (m.uuid, f"{g0.index}:{m.index}"):
        nodes = by[name]["containerEdits"]["deviceNodes"]
        assert [n["path"] for n in nodes] == [f"/dev/nvidia{g0.minor}", "/dev/nvidia-caps/nvidia-cap31",
                                              "/dev/nvidia-caps/nvidia-cap32"]
        assert nodes[0]["hostPath"] == f"/run/nvidia/driver/dev/nvidia{g0.minor}"
    assert len(by) == 2 * (len(inv.gpus) + sum(len(g.mig_devices) for g in inv.gpus))
    path = write_spec(spec, tmp_path / "cdi", "nvidia.com", "gpu")
    assert path.name == "nvidia.com-gpu.json" and json.loads(path.read_text()) == spec
    # Rewriting replaces the file whole.
    spec2 = dict(spec, devices=spec["devices"][:2])
    write_spec(spec2, tmp_path / "cdi", "nvidia.com", "gpu")
    assert len(json.loads(path.read_text())["devices"]) == 2
    assert sorted(p.name for p in (tmp_path / "cdi").iterdir()) == ["nvidia.com-gpu.json"]
