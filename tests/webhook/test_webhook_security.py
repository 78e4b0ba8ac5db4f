"""Issue 11 items 2 and 9, issue 12 items 1 and 8 at admission: only kubegpu writes the records, GPU pods
are steered to kubegpu's scheduler in full mode, pods created onto a node get ``void`` like any pod that
can reach a GPU, pods over the GPU-container cap are refused with the reason, and envFrom on a GPU
container is a warning naming the node-side setting that closes it."""

from __future__ import annotations

import base64
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kubegpu.model import annotations as A
from kubegpu.webhook.app import WebhookSettings, decide, default_record_writers

NODE_SA = "system:serviceaccount:kubegpu-system:kubegpu-node"
EXTENDER_SA = "system:serviceaccount:kubegpu-system:kubegpu-scheduler-extender"
FULL = WebhookSettings(own_namespace="kubegpu-system", scheduler_name="kubegpu-scheduler")


def gpu_pod(annotations: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "p", "namespace": "team-a"}
    if annotations is not None:
        meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"containers": [{"name": "c", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
                     **spec}}


def review(obj: dict[str, Any], *, op: str = "CREATE", old: dict[str, Any] | None = None, user: str = "alice",
           sub: str = "", settings: WebhookSettings = FULL, mutate: bool = True) -> dict[str, Any]:
    body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u", "kind": {"kind": "Pod"}, "namespace": "team-a", "operation": op,
                        "subResource": sub, "object": obj, "oldObject": old,
                        "userInfo": {"username": user, "groups": ["system:authenticated"]}}}
    return json.loads(decide(json.dumps(body).encode(), settings, mutate=mutate).body)["response"]


def patch_of(resp: dict[str, Any]) -> list[dict[str, Any]]:
    return json.loads(base64.b64decode(resp["patch"])) if "patch" in resp else []


FORGED = '{"gpu":[{"minor":0,"id":"GPU-x","resources":{"kubegpu.io/gpu-core":"100"}}]}'


def test_a_pod_created_with_a_record_is_refused_unless_kubegpu_sends_it() -> None:
    for key in (A.DEVICE_ALLOCATED, A.DEVICE_ASSIGNED):
        for mutate in (True, False):
            resp = review(gpu_pod({key: FORGED}), mutate=mutate)
            assert resp["allowed"] is False and key in resp["status"]["message"]
            assert "written only by kubegpu" in resp["status"]["message"]
        # In every namespace, the excluded ones too, and on plain (non-GPU) pods.
        plain = {"metadata": {"name": "q", "namespace": "kube-system", "annotations": {key: "{}"}}, "spec": {}}
        assert review(plain)["allowed"] is False
    assert review(gpu_pod({A.DEVICE_ASSIGNED: "{}"}), user=NODE_SA)["allowed"] is True


def test_every_device_key_is_refused_to_anyone_but_its_kubegpu_writer() -> None:
    """Issue 24 item 4: on its own (clusters before 1.30 have no admission policy), the webhook refuses the
    signature keys and any other kubegpu.io/device-* key, on create and on patch."""
    sig_writers = {"kubegpu.io/device-allocated-signature": EXTENDER_SA,
                   "kubegpu.io/device-assigned-signature": NODE_SA}
    for key in (*sig_writers, "kubegpu.io/device-foo"):
        assert review(gpu_pod({key: "0" * 64}))["allowed"] is False, key
        resp = review(gpu_pod({key: "1" * 64}), op="UPDATE", old=gpu_pod({}))
        assert resp["allowed"] is False and key in resp["status"]["message"], key
        assert review(gpu_pod({}), op="UPDATE", old=gpu_pod({key: "1"}))["allowed"] is False, key  # removal
    for key, writer in sig_writers.items():
        assert review(gpu_pod({key: "1" * 64}), op="UPDATE", old=gpu_pod({}), user=writer)["allowed"] is True
        other = NODE_SA if writer == EXTENDER_SA else EXTENDER_SA
        assert review(gpu_pod({key: "1" * 64}), op="UPDATE", old=gpu_pod({}), user=other)["allowed"] is False
    # Keys of other prefixes are not kubegpu's records.
    assert review(gpu_pod({"kubegpu.io/team": "x"}), op="UPDATE", old=gpu_pod({}))["allowed"] is True


def test_an_unknown_device_key_is_refused_as_unknown_and_a_record_as_kubegpus() -> None:
    # A misspelt key is no record: its author is told the key is unknown and which ones exist, not that the
    # extender wrote it.
    message = review(gpu_pod({"kubegpu.io/device-foo": "x"}))["status"]["message"]
    assert message.startswith("kubegpu.io/device-foo is not a kubegpu.io annotation kubegpu knows")
    assert "written only by kubegpu" not in message and "extender" not in message
    assert A.GPU_MODEL in message and A.REQUIRE_NVLINK in message and A.DEVICE_ALLOCATED in message
    for key in (A.DEVICE_ALLOCATED, "kubegpu.io/device-allocated-signature"):
        message = review(gpu_pod({key: "{}"}))["status"]["message"]
        assert message.startswith(f"{key} is written only by kubegpu (the scheduler extender records")
        assert "not a kubegpu.io annotation" not in message
    both = review(gpu_pod({A.DEVICE_ASSIGNED: "{}", "kubegpu.io/device-x": "1", "kubegpu.io/device-y": "2"}),
                  op="UPDATE", old=gpu_pod({}))["status"]["message"].splitlines()
    assert len(both) == 2
    assert both[0].startswith(f"{A.DEVICE_ASSIGNED} is written only by kubegpu")
    assert both[1].startswith("kubegpu.io/device-x and kubegpu.io/device-y are not kubegpu.io annotations")
    # A key as long as the API server allows is named, not echoed whole.
    long_key = "kubegpu.io/device-" + "z" * 300
    assert len(review(gpu_pod({long_key: "1"}))["status"]["message"]) < 600


def test_an_update_that_sets_changes_or_removes_a_record_is_refused_unless_kubegpu_sends_it() -> None:
    bound = gpu_pod({A.DEVICE_ALLOCATED: FORGED})
    for new_ann in ({A.DEVICE_ALLOCATED: FORGED.replace("GPU-x", "GPU-y")}, {},
                    {A.DEVICE_ALLOCATED: FORGED, A.DEVICE_ASSIGNED: "{}"}):
        resp = review(gpu_pod(new_ann), op="UPDATE", old=bound)
        assert resp["allowed"] is False, new_ann
        writer = NODE_SA if A.DEVICE_ASSIGNED in new_ann else EXTENDER_SA  # each record has its writer
        assert review(gpu_pod(new_ann), op="UPDATE", old=bound, user=writer)["allowed"] is True
    # Through the status subresource too (metadata can ride along).
    assert review(gpu_pod({}), op="UPDATE", old=bound, sub="status")["allowed"] is False
    # Updates that leave the records alone pass (labels, finalizers, the kubelet's status).
    same = gpu_pod({A.DEVICE_ALLOCATED: FORGED, "team": "x"})
    assert review(same, op="UPDATE", old=bound)["allowed"] is True
    assert review(bound, op="UPDATE", old=bound, sub="status", user="system:node:n1")["allowed"] is True


def test_record_writers_are_configurable() -> None:
    only = WebhookSettings(record_writers=frozenset({"system:serviceaccount:gpu:writer"}))
    assert review(gpu_pod({A.DEVICE_ASSIGNED: "{}"}), user=NODE_SA, settings=only)["allowed"] is False
    assert review(gpu_pod({A.DEVICE_ASSIGNED: "{}"}), user="system:serviceaccount:gpu:writer",
                  settings=only)["allowed"] is True
    assert NODE_SA in default_record_writers("kubegpu-system", A.DEVICE_ASSIGNED)
    assert NODE_SA not in default_record_writers("kubegpu-system", A.DEVICE_ALLOCATED)
    assert "system:serviceaccount:other:kubegpu-node" in default_record_writers("other")
    # By default each record has its own writer: the node daemon may not rewrite the extender's record.
    assert review(gpu_pod({A.DEVICE_ALLOCATED: FORGED}), user=NODE_SA)["allowed"] is False
    assert review(gpu_pod({A.DEVICE_ALLOCATED: FORGED}), user=EXTENDER_SA)["allowed"] is True


@given(ann=st.dictionaries(st.sampled_from([A.DEVICE_ALLOCATED, A.DEVICE_ASSIGNED, "x"]),
                           st.sampled_from(["", "{}", FORGED]), max_size=3),
       old_ann=st.dictionaries(st.sampled_from([A.DEVICE_ALLOCATED, A.DEVICE_ASSIGNED, "x"]),
                               st.sampled_from(["", "{}", FORGED]), max_size=3),
       op=st.sampled_from(["CREATE", "UPDATE", "DELETE", "CONNECT"]),
       user=st.sampled_from(["alice", NODE_SA, "", EXTENDER_SA,
                             "system:serviceaccount:kubegpu-system:kubegpu-scheduler"]))
@settings(max_examples=200, deadline=None)
def test_refused_exactly_when_someone_else_changes_a_record(ann: dict[str, str], old_ann: dict[str, str], op: str,
                                                            user: str) -> None:
    old = gpu_pod(old_ann) if op == "UPDATE" else None
    resp = review(gpu_pod(ann), op=op, old=old, user=user)
    before = old_ann if op == "UPDATE" else {}
    changes = any(ann.get(k) != before.get(k) for k in (A.DEVICE_ALLOCATED, A.DEVICE_ASSIGNED)
                  if k in ann or k in before)
    changed = [k for k in (A.DEVICE_ALLOCATED, A.DEVICE_ASSIGNED)
               if (k in ann or k in before) and ann.get(k) != before.get(k)]
    allowed = all(user in default_record_writers("kubegpu-system", k) for k in changed)
    refused = op in ("CREATE", "UPDATE") and changes and not allowed
    assert (resp["allowed"] is False and "written only by kubegpu" in resp["status"]["message"]) == refused


def test_full_mode_steers_gpu_pods_to_kubegpus_scheduler() -> None:
    resp = review(gpu_pod())
    assert {"op": "add", "path": "/spec/schedulerName", "value": "kubegpu-scheduler"} in patch_of(resp)
    assert any("schedulerName set to kubegpu-scheduler" in w for w in resp["warnings"])
    resp = review(gpu_pod(schedulerName="default-scheduler"))
    assert {"op": "add", "path": "/spec/schedulerName", "value": "kubegpu-scheduler"} in patch_of(resp)
    # Already kubegpu's: nothing to do. Another scheduler: left alone, with a warning.
    assert not any(op["path"] == "/spec/schedulerName" for op in patch_of(review(gpu_pod(
        schedulerName="kubegpu-scheduler"))))
    other = review(gpu_pod(schedulerName="volcano"))
    assert not any(op["path"] == "/spec/schedulerName" for op in patch_of(other))
    assert any("'volcano'" in w for w in other.get("warnings", []))
    # Pods without GPUs, and settings without a scheduler name (node-only), are not touched.
    plain = {"metadata": {"name": "q", "namespace": "team-a"}, "spec": {"containers": [{"name": "c"}]}}
    assert not any(op["path"] == "/spec/schedulerName" for op in patch_of(review(plain)))
    assert not any(op["path"] == "/spec/schedulerName"
                   for op in patch_of(review(gpu_pod(), settings=WebhookSettings())))


def share_pod(**spec: Any) -> dict[str, Any]:
    pod = gpu_pod(**spec)
    pod["spec"]["containers"][0]["resources"]["limits"] = {"kubegpu.io/gpu-core": "25",
                                                           "kubegpu.io/gpu-memory-ratio": "25"}
    return pod


def test_a_share_pod_no_kubegpu_scheduler_places_is_refused_with_the_way_out() -> None:
    """A node serves a share only as the record kubegpu's scheduler writes at bind: a share pod created onto
    a node, or given to another scheduler, would fail there, and while it waited its Allocate call could be
    taken for a recorded pod's. Refused at admission, saying what to change."""
    onto = review(share_pod(nodeName="gpu-node-a"))
    assert onto["allowed"] is False
    msg = onto["status"]["message"]
    assert "spec.nodeName is set ('gpu-node-a')" in msg and "nodeSelector or node affinity" in msg
    assert "kubegpu.io/gpu.shared" in msg and "kubegpu-scheduler" in msg
    other = review(share_pod(schedulerName="volcano"))
    assert other["allowed"] is False and "spec.schedulerName is 'volcano'" in other["status"]["message"]
    # The validating webhook (no mutation) refuses alike: the pod reaches it with the share resources.
    assert review(share_pod(schedulerName="volcano"), mutate=False)["allowed"] is False
    # Placed by kubegpu's scheduler (named, or steered there by full mode): allowed.
    assert review(share_pod(schedulerName="kubegpu-scheduler"))["allowed"] is True
    steered = review(share_pod())
    assert steered["allowed"] is True
    assert {"op": "add", "path": "/spec/schedulerName", "value": "kubegpu-scheduler"} in patch_of(steered)
    # Whole GPUs are served to pods another scheduler binds (no record needed): not refused.
    assert review(gpu_pod(nodeName="gpu-node-a"))["allowed"] is True
    assert review(gpu_pod(schedulerName="volcano"))["allowed"] is True
    # Without a scheduler name (node-only settings) the webhook cannot tell who places pods: not refused.
    assert review(share_pod(nodeName="gpu-node-a"), settings=WebhookSettings())["allowed"] is True


def test_a_pod_created_onto_a_node_gets_void_without_a_toleration() -> None:
    pod = {"metadata": {"name": "q", "namespace": "team-a"},
           "spec": {"nodeName": "gpu-node-a", "containers": [{"name": "cuda", "image": "nvidia/cuda"}]}}
    ops = patch_of(review(pod))
    assert {"op": "add", "path": "/spec/containers/0/env",
            "value": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]} in ops
    del pod["spec"]["nodeName"]  # without a node or the GPU toleration it cannot reach a tainted GPU node
    assert patch_of(review(pod)) == []


def test_pods_over_the_gpu_container_cap_are_refused_at_admission() -> None:
    many = gpu_pod()
    many["spec"]["containers"] = [{"name": f"c{i}", "resources": {"limits": {"kubegpu.io/gpu": "1"}}}
                                  for i in range(33)]
    resp = review(many)
    assert resp["allowed"] is False and "33 containers that ask for GPUs" in resp["status"]["message"]
    many["spec"]["containers"] = many["spec"]["containers"][:32]
    assert review(many)["allowed"] is True


def test_env_from_on_a_gpu_container_warns_with_the_node_side_fix() -> None:
    pod = gpu_pod()
    pod["spec"]["containers"][0]["envFrom"] = [{"configMapRef": {"name": "cfg"}}]
    warnings = review(pod).get("warnings", [])
    assert any("envFrom may set NVIDIA_VISIBLE_DEVICES" in w and "accept-nvidia-visible-devices" in w
               for w in warnings)
    pod["spec"]["containers"][0]["envFrom"] = [{"configMapRef": {"name": "cfg"}, "prefix": "APP_"}]
    assert not any("envFrom" in w for w in review(pod).get("warnings", []))
    # A container without GPUs beside it gets void, which overrides anything envFrom brings.
    pod["spec"]["containers"].append({"name": "side", "envFrom": [{"secretRef": {"name": "s"}}]})
    assert {"op": "add", "path": "/spec/containers/1/env",
            "value": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]} in patch_of(review(pod))


def test_kubegpu_check_notes_what_the_webhook_adds(tmp_path: Any) -> None:
    import yaml
    from typer.testing import CliRunner

    from kubegpu.cli.main import app

    pod = gpu_pod({A.DEVICE_ALLOCATED: FORGED})
    path = tmp_path / "pod.yaml"
    path.write_text(yaml.safe_dump(pod))
    (obj,) = json.loads(CliRunner().invoke(app, ["check", str(path), "--json"]).output)["objects"]
    assert any("schedulerName is not set" in n for n in obj["notes"])
    assert any("written only by kubegpu" in n for n in obj["notes"])
    steered = gpu_pod(schedulerName="kubegpu-scheduler")
    path.write_text(yaml.safe_dump(steered))
    (obj,) = json.loads(CliRunner().invoke(app, ["check", str(path), "--json"]).output)["objects"]
    assert obj["notes"] == []
    path.write_text(yaml.safe_dump(pod))
    (obj,) = json.loads(CliRunner().invoke(app, ["check", str(path), "--json", "--scheduler-name", ""]).output)[
        "objects"]
    assert not any("schedulerName" in n for n in obj["notes"])
