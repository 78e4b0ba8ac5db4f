"""GFD's node labels from an inventory + config: dgx-a100, t4x4, a100-mig, sharing, MIG strategies."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kubegpu.inventory.topology import load_topology, parse_topology, shipped_topologies
from kubegpu.model.inventory import NodeInventory
from kubegpu.node.config import load_config
from kubegpu.node.publish.labels import (
    arch_family,
    gpu_labels,
    is_valid_label_value,
    label_changes,
    label_value,
    owns_label,
)


def test_dgx_a100_labels() -> None:
    labels = gpu_labels(load_topology("dgx-a100").inventory, load_config())
    assert labels == {
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB",
        "nvidia.com/gpu.count": "8",
        "nvidia.com/gpu.memory": "81920",
        "nvidia.com/gpu.replicas": "1",
        "nvidia.com/gpu.sharing-strategy": "none",
        "nvidia.com/gpu.family": "ampere",
        "nvidia.com/gpu.compute.major": "8",
        "nvidia.com/gpu.compute.minor": "0",
        "nvidia.com/mig.capable": "true",
        "nvidia.com/mps.capable": "false",
        "nvidia.com/cuda.driver.major": "550",
        "nvidia.com/cuda.driver.minor": "54",
        "nvidia.com/cuda.driver.rev": "15",
        "nvidia.com/cuda.driver-version.major": "550",
        "nvidia.com/cuda.driver-version.minor": "54",
        "nvidia.com/cuda.driver-version.revision": "15",
        "nvidia.com/cuda.driver-version.full": "550.54.15",
        "nvidia.com/cuda.runtime.major": "12",
        "nvidia.com/cuda.runtime.minor": "4",
        "nvidia.com/cuda.runtime-version.major": "12",
        "nvidia.com/cuda.runtime-version.minor": "4",
        "nvidia.com/cuda.runtime-version.full": "12.4",
        "alpha.kubernetes.io/nvidia-gpu-name": "NVIDIA-A100-SXM4-80GB",
    }


def test_t4x4_labels_and_time_slicing() -> None:
    inv = load_topology("t4x4").inventory
    plain = gpu_labels(inv, load_config())
    assert plain["nvidia.com/gpu.product"] == "Tesla-T4"
    assert plain["nvidia.com/gpu.family"] == "turing" and plain["nvidia.com/gpu.memory"] == "15360"
    assert plain["nvidia.com/mig.capable"] == "false" and "nvidia.com/mig.strategy" not in plain
    shared = gpu_labels(inv, load_config(file={"sharing": {"timeSlicing": {
        "resources": [{"name": "nvidia.com/gpu", "replicas": 4}]}}}))
    assert shared["nvidia.com/gpu.product"] == "Tesla-T4-SHARED"
    assert shared["nvidia.com/gpu.replicas"] == "4"
    assert shared["nvidia.com/gpu.sharing-strategy"] == "time-slicing"
    renamed = gpu_labels(inv, load_config(file={"sharing": {"timeSlicing": {
        "renameByDefault": True, "resources": [{"name": "gpu", "replicas": 4}]}}}))
    assert renamed["nvidia.com/gpu.product"] == "Tesla-T4" and renamed["nvidia.com/gpu.replicas"] == "4"
    mps = gpu_labels(inv, load_config(file={"sharing": {"mps": {"resources": [{"name": "gpu", "replicas": 2}]}}}))
    assert mps["nvidia.com/mps.capable"] == "true" and mps["nvidia.com/gpu.sharing-strategy"] == "mps"


def test_a100_mig_mixed_labels() -> None:
    inv = load_topology("a100-mig").inventory
    labels = gpu_labels(inv, load_config(flags={"mig-strategy": "mixed"}))
    assert labels["nvidia.com/mig.strategy"] == "mixed" and labels["nvidia.com/mig.capable"] == "true"
    # Two whole GPUs of the same model override the MIG-enabled ones: count stays per model.
    assert labels["nvidia.com/gpu.count"] == "4" and labels["nvidia.com/gpu.replicas"] == "1"
    assert labels["nvidia.com/mig-1g.10gb.count"] == "2"
    assert labels["nvidia.com/mig-3g.40gb.count"] == "2"
    assert labels["nvidia.com/mig-4g.40gb.count"] == "1"
    assert labels["nvidia.com/mig-2g.20gb.count"] == "1"
    assert labels["nvidia.com/mig-3g.40gb.product"] == "NVIDIA-A100-SXM4-80GB-MIG-3g.40gb"
    assert labels["nvidia.com/mig-3g.40gb.memory"] == "40192"
    assert labels["nvidia.com/mig-3g.40gb.multiprocessors"] == "42"
    assert labels["nvidia.com/mig-3g.40gb.slices.gi"] == "3" and labels["nvidia.com/mig-3g.40gb.slices.ci"] == "3"
    assert labels["nvidia.com/mig-3g.40gb.engines.copy"] == "3"
    assert labels["nvidia.com/mig-1g.10gb.engines.decoder"] == "0"
    assert labels["nvidia.com/mig-1g.10gb.replicas"] == "1"
    shared = gpu_labels(inv, load_config(flags={"mig-strategy": "mixed"}, file={"sharing": {"timeSlicing": {
        "resources": [{"name": "mig-1g.10gb", "replicas": 2}]}}}))
    assert shared["nvidia.com/mig-1g.10gb.product"] == "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb-SHARED"
    assert shared["nvidia.com/mig-1g.10gb.replicas"] == "2"
    assert shared["nvidia.com/mig-3g.40gb.replicas"] == "1"


def test_all_gpus_mig_enabled_have_zero_whole_replicas() -> None:
    inv = load_topology("a100-mig").inventory
    only_mig = replace(inv, gpus=inv.gpus[:2])
    labels = gpu_labels(only_mig, load_config(flags={"mig-strategy": "mixed"}))
    assert labels["nvidia.com/gpu.replicas"] == "0" and labels["nvidia.com/gpu.count"] == "2"
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB"


def _uniform(n: int = 2) -> NodeInventory:
    return parse_topology({"gpu": {"model": "NVIDIA A100-SXM4-40GB", "memoryMiB": 40960,
                                   "computeCapability": "8.0", "migCapable": True},
                           "gpus": [{"mig": [{"profile": "3g.20gb", "gi": 1}, {"profile": "3g.20gb", "gi": 2}]}] * n},
                          node_name="uniform").inventory


def test_mig_single_labels_describe_the_mig_device() -> None:
    labels = gpu_labels(_uniform(), load_config(flags={"mig-strategy": "single"}))
    assert labels["nvidia.com/mig.strategy"] == "single"
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-40GB-MIG-3g.20gb"
    assert labels["nvidia.com/gpu.count"] == "4" and labels["nvidia.com/gpu.memory"] == "19968"
    assert labels["nvidia.com/gpu.multiprocessors"] == "42" and labels["nvidia.com/gpu.slices.gi"] == "3"
    assert labels["nvidia.com/gpu.family"] == "ampere"


def test_mig_single_invalid_node_is_labelled_invalid() -> None:
    labels = gpu_labels(load_topology("a100-mig").inventory, load_config(flags={"mig-strategy": "single"}))
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB-MIG-INVALID"
    assert labels["nvidia.com/gpu.count"] == "0" and labels["nvidia.com/gpu.replicas"] == "0"
    assert labels["nvidia.com/gpu.memory"] == "0"


def test_mig_strategy_none_ignores_mig_devices() -> None:
    labels = gpu_labels(load_topology("a100-mig").inventory, load_config())
    assert not any(k.startswith("nvidia.com/mig-") for k in labels) and "nvidia.com/mig.strategy" not in labels
    assert labels["nvidia.com/gpu.count"] == "4" and labels["nvidia.com/gpu.replicas"] == "1"


@pytest.mark.parametrize("name", shipped_topologies())
@pytest.mark.parametrize("strategy", ["none", "mixed", "single"])
def test_every_label_is_valid(name: str, strategy: str) -> None:
    labels = gpu_labels(load_topology(name).inventory, load_config(flags={"mig-strategy": strategy}))
    for key, value in labels.items():
        assert key.startswith(("nvidia.com/", "alpha.kubernetes.io/nvidia-gpu-name")) and owns_label(key)
        _, _, part = key.partition("/")
        assert len(part) <= 63 and is_valid_label_value(part), key
        assert is_valid_label_value(value), (key, value)


def test_families() -> None:
    cases = {(3, 7): "kepler", (5, 2): "maxwell", (6, 0): "pascal", (7, 0): "volta", (7, 5): "turing",
             (8, 0): "ampere", (8, 6): "ampere", (8, 9): "ada-lovelace", (9, 0): "hopper", (10, 0): "blackwell",
             (4, 0): "undefined"}
    for (major, minor), family in cases.items():
        assert arch_family(major, minor) == family
    assert gpu_labels(load_topology("l4x8").inventory, load_config())["nvidia.com/gpu.family"] == "ada-lovelace"
    assert gpu_labels(load_topology("dgx-h100").inventory, load_config())["nvidia.com/gpu.product"] == \
        "NVIDIA-H100-80GB-HBM3"


def test_label_value_sanitising_and_bad_versions() -> None:
    assert label_value("NVIDIA GeForce RTX 4090 (rev/a)") == "NVIDIA-GeForce-RTX-4090-reva"
    assert label_value("  Tesla   V100-SXM2-16GB ") == "Tesla-V100-SXM2-16GB"
    assert is_valid_label_value(label_value("x" * 100 + " "))
    inv = replace(load_topology("t4x4").inventory, driver_version="garbage", cuda_version="")
    labels = gpu_labels(inv, load_config())
    assert not any(k.startswith("nvidia.com/cuda.") for k in labels)
    assert gpu_labels(replace(inv, gpus=()), load_config()) == {}


def test_label_changes_remove_only_owned_stale_keys() -> None:
    current = {"nvidia.com/gpu.count": "8", "nvidia.com/mig.strategy": "mixed", "kubernetes.io/hostname": "n",
               "nvidia.com/mig-1g.10gb.count": "2", "nvidia.com/cuda.driver-version.full": "535.1.2",
               # the GPU operator's and mig-manager's labels are not ours to remove
               "nvidia.com/gpu.deploy.operands": "true", "nvidia.com/mig.config": "all-1g.10gb",
               "nvidia.com/mig.config.state": "success", "nvidia.com/gpu.workload.config": "container"}
    wanted = {"nvidia.com/gpu.count": "4", "nvidia.com/gpu.present": "true"}
    patch = label_changes(current, wanted)
    assert patch == {"nvidia.com/gpu.count": "4", "nvidia.com/gpu.present": "true",
                     "nvidia.com/mig.strategy": None, "nvidia.com/mig-1g.10gb.count": None,
                     "nvidia.com/cuda.driver-version.full": None}
