"""The shared admission review (review_pod): every combination of GPU resources, spelled with
every alias, in limits or requests, is either refused or patched to a canonical fixed point that
parses to the same request."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import jsonpatch
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubegpu.model import parse_pod
from kubegpu.model import resources as R
from kubegpu.model.normalise import AdmissionPolicy, request_summary, review_ephemeral, review_pod

SPELLINGS: dict[str, list[str]] = {canon: [canon] for canon in (*R.SHARE_RESOURCES, R.NVIDIA_GPU)}
for alias, canon in R.ALIASES.items():
    SPELLINGS[canon].append(alias)
VALUES: dict[str, list[str]] = {
    R.NVIDIA_GPU: ["1", "2", "0.5", "0"],
    R.GPU_CORE: ["25", "50", "100", "200", "150", "0"],
    R.GPU_MEMORY_RATIO: ["25", "50", "100", "200", "250"],
    R.GPU_PERCENT: ["50", "100", "200", "150"],
    R.GPU_MEMORY: ["4Gi", "16Gi", "1025", "0.5"],
    R.GPU_SLOTS: ["1", "2", "4", "0"],
}


def pod_with(entries: dict[str, tuple[str, str, str]], sidecar: bool = False) -> dict[str, Any]:
    """entries: canonical name -> (spelling, value, where: limits|requests|both)."""
    limits: dict[str, str] = {"cpu": "1"}
    requests: dict[str, str] = {"memory": "1Gi"}
    for spelling, value, where in entries.values():
        if where in ("limits", "both"):
            limits[spelling] = value
        if where in ("requests", "both"):
            requests[spelling] = value
    containers: list[dict[str, Any]] = [{"name": "main", "image": "x",
                                         "resources": {"limits": limits, "requests": requests}}]
    if sidecar:
        containers.append({"name": "side", "image": "y"})
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": containers}}


def check_fixed_point(pod: dict[str, Any]) -> None:
    review = review_pod(pod)
    if not review.allowed:
        assert not review.patch
        for r in review.refusals:
            assert r.container and r.rule and r.code
        return
    patched = jsonpatch.apply_patch(copy.deepcopy(pod), list(review.patch))
    parsed = parse_pod(patched)
    assert parsed.ok
    assert request_summary(parsed) == request_summary(review.request)
    for c in patched["spec"]["containers"]:
        res = c.get("resources") or {}
        gpu_l = {k: v for k, v in (res.get("limits") or {}).items() if R.is_gpu_resource(k)}
        gpu_r = {k: v for k, v in (res.get("requests") or {}).items() if R.is_gpu_resource(k)}
        assert gpu_l == gpu_r
        assert not set(gpu_l) & (set(R.ALIASES) | {R.GPU_PERCENT})
    # Non-GPU entries are never touched.
    res = patched["spec"]["containers"][0]["resources"]
    assert res["limits"]["cpu"] == "1" and res["requests"]["memory"] == "1Gi"
    again = review_pod(patched)
    assert again.allowed and again.patch == ()


SHARE_NAMES = [R.GPU_CORE, R.GPU_MEMORY, R.GPU_MEMORY_RATIO, R.GPU_PERCENT, R.GPU_SLOTS]


@pytest.mark.parametrize("combo", [c for n in range(1, 6) for c in itertools.combinations(SHARE_NAMES, n)],
                         ids=lambda c: "+".join(x.split("/")[1] for x in c))
def test_every_share_combination_with_canonical_names(combo: tuple[str, ...]) -> None:
    divisible = {R.GPU_CORE: "100", R.GPU_MEMORY_RATIO: "100", R.GPU_PERCENT: "100", R.GPU_MEMORY: "16Gi",
                 R.GPU_SLOTS: "2"}
    entries = {canon: (canon, divisible[canon], "limits") for canon in combo}
    review = review_pod(pod_with(entries))
    present = set(combo)
    memory_forms = present & {R.GPU_MEMORY, R.GPU_MEMORY_RATIO}
    allowed = (
        not (R.GPU_PERCENT in present and present & {R.GPU_CORE, R.GPU_MEMORY, R.GPU_MEMORY_RATIO, R.GPU_SLOTS})
        and len(memory_forms) <= 1
        and (bool(memory_forms) or R.GPU_PERCENT in present)
    )
    # The protocol's list: gpu alone; gpu-memory alone; ratio alone; core with one memory form;
    # gpu.shared with a memory form (and optionally core); kubegpu.io/gpu only alone.
    assert review.allowed is allowed, (combo, review.refusals)
    check_fixed_point(pod_with(entries))


@given(
    picks=st.dictionaries(st.sampled_from([*SHARE_NAMES, R.NVIDIA_GPU]),
                          st.tuples(st.integers(0, 9), st.integers(0, 9),
                                    st.sampled_from(["limits", "requests", "both"])),
                          min_size=1, max_size=4),
    sidecar=st.booleans(),
)
@settings(max_examples=300, deadline=None)
def test_any_spelling_and_placement_is_refused_or_a_canonical_fixed_point(
        picks: dict[str, tuple[int, int, str]], sidecar: bool) -> None:
    entries = {}
    for canon, (si, vi, where) in picks.items():
        spellings, values = SPELLINGS[canon], VALUES[canon]
        entries[canon] = (spellings[si % len(spellings)], values[vi % len(values)], where)
    check_fixed_point(pod_with(entries, sidecar))


def test_policy_switches() -> None:
    pod = pod_with({R.NVIDIA_GPU: (R.NVIDIA_GPU, "1", "limits")}, sidecar=True)
    paths = [op["path"] for op in review_pod(pod).patch]
    assert paths == ["/spec/containers/0/resources", "/spec/containers/1/env", "/spec/tolerations"]
    quiet = AdmissionPolicy(add_toleration=False, void_env=False)
    assert [op["path"] for op in review_pod(pod, quiet).patch] == ["/spec/containers/0/resources"]
    custom = review_pod(pod, AdmissionPolicy(taint_key="example.com/accelerator")).patch[-1]
    assert custom["value"] == [{"key": "example.com/accelerator", "operator": "Exists", "effect": "NoSchedule"}]


def test_void_reaches_plain_pods_only_when_they_can_land_on_gpu_nodes() -> None:
    plain = {"spec": {"containers": [{"name": "web", "image": "nginx"}]}}
    assert review_pod(plain).patch == ()
    assert [op["path"] for op in review_pod(plain, AdmissionPolicy(void_all_pods=True)).patch] == \
        ["/spec/containers/0/env"]
    for toleration in ({"operator": "Exists"}, {"key": "nvidia.com/gpu", "operator": "Exists"},
                       {"key": "nvidia.com/gpu", "operator": "Equal", "value": "present", "effect": "NoSchedule"}):
        tolerating = copy.deepcopy(plain)
        tolerating["spec"]["tolerations"] = [toleration]
        assert review_pod(tolerating).patch, toleration
    other = copy.deepcopy(plain)
    other["spec"]["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute"},
                                    {"key": "dedicated", "operator": "Exists"}]
    assert review_pod(other).patch == ()


def test_privileged_containers_and_unknown_nvidia_devices_get_no_void() -> None:
    pod = pod_with({R.NVIDIA_GPU: (R.NVIDIA_GPU, "1", "limits")})
    pod["spec"]["containers"] += [
        {"name": "agent", "image": "dcgm", "securityContext": {"privileged": True}},
        {"name": "small", "image": "x", "resources": {"limits": {"nvidia.com/small": "1"}}},
        {"name": "rdma", "image": "x", "resources": {"limits": {"nvidia.com/rdma_shared_device_a": "1"}}},
    ]
    assert [op["path"] for op in review_pod(pod).patch] == ["/spec/containers/0/resources", "/spec/tolerations"]


@pytest.mark.parametrize("value", ["void", "none", "", "VOID"])
def test_harmless_visible_devices_values_are_allowed(value: str) -> None:
    pod = {"spec": {"containers": [{"name": "c", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": value}]}]}}
    assert review_pod(pod).allowed


def test_cuda_visible_devices_is_not_an_escape() -> None:
    pod = {"spec": {"containers": [{"name": "c", "env": [{"name": "CUDA_VISIBLE_DEVICES", "value": "0,1"}]}]}}
    assert review_pod(pod).allowed


def test_ephemeral_review_only_judges_new_containers() -> None:
    old = {"spec": {"containers": [{"name": "c"}], "ephemeralContainers": [
        {"name": "old", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]}}
    new = copy.deepcopy(old)
    new["spec"]["ephemeralContainers"].append({"name": "dbg"})
    review = review_ephemeral(new, old)
    assert review.allowed
    assert review.patch == ({"op": "add", "path": "/spec/ephemeralContainers/1/env",
                             "value": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]},)
    new["spec"]["ephemeralContainers"][1]["volumeMounts"] = [
        {"name": "x", "mountPath": "/var/run/nvidia-container-devices/GPU-1"}]
    assert [r.code for r in review_ephemeral(new, old).refusals] == ["visibility-mount"]
    assert review_ephemeral({"spec": None}, None).allowed
