"""The rendered install: schema-valid, least privilege, NVIDIA chart keys honoured, checked-in copy fresh."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from typer.testing import CliRunner

from kubegpu.cli.main import app
from kubegpu.install.render import render, scheduler_config, to_yaml
from kubegpu.install.values import Values, ValuesError, load_values, values_from_dict

ROOT = Path(__file__).resolve().parents[2]
K8S_VERSION = "1.30.0"
# Kinds whose schemas are not part of Kubernetes (validated by their own operators).
FOREIGN = {"cert-manager.io/v1"}


def _by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


@pytest.mark.parametrize("mode", ["full", "node-only"])
def test_every_object_validates_against_the_kubernetes_openapi_schema(mode: str) -> None:
    objs = render(values_from_dict({"mode": mode}))
    checked = 0
    for obj in objs:
        if obj["apiVersion"] in FOREIGN:
            continue
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        checked += 1
    assert checked >= (20 if mode == "full" else 6)


def test_checked_in_default_install_is_fresh() -> None:
    assert (ROOT / "deploy" / "kubegpu.yaml").read_text() == to_yaml(render(Values())), (
        "deploy/kubegpu.yaml is stale: run `kubegpu manifests -o deploy/kubegpu.yaml`"
    )


def test_node_only_mode_renders_only_the_node_role() -> None:
    objs = render(values_from_dict({"mode": "node-only"}))
    names = {o["metadata"]["name"] for o in objs}
    assert "kubegpu-node" in names
    assert not any("scheduler" in n or "webhook" in n for n in names)


def test_nvidia_chart_keys_reach_the_daemonset() -> None:
    v = values_from_dict({
        "migStrategy": "mixed", "failOnInitError": False, "deviceListStrategy": "volume-mounts",
        "deviceIDStrategy": "index", "nvidiaDriverRoot": "/run/nvidia/driver", "compatWithCPUManager": True,
        "runtimeClassName": "nvidia", "nodeSelector": {"gpu": "yes"},
        "config": {"map": {"default": "version: v1\nflags:\n  migStrategy: none\n",
                           "ts": "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
                                 "    - name: nvidia.com/gpu\n      replicas: 4\n"},
                   "default": "ts"},
    })
    objs = render(v)
    spec = _by_kind(objs, "DaemonSet")[0]["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert env["MIG_STRATEGY"] == "mixed"
    assert env["FAIL_ON_INIT_ERROR"] == "false"
    assert env["DEVICE_LIST_STRATEGY"] == "volume-mounts"
    assert env["DEVICE_ID_STRATEGY"] == "index"
    assert env["PASS_DEVICE_SPECS"] == "true"
    assert env["CONFIG_FILE"] == "/config/ts"
    assert spec["containers"][0]["securityContext"] == {"privileged": True}
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["nodeSelector"] == {"gpu": "yes"}
    assert {"name": "driver-root", "hostPath": {"path": "/run/nvidia/driver"}} in spec["volumes"]
    cm = next(o for o in _by_kind(objs, "ConfigMap") if o["metadata"]["name"] == "kubegpu-device-plugin-config")
    assert set(cm["data"]) == {"default", "ts"}


def test_daemonset_uses_nvidia_chart_placement_by_default() -> None:
    spec = _by_kind(render(Values()), "DaemonSet")[0]["spec"]["template"]["spec"]
    assert spec["priorityClassName"] == "system-node-critical"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]} in [
        t["matchExpressions"][0] for t in terms]
    paths = {vol["hostPath"]["path"] for vol in spec["volumes"] if "hostPath" in vol}
    assert {"/var/lib/kubelet/device-plugins", "/var/lib/kubelet/pod-resources", "/var/run/cdi"} <= paths


def test_rbac_is_least_privilege_per_role() -> None:
    objs = render(Values())
    roles = {o["metadata"]["name"]: o["rules"] for o in _by_kind(objs, "ClusterRole")}
    assert set(roles) == {"kubegpu-node", "kubegpu-scheduler-extender"}
    for rules in roles.values():
        for rule in rules:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"]
            assert "delete" not in rule["verbs"]
    sched = {(r["apiGroups"][0], res): r["verbs"] for r in roles["kubegpu-scheduler-extender"]
             for res in r["resources"]}
    assert sched[("", "pods/binding")] == ["create"]
    assert ("kubegpu.io", "devices") in sched and "patch" not in sched[("kubegpu.io", "devices")]
    node = {(r["apiGroups"][0], res): r["verbs"] for r in roles["kubegpu-node"] for res in r["resources"]}
    assert ("", "pods/binding") not in node


def test_scheduler_configuration_extender_entry() -> None:
    cfg = scheduler_config(Values())
    (ext,) = cfg["extenders"]
    assert ext["nodeCacheCapable"] is True
    assert ext["filterVerb"] == "filter" and ext["prioritizeVerb"] == "prioritize" and ext["bindVerb"] == "bind"
    assert ext["weight"] > 0 and ext["httpTimeout"] == "10s"
    managed = {m["name"] for m in ext["managedResources"]}
    assert {"nvidia.com/gpu", "kubegpu.io/gpu-core", "kubegpu.io/gpu-memory", "kubegpu.io/gpu-memory-ratio",
            "kubegpu.io/gpu.shared"} <= managed
    cm = next(o for o in render(Values()) if o["metadata"]["name"] == "kubegpu-scheduler-config")
    assert yaml.safe_load(cm["data"]["scheduler-config.yaml"]) == cfg


def test_webhook_configuration_excludes_its_own_namespace() -> None:
    objs = render(Values())
    (mwc,) = _by_kind(objs, "MutatingWebhookConfiguration")
    hook = mwc["webhooks"][0]
    assert hook["failurePolicy"] == "Fail" and hook["timeoutSeconds"] == 5
    exprs = hook["namespaceSelector"]["matchExpressions"]
    assert {"key": "kubernetes.io/metadata.name", "operator": "NotIn",
            "values": ["kube-system", "kubegpu-system"]} in exprs
    assert _by_kind(objs, "PodDisruptionBudget")
    assert "matchConditions" in hook


def test_webhook_without_cert_manager_or_match_conditions() -> None:
    objs = render(values_from_dict({"webhook": {"certManager": False, "caBundle": "Q0E=", "matchConditions": False,
                                                "failurePolicy": "Ignore", "replicas": 3}}))
    assert not [o for o in objs if o["apiVersion"].startswith("cert-manager.io/")]
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        (cfg,) = _by_kind(objs, kind)
        assert "annotations" not in cfg["metadata"]
        (hook,) = cfg["webhooks"]
        assert hook["clientConfig"]["caBundle"] == "Q0E=" and hook["failurePolicy"] == "Ignore"
        assert "matchConditions" not in hook
    deployment = next(o for o in _by_kind(objs, "Deployment") if o["metadata"]["name"] == "kubegpu-webhook")
    assert deployment["spec"]["replicas"] == 3


def test_namespace_and_image_values_reach_every_role() -> None:
    objs = render(values_from_dict({"namespace": "gpu-infra", "image": {"repository": "reg.local/kubegpu",
                                                                       "tag": "9.9"}}))
    text = to_yaml(objs)
    assert "kubegpu-system" not in text
    images = {c["image"] for o in objs if o["kind"] in ("Deployment", "DaemonSet")
              for c in o["spec"]["template"]["spec"]["containers"] if c["name"] != "kube-scheduler"}
    assert images == {"reg.local/kubegpu:9.9"}


@pytest.mark.parametrize("raw, key", [
    ({"migStrategy": "both"}, "migStrategy"),
    ({"bogus": 1}, "bogus"),
    ({"scheduler": {"weight": "x"}}, "scheduler.weight"),
    ({"mode": "everything"}, "mode"),
])
def test_bad_values_name_the_key(raw: dict, key: str) -> None:
    with pytest.raises(ValuesError, match=key.replace(".", r"\.")):
        values_from_dict(raw)


def test_cli_renders_from_a_values_file(tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text("mode: node-only\nmigStrategy: single\n")
    result = CliRunner().invoke(app, ["manifests", "--values", str(values)])
    assert result.exit_code == 0, result.output
    docs = [d for d in yaml.safe_load_all(result.output) if d]
    assert {d["kind"] for d in docs} >= {"Namespace", "CustomResourceDefinition", "DaemonSet"}
    assert load_values(values).mig_strategy == "single"


def test_cli_reports_a_bad_values_file(tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text("migStrategy: [\n")
    result = CliRunner().invoke(app, ["manifests", "--values", str(values)])
    assert result.exit_code == 2
    assert "not valid YAML" in result.output


def _container_args(objs: list[dict], kind: str, container: str) -> list[str]:
    for o in _by_kind(objs, kind):
        for c in o["spec"]["template"]["spec"]["containers"]:
            if c["name"] == container:
                return c["args"]
    raise AssertionError(f"no container {container} in a {kind}")


def test_rendered_args_are_accepted_by_the_commands(tmp_path: Path) -> None:
    from typer.main import get_command

    objs = render(Values())
    root = get_command(app)
    for kind, container in (("Deployment", "extender"), ("Deployment", "webhook")):
        args = _container_args(objs, kind, container)
        for mounted in ("/tls/tls.crt", "/tls/tls.key"):  # files the Secret mounts; any file will do here
            (tmp_path / mounted.rsplit("/", 1)[1]).write_text("x")
            args = [a.replace(mounted, str(tmp_path / mounted.rsplit("/", 1)[1])) for a in args]
        cmd = root.get_command(root.context_class(root), args[0])  # type: ignore[attr-defined]
        assert cmd is not None, args[0]
        cmd.make_context(args[0], list(args[1:]))  # raises a usage error on an unknown flag
    node_args = _container_args(objs, "DaemonSet", "node")
    result = CliRunner().invoke(app, [*node_args, "--standalone", "--inventory", "t4x4", "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
