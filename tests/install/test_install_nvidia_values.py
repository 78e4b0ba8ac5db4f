"""NVIDIA's chart values render a working install in one run: its defaults are never an error, its overrides are
honoured or all reported at once (naming the file and each key), its image never becomes kubegpu's, and every
printed instruction follows the namespace and names rendered. The files are in ``nvidia_chart/``."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from typer.testing import CliRunner

from kubegpu import __version__
from kubegpu.cli.main import app
from kubegpu.install.render import notes, render
from kubegpu.install.values import ValuesError, read_values, values_from_dict

CHART = Path(__file__).parent / "nvidia_chart"
DEFAULTS = ["values-0.14.yaml", "values-0.17.yaml", "values-main.yaml"]
KUBEGPU_IMAGE = f"ghcr.io/kubegpu/kubegpu:{__version__}"


def _helm_merge(base: Any, over: Any) -> Any:
    """Helm's merge of a user's values over the chart's: mappings key by key, anything else replaced."""
    if isinstance(base, dict) and isinstance(over, dict):
        return {**base, **{k: _helm_merge(base.get(k), v) for k, v in over.items()}}
    return over


def _load(*names: str) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for name in names:
        merged = _helm_merge(merged, yaml.safe_load((CHART / name).read_text()))
    return merged


def _pods(objs: list[dict]) -> dict[str, dict]:
    return {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in objs
            if o["kind"] in ("DaemonSet", "Deployment")}


def _env(container: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


@pytest.mark.parametrize("name", DEFAULTS)
def test_nvidias_defaults_render_kubegpus_install(name: str, tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text((CHART / name).read_text())
    v, chart_notes = read_values(values)
    objs = render(v)
    for obj in objs:
        if not obj["apiVersion"].startswith("cert-manager.io/"):
            kubernetes_validate.validate(obj, "1.30.0", strict=True)
    pods = _pods(objs)
    images = {c["image"] for spec in pods.values() for c in spec["containers"] if c["name"] != "kube-scheduler"}
    assert images == {KUBEGPU_IMAGE}  # not nvcr.io/nvidia/k8s-device-plugin, never "...:" (tag "")
    assert any("nvcr.io/nvidia/k8s-device-plugin" in n and "kubegpuImage" in n for n in chart_notes)
    node = pods["kubegpu-node"]
    # NVIDIA's defaults and kubegpu's agree: nothing of the file changed the node DaemonSet.
    assert node == _pods(render(values_from_dict({})))["kubegpu-node"]
    assert node["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True  # {} = kubegpu's own
    result = CliRunner().invoke(app, ["manifests", "-f", str(values)])
    assert result.exit_code == 0, result.output
    assert "error" not in result.stderr


def test_common_overrides_are_honoured() -> None:
    raw = _load("values-main.yaml", "overrides-common.yaml")
    v, chart_notes = read_values_from(raw)
    objs = render(v)
    # kube-system: the extender reads the API server's authentication ConfigMap there
    assert {o["metadata"].get("namespace") for o in objs} <= {None, "gpu-infra", "kube-system"}
    pods = _pods(objs)
    node = pods["gpu-device-plugin"]
    c = node["containers"][0]
    env = _env(c)
    assert env["CONFIG_FILE"] == "/config/time-sliced"
    assert env["FAIL_ON_INIT_ERROR"] == "false" and env["DEVICE_LIST_STRATEGY"] == "envvar"
    assert env["NVIDIA_DRIVER_ROOT"] == "/run/nvidia/driver" and env["GDS_ENABLED"] == "true"
    assert env["NVIDIA_CDI_HOOK_PATH"] == "/usr/local/nvidia/toolkit/nvidia-cdi-hook"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility,video" and env["LOG_LEVEL"] == "debug"
    assert [e["name"] for e in c["env"]].count("NVIDIA_DRIVER_CAPABILITIES") == 1
    assert env["NODE_NAME"] is None  # kubegpu's own (fieldRef) kept
    assert c["resources"] == {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}}
    assert node["runtimeClassName"] == "nvidia" and node["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"} in node["tolerations"]
    assert node["securityContext"] == {"runAsUser": 0, "runAsGroup": 0, "fsGroup": 0}
    assert node["serviceAccountName"] == "gpu-device-plugin"
    for spec in pods.values():  # kubegpu's image, from the registry the secret opens, for every role
        assert spec["imagePullSecrets"] == [{"name": "corp-registry"}]
        assert all(ct["image"] == KUBEGPU_IMAGE for ct in spec["containers"] if ct["name"] != "kube-scheduler")
    assert any("v0.17.0" in n for n in chart_notes)  # the pinned NVIDIA tag is named as not used
    said = "\n".join(notes(v))
    assert "gpu-infra/kubegpu-record-key" in said and "kubectl -n gpu-infra create secret" in said
    assert "kubegpu-system" not in said
    assert "no gpu-feature-discovery DaemonSet" in said and "node-feature-discovery" in said


def read_values_from(raw: dict[str, Any]) -> tuple[Any, list[str]]:
    from kubegpu.install.values import parse_values

    return parse_values(raw)


def test_everything_kubegpu_cannot_honour_is_reported_at_once_naming_the_file(tmp_path: Path) -> None:
    values = tmp_path / "my-values.yaml"
    values.write_text(yaml.safe_dump(_load("values-main.yaml", "overrides-refused.yaml")))
    with pytest.raises(ValuesError) as caught:
        read_values(values)
    keys = ["legacyDaemonsetAPI", "deviceDiscoveryStrategy", "devicePlugin.enabled", "gfd.sleepInterval",
            "nfd.enabled", "mps.root", "image.repository", "migStrategy", "failOnInitErorr"]
    assert len(caught.value.problems) == len(keys)
    for key, problem in zip(sorted(keys), sorted(caught.value.problems), strict=True):
        assert problem.startswith(f"{key}:"), problem
    assert "did you mean failOnInitError?" in str(caught.value)
    result = CliRunner().invoke(app, ["manifests", "-f", str(values)])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith(f"error: {values}: {len(keys)} settings to change")
    assert all(f"  - {key}:" in result.stderr for key in keys)


def test_a_subchart_section_is_named_as_such() -> None:
    with pytest.raises(ValuesError, match="give what is under nvidia-device-plugin as the values file"):
        values_from_dict({"nvidia-device-plugin": {"migStrategy": "none"}})


@pytest.mark.parametrize(("image", "ref"), [
    ({"repository": "ghcr.io/kubegpu/kubegpu", "tag": ""}, KUBEGPU_IMAGE),
    ({"repository": "mirror.corp/kubegpu", "tag": "1.2.3"}, "mirror.corp/kubegpu:1.2.3"),
    ({"repository": "nvcr.io/nvidia/k8s-device-plugin", "tag": "v0.17.0"}, KUBEGPU_IMAGE),
    ({"repository": "mirror.corp/nvidia/k8s-device-plugin"}, KUBEGPU_IMAGE),
    ({"tag": "v0.17.0", "pullPolicy": "Always"}, KUBEGPU_IMAGE),
])
def test_only_a_kubegpu_image_block_is_kubegpus(image: dict, ref: str) -> None:
    objs = render(values_from_dict({"image": image}))
    images = {c["image"] for spec in _pods(objs).values() for c in spec["containers"] if c["name"] != "kube-scheduler"}
    assert images == {ref}


def test_kubegpu_image_says_it_without_doubt() -> None:
    v = values_from_dict({"image": {"repository": "registry.corp/mirror/nvdp", "tag": "v0.17.0"},
                          "kubegpuImage": {"repository": "registry.corp/mirror/kg", "tag": "0.1.0"}})
    images = {c["image"] for spec in _pods(render(v)).values() for c in spec["containers"]
              if c["name"] != "kube-scheduler"}
    assert images == {"registry.corp/mirror/kg:0.1.0"}


def test_nvidia_keys_kubegpu_honours_under_their_names() -> None:
    objs = render(values_from_dict({
        "mode": "node-only", "nameOverride": "nvdp", "selectorLabelsOverride": {"name": "nvidia-device-plugin-ds"},
        "mofedEnabled": True, "gdrcopyEnabled": False, "cdi": {"featureFlags": ["disable-a", "enable-b"]},
        "devicePlugin": {"enableHostNetwork": True}, "securityContext": {"privileged": True},
    }))
    (ds,) = [o for o in objs if o["kind"] == "DaemonSet"]
    assert ds["metadata"]["name"] == "nvdp"
    assert ds["spec"]["selector"]["matchLabels"]["name"] == "nvidia-device-plugin-ds"
    assert ds["spec"]["template"]["metadata"]["labels"]["name"] == "nvidia-device-plugin-ds"
    spec = ds["spec"]["template"]["spec"]
    env = _env(spec["containers"][0])
    assert env["MOFED_ENABLED"] == "true" and env["GDRCOPY_ENABLED"] == "false"
    assert env["CDI_FEATURE_FLAGS"] == "disable-a,enable-b"
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert spec["containers"][0]["securityContext"] == {"privileged": True}
    for obj in objs:
        kubernetes_validate.validate(obj, "1.30.0", strict=True)
    assert any("metrics port 9400" in n for n in notes(values_from_dict({"devicePlugin": {"enableHostNetwork": True}})))


def test_printed_instructions_follow_the_rendered_namespace(tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text("namespaceOverride: gpu-ops\nwebhook: {certManager: false, caBundle: Q0E=}\n")
    result = CliRunner().invoke(app, ["manifests", "-f", str(values)])
    assert result.exit_code == 0, result.output
    assert "kubegpu-system" not in result.stderr
    assert "kubectl -n gpu-ops create secret generic kubegpu-record-key" in result.stderr
    assert "--namespace gpu-ops" in result.stderr and "kubegpu-webhook.gpu-ops.svc" in result.stderr


# --- the manifests command's flags ----------------------------------------------------------------------

def test_output_format_and_file(tmp_path: Path) -> None:
    runner = CliRunner()
    as_json = runner.invoke(app, ["manifests", "-o", "json"])
    assert as_json.exit_code == 0, as_json.output
    listed = json.loads(as_json.stdout)
    as_yaml = runner.invoke(app, ["manifests", "-o", "yaml"])
    assert listed["kind"] == "List" and listed["items"] == [d for d in yaml.safe_load_all(as_yaml.stdout) if d]
    out = tmp_path / "k.json"
    assert runner.invoke(app, ["manifests", "-o", "json", "--output-file", str(out)]).exit_code == 0
    assert json.loads(out.read_text()) == listed
    old = tmp_path / "kubegpu.yaml"  # the old spelling still writes the file, with a deprecation warning
    result = runner.invoke(app, ["manifests", "-o", str(old)])
    assert result.exit_code == 0 and result.stdout == ""
    assert old.read_text() == as_yaml.stdout and f"use --output-file {old}" in result.stderr
    wide = runner.invoke(app, ["manifests", "-o", "wide"])
    assert wide.exit_code == 2 and "-o yaml or -o json" in wide.stderr


@pytest.mark.parametrize(("args", "values", "message"), [
    (["--dra", "--kube-version", "1.30"], "", "--dra: --kube-version 1.30 is below 1.34"),
    (["--dra"], "kubeVersion: '1.33'\n", "--dra: the values' kubeVersion 1.33 is below 1.34"),
    (["--dra-shared-gpus", "all"], "", "--dra-shared-gpus needs --dra"),
    (["--dra-all-nodes", "--dra-extended-resource"], "", "--dra-extended-resource, --dra-all-nodes need --dra"),
])
def test_flags_that_cannot_work_are_refused_with_the_reason(args: list[str], values: str, message: str,
                                                             tmp_path: Path) -> None:
    if values:
        (tmp_path / "v.yaml").write_text(values)
        args = [*args, "-f", str(tmp_path / "v.yaml")]
    result = CliRunner().invoke(app, ["manifests", *args])
    assert result.exit_code == 2 and result.stdout == ""
    assert re.search(re.escape(message), result.stderr), result.stderr


def test_dra_keeps_the_renamed_device_plugin_daemonset_off_dra_nodes(tmp_path: Path) -> None:
    (tmp_path / "v.yaml").write_text("fullnameOverride: gpu-plugin\nnamespaceOverride: gpu-ops\n")
    result = CliRunner().invoke(app, ["manifests", "--dra", "--kube-version", "1.34", "-f", str(tmp_path / "v.yaml")])
    assert result.exit_code == 0, result.output
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    plugin = next(d for d in docs if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "gpu-plugin")
    terms = plugin["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert all({"key": "kubegpu.io/kubelet-plugin", "operator": "NotIn", "values": ["dra"]} in t["matchExpressions"]
               for t in terms)
    assert {d["metadata"].get("namespace") for d in docs} <= {None, "gpu-ops", "kube-system"}
