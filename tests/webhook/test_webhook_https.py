"""The admission table over real HTTPS on loopback: AdmissionReview v1 in, verdicts and JSON patches
out; patches applied with ``jsonpatch`` and the result re-parsed as canonical."""

from __future__ import annotations

import base64
import copy
import glob
import json
from pathlib import Path
from typing import Any

import httpx
import jsonpatch
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kubegpu.model import parse_pod
from kubegpu.model import resources as R
from kubegpu.model.normalise import request_summary
from kubegpu.webhook.review import MAX_BODY_BYTES

# The seed examples, shipped with the tests (copied from the project's shared seed-examples).
SEEDS = Path(__file__).resolve().parents[1] / "fixtures" / "seed-examples"

CASES = yaml.safe_load((Path(__file__).parent / "admission_cases.yaml").read_text())
VOID = {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def case_pod(case: dict[str, Any]) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": case["id"], "namespace": case.get("namespace", "team-a")}
    if "annotations" in case:
        meta["annotations"] = case["annotations"]
    spec: dict[str, Any] = {"containers": [{"image": "busybox", **c} for c in case["containers"]]}
    if "initContainers" in case:
        spec["initContainers"] = [{"image": "busybox", **c} for c in case["initContainers"]]
    if "tolerations" in case:
        spec["tolerations"] = case["tolerations"]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def admission_review(pod: dict[str, Any], uid: str, *, operation: str = "CREATE",
                     namespace: str | None = None) -> dict[str, Any]:
    ns = namespace if namespace is not None else pod.get("metadata", {}).get("namespace", "default")
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "namespace": ns,
            "operation": operation,
            "userInfo": {"username": "alice"},
            "object": pod,
            "oldObject": None,
            "dryRun": False,
        },
    }


def post(client: httpx.Client, path: str, pod: dict[str, Any], uid: str = "uid-1") -> dict[str, Any]:
    r = client.post(path, json=admission_review(pod, uid))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["apiVersion"] == "admission.k8s.io/v1" and body["kind"] == "AdmissionReview"
    assert body["response"]["uid"] == uid
    return body["response"]


def apply_patch(pod: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    if "patch" not in response:
        return pod
    assert response["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(response["patch"]))
    return jsonpatch.apply_patch(pod, ops)


def gpu_entries(section: dict[str, Any] | None) -> dict[str, str]:
    return {k: str(v) for k, v in (section or {}).items() if R.is_gpu_resource(k)}


def all_containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def assert_canonical(pod: dict[str, Any]) -> None:
    """Every GPU entry has its canonical name, limits equal requests, and parse_pod accepts it."""
    parsed = parse_pod(pod)
    assert parsed.ok, parsed.refusals
    for c in all_containers(pod):
        res = c.get("resources") or {}
        limits, requests = gpu_entries(res.get("limits")), gpu_entries(res.get("requests"))
        assert limits == requests
        for name in limits:
            assert name not in R.ALIASES and name != R.GPU_PERCENT


@pytest.mark.parametrize("case", [c for c in CASES if c["expect"] == "allow"], ids=lambda c: c["id"])
def test_allowed_cases_are_patched_to_canonical(client: httpx.Client, case: dict[str, Any]) -> None:
    pod = case_pod(case)
    response = post(client, "/mutate", copy.deepcopy(pod))
    assert response["allowed"] is True
    assert ("patch" in response) == case.get("patched", True)
    patched = apply_patch(copy.deepcopy(pod), response)
    if case.get("webhook_only"):
        assert patched == pod
        return
    assert_canonical(patched)

    by_name = {c["name"]: c for c in all_containers(patched)}
    for name, canon in case["canonical"].items():
        res = by_name[name]["resources"]
        assert gpu_entries(res["limits"]) == canon
        assert gpu_entries(res["requests"]) == canon
    for name, kept in case.get("keeps", {}).items():
        res = by_name[name]["resources"]
        for section, entries in kept.items():
            assert {k: v for k, v in res[section].items() if not R.is_gpu_resource(k)} == entries
    voided = [n for n, c in by_name.items() if VOID in (c.get("env") or [])]
    assert sorted(voided) == sorted(case.get("void", []))
    for c in by_name.values():  # never two NVIDIA_VISIBLE_DEVICES in one container
        assert sum(e["name"] == "NVIDIA_VISIBLE_DEVICES" for e in c.get("env") or []) <= 1
    tolerations = patched["spec"].get("tolerations") or []
    if case.get("toleration_added"):
        assert tolerations == [*case.get("tolerations", []), GPU_TOLERATION]
    else:
        assert tolerations == case.get("tolerations", [])

    # The same requests before and after, and the result is a fixed point of the webhook.
    assert request_summary(parse_pod(patched)) == request_summary(parse_pod(pod))
    again = post(client, "/mutate", copy.deepcopy(patched), uid="uid-2")
    assert again["allowed"] is True and "patch" not in again
    assert post(client, "/validate", patched, uid="uid-3")["allowed"] is True


@pytest.mark.parametrize("case", [c for c in CASES if c["expect"] == "deny"], ids=lambda c: c["id"])
def test_refused_cases_name_container_resource_value_and_rule(client: httpx.Client,
                                                               case: dict[str, Any]) -> None:
    pod = case_pod(case)
    for path in ("/mutate", "/validate"):
        response = post(client, path, copy.deepcopy(pod))
        assert response["allowed"] is False
        assert "patch" not in response
        status = response["status"]
        assert status["code"] == 403
        lines = status["message"].splitlines()
        assert [line.rsplit("[", 1)[-1].rstrip("]") for line in lines] == case["codes"]
        for line in lines:
            assert line.startswith(("container '", "pod:"))


def test_seed_example_pods(client: httpx.Client) -> None:
    seeds = sorted(glob.glob(str(SEEDS / "*.yaml")))
    pods = [d for f in seeds for d in yaml.safe_load_all(Path(f).read_text()) if d and d.get("kind") == "Pod"]
    assert len(pods) >= 8
    expected = {
        "gpu-pod-affinity": [("whole", 2)], "gpu-pod": [("whole", 2), ("whole", 3)],
        "gpu-pod-toleration": [("whole", 1)], "cuda-vector-add": [("whole", 1)],
        "share-gpu-100": [("share", 1)], "share-core-ratio": [("share", 1)], "share-core-memory": [("share", 1)],
    }
    seen = set()
    for i, pod in enumerate(pods):
        response = post(client, "/mutate", copy.deepcopy(pod), uid=f"seed-{i}")
        assert response["allowed"] is True, response
        patched = apply_patch(copy.deepcopy(pod), response)
        assert_canonical(patched)
        summary = request_summary(parse_pod(patched))
        name = pod["metadata"]["name"]
        if name == "gpu-pod" and len(pod["spec"]["containers"]) == 1:
            assert [(s["kind"], s["count"]) for s in summary] == [("whole", 1)]
        else:
            assert [(s["kind"], s["count"]) for s in summary] == expected[name]
        seen.add(name)
        # The toleration seed already tolerates the taint: no second toleration.
        tols = [t for t in patched["spec"].get("tolerations", []) if t.get("key") == "nvidia.com/gpu"]
        assert len(tols) == 1
    assert seen == set(expected)
    share = next(p for p in pods if p["metadata"]["name"] == "share-core-memory")
    patched = apply_patch(copy.deepcopy(share), post(client, "/mutate", copy.deepcopy(share)))
    res = patched["spec"]["containers"][0]["resources"]
    assert res["limits"] == {"cpu": "40m", "memory": "40Mi", R.GPU_CORE: "100", R.GPU_MEMORY: "16Mi",
                             R.GPU_SLOTS: "1"}
    assert res["requests"] == res["limits"]


BAD_BODIES = [
    b"",
    b"not json",
    b"[]",
    b'"AdmissionReview"',
    b'{"apiVersion": "v1", "kind": "Pod"}',
    b'{"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", "request": {"uid": "x"}}',
    b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}',
    b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": "x"}',
    b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"object": {}}}',
    b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": 5}}',
    b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": "x"',
    b"\xff\xfe\x00garbage",
    b"{" * 100_000,
    b" " * (9 * 2**20),
]


@pytest.mark.parametrize("body", BAD_BODIES, ids=range(len(BAD_BODIES)))
@pytest.mark.parametrize("path", ["/mutate", "/validate"])
def test_bad_bodies_get_400_and_the_server_lives_on(client: httpx.Client, body: bytes, path: str) -> None:
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == (413 if len(body) > MAX_BODY_BYTES else 400)
    assert "error" in r.json()
    assert client.get("/healthz").status_code == 200


@pytest.mark.parametrize("obj", [None, "a string", [], {"spec": None}, {"spec": {"containers": "x"}},
                                 {"spec": {"containers": [{"name": "a", "resources": {"limits": 7}}]}}])
def test_malformed_pods_in_a_good_review_are_refused_or_passed_never_500(client: httpx.Client,
                                                                         obj: Any) -> None:
    review = admission_review({}, "u")
    review["request"]["object"] = obj
    r = client.post("/mutate", json=review)
    assert r.status_code == 200
    response = r.json()["response"]
    if isinstance(obj, dict):
        assert response["allowed"] is False and response["status"]["message"]
    else:
        assert response["allowed"] is True  # no object to judge (DELETE-like)


def test_only_pod_creation_is_judged(client: httpx.Client) -> None:
    bad = case_pod({"id": "x", "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "0.5"}}}]})
    for operation in ("UPDATE", "DELETE", "CONNECT"):
        r = client.post("/validate", json=admission_review(bad, "u", operation=operation))
        assert r.json()["response"]["allowed"] is True
    deployment = admission_review(bad, "u")
    deployment["request"]["kind"]["kind"] = "Deployment"
    assert client.post("/validate", json=deployment).json()["response"]["allowed"] is True
    sub = admission_review(bad, "u")
    sub["request"]["subResource"] = "status"
    assert client.post("/validate", json=sub).json()["response"]["allowed"] is True


def test_own_namespace_is_always_excluded(client: httpx.Client) -> None:
    bad = case_pod({"id": "x", "namespace": "kubegpu-system",
                    "containers": [{"name": "c", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]})
    response = post(client, "/mutate", bad)
    assert response["allowed"] is True and "patch" not in response
    bad["metadata"]["namespace"] = "team-a"
    assert post(client, "/mutate", bad)["allowed"] is False


def test_plain_pod_passes_with_no_patch_and_no_warnings(client: httpx.Client) -> None:
    pod = case_pod({"id": "web", "containers": [{"name": "nginx", "resources": {"limits": {"cpu": "1"}}}]})
    response = post(client, "/mutate", pod)
    assert response == {"uid": "uid-1", "allowed": True}


def metric_samples(client: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The webhook's metrics now, by (sample name, sorted labels)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(client.get("/metrics").text) for s in fam.samples}


MUTATE_TIMINGS = ("kubegpu_webhook_review_seconds_count", (("endpoint", "mutate"),))


def test_metrics_count_reviews_by_verdict_and_reason(client: httpx.Client) -> None:
    timed = metric_samples(client).get(MUTATE_TIMINGS, 0.0)  # the client is shared with the module's other tests
    post(client, "/mutate", case_pod(CASES[0]))
    post(client, "/validate", case_pod({"id": "f", "containers": [
        {"name": "c", "resources": {"limits": {"nvidia.com/gpu": "0.5"}}}]}))
    client.post("/mutate", content=b"junk")
    samples = metric_samples(client)

    def count(endpoint: str, verdict: str, reason: str) -> float:
        key = ("kubegpu_webhook_reviews_total",
               tuple(sorted({"endpoint": endpoint, "verdict": verdict, "reason": reason}.items())))
        return samples.get(key, 0.0)

    assert count("mutate", "patched", "gpu") >= 1
    assert count("validate", "denied", "whole-number") >= 1
    assert count("mutate", "error", "bad-request") >= 1
    # Answered reviews are timed; the malformed one is counted above, not timed.
    assert samples[MUTATE_TIMINGS] == timed + 1
    assert samples[("kubegpu_webhook_cert_not_after_seconds", ())] > 0


def test_ephemeral_debug_containers_get_void_and_may_not_choose_gpus(client: httpx.Client) -> None:
    old = case_pod({"id": "p", "containers": [{"name": "cuda", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]})
    old["spec"]["ephemeralContainers"] = [{"name": "debug-old", "image": "busybox"}]
    new = copy.deepcopy(old)
    new["spec"]["ephemeralContainers"].append({"name": "debug", "image": "cuda", "env": [{"name": "A", "value": "1"}]})
    review = admission_review(new, "e1", operation="UPDATE")
    review["request"]["subResource"] = "ephemeralcontainers"
    review["request"]["oldObject"] = old
    response = client.post("/mutate", json=review).json()["response"]
    assert response["allowed"] is True
    patched = apply_patch(copy.deepcopy(new), response)
    debug_old, debug = patched["spec"]["ephemeralContainers"]
    assert "env" not in debug_old  # existing ephemeral containers are immutable: untouched
    assert debug["env"] == [{"name": "A", "value": "1"}, VOID]

    new["spec"]["ephemeralContainers"][1]["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]
    review["request"]["object"] = new
    response = client.post("/validate", json=review).json()["response"]
    assert response["allowed"] is False
    assert "container 'debug': env NVIDIA_VISIBLE_DEVICES='all'" in response["status"]["message"]


def test_served_connections_disable_nagle(webhook: Any) -> None:
    """asyncio sets TCP_NODELAY only on sockets whose proto is TCP; without it each review
    waits for a delayed ACK (40 ms on Linux)."""
    import socket

    assert webhook.sock.proto == socket.IPPROTO_TCP
    assert webhook.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
