"""``render_table`` shows a holder's container: ``pod[container]`` is text, not rich markup."""

from __future__ import annotations

from rich.console import Console

from kubegpu.cli.status import render_table
from kubegpu.model.allocation import ContainerAllocation, DeviceGrant, PodAllocation
from kubegpu.model.inventory import Gpu, NodeInventory
from kubegpu.status.view import PodRecord, build_view


def test_holder_container_is_shown() -> None:
    inv = NodeInventory("n1", (Gpu("GPU-a", 0, 0, "Tesla T4", 16 * 2**30),))
    alloc = PodAllocation((ContainerAllocation("trainer", (DeviceGrant(0, "GPU-a", 100, 16 * 2**30, 100),)),))
    console = Console(record=True, width=200)
    console.print(render_table(build_view([inv], [PodRecord("ns", "job", "n1", alloc)])))
    assert "ns/job[trainer] 100%/16Gi" in console.export_text()
