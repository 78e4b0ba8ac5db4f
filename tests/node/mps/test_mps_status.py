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


def test_strict_compute_mode_lock_and_escape_travel_to_status_within_the_crd() -> None:
    from kubegpu.install.render import device_crd

    inv = FakeBackend("t4x4").discover()
    a, b, c, d = inv.gpus
    inv = replace(inv, gpus=(
        replace(a, share_enforcement="strict", compute_mode="Exclusive_Process", share_shape_lock="25% / 4096M",
                share_escapable=False),
        replace(b, share_enforcement="strict", share_escapable=False),
        replace(c, share_enforcement="mps", share_escapable=True), d))
    obj = device_object(inv)
    assert obj["spec"]["devices"][0]["shareEnforcement"] == {
        "mode": "strict", "computeMode": "Exclusive_Process", "shapeLock": "25% / 4096M", "escapable": False}
    # The CRD keeps every field (an unknown one would be pruned) and takes the strict mode.
    schema = device_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    enf = schema["properties"]["spec"]["properties"]["devices"]["items"]["properties"]["shareEnforcement"]
    types = {"string": str, "boolean": bool}
    for dev in obj["spec"]["devices"][:3]:
        for key, value in dev["shareEnforcement"].items():
            assert isinstance(value, types[enf["properties"][key]["type"]]), key
        assert dev["shareEnforcement"]["mode"] in enf["properties"]["mode"]["enum"]
    back = inventory_from_device(obj)
    assert back == inv
    # A Device object written before these fields reads as "not reported".
    del obj["spec"]["devices"][2]["shareEnforcement"]["escapable"]
    assert inventory_from_device(obj).gpus[2].share_escapable is None
    view = build_view([back], [])
    gpus = view.to_json()["nodes"][0]["gpus"]
    assert [(g["share_enforcement"], g["compute_mode"], g["share_shape_lock"], g["share_escapable"])
            for g in gpus] == [("strict", "Exclusive_Process", "25% / 4096M", False), ("strict", "", "", False),
                               ("mps", "", "", True), ("", "", "", None)]
    console = Console(width=250, record=True)
    console.print(render_table(view))
    text = console.export_text()
    assert "strict, Exclusive_Process, locked to 25% / 4096M" in text and "mps, escapable" in text
