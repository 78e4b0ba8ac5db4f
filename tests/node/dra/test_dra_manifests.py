"""``kubegpu manifests --dra``: schema-valid objects, classes that select the published devices, one mode per node."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from typer.testing import CliRunner

import kubegpu.node.dra
from kubegpu.cli.main import app
from kubegpu.install.dra import MODE_LABEL, apply_dra, device_classes
from kubegpu.install.render import render
from kubegpu.install.values import Values
from kubegpu.inventory.fake import FakeBackend
from kubegpu.node.dra.slices import DraSettings, pool_content, slice_bodies
from kubegpu_standins.dra_allocator import Candidate, cel_matches
from kubegpu_standins.dra_validation import validate
from kubegpu_standins.scheduler import StandinScheduler

K8S = "1.34.0"  # resource.k8s.io/v1 is GA from 1.34


def _objs(**kw: Any) -> list[dict[str, Any]]:
    v = Values()
    return apply_dra(render(v), v, **kw)


def test_objects_validate_against_the_1_34_schema() -> None:
    for o in _objs(extended_resource=True):
        if "cert-manager" in o["apiVersion"]:
            continue  # not a Kubernetes schema (the webhook's certificate)
        kubernetes_validate.validate(o, K8S, strict=True)
        if o["apiVersion"].startswith("resource.k8s.io"):
            assert validate(o["kind"], o) == []


def test_device_plugin_and_dra_daemonsets_split_the_nodes() -> None:
    ds = {o["metadata"]["name"]: o for o in _objs() if o["kind"] == "DaemonSet"}
    def exprs(d: dict[str, Any]) -> list[dict[str, Any]]:
        terms = d["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        return [e for t in terms for e in t["matchExpressions"] if e["key"] == MODE_LABEL]
    assert {e["operator"] for e in exprs(ds["kubegpu-node"])} == {"NotIn"}
    assert {e["operator"] for e in exprs(ds["kubegpu-dra-node"])} == {"In"}
    dra = ds["kubegpu-dra-node"]["spec"]["template"]["spec"]
    paths = {v["hostPath"]["path"] for v in dra["volumes"]}
    assert {"/var/lib/kubelet/plugins", "/var/lib/kubelet/plugins_registry", "/var/run/cdi"} <= paths
    assert "--kubelet-plugin" in dra["containers"][0]["args"]
    everywhere = {o["metadata"]["name"] for o in _objs(all_nodes=True) if o["kind"] == "DaemonSet"}
    assert everywhere == {"kubegpu-dra-node"}


def test_rbac_reads_claims_and_writes_only_own_node_slices() -> None:
    objs = _objs()
    role = next(o for o in objs if o["kind"] == "ClusterRole" and o["metadata"]["name"] == "kubegpu-dra-node")
    by_res = {r["resources"][0]: set(r["verbs"]) for r in role["rules"]}
    assert by_res == called_by_dra_code()
    vap = next(o for o in objs if o["kind"] == "ValidatingAdmissionPolicy")
    assert "authentication.kubernetes.io/node-name" in vap["spec"]["variables"][0]["expression"]
    # Denials are 403 Forbidden like kubegpu's other policies (recorded: without a reason, a 422 with an
    # empty field path, dra-node-policy-checks.log).
    own = next(o for o in objs if o["metadata"]["name"] == "kubegpu-dra-node-own-slices"
               and o["kind"] == "ValidatingAdmissionPolicy")
    assert all(v.get("reason") == "Forbidden" for o in objs if o["kind"] == "ValidatingAdmissionPolicy"
               for v in o["spec"]["validations"])
    assert [v.get("reason") for v in own["spec"]["validations"]] == ["Forbidden", "Forbidden"]
    assert any(o["kind"] == "ValidatingAdmissionPolicyBinding" for o in objs)


def called_by_dra_code() -> dict[str, set[str]]:
    """resource -> verbs, from the client calls in kubegpu.node.dra (a new call without a grant fails)."""
    verbs = {"get": "get", "list": "list", "watch": "watch", "create": "create", "replace": "update",
             "delete": "delete", "patch": "patch"}
    kinds = {"ResourceClaim": "resourceclaims", "ResourceSlice": "resourceslices", "DeviceClass": "deviceclasses",
             "Node": "nodes"}
    out: dict[str, set[str]] = {}
    for path in sorted((Path(kubegpu.node.dra.__file__).parent).glob("*.py")):
        for verb, kind in re.findall(r"client\.(\w+)\(\s*([A-Z]\w*)", path.read_text()):
            out.setdefault(kinds[kind], set()).add(verbs[verb])
    return out


def test_classes_select_the_devices_the_node_publishes() -> None:
    inv = FakeBackend("a100-mig").discover()
    s = DraSettings(node_name=inv.name, shared_gpus=frozenset({3}))
    devices = slice_bodies(pool_content(inv, s), s, 1)[0]["spec"]["devices"]
    classes = {c["metadata"]["name"]: c["spec"]["selectors"][0]["cel"]["expression"]
               for c in device_classes(Values(), extended_resource=True)}

    def chosen(cls: str) -> list[str]:
        return [d["name"] for d in devices
                if cel_matches(classes[cls], Candidate("gpu.kubegpu.io", inv.name, inv.name, d).cel_view())]
    # Plain GPUs first (the one taking shares too), then MIG parents.
    assert chosen("gpu.kubegpu.io") == ["gpu-2", "gpu-3", "gpu-0", "gpu-1"]
    assert chosen("shared-gpu.kubegpu.io") == ["gpu-3"]
    assert len(chosen("mig.kubegpu.io")) == 6
    assert chosen("mig-1g.10gb.kubegpu.io") == ["gpu-0-mig-1g10gb-13", "gpu-0-mig-1g10gb-14"]
    ext = next(c for c in device_classes(Values(), extended_resource=True)
               if c["metadata"]["name"] == "gpu-extended.kubegpu.io")
    assert ext["spec"]["extendedResourceName"] == "nvidia.com/gpu"


@pytest.mark.parametrize(("args", "code", "out"), [
    (["manifests", "--dra"], 0, "kind: DeviceClass"),
    (["manifests", "--dra", "--dra-shared-gpus", "first"], 2, "expected all, none"),
])
def test_cli(args: list[str], code: int, out: str) -> None:
    r = CliRunner().invoke(app, args)
    assert r.exit_code == code
    assert out in r.output


def _managed(objs: list[dict[str, Any]]) -> set[str]:
    cm = next(o for o in objs if o["kind"] == "ConfigMap" and "scheduler-config.yaml" in o.get("data", {}))
    cfg = yaml.safe_load(cm["data"]["scheduler-config.yaml"])
    return {r["name"] for e in cfg["extenders"] for r in e["managedResources"]}


def test_full_mode_sends_nvidia_gpu_pods_past_the_extender_when_dra_serves_them() -> None:
    """Recorded (ext-pod-full-mode-pending.yaml): with --dra-extended-resource, an nvidia.com/gpu pod moved to
    kubegpu-scheduler stayed Pending, the extender failing every DRA node (no Device object). Only pods asking
    kubegpu's other resources go to the extender then; kube-scheduler serves nvidia.com/gpu itself."""
    pod = {"spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}
    share = {"spec": {"containers": [{"name": "c", "resources": {"limits": {"kubegpu.io/gpu-core": "25",
                                                                            "kubegpu.io/gpu-memory": "8Gi"}}}]}}
    plain, dra = _managed(_objs()), _managed(_objs(extended_resource=True))
    assert "nvidia.com/gpu" in plain and "nvidia.com/gpu" not in dra
    assert dra == plain - {"nvidia.com/gpu"}
    # kube-scheduler calls the extender only for pods asking a managed resource (the stand-in does the same).
    assert StandinScheduler(None, "", plain).interested(pod)
    assert not StandinScheduler(None, "", dra).interested(pod)
    assert StandinScheduler(None, "", dra).interested(share)
