"""The demo's end-state checks pass on a consistent state and fail, naming the culprit, on each kind
of inconsistency: env naming other GPUs, a missing record, a refused pod admitted, an overcommitted
GPU, a healthy "Xid" GPU, a new pod on the Xid GPU. Also the choice of the GPU to fail."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from kubegpu.demo.scenario import choose_xid_target, short_id
from kubegpu.demo.verify import EndState, Run, XidFault, replica_overlaps, verify
from kubegpu.model.allocation import ContainerAllocation, DeviceGrant, PodAllocation, encode
from kubegpu.model.annotations import DEVICE_ALLOCATED
from kubegpu.model.inventory import Gpu, NodeInventory
from kubegpu.node.handoff import DEVICE_ASSIGNED
from kubegpu.status.sources import pod_records
from kubegpu.status.view import build_view

GI = 2**30
A, B, C = "GPU-aaaaaaaa-0000", "GPU-bbbbbbbb-0000", "GPU-cccccccc-0000"


def _inv(healthy_c: bool = False) -> NodeInventory:
    return NodeInventory("n1", tuple(Gpu(u, i, i, "Tesla T4", 16 * GI, healthy=(u != C or healthy_c))
                                     for i, u in enumerate((A, B, C))))


def _pod(name: str, limits: dict[str, Any], grants: list[DeviceGrant] | None, container: str = "main",
         env: list[dict[str, str]] | None = None, ack: tuple[str, list[str]] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "d"}
    if grants is not None:
        meta["annotations"] = {DEVICE_ALLOCATED: encode(PodAllocation((ContainerAllocation(container,
                                                                                            tuple(grants)),)))}
    if ack is not None:
        meta["annotations"][DEVICE_ASSIGNED] = json.dumps(
            {"containers": {container: {"resource": ack[0], "devices": ack[1]}}})
    c: dict[str, Any] = {"name": container, "image": "x", "resources": {"limits": limits, "requests": limits}}
    if env:
        c["env"] = env
    return {"metadata": meta, "spec": {"nodeName": "n1", "containers": [c]}, "status": {"phase": "Running"}}


def _state(**changes: Any) -> EndState:
    pods = {
        "d/whole": _pod("whole", {"nvidia.com/gpu": "1"}, [DeviceGrant(0, A, 100, 16 * GI, 100)],
                        ack=("nvidia.com/gpu", [A])),
        "d/share": _pod("share", {"kubegpu.io/gpu-core": "50", "kubegpu.io/gpu-memory": "4Gi",
                                  "kubegpu.io/gpu.shared": "1"}, [DeviceGrant(1, B, 50, 4 * GI, 25)],
                        ack=("kubegpu.io/gpu.shared", [f"{B}::3"])),
        "d/after": _pod("after", {"kubegpu.io/gpu-core": "40", "kubegpu.io/gpu-memory": "4Gi",
                                  "kubegpu.io/gpu.shared": "1"}, [DeviceGrant(1, B, 40, 4 * GI, 25)],
                        ack=("kubegpu.io/gpu.shared", [f"{B}::7"])),
        "d/plain": _pod("plain", {"cpu": "1"}, None, env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]),
    }
    runs = [
        Run("d/whole", "main", "n1", {"NVIDIA_VISIBLE_DEVICES": A, "KUBEGPU_GPU_CORE_PERCENT": "100",
                                      "KUBEGPU_GPU_MEMORY_BYTES": str(16 * GI)}, {"nvidia.com/gpu": [A]}, 1.0),
        Run("d/share", "main", "n1", {"NVIDIA_VISIBLE_DEVICES": B, "KUBEGPU_GPU_CORE_PERCENT": "50",
                                      "KUBEGPU_GPU_MEMORY_BYTES": str(4 * GI)}, {"kubegpu.io/gpu.shared": [f"{B}::3"]},
            1.0),
        Run("d/after", "main", "n1", {"NVIDIA_VISIBLE_DEVICES": B, "KUBEGPU_GPU_CORE_PERCENT": "40",
                                      "KUBEGPU_GPU_MEMORY_BYTES": str(4 * GI)}, {"kubegpu.io/gpu.shared": [f"{B}::7"]},
            3.0),
        Run("d/plain", "main", "n1", {"NVIDIA_VISIBLE_DEVICES": "void"}, {}, 1.0),
    ]
    inv = changes.pop("inventory", _inv())
    pods = changes.pop("pods", pods)
    runs = changes.pop("runs", runs)
    view = build_view([inv], pod_records(pods.values(), []))
    base = EndState(expected_refused={"d/bad"}, refusals={"d/bad": "container 'main': memory must be declared"},
                    pods=pods, runs=runs, inventories={"n1": inv}, view=view,
                    xid=XidFault("n1", 2, C, 48, 2.0, 0.1), after_xid={"d/after"},
                    kubelet_unhealthy={"n1": {C, f"{C}::0"}}, extender_view=view,
                    expected_admitted=set(pods))
    return dataclasses.replace(base, **changes)


def _failed(state: EndState) -> dict[str, str]:
    return {c.name: c.detail for c in verify(state) if not c.ok}


def test_a_consistent_state_passes_every_check() -> None:
    assert _failed(_state()) == {}


def test_env_naming_another_gpu_fails() -> None:
    s = _state()
    s.runs[1] = dataclasses.replace(s.runs[1], env={**s.runs[1].env, "NVIDIA_VISIBLE_DEVICES": A})
    assert "d/share[main]" in _failed(s)["placed where recorded"]


def test_env_with_another_share_fails() -> None:
    s = _state()
    s.runs[1] = dataclasses.replace(s.runs[1], env={**s.runs[1].env, "KUBEGPU_GPU_CORE_PERCENT": "60"})
    assert "KUBEGPU_GPU_CORE_PERCENT=60" in _failed(s)["placed where recorded"]


def test_gpu_container_without_record_fails() -> None:
    s = _state()
    s.pods["d/whole"] = _pod("whole", {"nvidia.com/gpu": "1"}, None)
    assert "no kubegpu.io/device-allocated record" in _failed(s)["placed where recorded"]


def test_plain_container_seeing_gpus_fails() -> None:
    s = _state()
    s.runs[3] = dataclasses.replace(s.runs[3], env={"NVIDIA_VISIBLE_DEVICES": "all"})
    assert "asks for no GPU" in _failed(s)["placed where recorded"]


def test_allocate_acknowledged_for_another_container_fails() -> None:
    s = _state()
    s.pods["d/share"] = _pod("share", {"kubegpu.io/gpu-core": "50", "kubegpu.io/gpu-memory": "4Gi",
                                       "kubegpu.io/gpu.shared": "1"}, [DeviceGrant(1, B, 50, 4 * GI, 25)],
                             ack=("kubegpu.io/gpu.shared", [f"{B}::7"]))  # d/after's slot
    assert "d/share[main]: kubelet allocated" in _failed(s)["handoff acknowledged"]


def test_missing_acknowledgement_fails() -> None:
    s = _state()
    s.pods["d/whole"] = _pod("whole", {"nvidia.com/gpu": "1"}, [DeviceGrant(0, A, 100, 16 * GI, 100)])
    assert "acknowledged None" in _failed(s)["handoff acknowledged"]


def test_pending_pod_fails_placement() -> None:
    s = _state()
    s.pods["d/whole"] = {**s.pods["d/whole"], "status": {"phase": "Pending"}}
    assert "d/whole: Pending" in _failed(s)["every pod placed and running"]


def test_refused_pod_that_was_admitted_fails() -> None:
    s = _state(refusals={})
    assert "d/bad was admitted" in _failed(s)["admission"]


def test_pod_the_webhook_could_not_review_fails() -> None:
    s = _state(expected_admitted={"d/whole", "d/share", "d/after", "d/plain", "d/lost"},
               admission_errors={"d/lost": "webhook https://x/mutate: connection refused"})
    assert "d/lost was never created: webhook https://x/mutate: connection refused" in _failed(s)["admission"]


def test_unexpected_refusal_fails() -> None:
    s = _state(refusals={"d/bad": "x", "d/other": "nope"})
    assert "d/other was refused" in _failed(s)["admission"]


def test_overcommitted_record_fails() -> None:
    s = _state()
    s.pods["d/after"] = _pod("after", {"kubegpu.io/gpu-core": "60", "kubegpu.io/gpu-memory": "4Gi",
                                       "kubegpu.io/gpu.shared": "1"}, [DeviceGrant(1, B, 60, 4 * GI, 25)])
    s = _state(pods=s.pods)
    failed = _failed(s)
    assert "overcommitted" in failed["no overcommit"] or "110 %" in failed["no overcommit"]


def test_overcommit_in_what_containers_were_given_fails() -> None:
    s = _state()
    s.runs.append(Run("d/rogue", "main", "n1", {"NVIDIA_VISIBLE_DEVICES": B, "KUBEGPU_GPU_CORE_PERCENT": "30"},
                      {"kubegpu.io/gpu.shared": [f"{B}::9"]}, 3.0))
    assert "given 120 % compute" in _failed(s)["no overcommit"]


def test_time_slicing_replica_on_a_shared_gpu_is_overcommit() -> None:
    s = _state()
    s.runs.append(Run("d/replica", "main", "n1", {"NVIDIA_VISIBLE_DEVICES": B, "KUBEGPU_GPU_CORE_PERCENT": "25"},
                      {"nvidia.com/sharedgpu": [f"{B}::0"]}, 1.0))
    assert "given 115 % compute" in _failed(s)["no overcommit"]


def test_mig_devices_do_not_count_against_their_gpu() -> None:
    s = _state()
    s.runs.append(Run("d/mig", "main", "n1", {"NVIDIA_VISIBLE_DEVICES": "MIG-x", "KUBEGPU_GPU_CORE_PERCENT": "50"},
                      {"nvidia.com/mig-1g.10gb": ["MIG-x"]}, 1.0))
    assert "no overcommit" not in _failed(s)


def test_healthy_xid_gpu_fails() -> None:
    s = _state(inventory=_inv(healthy_c=True))
    assert "still Healthy" in _failed(s)["Xid GPU unhealthy"]


def test_kubelet_not_told_fails() -> None:
    s = _state(kubelet_unhealthy={"n1": set()})
    assert "not told" in _failed(s)["Xid GPU unhealthy"]


def test_pod_started_on_the_xid_gpu_after_it_fails() -> None:
    s = _state()
    s.runs.append(Run("d/late", "main", "n1", {"NVIDIA_VISIBLE_DEVICES": C}, {"nvidia.com/gpu": [C]}, 2.5))
    assert "d/late[main] started on it" in _failed(s)["nothing new on the Xid GPU"]


def test_missing_xid_fails() -> None:
    assert "no Xid" in _failed(_state(xid=None))["Xid GPU unhealthy"]


def test_extender_accounting_other_than_the_records_fails() -> None:
    s = _state()
    stale = build_view([_inv()], pod_records([s.pods["d/whole"]], []))  # missed both shares
    failed = _failed(dataclasses.replace(s, extender_view=stale))
    assert "GPU minor 1: records (90, 8589934592), extender (0, 0)" in failed["extender agrees"]
    assert "could not be read" in _failed(_state(extender_view=None))["extender agrees"]


def test_exited_role_fails() -> None:
    assert "node-n1" in _failed(_state(roles_exited=["node-n1 (exit 1)"]))["roles alive"]


@pytest.mark.parametrize("used, expected", [
    (set(), ("n2", 0)),  # n2 has three free GPUs, n1 two
    ({("n2", "GPU-n2-0"), ("n2", "GPU-n2-1")}, ("n1", 0)),  # replicas in use count, though unrecorded
])
def test_xid_target_is_a_free_gpu_on_the_roomiest_node(used: set[tuple[str, str]], expected: tuple[str, int]
                                                       ) -> None:
    invs = {"n1": NodeInventory("n1", tuple(Gpu(f"GPU-n1-{i}", i, i, "T4", GI) for i in range(2))),
            "n2": NodeInventory("n2", tuple(Gpu(f"GPU-n2-{i}", i, i, "T4", GI) for i in range(3)))}
    view = build_view(invs.values(), [])
    runs = [Run("d/r", "c", node, {}, {"nvidia.com/sharedgpu": [f"{uuid}::0"]}) for node, uuid in used]
    node, index, uuid = choose_xid_target(invs, view, runs) or ("", -1, "")
    assert (node, index) == expected and uuid == f"GPU-{node}-{index}"


def test_no_xid_target_when_every_gpu_is_held() -> None:
    invs = {"n1": NodeInventory("n1", (Gpu("GPU-x", 0, 0, "T4", GI),))}
    runs = [Run("d/r", "c", "n1", {}, {"nvidia.com/gpu": ["GPU-x"]})]
    assert choose_xid_target(invs, build_view(invs.values(), []), runs) is None


def test_replica_and_share_on_one_gpu_is_noted() -> None:
    runs = [Run("d/a", "c", "n1", {}, {"nvidia.com/sharedgpu": [f"{A}::0"]}),
            Run("d/b", "c", "n1", {}, {"kubegpu.io/gpu.shared": [f"{A}::5"]}),
            Run("d/c", "c", "n1", {}, {"kubegpu.io/gpu.shared": [f"{B}::5"]})]
    assert replica_overlaps(runs) == [f"n1 {A}"]


def test_short_id_keeps_gpus_apart() -> None:
    assert short_id("GPU-94e1c108-fd63-5aed,MIG-f25db7b9-3d15") == "GPU-94e1c108,MIG-f25db7b9"
    assert short_id("void") == "void"
