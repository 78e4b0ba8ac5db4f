"""The NVML backend's start-up with the environment the rendered DaemonSet gives the node container.

NVIDIA's plugin finds ``libnvidia-ml.so.1`` under the host driver root mounted at ``/driver-root`` and
otherwise relies on the NVIDIA container runtime, which injects the driver into a container started with
``NVIDIA_VISIBLE_DEVICES`` set and the ``utility`` capability. The backend does the same; these tests run
its real start-up code with a scripted pynvml whose ``nvmlInit`` succeeds only once the library was loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pynvml as real
import pytest
from test_inventory_nvml import ScriptedNvml, nvml_error

from kubegpu.install.render import render
from kubegpu.install.values import values_from_dict
from kubegpu.inventory.base import InventoryError
from kubegpu.inventory.nvml import NVML_LIBRARY, NvmlBackend, locate_nvml
from kubegpu.inventory.topology import load_topology


def daemonset_env(values: dict[str, Any]) -> dict[str, str]:
    """The node container's environment as the rendered DaemonSet sets it (fieldRefs resolved)."""
    (ds,) = [o for o in render(values_from_dict(values)) if o["kind"] == "DaemonSet"]
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value", "node-a") for e in container["env"]}


class DriverNvml(ScriptedNvml):
    """nvmlInit fails with LIBRARY_NOT_FOUND until ``loaded`` (what preloading the library does)."""

    def __init__(self) -> None:
        super().__init__(load_topology("t4x4").inventory)
        self.loaded: list[Path] = []

    def nvmlInit(self) -> None:
        if not self.loaded:
            raise nvml_error(real.NVML_ERROR_LIBRARY_NOT_FOUND)
        super().nvmlInit()


def driver_root(tmp_path: Path, libdir: str = "usr/lib/x86_64-linux-gnu") -> Path:
    root = tmp_path / "driver-root"
    (root / libdir).mkdir(parents=True)
    (root / libdir / NVML_LIBRARY).write_bytes(b"\x7fELF")
    return root


@pytest.mark.parametrize("mig", ["none", "mixed"])
def test_the_daemonset_environment_starts_nvml_from_the_driver_root(tmp_path: Path, mig: str) -> None:
    env = daemonset_env({"migStrategy": mig})
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    assert ("NVIDIA_MIG_MONITOR_DEVICES" in env) == (mig != "none")
    nvml = DriverNvml()
    root = driver_root(tmp_path)
    backend = NvmlBackend(nvml=nvml, env=env, driver_root=root, preload=nvml.loaded.append)
    inv = backend.discover()
    assert nvml.loaded == [root / "usr/lib/x86_64-linux-gnu" / NVML_LIBRARY]
    assert backend.library == nvml.loaded[0]
    assert inv.name == "node-a" and len(inv.gpus) == 4


def test_runtime_injected_library_needs_no_driver_root(tmp_path: Path) -> None:
    """Driver root without the library (a CDI / runtime-injected setup): the library path is used."""
    nvml = ScriptedNvml(load_topology("t4x4").inventory)
    loaded: list[Path] = []
    backend = NvmlBackend(nvml=nvml, env=daemonset_env({}), driver_root=tmp_path, preload=loaded.append)
    assert len(backend.discover().gpus) == 4
    assert loaded == [] and backend.library is None


def test_library_dirs_are_searched_in_nvidias_order(tmp_path: Path) -> None:
    root = driver_root(tmp_path, "usr/lib64")
    (root / "lib64").mkdir()
    (root / "lib64" / NVML_LIBRARY).write_bytes(b"")
    assert locate_nvml(root) == root / "usr/lib64" / NVML_LIBRARY
    assert locate_nvml(tmp_path / "nowhere") is None and locate_nvml(None) is None


@pytest.mark.parametrize(("env", "hint"), [
    ({}, "NVIDIA_VISIBLE_DEVICES is not set to 'all'"),
    ({"NVIDIA_VISIBLE_DEVICES": "void"}, "NVIDIA_VISIBLE_DEVICES is not set to 'all'"),
    ({"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "compute"}, "lacks 'utility'"),
    ({"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"}, "runtimeClassName"),
])
def test_a_missing_driver_says_what_the_container_lacks(tmp_path: Path, env: dict[str, str], hint: str) -> None:
    nvml = DriverNvml()
    backend = NvmlBackend(nvml=nvml, env=env, driver_root=tmp_path / "empty", preload=nvml.loaded.append)
    with pytest.raises(InventoryError) as err:
        backend.discover()
    message = str(err.value)
    assert "NVML shared library not found" in message and hint in message
    assert f"no {NVML_LIBRARY} under the driver root" in message


def test_a_library_that_cannot_be_loaded_falls_back_to_the_library_path(tmp_path: Path) -> None:
    def broken(path: Path) -> None:
        raise OSError("wrong ELF class")

    nvml = ScriptedNvml(load_topology("t4x4").inventory)
    backend = NvmlBackend(nvml=nvml, env=daemonset_env({}), driver_root=driver_root(tmp_path), preload=broken)
    assert len(backend.discover().gpus) == 4 and backend.library is None
