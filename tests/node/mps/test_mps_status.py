"""Operators see per GPU how shares are enforced: Device object round trip, `kubegpu status` table and JSON."""

from __future__ import annotations

from dataclasses import replace

from rich.console import Console

from kubegpu.cli.status import render_table
from kubegpu.inventory.fake import FakeBackend
from kubegpu.model.device_object import device_object, inventory_from_device
from kubegpu.status.view import build_view


def test_enforcement_travels_from_the_node_to_status() -> None:
    inv = FakeBackend("t4x4").discover()
    a, b, *rest = inv.gpus
    inv = replace(inv, gpus=(replace(a, share_enforcement="mps"),
                             replace(b, share_enforcement="unenforced",
                                     share_enforcement_reason="MPS daemon share-c25 is down"), *rest))
    obj = device_object(inv)
    assert obj["spec"]["devices"][1]["shareEnforcement"] == {"mode": "unenforced",
                                                             "reason": "MPS daemon share-c25 is down"}
    assert "shareEnforcement" not in obj["spec"]["devices"][2]  # not reported: the seed's shape
    back = inventory_from_device(obj)
    assert back == inv
    view = build_view([back], [])
    gpus = view.to_json()["nodes"][0]["gpus"]
    assert [g["share_enforcement"] for g in gpus[:3]] == ["mps", "unenforced: MPS daemon share-c25 is down", ""]
    console = Console(width=250, record=True)
    console.print(render_table(view))
    text = console.export_text()
    assert "SHARES" in text and "unenforced: MPS daemon share-c25 is down" in text
