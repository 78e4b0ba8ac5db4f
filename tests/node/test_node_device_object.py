"""The Device object round-trips an inventory exactly, matches the seed's shape and the CRD schema."""

from __future__ import annotations

import copy
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kubegpu.install.render import device_crd
from kubegpu.inventory.topology import load_topology, shipped_topologies
from kubegpu.model.device_object import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    DeviceObjectError,
    device_object,
    inventory_from_device,
)

ROOT = Path(__file__).resolve().parents[2]
CRD = device_crd()
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
SEED = Path(__file__).resolve().parents[1] / "fixtures" / "seed-examples" / "device-object.yaml"


def check(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """A structural-schema check: types, required, enum, minimum, pattern, and no pruned (unknown) field."""
    errors: list[str] = []
    if schema.get("x-kubernetes-int-or-string"):
        if not isinstance(value, int | str) or isinstance(value, bool):
            errors.append(f"{path}: not int-or-string")
        return errors
    t = schema.get("type")
    types = {"object": dict, "array": list, "string": str, "integer": int, "boolean": bool}
    if t and (not isinstance(value, types[t]) or (t == "integer" and isinstance(value, bool))):
        return [f"{path}: not {t}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: not in enum")
    if "minimum" in schema and value < schema["minimum"]:
        errors.append(f"{path}: below minimum")
    if "pattern" in schema and not re.search(schema["pattern"], value):
        errors.append(f"{path}: does not match pattern")
    if t == "object":
        props = schema.get("properties")
        for key in schema.get("required", ()):
            if key not in value:
                errors.append(f"{path}.{key}: required")
        for key, v in value.items():
            if props is not None and key in props:
                errors += check(props[key], v, f"{path}.{key}")
            elif "additionalProperties" in schema:
                errors += check(schema["additionalProperties"], v, f"{path}.{key}")
            elif props is not None:
                errors.append(f"{path}.{key}: unknown field (would be pruned)")
    if t == "array":
        for i, item in enumerate(value):
            errors += check(schema["items"], item, f"{path}[{i}]")
    return errors


@pytest.mark.parametrize("name", shipped_topologies())
def test_round_trip_every_shipped_topology(name: str) -> None:
    inv = load_topology(name).inventory
    obj = device_object(inv, node_uid="8d3c-uid")
    assert inventory_from_device(obj) == inv
    # Through JSON/YAML text too, as the API server returns it.
    assert inventory_from_device(yaml.safe_load(yaml.safe_dump(obj))) == inv
    assert check(SCHEMA, obj) == []


def test_round_trip_keeps_health_links_and_mig_state() -> None:
    inv = load_topology("a100-mig").inventory
    g0 = inv.gpus[0]
    sick = replace(g0, healthy=False, core=50,
                   mig_devices=(replace(g0.mig_devices[0], healthy=False), *g0.mig_devices[1:]))
    inv = replace(inv, gpus=(sick, *inv.gpus[1:]), labels={"zone": "a"}, cpu_milli=1500)
    obj = device_object(inv)
    back = inventory_from_device(obj)
    assert back == inv
    assert back.gpus[0].mig_devices[0].healthy is False and back.gpus[0].core == 50
    assert obj["spec"]["node"]["cpu"] == "1500m"
    assert obj["status"] == {"node": "a100-mig", "model": "NVIDIA A100-SXM4-80GB", "gpus": 4, "healthy": 3}
    assert "ownerReferences" not in obj["metadata"]


def test_seed_shape() -> None:
    inv = load_topology("t4x4", node_name="host04").inventory
    obj = device_object(inv, node_uid="09c4f912-6026-467a-85d2-6b2147c9557e")
    seed = yaml.safe_load(SEED.read_text())
    assert obj["apiVersion"] == seed["apiVersion"] == API_VERSION and obj["kind"] == seed["kind"] == KIND
    assert obj["metadata"] == seed["metadata"]
    seed_entry, ours = seed["spec"]["devices"][0], obj["spec"]["devices"][0]
    for key in seed_entry:
        assert type(ours[key]) is type(seed_entry[key]), key
    assert ours["resources"] == {"kubegpu.io/gpu-core": "100", "kubegpu.io/gpu-memory": "15Gi",
                                 "kubegpu.io/gpu-memory-ratio": "100"}
    # The seed's own object (no kubegpu extras) reads as an inventory, and fits the CRD.
    back = inventory_from_device(seed)
    assert [g.uuid for g in back.gpus] == [d["id"] for d in seed["spec"]["devices"]]
    assert [g.memory_bytes for g in back.gpus] == [16 * 2**30] * 2 and [g.index for g in back.gpus] == [0, 1]
    assert check(SCHEMA, seed) == []


def test_constants_match_the_kube_adapter() -> None:
    from kubegpu.kube import resources as kr

    assert (GROUP, KIND, PLURAL) == (kr.DEVICE_GROUP, kr.DEVICE_KIND, kr.DEVICE_PLURAL)
    assert f"{kr.DEVICE_GROUP}/{kr.DEVICE_VERSION}" == API_VERSION
    assert CRD["spec"]["group"] == GROUP and CRD["spec"]["names"]["plural"] == PLURAL
    assert CRD["spec"]["names"]["kind"] == KIND and CRD["spec"]["scope"] == "Cluster"


def test_crd_is_a_valid_crd_with_printer_columns() -> None:
    kubernetes_validate.validate(CRD, kubernetes_validate.latest_version(), strict=True)
    cols = {c["name"]: c["jsonPath"] for c in CRD["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert {"Node", "GPUs", "Healthy"} <= set(cols)


def _obj() -> dict[str, Any]:
    return device_object(load_topology("a100-mig").inventory, node_uid="u")


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda o: o["spec"]["devices"][1]["resources"].update({"kubegpu.io/gpu-memory": "lots"}),
         "spec.devices[1].resources.kubegpu.io/gpu-memory: 'lots' is not a quantity"),
        (lambda o: o["spec"]["devices"][0].pop("id"), "spec.devices[0].id: missing"),
        (lambda o: o["spec"]["devices"][2].update({"minor": -1}), "spec.devices[2].minor: -1 is not an integer"),
        (lambda o: o["spec"]["devices"][0].update({"health": "yes"}), "spec.devices[0].health: 'yes' is not true"),
        (lambda o: o["spec"]["devices"][0].update({"type": "fpga"}), "spec.devices[0].type: 'fpga'"),
        (lambda o: o["spec"]["devices"][0]["mig"]["devices"][1].update({"gi": "two"}),
         "spec.devices[0].mig.devices[1].gi: 'two' is not an integer"),
        (lambda o: o["spec"]["devices"][0]["topology"]["nvlinks"][0].update({"peer": "GPU-gone"}),
         "spec.devices[0].topology.nvlinks: peer GPU-gone is not a device"),
        (lambda o: o["spec"]["devices"][3].update({"computeCapability": "eight"}),
         "spec.devices[3].computeCapability: 'eight' is not <major>.<minor>"),
        (lambda o: o["spec"]["devices"].append(copy.deepcopy(o["spec"]["devices"][0])),
         "spec.devices: a device id appears twice"),
        (lambda o: o["spec"].update({"devices": {}}), "spec.devices: expected a list"),
        (lambda o: o.pop("spec"), "Device.spec: missing"),
        (lambda o: o.update({"apiVersion": "v1"}), "apiVersion/kind"),
        (lambda o: o["spec"]["node"].update({"cpu": "many"}), "spec.node.cpu: 'many' is not a quantity"),
    ],
)
def test_corrupt_object_names_the_field(mutate, message: str) -> None:
    obj = _obj()
    mutate(obj)
    with pytest.raises(DeviceObjectError) as err:
        inventory_from_device(obj)
    assert message in str(err.value)


def test_crd_schema_rejects_wrong_shapes() -> None:
    obj = _obj()
    obj["spec"]["devices"][0]["minor"] = "zero"
    obj["spec"]["devices"][1]["health"] = "yes"
    obj["spec"]["devices"][2]["extra"] = 1
    del obj["spec"]["devices"][3]["resources"]
    errors = check(SCHEMA, obj)
    assert ".spec.devices[0].minor: not integer" in errors
    assert ".spec.devices[1].health: not boolean" in errors
    assert ".spec.devices[2].extra: unknown field (would be pruned)" in errors
    assert ".spec.devices[3].resources: required" in errors
