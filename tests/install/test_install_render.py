"""The rendered install: schema-valid, least privilege, NVIDIA chart keys honoured, checked-in copy fresh."""

from __future__ import annotations

import re
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
        "deploy/kubegpu.yaml is stale: run `kubegpu manifests --output-file deploy/kubegpu.yaml`"
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
    ext, binder = cfg["extenders"]
    assert ext["nodeCacheCapable"] is True
    assert ext["filterVerb"] == "filter" and ext["prioritizeVerb"] == "prioritize" and "bindVerb" not in ext
    assert ext["weight"] > 0 and ext["httpTimeout"] == "10s"
    # Bind on its own entry, with a timeout above the extender's longest handoff wait (docs/handoff.md).
    assert binder["bindVerb"] == "bind" and binder["httpTimeout"] == "60s" and binder["managedResources"] == []
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


# --- Kubernetes releases --------------------------------------------------------------------------------

RELEASES = [f"1.{m}" for m in range(24, 38)]


def _schema_version(release: str) -> str:
    # kubernetes-validate ships schemas from 1.25; 1.24's objects are checked against 1.25's (strict: a
    # field 1.25 lacks, such as matchConditions, still fails) plus the API versions 1.24 serves.
    return "1.25.0" if release == "1.24" else f"{release}.0"


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("mode", ["full", "node-only"])
def test_every_release_renders_objects_its_api_server_accepts(release: str, mode: str) -> None:
    v = values_from_dict({"mode": mode, "kubeVersion": release})
    objs = render(v)
    for obj in objs:
        if obj["apiVersion"] in FOREIGN:
            continue
        kubernetes_validate.validate(obj, _schema_version(release), strict=True)
    minor = int(release.split(".")[1])
    kinds = {o["kind"] for o in objs}
    assert ("ValidatingAdmissionPolicy" in kinds) == (minor >= 30)
    if mode == "full":
        cfg = scheduler_config(v)
        assert cfg["apiVersion"] == ("kubescheduler.config.k8s.io/v1" if minor >= 25
                                     else "kubescheduler.config.k8s.io/v1beta3")
        image = next(c["image"] for o in _by_kind(objs, "Deployment") for c in o["spec"]["template"]["spec"]
                     ["containers"] if c["name"] == "kube-scheduler")
        assert image == f"registry.k8s.io/kube-scheduler:v{release}.0"
        for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
            (hook,) = _by_kind(objs, kind)[0]["webhooks"]
            # Without matchConditions the webhook would sit in front of every pod: it must not refuse
            # plain pods while down.
            assert ("matchConditions" in hook) == (minor >= 28)
            assert hook["failurePolicy"] == ("Fail" if minor >= 28 else "Ignore")


def test_default_release_is_the_newest() -> None:
    from kubegpu.install.values import NEWEST_KUBE

    assert scheduler_config(Values())["apiVersion"].endswith("/v1")
    assert f"1.{NEWEST_KUBE[1]}" == RELEASES[-1]
    assert render(Values()) == render(values_from_dict({"kubeVersion": RELEASES[-1]}))


@pytest.mark.parametrize("release", ["1.23", "1.38", "2.0", "latest", "1"])
def test_unsupported_releases_are_refused(release: str) -> None:
    with pytest.raises(ValuesError, match="kubeVersion"):
        values_from_dict({"kubeVersion": release})
    result = CliRunner().invoke(app, ["manifests", "--kube-version", release])
    assert result.exit_code == 2 and "kubeVersion" in result.output


def test_cli_kube_version_flag_and_notes() -> None:
    result = CliRunner().invoke(app, ["manifests", "--kube-version", "1.27"])
    assert result.exit_code == 0, result.output
    assert "kubescheduler.config.k8s.io/v1" in result.stdout and "matchConditions" not in result.stdout
    assert "note: Kubernetes 1.27 has no webhook matchConditions" in result.stderr


# --- NVIDIA chart keys ----------------------------------------------------------------------------------

def _daemonset(objs: list[dict]) -> dict:
    (ds,) = _by_kind(objs, "DaemonSet")
    return ds


def test_nvidia_pod_keys_reach_the_daemonset() -> None:
    objs = render(values_from_dict({
        "imagePullSecrets": [{"name": "regcred"}], "podAnnotations": {"a": "b"},
        "securityContext": {"privileged": True}, "updateStrategy": {"type": "OnDelete"},
        "fullnameOverride": "gpu-plugin", "namespaceOverride": "gpu-operator",
        "deviceDiscoveryStrategy": "nvml", "cdi": {"nvidiaHookPath": "/opt/nvidia/nvidia-cdi-hook"},
        "gfd": {"enabled": True}, "nfd": {"enabled": False}, "mode": "node-only",
    }))
    ds = _daemonset(objs)
    pod = ds["spec"]["template"]
    assert ds["metadata"]["name"] == "gpu-plugin" and ds["metadata"]["namespace"] == "gpu-operator"
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["metadata"]["annotations"]["a"] == "b"  # beside the scrape annotations
    assert pod["spec"]["containers"][0]["securityContext"] == {"privileged": True}
    assert ds["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert pod["spec"]["serviceAccountName"] == "gpu-plugin"
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["DEVICE_DISCOVERY_STRATEGY"] == "nvml"
    assert env["NVIDIA_CDI_HOOK_PATH"] == "/opt/nvidia/nvidia-cdi-hook"
    (policy,) = _by_kind(objs, "ValidatingAdmissionPolicy")
    assert "system:serviceaccount:gpu-operator:gpu-plugin" in policy["spec"]["matchConditions"][0]["expression"]
    assert {o["metadata"].get("namespace") for o in objs} <= {None, "gpu-operator"}


def test_config_name_mounts_an_existing_configmap() -> None:
    objs = render(values_from_dict({"config": {"name": "my-plugin-config", "default": "a100"}}))
    spec = _daemonset(objs)["spec"]["template"]["spec"]
    assert {"name": "config", "configMap": {"name": "my-plugin-config"}} in spec["volumes"]
    assert not [o for o in _by_kind(objs, "ConfigMap") if o["metadata"]["name"] == "my-plugin-config"]
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert env["CONFIG_FILE"] == "/config/a100" and env["CONFIG_DIR"] == "/config"


@pytest.mark.parametrize(("config", "chosen"), [
    ({"map": {"default": "version: v1\n", "ts": "version: v1\n"}}, "default"),  # named
    ({"map": {"only": "version: v1\n"}}, "only"),  # single
    ({"map": {"default": "version: v1\n", "ts": "version: v1\n"}, "default": "ts"}, "ts"),
    ({"map": {"only": "version: v1\n"}, "fallbackStrategies": ["named"], "default": "only"}, "only"),
])
def test_config_default_and_fallback_strategies(config: dict, chosen: str) -> None:
    spec = _daemonset(render(values_from_dict({"config": config})))["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert env["CONFIG_FILE"] == f"/config/{chosen}"


@pytest.mark.parametrize(("raw", "message"), [
    ({"config": {"map": {"a": "version: v1\n"}, "default": "b"}}, "config.default: 'b' is not an entry"),
    ({"config": {"map": {"a": "version: v1\n", "b": "version: v1\n"}}}, "none is chosen"),
    ({"config": {"map": {"a": "version: v1\n"}, "fallbackStrategies": ["named"]}}, "none is chosen"),
    ({"config": {"map": {"a": "x"}, "name": "cm"}}, "config.name and config.map"),
    ({"config": {"fallbackStrategies": ["first"]}}, "fallbackStrategies"),
    ({"nfd": {"enabled": True}}, "nfd.enabled"),
    ({"devicePlugin": {"enabled": False}}, "devicePlugin.enabled: false cannot be honoured"),
    ({"gfd": {"sleepInterval": "30s"}}, "gfd.sleepInterval: '30s' cannot be honoured"),
    ({"legacyDaemonsetAPI": True}, "legacyDaemonsetAPI: true cannot be honoured"),
    ({"namespace": "default", "mode": "node-only"}, "allowDefaultNamespace: true"),
    ({"namespaceOverride": "default", "allowDefaultNamespace": True}, "admitted unchecked"),
    ({"image": {"repository": "registry.corp/gpu/plugin"}}, "kubegpuImage.repository"),
    ({"kubegpuImage": {"tag": "v1:2"}}, "kubegpuImage.tag: 'v1:2' is not an image tag"),
    ({"devicePlugin": {"containers": {"main": {"env": [{"name": "KUBEGPU_RECORD_KEY", "value": "x"}]}}}},
     "KUBEGPU_RECORD_KEY is set by kubegpu"),
    ({"deviceDiscoveryStrategy": "tegra"}, "deviceDiscoveryStrategy: 'tegra'"),
    ({"deviceDiscoveryStrategy": "vfio"}, "deviceDiscoveryStrategy: 'vfio'"),
    ({"webhook": {"certManager": False}}, "webhook.caBundle"),
    ({"imagePullSecrets": [{"secret": "x"}]}, "imagePullSecrets"),
])
def test_values_that_cannot_work_are_refused(raw: dict, message: str) -> None:
    with pytest.raises(ValuesError, match=re.escape(message)):
        values_from_dict(raw)


def test_node_only_needs_no_ca() -> None:
    values_from_dict({"mode": "node-only", "webhook": {"certManager": False}})


def test_mig_monitoring_only_for_mig_strategies() -> None:
    def ctx_env(raw: dict) -> tuple[dict, set[str]]:
        c = _daemonset(render(values_from_dict(raw)))["spec"]["template"]["spec"]["containers"][0]
        return c["securityContext"], {e["name"] for e in c["env"]}

    ctx, env = ctx_env({})
    assert "add" not in ctx["capabilities"] and "NVIDIA_MIG_MONITOR_DEVICES" not in env
    for raw in ({"migStrategy": "single"}, {"config": {"map": {"m": "version: v1\nflags:\n  migStrategy: mixed\n"}}}):
        ctx, env = ctx_env(raw)
        assert ctx["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]} and "NVIDIA_MIG_MONITOR_DEVICES" in env
    ctx, env = ctx_env({"migStrategy": "none", "config": {"map": {"m": "flags:\n  migStrategy: mixed\n"}}})
    assert "add" not in ctx["capabilities"]  # the value wins over the files, as in NVIDIA's chart


def test_runtime_class_per_role() -> None:
    objs = render(values_from_dict({"runtimeClassName": "nvidia", "scheduler": {"runtimeClassName": "kata"},
                                    "webhook": {"runtimeClassName": "gvisor"}}))
    by_name = {o["metadata"]["name"]: o["spec"]["template"]["spec"].get("runtimeClassName")
               for o in objs if o["kind"] in ("DaemonSet", "Deployment")}
    assert by_name == {"kubegpu-node": "nvidia", "kubegpu-scheduler": "kata", "kubegpu-webhook": "gvisor"}
    objs = render(Values())
    assert all("runtimeClassName" not in o["spec"]["template"]["spec"] for o in objs
               if o["kind"] in ("DaemonSet", "Deployment"))
