"""The recorded DRA sequences, end to end: kubegpu's DRA daemon against the stand-in kubelet DRA manager
(real gRPC on unix sockets), the stand-in API server (real HTTP) and the stand-in allocator."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from dra_harness import FIXTURES, Bed, fixture, make_bed, make_strict_bed, strip_server

from kubegpu.install.dra import device_classes
from kubegpu.install.values import Values
from kubegpu.node.dra.names import DRIVER
from kubegpu.node.dra.prepare import cdi_spec_path
from kubegpu_standins.dra_allocator import UNSCHEDULABLE
from kubegpu_standins.dra_cdi import inject, toolkit_devices
from kubegpu_standins.mps_control import connect_client

GROUP = "resource.k8s.io"


@pytest.fixture
def root() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kgd-", dir="/tmp"))  # unix socket paths must stay short
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def bed(root: Path) -> Iterator[Bed]:
    b = make_bed(root)
    try:
        yield b
    finally:
        b.close()


def _ready(bed: Bed, n_slices: int = 1) -> None:
    bed.start_daemon()
    assert bed.wait(lambda: DRIVER in bed.kubelet.plugins and len(bed.slices()) == n_slices)


def _classes(bed: Bed) -> None:
    # kubegpu's own classes (what `manifests --dra` installs), so the stand-in allocator checks them.
    for c in device_classes(Values()):
        bed.put(c)


def _claim(bed: Bed, name: str, request: dict, ns: str = "default") -> dict:
    return bed.api.put_object({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                               "metadata": {"name": name, "namespace": ns},
                               "spec": {"devices": {"requests": [{"name": "gpu", "exactly": request}]}}})


def test_registration_handshake_as_recorded(bed: Bed) -> None:
    _ready(bed)
    rec = fixture("registration-calls.json")
    info = rec[1]["response"]
    p = bed.kubelet.plugins[DRIVER]
    assert p.version == "v1.DRAPlugin"
    assert p.endpoint.endswith("/plugins/gpu.kubegpu.io/dra.sock")
    assert bed.daemon is not None and bed.daemon.plugin is not None
    assert bed.daemon.plugin.registered and bed.daemon.plugin.registration_error == ""
    assert info["supported_versions"] == list(bed.daemon.plugin.versions)
    # NodeWatchResources opened right after: every device HEALTHY, as in the recording.
    assert bed.wait(lambda: len(p.health) == 4)
    assert p.health == {("gpu-node-1", f"gpu-{i}"): "HEALTHY" for i in range(4)}


def test_slices_are_owned_by_their_node(bed: Bed) -> None:
    node = bed.api.put_object({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-node-1"}})
    _ready(bed)
    assert bed.wait(lambda: all(s["metadata"].get("ownerReferences") for s in bed.slices()))
    for s in bed.slices():
        assert s["metadata"]["ownerReferences"] == [{"apiVersion": "v1", "kind": "Node", "name": "gpu-node-1",
                                                     "uid": node["metadata"]["uid"], "controller": True}]


def test_v1beta1_when_the_kubelet_prefers_it(root: Path) -> None:
    bed = make_bed(root, kubelet_versions=("v1beta1.DRAPlugin",))
    try:
        _ready(bed)
        assert bed.kubelet.plugins[DRIVER].version == "v1beta1.DRAPlugin"
        _classes(bed)
        bed.put(fixture("s1-resourceclaimtemplate.json"))
        pod = bed.pod("p", [{"name": "gpu", "resourceClaimTemplateName": "single-gpu"}])
        assert bed.run(pod) and bed.wait(lambda: bed.running(pod))
        assert bed.kubelet.calls[-1].version == "v1beta1.DRAPlugin"
    finally:
        bed.close()


def test_single_gpu_from_a_template_prepare_and_unprepare(bed: Bed) -> None:
    _ready(bed)
    _classes(bed)
    bed.put(fixture("s1-resourceclaimtemplate.json"))
    pod = bed.pod("s1-pod", [{"name": "gpu", "resourceClaimTemplateName": "single-gpu"}])
    assert bed.run(pod)
    assert bed.wait(lambda: bed.running(pod))
    claims = bed.api.objects("resourceclaims", GROUP, "default")
    assert len(claims) == 1
    claim = claims[0]
    rec = fixture("s1-claim.json")
    assert claim["metadata"]["name"].startswith("s1-pod-gpu-")
    assert claim["metadata"]["annotations"] == rec["metadata"]["annotations"]
    assert claim["status"]["allocation"]["devices"] == rec["status"]["allocation"]["devices"]
    assert claim["status"]["allocation"]["nodeSelector"] == rec["status"]["allocation"]["nodeSelector"]
    call = bed.kubelet.calls[-1]
    assert call.method == "NodePrepareResources" and call.version == "v1.DRAPlugin"
    uid = claim["metadata"]["uid"]
    r = call.response.claims[uid]
    assert r.error == ""
    [d] = r.devices
    assert (list(d.request_names), d.pool_name, d.device_name) == (["gpu"], "gpu-node-1", "gpu-0")
    assert list(d.cdi_device_ids) == [f"k8s.gpu.kubegpu.io/device={uid}-gpu-0"]
    assert not d.HasField("share_id")
    spec = json.loads(cdi_spec_path(bed.cdi_dir, uid).read_text())
    example = fixture("s1-cdi-spec-example.json")
    assert spec["kind"] == example["kind"] and spec["cdiVersion"] == example["cdiVersion"]
    assert [x["name"] for x in spec["devices"]] == [f"{uid}-gpu-0"]
    env = spec["containerEdits"]["env"]
    assert "NVIDIA_VISIBLE_DEVICES=GPU-4c1f3a6e-9d2b-4e5f-8a7c-000000000000" in env
    assert f"KUBEGPU_CLAIM=default/{claim['metadata']['name']}" in env
    assert {"path": "/dev/nvidia0"} in spec["devices"][0]["containerEdits"]["deviceNodes"]
    # Pod ends: one Unprepare with the same claim, the spec is gone, the generated claim is deleted.
    assert bed.delete(pod) == [uid]
    assert bed.kubelet.calls[-1].method == "NodeUnprepareResources"
    assert bed.kubelet.calls[-1].response.claims[uid].error == ""
    assert not cdi_spec_path(bed.cdi_dir, uid).exists()
    assert bed.api.objects("resourceclaims", GROUP, "default") == []
    assert bed.daemon is not None and bed.daemon.preparer is not None and bed.daemon.preparer.claims == {}


def test_shared_claim_two_pods_one_prepare(bed: Bed) -> None:
    _ready(bed)
    _classes(bed)
    claim = _claim(bed, "shared-gpu", {"deviceClassName": "gpu.kubegpu.io", "allocationMode": "ExactCount",
                                       "count": 1})
    p1 = bed.pod("p1", [{"name": "gpu", "resourceClaimName": "shared-gpu"}])
    p2 = bed.pod("p2", [{"name": "gpu", "resourceClaimName": "shared-gpu"}])
    assert bed.run(p1) and bed.wait(lambda: bed.running(p1))
    n = len(bed.kubelet.calls)
    assert bed.run(p2) and bed.wait(lambda: bed.running(p2))
    assert len(bed.kubelet.calls) == n  # the second pod starts with no RPC
    assert len(bed.claim("shared-gpu")["status"]["reservedFor"]) == 2
    assert bed.delete(p1) == [] and len(bed.kubelet.calls) == n
    assert [r["name"] for r in bed.claim("shared-gpu")["status"]["reservedFor"]] == ["p2"]
    assert bed.delete(p2) == [claim["metadata"]["uid"]]
    st = bed.claim("shared-gpu").get("status") or {}
    assert "allocation" not in st and "reservedFor" not in st


def test_one_pod_two_claims_one_call(bed: Bed) -> None:
    _ready(bed)
    _classes(bed)
    req = {"deviceClassName": "gpu.kubegpu.io", "allocationMode": "ExactCount", "count": 1}
    _claim(bed, "a", req)
    _claim(bed, "b", req)
    pod = bed.pod("s2b", [{"name": "gpu-a", "resourceClaimName": "a"}, {"name": "gpu-b", "resourceClaimName": "b"}])
    assert bed.run(pod) and bed.wait(lambda: bed.running(pod))
    call = bed.kubelet.calls[-1]
    assert len(call.claims) == 2 and len(call.response.claims) == 2
    devs = sorted(d.device_name for c in call.response.claims.values() for d in c.devices)
    assert devs == ["gpu-0", "gpu-1"]
    assert len(bed.delete(pod)) == 2
    assert len(bed.kubelet.calls[-1].claims) == 2


def test_a_container_with_several_claims_sees_all_their_gpus(root: Path) -> None:
    """#21: one container on two claims (a whole GPU and a share), a second container on one of them.
    Through the real DRA gRPC, then the runtime's CDI injection in the kubelet's order: each container's
    device nodes and toolkit device list hold exactly the GPUs of its claims."""
    bed = make_bed(root, shared="all")
    try:
        _ready(bed)
        _classes(bed)
        _claim(bed, "whole", {"deviceClassName": "gpu.kubegpu.io", "allocationMode": "ExactCount", "count": 1})
        _claim(bed, "part", {"deviceClassName": "shared-gpu.kubegpu.io", "allocationMode": "ExactCount", "count": 1,
                             "capacity": {"requests": {"compute": "25", "memory": "10Gi"}}})
        claims = [{"name": "w", "resourceClaimName": "whole"}, {"name": "p", "resourceClaimName": "part"}]
        pod = bed.pod("multi", claims, containers=[
            {"name": "both", "image": "cuda", "resources": {"claims": [{"name": "w"}, {"name": "p"}]}},
            {"name": "one", "image": "cuda", "resources": {"claims": [{"name": "w"}]}}])
        assert bed.run(pod) and bed.wait(lambda: bed.running(pod))
        gpus = {g.index: g for g in bed.backend.discover().gpus}
        dev = {n: bed.claim(n)["status"]["allocation"]["devices"]["results"][0]["device"] for n in ("whole", "part")}
        assert dev == {"whole": "gpu-0", "part": "gpu-1"}
        per_ctr = bed.kubelet.pod_resources(pod["metadata"]["uid"])
        ids = {c: [d["name"] for r in res for cr in r["claim_resources"] for d in cr["cdi_devices"]]
               for c, res in per_ctr.items()}
        both, one = inject(bed.cdi_dir, ids["both"]), inject(bed.cdi_dir, ids["one"])
        assert toolkit_devices(both, volume_mounts=True) == [gpus[0].uuid, gpus[1].uuid]
        assert {"/dev/nvidia0", "/dev/nvidia1"} <= set(both.device_nodes)
        assert toolkit_devices(one, volume_mounts=True) == [gpus[0].uuid]
        assert "/dev/nvidia1" not in one.device_nodes
        # A single-claim container keeps the plain variable too (the toolkit's default mode).
        assert toolkit_devices(one, volume_mounts=False) == [gpus[0].uuid]
    finally:
        bed.close()


def test_consumable_capacity_three_shares_fourth_waits(root: Path) -> None:
    bed = make_bed(root, shared="0")
    try:
        _ready(bed)
        _classes(bed)
        share = {"deviceClassName": "shared-gpu.kubegpu.io", "allocationMode": "ExactCount", "count": 1,
                 "capacity": {"requests": {"compute": "30", "memory": "20Gi"}}}
        pods = []
        for i in range(1, 5):
            _claim(bed, f"slice-{i}", share)
            pods.append(bed.pod(f"s4-pod-{i}", [{"name": "gpu", "resourceClaimName": f"slice-{i}"}]))
        for p in pods[:3]:
            assert bed.run(p) and bed.wait(lambda p=p: bed.running(p))
        rec = fixture("s4-claim-slice-1.json")["status"]["allocation"]["devices"]["results"][0]
        shares = set()
        for i in range(1, 4):
            [r] = bed.claim(f"slice-{i}")["status"]["allocation"]["devices"]["results"]
            assert set(r) == set(rec)
            assert r["consumedCapacity"] == rec["consumedCapacity"] == {"compute": "30", "memory": "20Gi"}
            assert (r["device"], r["request"]) == ("gpu-0", "gpu")
            shares.add(r["shareID"])
        assert len(shares) == 3
        # The fourth does not fit (120 > 100): no status, the recorded message, no RPC.
        n = len(bed.kubelet.calls)
        assert not bed.run(pods[3])
        assert bed.allocator.last_failure == UNSCHEDULABLE == fixture("s4-pod-4.events.json")[0]["message"]
        assert bed.claim("slice-4").get("status", {}) == fixture("s4-claim-slice-4.json")["status"] == {}
        assert len(bed.kubelet.calls) == n
        # The prepare echoes the share ID and the container gets the share's limits.
        c1 = bed.claim("slice-1")
        uid, sid = c1["metadata"]["uid"], c1["status"]["allocation"]["devices"]["results"][0]["shareID"]
        first = next(c for c in bed.kubelet.calls if c.claims and c.claims[0][1] == uid)
        [d] = first.response.claims[uid].devices
        assert d.share_id == sid
        assert list(d.cdi_device_ids) == [f"k8s.gpu.kubegpu.io/device={uid}-gpu-0-{sid}"]
        env = json.loads(cdi_spec_path(bed.cdi_dir, uid).read_text())["containerEdits"]["env"]
        assert "KUBEGPU_GPU_CORE_PERCENT=30" in env and f"KUBEGPU_GPU_MEMORY_BYTES={20 * 2**30}" in env
        assert not any(e.startswith("CUDA_MPS_") for e in env)
        # PodResources reports the share ID (s8).
        dyn = bed.kubelet.pod_resources(pods[0]["metadata"]["uid"])["ctr"][0]
        res = dyn["claim_resources"][0]
        assert res["share_id"] == sid
        rec_dyn = fixture("s8-podresources-consumable-capacity.json")["List"]["pod_resources"][0]["containers"][0][
            "dynamic_resources"][0]
        assert set(dyn) == set(rec_dyn) and set(res) == set(rec_dyn["claim_resources"][0])
        assert res["cdi_devices"] == [{"name": f"k8s.gpu.kubegpu.io/device={uid}-gpu-0-{sid}"}]
        # Pod 1 ends: the waiting claim now fits and is prepared.
        bed.delete(pods[0])
        assert bed.run(pods[3]) and bed.wait(lambda: bed.running(pods[3]))
        # Without capacity.requests: the policy defaults, which are the whole GPU (100 %, 80Gi): it
        # does not fit beside the shares (recorded s4: a claim without requests consumes the defaults).
        _claim(bed, "slice-default", {"deviceClassName": "shared-gpu.kubegpu.io", "allocationMode": "ExactCount",
                                      "count": 1})
        assert not bed.run(bed.pod("s4-pod-default", [{"name": "gpu", "resourceClaimName": "slice-default"}]))
        assert bed.claim("slice-default").get("status", {}) == {}
        # compute: 150 is accepted by the API and cannot be allocated.
        _claim(bed, "slice-bad", {"deviceClassName": "shared-gpu.kubegpu.io", "allocationMode": "ExactCount",
                                  "count": 1, "capacity": {"requests": {"compute": "150"}}})
        assert not bed.run(bed.pod("s4-pod-bad", [{"name": "gpu", "resourceClaimName": "slice-bad"}]))
    finally:
        bed.close()


def test_a_gpu_serves_whole_claims_and_shares_as_demand_comes(root: Path) -> None:
    """Every GPU takes either one whole claim or shares up to its capacity, decided per claim by the
    allocator (no start-up split): wholes and shares interleave and nothing is over 100 %."""
    bed = make_bed(root, FIXTURES / "gpu-node-1.yaml", shared="all")
    try:
        _ready(bed)
        _classes(bed)
        whole = {"deviceClassName": "gpu.kubegpu.io", "allocationMode": "ExactCount", "count": 1}
        share = {"deviceClassName": "shared-gpu.kubegpu.io", "allocationMode": "ExactCount", "count": 1,
                 "capacity": {"requests": {"compute": "50", "memory": "40Gi"}}}
        order = [("w1", whole), ("s1", share), ("s2", share), ("s3", share), ("w2", whole)]
        pods = {}
        for name, req in order:
            _claim(bed, name, req)
            pods[name] = bed.pod(f"p-{name}", [{"name": "gpu", "resourceClaimName": name}])
            assert bed.run(pods[name]) and bed.wait(lambda n=name: bed.running(pods[n])), name
        res = {n: bed.claim(n)["status"]["allocation"]["devices"]["results"][0] for n, _ in order}
        # First fit in slice order, as the recorded allocator: a share skips the GPU a whole claim
        # holds, a whole claim skips the GPU a share is on.
        assert {n: r["device"] for n, r in res.items()} == {
            "w1": "gpu-0", "s1": "gpu-1", "s2": "gpu-1", "s3": "gpu-2", "w2": "gpu-3"}
        # A whole claim consumes all the capacity (the policy defaults), so no share lands beside it.
        assert res["w1"]["consumedCapacity"] == {"compute": "100", "memory": "80Gi"}
        used: dict[str, int] = {}
        for r in res.values():
            used[r["device"]] = used.get(r["device"], 0) + int(r["consumedCapacity"]["compute"])
        assert used == {"gpu-0": 100, "gpu-1": 100, "gpu-2": 50, "gpu-3": 100}

        def env(n: str) -> list[str]:
            return json.loads(cdi_spec_path(bed.cdi_dir, bed.claim(n)["metadata"]["uid"]).read_text())[
                "containerEdits"]["env"]
        # A whole claim's container is a whole-GPU container (no share limits); a share's has its limits.
        assert not any(e.startswith("KUBEGPU_GPU_CORE_PERCENT") for e in env("w1"))
        assert "KUBEGPU_GPU_CORE_PERCENT=50" in env("s1")
        # No GPU is whole-free (gpu-2 is half used): a third whole claim waits, a share still fits.
        _claim(bed, "w3", whole)
        p_w3 = bed.pod("p-w3", [{"name": "gpu", "resourceClaimName": "w3"}])
        assert not bed.run(p_w3)
        _claim(bed, "s4", share)
        assert bed.run(bed.pod("p-s4", [{"name": "gpu", "resourceClaimName": "s4"}]))
        assert bed.claim("s4")["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu-2"
        # gpu-1 is whole-free only once both its shares are gone; then the waiting whole claim gets it.
        bed.delete(pods["s1"])
        assert not bed.run(p_w3)
        bed.delete(pods["s2"])
        assert bed.run(p_w3) and bed.wait(lambda: bed.running(p_w3))
        assert bed.claim("w3")["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu-1"
    finally:
        bed.close()


def test_capacity_requests_only_filter_devices_given_whole(bed: Bed) -> None:
    """Upstream: on a device without allowMultipleAllocations, capacity.requests is a filter (as a CEL
    capacity >= request), and the device is still given whole (no consumedCapacity)."""
    _ready(bed)
    _classes(bed)
    big = {"deviceClassName": "gpu.kubegpu.io", "allocationMode": "ExactCount", "count": 1,
           "capacity": {"requests": {"memory": "100Gi"}}}
    _claim(bed, "too-big", big)
    assert not bed.run(bed.pod("p-big", [{"name": "gpu", "resourceClaimName": "too-big"}]))
    _claim(bed, "fits", dict(big, capacity={"requests": {"memory": "40Gi"}}))
    assert bed.run(bed.pod("p-fits", [{"name": "gpu", "resourceClaimName": "fits"}]))
    [r] = bed.claim("fits")["status"]["allocation"]["devices"]["results"]
    assert r["device"] == "gpu-0" and "consumedCapacity" not in r and "shareID" not in r


def test_shares_are_enforced_by_their_mps_daemon(root: Path) -> None:
    from kubegpu_standins.mps_control import install

    bed = make_bed(root, shared="all")
    mps_root = Path(tempfile.mkdtemp(prefix="kgm-", dir="/tmp"))  # unix socket paths stay short
    try:
        assert bed.settings is not None
        bed.settings = replace(bed.settings, mps=True, mps_root=str(mps_root), mps_binary=install(mps_root))
        _ready(bed)
        _classes(bed)
        _claim(bed, "s", {"deviceClassName": "shared-gpu.kubegpu.io", "allocationMode": "ExactCount", "count": 1,
                          "capacity": {"requests": {"compute": "25", "memory": "4Gi"}}})
        pod = bed.pod("p", [{"name": "gpu", "resourceClaimName": "s"}])
        assert bed.run(pod) and bed.wait(lambda: bed.running(pod))
        uid = bed.claim("s")["metadata"]["uid"]
        spec = json.loads(cdi_spec_path(bed.cdi_dir, uid).read_text())
        env = dict(e.split("=", 1) for e in spec["containerEdits"]["env"])
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
        mounts = {m["containerPath"]: m["hostPath"] for m in spec["containerEdits"]["mounts"]}
        assert mounts["/dev/shm"] == str(mps_root / "shm")
        # A client that raises its own limits gets the share: the daemon's defaults bind.
        client = connect_client({**env, "CUDA_MPS_PIPE_DIRECTORY": mounts[env["CUDA_MPS_PIPE_DIRECTORY"]],
                                 "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100",
                                 "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=100G"}, env["KUBEGPU_VISIBLE_GPUS"].split(","))
        assert client["thread_percentage"] == 25 and list(client["memory_limit_mib"].values()) == [4096]
        assert {d["attributes"]["shareEnforcement"]["string"] for s in bed.slices()
                for d in s["spec"].get("devices", []) if "shareEnforcement" in d["attributes"]} == {"mps"}
        # A daemon that stops answering taints its GPU's shared device with the reason until it is back.
        d = bed.daemon
        assert d is not None and d.mps is not None
        gpu = env["KUBEGPU_VISIBLE_GPUS"]
        assert gpu not in d.status()["taints"]
        for e in d.mps.manager._entries.values():
            e.control.quit()
            e.control.binary = str(mps_root / "gone")
        d.mps.manager.supervise()
        assert bed.wait(lambda: gpu in d.status()["taints"])
        for e in d.mps.manager._entries.values():
            e.control.binary, e.next_try = str(mps_root / "nvidia-cuda-mps-control"), 0.0
        d.mps.manager.supervise()
        assert bed.wait(lambda: gpu not in d.status()["taints"])
    finally:
        bed.close()
        shutil.rmtree(mps_root, ignore_errors=True)


def test_mig_claim_then_whole_gpu_waits(root: Path) -> None:
    bed = make_bed(root, topology="a100-mig")
    try:
        # The driver's list of MIG capability minors (the format of /proc/driver/nvidia-caps/mig-minors).
        minors = root / "mig-minors"
        minors.write_text("config 1\nmonitor 2\ngpu0/gi13/access 120\ngpu0/gi13/ci0/access 121\n"
                          "gpu0/gi14/access 129\n")
        assert bed.settings is not None
        bed.settings = replace(bed.settings, mig_minors_file=str(minors))
        _ready(bed, n_slices=2)
        _classes(bed)
        mig = {"deviceClassName": "mig.kubegpu.io", "allocationMode": "ExactCount", "count": 1,
               "selectors": [{"cel": {"expression": 'device.attributes["gpu.kubegpu.io"].profile == "1g.10gb"'}}]}
        _claim(bed, "mig-1g", mig)
        p = bed.pod("mig", [{"name": "gpu", "resourceClaimName": "mig-1g"}])
        assert bed.run(p) and bed.wait(lambda: bed.running(p))
        [r] = bed.claim("mig-1g")["status"]["allocation"]["devices"]["results"]
        assert r["device"] == "gpu-0-mig-1g10gb-13"
        uid = bed.claim("mig-1g")["metadata"]["uid"]
        spec = json.loads(cdi_spec_path(bed.cdi_dir, uid).read_text())
        env = spec["containerEdits"]["env"]
        # The GI and CI capability nodes ride with the MIG device, as on the device-plugin path.
        assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [
            {"path": "/dev/nvidia0"}, {"path": "/dev/nvidia-caps/nvidia-cap120"},
            {"path": "/dev/nvidia-caps/nvidia-cap121"}]
        mig_uuid = next(m.uuid for g in bed.backend.discover().gpus for m in g.mig_devices if m.gi == 13)
        assert f"NVIDIA_VISIBLE_DEVICES={mig_uuid}" in env
        # The parent of a used MIG device cannot be given whole (counters), another GPU can.
        whole = {"deviceClassName": "gpu.kubegpu.io", "allocationMode": "ExactCount", "count": 1,
                 "selectors": [{"cel": {"expression": 'device.attributes["gpu.kubegpu.io"].index == 0'}}]}
        _claim(bed, "whole-gpu-0", whole)
        assert not bed.run(bed.pod("full", [{"name": "gpu", "resourceClaimName": "whole-gpu-0"}]))
        assert bed.allocator.last_failure == UNSCHEDULABLE
        whole["selectors"] = [{"cel": {"expression": 'device.attributes["gpu.kubegpu.io"].index == 2'}}]
        _claim(bed, "whole-gpu-2", whole)
        assert bed.run(bed.pod("full2", [{"name": "gpu", "resourceClaimName": "whole-gpu-2"}]))
    finally:
        bed.close()


def test_extended_resource_claim(bed: Bed) -> None:
    _ready(bed)
    _classes(bed)
    bed.put(fixture("s6-deviceclass.json"))
    pod = bed.pod("s6-pod", [], containers=[{"name": "ctr", "image": "pause",
                                             "resources": {"limits": {"nvidia.com/gpu": "1"}}}])
    assert bed.run(pod) and bed.wait(lambda: bed.running(pod))
    [claim] = bed.api.objects("resourceclaims", GROUP, "default")
    rec = fixture("s6-claim.json")
    assert claim["metadata"]["annotations"] == rec["metadata"]["annotations"]
    assert claim["spec"] == rec["spec"]
    call = bed.kubelet.calls[-1]
    assert list(call.response.claims[claim["metadata"]["uid"]].devices[0].request_names) == ["container-0-request-0"]
    st = bed.api.get_object("pods", "s6-pod", "default")["status"]["extendedResourceClaimStatus"]
    assert st["requestMappings"] == fixture("s6-pod.json")["status"]["extendedResourceClaimStatus"]["requestMappings"]


def test_taints_skip_devices_and_tolerations_are_copied(bed: Bed) -> None:
    _ready(bed)
    _classes(bed)
    bed.backend.inject_xid(0, 79)
    assert bed.wait(lambda: "taints" in bed.slices()[0]["spec"]["devices"][0])
    taint = bed.slices()[0]["spec"]["devices"][0]["taints"][0]
    rec = fixture("s5-resourceslice-tainted.json")["spec"]["devices"][0]["taints"][0]
    assert {k: v for k, v in taint.items() if k != "timeAdded"} == {k: v for k, v in rec.items() if k != "timeAdded"}
    assert bed.slices()[0]["spec"]["pool"]["generation"] >= 2
    req = {"deviceClassName": "gpu.kubegpu.io", "allocationMode": "ExactCount", "count": 1}
    _claim(bed, "avoid", req)
    assert bed.run(bed.pod("avoid", [{"name": "gpu", "resourceClaimName": "avoid"}]))
    assert bed.claim("avoid")["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu-1"
    idx0 = dict(req, selectors=[{"cel": {"expression": 'device.attributes["gpu.kubegpu.io"].index == 0'}}])
    _claim(bed, "intolerant", idx0)
    assert not bed.run(bed.pod("intolerant", [{"name": "gpu", "resourceClaimName": "intolerant"}]))
    tol = [{"effect": "NoSchedule", "key": "gpu.kubegpu.io/xid-error", "operator": "Exists"}]
    _claim(bed, "tolerate", dict(idx0, tolerations=tol))
    assert bed.run(bed.pod("tolerate", [{"name": "gpu", "resourceClaimName": "tolerate"}]))
    res = bed.claim("tolerate")["status"]["allocation"]["devices"]["results"][0]
    want = fixture("s5-claim-taint-tolerate.json")["status"]["allocation"]["devices"]["results"][0]
    assert res == want
    # The kubelet's health stream saw it; recovery removes the taint.
    p = bed.kubelet.plugins[DRIVER]
    assert bed.wait(lambda: p.health.get(("gpu-node-1", "gpu-0")) == "UNHEALTHY")
    bed.backend.recover(0)
    assert bed.wait(lambda: "taints" not in bed.slices()[0]["spec"]["devices"][0])
    assert bed.wait(lambda: p.health.get(("gpu-node-1", "gpu-0")) == "HEALTHY")


def test_kubelet_restart_wipes_slices_and_prepares_again(bed: Bed) -> None:
    _ready(bed)
    _classes(bed)
    _claim(bed, "restart-claim", {"deviceClassName": "gpu.kubegpu.io", "allocationMode": "ExactCount", "count": 1})
    pod = bed.pod("s7", [{"name": "gpu", "resourceClaimName": "restart-claim"}])
    assert bed.run(pod) and bed.wait(lambda: bed.running(pod))
    uid = bed.claim("restart-claim")["metadata"]["uid"]
    first = bed.kubelet.calls[-1].response.claims[uid]
    before = json.loads((bed.kubelet.checkpoint_path).read_text())
    want = fixture("checkpoint-dra_manager_state-before-kubelet-restart.json")
    assert set(before) == set(want)
    entry = json.loads(before["Data"])["ClaimInfoStateList"][0]
    rec_entry = json.loads(want["Data"])["ClaimInfoStateList"][0]
    assert set(entry) == set(rec_entry)
    assert set(entry["DriverState"][DRIVER]["Devices"][0]) == set(rec_entry["DriverState"][DRIVER]["Devices"][0])
    # Restart: the kubelet deletes the node's slices; the driver publishes them again.
    bed.kubelet.stop()
    from kubegpu_standins.dra_kubelet import DraKubelet

    k2 = DraKubelet(bed.api, bed.root / "kubelet", "gpu-node-1", retry_s=0.3)
    bed.kubelet = k2
    k2.start()
    assert any("Deleted ResourceSlices" in e for e in k2.events)
    assert bed.wait(lambda: DRIVER in k2.plugins and len(bed.slices()) == 1)
    k2.add_pod(bed.api.get_object("pods", "s7", "default"))
    assert bed.wait(lambda: bed.running(pod))
    again = k2.calls[-1].response.claims[uid]
    assert again == first  # idempotent: the same answer
    entry = json.loads(json.loads(k2.checkpoint_path.read_text())["Data"])["ClaimInfoStateList"][0]
    assert len(entry["DriverState"][DRIVER]["Devices"]) == 2  # the recorded upstream quirk
    assert bed.delete(pod) == [uid]


def test_daemon_restart_keeps_prepared_claims(bed: Bed) -> None:
    _ready(bed)
    _classes(bed)
    _claim(bed, "c", {"deviceClassName": "gpu.kubegpu.io", "allocationMode": "ExactCount", "count": 1})
    pod = bed.pod("p", [{"name": "gpu", "resourceClaimName": "c"}])
    assert bed.run(pod) and bed.wait(lambda: bed.running(pod))
    uid = bed.claim("c")["metadata"]["uid"]
    bed.stop_daemon()
    cdi_spec_path(bed.cdi_dir, uid).unlink()  # a reboot empties /var/run/cdi
    d = bed.start_daemon()
    assert d.preparer is not None and uid in d.preparer.claims
    assert d.preparer.prepare("default", uid, "c")[0].device == "gpu-0"
    assert cdi_spec_path(bed.cdi_dir, uid).exists()
    assert bed.wait(lambda: DRIVER in bed.kubelet.plugins and bed.kubelet.plugins[DRIVER].connected)
    assert bed.delete(pod) == [uid]
    assert d.preparer.claims == {}


def test_plugin_down_slices_wiped_prepare_retried(root: Path) -> None:
    bed = make_bed(root, wipe_delay_s=6.0, retry_s=0.3)
    try:
        bed.start_daemon(withdraw_timeout_s=0.0)  # it goes as a killed driver does: its devices not withdrawn
        assert bed.wait(lambda: DRIVER in bed.kubelet.plugins and len(bed.slices()) == 1)
        _classes(bed)
        _claim(bed, "noplugin-claim", {"deviceClassName": "gpu.kubegpu.io", "allocationMode": "ExactCount",
                                       "count": 1})
        bed.stop_daemon()
        # Still scheduled: the slices exist until the kubelet's grace period ends.
        pod = bed.pod("s7-noplugin", [{"name": "gpu", "resourceClaimName": "noplugin-claim"}])
        assert bed.run(pod)
        assert bed.wait(lambda: any(c.error for c in bed.kubelet.calls))
        assert bed.wait(lambda: bed.slices() == [], 20)
        assert not bed.running(pod)
        bed.start_daemon()
        assert bed.wait(lambda: bed.running(pod))
        assert bed.wait(lambda: len(bed.slices()) == 1)
    finally:
        bed.close()


def test_failed_prepare_is_retried_then_succeeds(bed: Bed) -> None:
    _ready(bed)
    _classes(bed)
    _claim(bed, "fail-claim", {"deviceClassName": "gpu.kubegpu.io", "allocationMode": "ExactCount", "count": 1})
    bed.fail["fail-claim"] = "injected failure: GPU fail-claim could not be prepared (simulated NVML error)"
    pod = bed.pod("s7-fail", [{"name": "gpu", "resourceClaimName": "fail-claim"}])
    assert bed.run(pod)
    assert bed.wait(lambda: sum(1 for c in bed.kubelet.calls if c.method == "NodePrepareResources") >= 2)
    assert not bed.running(pod)
    assert any("NodePrepareResources failed for ResourceClaim fail-claim: injected failure" in e
               for e in bed.kubelet.events)
    bed.fail.clear()
    assert bed.wait(lambda: bed.running(pod))
    assert [c.method for c in bed.kubelet.calls].count("NodeUnprepareResources") == 0


def test_prepare_refuses_a_recreated_claim(bed: Bed) -> None:
    _ready(bed)
    _classes(bed)
    _claim(bed, "c", {"deviceClassName": "gpu.kubegpu.io", "allocationMode": "ExactCount", "count": 1})
    assert bed.daemon is not None and bed.daemon.preparer is not None
    from kubegpu.node.dra.prepare import PrepareError

    with pytest.raises(PrepareError, match="not allocated"):
        bed.daemon.preparer.prepare("default", bed.claim("c")["metadata"]["uid"], "c")
    with pytest.raises(PrepareError, match="has UID"):
        bed.daemon.preparer.prepare("default", "not-the-uid", "c")
    with pytest.raises(PrepareError, match="cannot read ResourceClaim default/missing"):
        bed.daemon.preparer.prepare("default", "u", "missing")


def test_registration_socket_served_again_when_deleted(bed: Bed) -> None:
    _ready(bed)
    assert bed.daemon is not None and bed.daemon.plugin is not None
    sock = bed.daemon.plugin.registration_socket
    sock.unlink()
    assert bed.wait(lambda: sock.exists())
    assert bed.wait(lambda: bed.daemon.plugin.registrations >= 2)  # type: ignore[union-attr]
    assert any("Unregistered DRA plugin" in e or "Registered DRA plugin" in e for e in bed.kubelet.events)


def test_fixture_objects_are_accepted_by_the_stand_in_api(bed: Bed) -> None:
    for f in ("s1-deviceclass.json", "s1-resourceslice.json", "s3-resourceslice-counters.json",
              "s3-resourceslice-devices.json", "s4-resourceslice.json", "s5-claim-taint-tolerate.json"):
        obj = strip_server(fixture(f))
        if obj["kind"] == "ResourceSlice":
            obj["metadata"]["name"] += "-copy"
        bed.api.put_object(obj)
    assert FIXTURES.is_dir()


class _Switchable:
    """An inventory backend whose GPUs can change (a MIG reconfiguration), with no health events."""

    def __init__(self, inv: Any) -> None:
        self.inv = inv

    def discover(self) -> Any:
        return self.inv

    def wait_event(self, timeout_s: float) -> None:
        time.sleep(min(timeout_s, 0.05))

    def probe(self, uuid: str) -> bool:
        return True

    def close(self) -> None:
        pass


def test_rediscovery_republishes_a_new_mig_geometry(bed: Bed) -> None:
    from kubegpu.inventory.fake import FakeBackend

    mig = FakeBackend("a100-mig", node_name="gpu-node-1").discover()
    plain = replace(mig, gpus=tuple(replace(g, mig_enabled=False, mig_devices=()) for g in mig.gpus))
    bed.backend = _Switchable(plain)  # type: ignore[assignment]
    _ready(bed)
    assert bed.daemon is not None
    assert bed.daemon.rediscover() is False  # nothing changed
    bed.backend.inv = mig  # type: ignore[attr-defined]
    assert bed.daemon.rediscover() is True
    assert bed.wait(lambda: len(bed.slices()) == 2)  # MIG devices and their counter sets
    names = {d["name"] for s in bed.slices() for d in s["spec"].get("devices") or []}
    assert "gpu-0-mig-1g10gb-13" in names
    assert {s["spec"]["pool"]["generation"] for s in bed.slices()} == {2}


def _strict_attrs(bed: Bed, gpu: str) -> dict[str, Any]:
    """The enforcement attributes the slices publish for GPU ``gpu``'s shared device."""
    dev = next(d for s in bed.slices() for d in s["spec"].get("devices", [])
               if d["attributes"]["uuid"]["string"] == gpu and "shareEnforcement" in d["attributes"])
    return {k: next(iter(v.values())) for k, v in dev["attributes"].items()
            if k in ("shareEnforcement", "computeMode", "shareShapeLock", "shareEscapable")}


def test_strict_shares_make_their_gpu_exclusive_and_a_whole_claim_waits_for_them(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kubegpu.inventory.compute_modes import DEFAULT, EXCLUSIVE_PROCESS
    from kubegpu.node.dra.prepare import PrepareError

    mps_root = Path(tempfile.mkdtemp(prefix="kgm-", dir="/tmp"))  # unix socket paths stay short
    state = mps_root / "driver"
    bed = make_strict_bed(root, mps_root, monkeypatch)
    try:
        _ready(bed)
        _classes(bed)
        gpu0 = bed.backend.discover().gpus[0].uuid
        assert _strict_attrs(bed, gpu0) == {"shareEnforcement": "strict", "shareEscapable": False}
        _claim(bed, "s", {"deviceClassName": "shared-gpu.kubegpu.io", "allocationMode": "ExactCount", "count": 1,
                          "capacity": {"requests": {"compute": "25", "memory": "4Gi"}}})
        pod = bed.pod("p", [{"name": "gpu", "resourceClaimName": "s"}])
        assert bed.run(pod) and bed.wait(lambda: bed.running(pod))
        claim = bed.claim("s")
        env = dict(e.split("=", 1) for e in json.loads(cdi_spec_path(bed.cdi_dir, claim["metadata"]["uid"])
                                                       .read_text())["containerEdits"]["env"])
        gpu = env["KUBEGPU_VISIBLE_GPUS"]
        assert bed.backend.compute_mode(gpu) == EXCLUSIVE_PROCESS
        assert "busy" in str(connect_client({}, [gpu], driver_state=str(state))["error"])  # no way around the server
        assert bed.wait(lambda: _strict_attrs(bed, gpu) == {
            "shareEnforcement": "strict", "computeMode": EXCLUSIVE_PROCESS, "shareShapeLock": "25% / 4096M",
            "shareEscapable": False})
        from kubegpu.status.dra import inventories

        [inv] = inventories(bed.slices())[0]
        shown = inv.gpu(gpu)
        assert (shown.share_enforcement, shown.compute_mode, shown.share_shape_lock, shown.share_escapable) == (
            "strict", EXCLUSIVE_PROCESS, "25% / 4096M", False)  # what `kubegpu status` shows of a DRA node
        # A claim handed the same GPU whole (a placement that did not know of the shares) is refused, with why.
        whole = json.loads(json.dumps(claim))
        whole["metadata"] = {"name": "w", "namespace": "default", "uid": "uid-whole"}
        for r in whole["status"]["allocation"]["devices"]["results"]:
            r.pop("consumedCapacity", None)
            r.pop("shareID", None)
        whole["status"].pop("reservedFor", None)  # not the share's pod: its end leaves this claim allocated
        bed.api.put_object(whole)
        d = bed.daemon
        assert d is not None and d.preparer is not None
        with pytest.raises(PrepareError, match=r"cannot be given whole now.*MPS-enforced share"):
            d.preparer.prepare("default", "uid-whole", "w")
        assert bed.backend.compute_mode(gpu) == EXCLUSIVE_PROCESS
        # The share is unprepared: its server quits, the mode goes back, the slices say so; then the GPU goes whole.
        bed.delete(pod)
        assert bed.backend.compute_mode(gpu) == DEFAULT
        assert bed.wait(lambda: _strict_attrs(bed, gpu) == {"shareEnforcement": "strict", "shareEscapable": False})
        d.preparer.prepare("default", "uid-whole", "w")
        assert bed.backend.compute_mode(gpu) == DEFAULT
        d.preparer.unprepare("default", "uid-whole", "w")
    finally:
        bed.close()
        shutil.rmtree(mps_root, ignore_errors=True)
